"""One source checkpoint to one published output: open -> plan -> write -> verify -> publish.

Used by `syncd convert` and by the daemon's workers. The adapters decide names, shapes and transposes
from the tensor table alone; `rename` may then rewrite output names; the target format's type (targets.py)
turns the plan into specs and metadata (what it cannot hold travels in `syncd.*` metadata, see carry.py).
This module moves the bytes, re-reads the written file to check every tensor, and only then publishes.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from syncd import carry
from syncd.adapters import (
    AUTO,
    BURN,
    KEEP,
    LAYOUT_CHOICES,
    PYTORCH,
    AdapterPlan,
    ModuleMap,
    PlanEntry,
    TensorRef,
    plan_conversion,
)
from syncd.context import gather_context
from syncd.errors import FormatError, SyncdError, UsageError, VerificationError, one_line
from syncd.formats import open_checkpoint
from syncd.formats.fileio import TensorFileReader, pwrite_all
from syncd.formats.registry import BY_NAME
from syncd.formats.table import TensorInfo, TensorSpec
from syncd.progress import ProgressCallback, track
from syncd.publish import PublishResult, ensure_destination_free, open_scratch, publish
from syncd.targets import TARGETS, Target
from syncd.transfer import Transfer

# The key-remapping seam: (source name, output name) pairs in, the same pairs with output names rewritten out.
Rename = Callable[[list[tuple[str, str]]], list[tuple[str, str]]]

SHA_PLACEHOLDER = "sha256-of-the-source-pending".ljust(64, "0")  # exactly as long as a hex sha256


@dataclass
class ConvertRequest:
    source: Path
    dest: Path | None = None
    to_format: str | None = None  # default: the other format
    layout: str = AUTO  # the source's layout: auto | pytorch | burn; keep = convert the container only
    module_map: ModuleMap | None = None
    overwrite: bool = False
    fail_early_if_exists: bool = True  # the daemon turns this off to tell "already in sync" from a conflict
    within: Path | None = None  # the daemon confines sources to their watched tree (no symlinks out of it)
    rename: Rename | None = None  # rewrites output names after the adapters (see `rename`)
    progress: ProgressCallback | None = None  # called with (bytes written, bytes to write) as the output fills


@dataclass
class ConvertResult:
    status: str  # published | replaced | in_sync
    source: Path
    dest: Path
    to_format: str
    tensors: int
    bytes: int
    seconds: float
    source_layout: str
    target_layout: str
    decisions: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    restored: list[str] = field(default_factory=list)


def default_destination(source: Path, to_format: str) -> Path:
    extension = BY_NAME[to_format].extension
    return source.with_suffix(extension) if source.suffix else Path(f"{source}{extension}")


def convert(request: ConvertRequest) -> ConvertResult:
    """open -> plan -> write -> verify -> publish."""
    started = time.monotonic()
    source_path = Path(request.source)
    if request.layout not in LAYOUT_CHOICES:
        raise UsageError(f"--layout must be one of {', '.join(LAYOUT_CHOICES)}, got {request.layout!r}")
    with open_source(source_path, request.within) as source:
        to_format = request.to_format or BY_NAME[source.header.format].converts_to
        dest = Path(request.dest) if request.dest else default_destination(source_path, to_format)
        _check_distinct(source_path, dest)
        if request.fail_early_if_exists and not request.overwrite:
            ensure_destination_free(dest)
        conversion = plan(source, request, TARGETS[to_format](), dest)
        if request.progress is not None:
            conversion.specs = track(conversion.specs, request.progress)
        outcome = write_verify_publish(conversion)
    return ConvertResult(
        status=outcome.status,
        source=source_path,
        dest=dest,
        to_format=to_format,
        tensors=len(conversion.specs),
        bytes=conversion.output_size,
        seconds=time.monotonic() - started,
        source_layout=conversion.plan.source_layout,
        target_layout=conversion.plan.target_layout,
        decisions=conversion.plan.decisions,
        dropped=conversion.plan.dropped,
        restored=conversion.restored,
    )


def _check_distinct(source: Path, dest: Path) -> None:
    if dest.resolve() == source.resolve():
        raise UsageError(f"the output would overwrite its own source {source}")


# -- open


class Source:
    """The tensors a conversion reads, behind one interface. Today one checkpoint file; a checkpoint in
    several files (sharded safetensors) is several readers here: `reader_of` says which file holds a tensor,
    and the header (format, metadata, scalars) is the first file's. Hashing, the permission bits and the
    unchanged-size check still look at `primary` only; a multi-file source must extend those three."""

    def __init__(self, readers: list[TensorFileReader]) -> None:
        self.readers = readers
        self.primary = readers[0]
        self.header = self.primary.header
        self.path = self.primary.path
        self.tensors = [info for reader in readers for info in reader.tensors]
        self._reader_of = {info.name: reader for reader in readers for info in reader.tensors}
        if len(self._reader_of) != len(self.tensors):
            raise FormatError("a tensor name occurs in more than one file of the checkpoint", self.path)

    def reader_of(self, name: str) -> TensorFileReader:
        return self._reader_of[name]

    def tensor(self, name: str) -> TensorInfo:
        return self._reader_of[name].tensor(name)

    def read(self, name: str) -> bytes:
        return self._reader_of[name].read(name)

    def close(self) -> None:
        for reader in self.readers:
            reader.close()

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def open_source(path: Path, within: Path | None) -> Source:
    return Source([open_checkpoint(path, within)])


# -- plan


@dataclass
class Conversion:
    """One planned conversion: what is read, what is written under which name, the output's metadata."""

    request: ConvertRequest
    source: Source
    target: Target
    dest: Path
    carried: carry.Carried
    plan: AdapterPlan
    entries: list[PlanEntry] = field(default_factory=list)  # after renaming, in output data order
    specs: list[TensorSpec] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)
    scalars: dict[str, Any] = field(default_factory=dict)
    restored: list[str] = field(default_factory=list)  # carried tensors written back
    transfer: Transfer = field(default_factory=Transfer)
    output_size: int = 0


def plan(source: Source, request: ConvertRequest, target: Target, dest: Path) -> Conversion:
    """Adapt names and shapes, let `request.rename` rewrite output names, then build the target's specs and
    metadata. Nothing is written yet."""
    carried = carry.parse(source.header.metadata, source.path)
    target.check_dtypes(source.tensors, source.path)
    adapted = _adapt(source, request, target, carried)
    c = Conversion(request, source, target, dest, carried, adapted)
    c.entries = target.order(rename(adapted.entries, request.rename, source.path), c)
    c.specs = [target.tensor_spec(c, entry, _fill(c, entry)) for entry in c.entries]
    c.specs += target.extra_specs(c, {spec.name for spec in c.specs})
    c.metadata, c.scalars = target.metadata(c)
    carry.stamp(c.metadata, adapted.target_layout, os.path.basename(source.path), SHA_PLACEHOLDER)
    carry.record_kinds(c.metadata, adapted.target_layout, adapted.kinds)
    return c


def _adapt(source: Source, request: ConvertRequest, target: Target, carried: carry.Carried) -> AdapterPlan:
    layout = request.layout
    to_layout = KEEP if layout == KEEP else target.format.native_layout
    source_layout = layout if layout in (PYTORCH, BURN) else AUTO
    refs = [TensorRef(t.name, t.dtype, t.shape) for t in source.tensors]
    # our own record of what we wrote, the file's metadata and the config.json beside it (issue 13)
    context = gather_context(source.path, source.header.metadata, carried.layout, carried.kinds)
    try:
        return plan_conversion(
            refs,
            to_layout=to_layout,
            source_layout=source_layout,
            module_map=request.module_map,
            context=context,
        )
    except SyncdError as exc:
        raise _naming_file(exc, source.path) from None


def rename(entries: list[PlanEntry], hook: Rename | None, path: str) -> list[PlanEntry]:
    """The seam for key remapping: `hook` gets the (source name, output name) pairs the adapters planned and
    returns them with output names rewritten (same sources, same order, output names unique)."""
    if hook is None:
        return entries
    pairs = hook([(e.source, e.target) for e in entries])
    if [s for s, _ in pairs] != [e.source for e in entries]:
        raise UsageError("a rename must keep every source tensor, in order", path)
    if len({t for _, t in pairs}) != len(pairs):
        raise UsageError("a rename gives two tensors the same output name", path)
    return [replace(entry, target=new) for entry, (_, new) in zip(entries, pairs, strict=True)]


def _fill(c: Conversion, entry: PlanEntry) -> Callable[[Any], None]:
    mover = c.transfer.transpose_fill if entry.transpose else c.transfer.copy_fill
    return mover(c.source.reader_of(entry.source), entry.source, entry.target)


# -- write, verify, publish


def write_verify_publish(c: Conversion) -> PublishResult:
    mode = os.fstat(c.source.primary.fd).st_mode & 0o777
    hasher = _SourceHasher(c.source.primary)
    with open_scratch(c.dest, mode) as scratch:
        try:
            header, c.output_size = c.target.write(scratch.fd, c)
        except OSError as exc:  # ENOSPC, EIO, EFBIG... name the file, keep the cause for the daemon
            raise SyncdError(f"cannot write the output ({exc.strerror or exc})", str(c.dest)) from exc
        # verify while the source is still being hashed on the other core; only the hash's place in the
        # header changes afterwards, and that is checked on its own
        verify(c, scratch.path)
        _fill_in_source_hash(c, scratch.fd, header, hasher.result())
        _check_source_unchanged(c.source.primary)
        return publish(scratch, replace=c.request.overwrite, source=Path(c.source.path))


def _fill_in_source_hash(c: Conversion, fd: int, header: bytes, sha: str) -> None:
    """The source hash is computed while the tensors are written, so the header went out with a placeholder
    of the same length: patching it in place keeps the header's size and every offset where it is."""
    placeholder = SHA_PLACEHOLDER.encode("ascii")
    if header.count(placeholder) != 1:
        raise SyncdError("cannot place the source hash in the output header", str(c.dest))
    c.metadata[carry.SOURCE_SHA256] = sha
    final = header.replace(placeholder, sha.encode("ascii"))
    pwrite_all(fd, final, 0)
    if os.pread(fd, len(final), 0) != final:
        raise VerificationError("the output header reads back different from what was written", str(c.dest))


def verify(c: Conversion, written: Path) -> None:
    """Read the written file back: its table must be the plan's, every tensor its source's."""
    try:
        output = c.target.format.reader(written)
    except FormatError as exc:
        raise VerificationError(f"the written file does not read back: {exc.message}", str(c.dest)) from None
    with output:
        _verify_table(c, output)
        c.target.check_written(c, output)
        for entry in c.entries:
            c.transfer.verify(output, entry.target)
        for name in c.restored:
            if output.read(name) != c.carried.dropped[name][2]:
                raise VerificationError(f"restored tensor '{name}' differs after writing", str(c.dest))


def _verify_table(c: Conversion, output: TensorFileReader) -> None:
    same = c.target.comparable
    expected = {s.name: (same(s.dtype), s.shape) for s in c.specs}
    found = {t.name: (same(t.dtype), t.shape) for t in output.tensors}
    if expected != found:
        missing = sorted(set(expected) ^ set(found)) or sorted(n for n in expected if expected[n] != found[n])
        raise VerificationError(f"the written tensor table differs from the plan at {missing[:5]}", str(c.dest))


def _naming_file(exc: SyncdError, path: str) -> SyncdError:
    """The adapters see a tensor table, not a file: put the file in front of their one-line message (the
    error keeps its type and its suggestion for --verbose and the log)."""
    if exc.path is None:
        exc.path = path
        exc.args = (f"{one_line(path)}: {exc.message}",)
    return exc


class _SourceHasher:
    """sha256 of the whole source, computed on another thread while the conversion runs (hashlib releases
    the GIL on large buffers, so on two cores this costs almost no wall time)."""

    CHUNK = 8 << 20

    def __init__(self, reader: TensorFileReader) -> None:
        self.fd = os.dup(reader.fd)
        self.size = reader.file_size
        self.path = reader.path
        self.digest: str | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="syncd-sha256", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            sha = hashlib.sha256()
            buf = memoryview(bytearray(self.CHUNK))
            offset = 0
            while offset < self.size:
                n = os.preadv(self.fd, [buf[: min(self.CHUNK, self.size - offset)]], offset)
                if n == 0:
                    raise FormatError("file truncated while hashing it", self.path)
                sha.update(buf[:n])
                offset += n
            self.digest = sha.hexdigest()
        except BaseException as exc:  # handed to the caller's thread in result()
            self.error = exc
        finally:
            os.close(self.fd)

    def result(self) -> str:
        self.thread.join()
        if self.error is not None:
            if isinstance(self.error, SyncdError):
                raise self.error
            raise FormatError(f"cannot read while hashing: {self.error}", self.path)
        assert self.digest is not None
        return self.digest


def _check_source_unchanged(reader: TensorFileReader) -> None:
    info = os.fstat(reader.fd)
    if info.st_size != reader.file_size:
        raise FormatError("the file changed size while it was being converted", reader.path)


def file_sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(8 << 20):
            sha.update(chunk)
    return sha.hexdigest()
