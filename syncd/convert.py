"""One source checkpoint to one published output: read, adapt, write, verify, publish.

Used by `syncd convert` and by the daemon's workers. The adapters decide names, shapes and transposes
from the tensor table alone; this module moves the bytes, carries what the target format cannot hold in
`syncd.*` metadata (see carry.py), re-reads the written file to check every tensor, and only then publishes.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from syncd import carry
from syncd.adapters import LAYOUT_CHOICES, AdapterPlan, ModuleMap, TensorRef, plan_conversion
from syncd.errors import FormatError, SyncdError, UnsupportedError, UsageError, VerificationError, one_line
from syncd.formats import BURNPACK, SAFETENSORS, open_checkpoint
from syncd.formats.burnpack import LAYOUT_ALIGNED, BurnpackReader, write_burnpack
from syncd.formats.dtypes import BURNPACK_DTYPES, DTYPE_TO_SAFETENSORS
from syncd.formats.fileio import TensorFileReader, pwrite_all
from syncd.formats.registry import BY_NAME
from syncd.formats.safetensors import SafetensorsReader, write_safetensors
from syncd.formats.table import TensorSpec
from syncd.publish import PublishResult, ensure_destination_free, open_scratch, publish
from syncd.transfer import Transfer

SHA_PLACEHOLDER = "sha256-of-the-source-pending".ljust(64, "0")  # exactly as long as a hex sha256


@dataclass
class ConvertRequest:
    source: Path
    dest: Path | None = None
    to_format: str | None = None  # default: the other format
    layout: str = "auto"  # the source's layout: auto | pytorch | burn; keep = convert the container only
    module_map: ModuleMap | None = None
    overwrite: bool = False
    fail_early_if_exists: bool = True  # the daemon turns this off to tell "already in sync" from a conflict
    within: Path | None = None  # the daemon confines sources to their watched tree (no symlinks out of it)


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
    started = time.monotonic()
    source = Path(request.source)
    if request.layout not in LAYOUT_CHOICES:
        raise UsageError(f"--layout must be one of {', '.join(LAYOUT_CHOICES)}, got {request.layout!r}")
    with open_checkpoint(source, request.within) as reader:
        to_format = request.to_format or BY_NAME[reader.header.format].converts_to
        dest = Path(request.dest) if request.dest else default_destination(source, to_format)
        _check_distinct(source, dest)
        if request.fail_early_if_exists and not request.overwrite:
            ensure_destination_free(dest)
        job = _Job(reader, request, to_format, dest)
        outcome = job.run()
    return ConvertResult(
        status=outcome.status,
        source=source,
        dest=dest,
        to_format=to_format,
        tensors=len(job.specs),
        bytes=job.output_size,
        seconds=time.monotonic() - started,
        source_layout=job.plan.source_layout,
        target_layout=job.plan.target_layout,
        decisions=job.plan.decisions,
        dropped=job.plan.dropped,
        restored=job.restored,
    )


def _check_distinct(source: Path, dest: Path) -> None:
    if dest.resolve() == source.resolve():
        raise UsageError(f"the output would overwrite its own source {source}")


class _Job:
    """The state of one conversion: plan, output specs and metadata, then write, verify, publish."""

    def __init__(self, reader: TensorFileReader, request: ConvertRequest, to_format: str, dest: Path) -> None:
        self.reader = reader
        self.request = request
        self.to_format = to_format
        self.dest = dest
        self.path = reader.path
        self.carried = carry.parse(reader.header.metadata, self.path)
        self._check_dtypes()
        self.plan = self._plan()
        self.restored: list[str] = []
        self.transfer = Transfer()
        self.specs = self._specs()
        self.metadata, self.scalars = self._metadata(SHA_PLACEHOLDER)
        self.layout = self._burn_layout()
        self.output_size = 0

    # -- planning

    def _check_dtypes(self) -> None:
        allowed = BURNPACK_DTYPES if self.to_format == BURNPACK else DTYPE_TO_SAFETENSORS.keys()
        for info in self.reader.tensors:
            if info.dtype not in allowed:
                side = "Burn has no dtype" if self.to_format == BURNPACK else "safetensors has no form"
                hint = " (quantized tensors stay in .bpk)" if info.dtype == "QFloat" else ""
                raise UnsupportedError(f"{side} for {info.dtype} (tensor '{info.name}'){hint}", self.path)

    def _plan(self) -> AdapterPlan:
        layout = self.request.layout
        to_layout = "keep" if layout == "keep" else BY_NAME[self.to_format].native_layout
        source_layout = layout if layout in ("pytorch", "burn") else "auto"
        if source_layout == "auto" and self.carried.layout in ("pytorch", "burn"):
            source_layout = self.carried.layout  # our own record of what we wrote beats inference
        refs = [TensorRef(t.name, t.dtype, t.shape) for t in self.reader.tensors]
        try:
            return plan_conversion(
                refs, to_layout=to_layout, source_layout=source_layout, module_map=self.request.module_map
            )
        except SyncdError as exc:
            raise _naming_file(exc, self.path) from None

    def _specs(self) -> list[TensorSpec]:
        entries = self._ordered_entries()
        specs = [self._spec(entry.source, entry.target, entry.shape, entry.transpose) for entry in entries]
        if self.to_format == SAFETENSORS and self.plan.target_layout == "pytorch":
            specs += self._restored_specs({spec.name for spec in specs})
        return specs

    def _ordered_entries(self) -> list[Any]:
        """Data order: the carried order of the original burnpack when there is one, else the source's."""
        entries = list(self.plan.entries)
        order = self.carried.data_order
        if self.to_format != BURNPACK or not order:
            return entries
        rank = {name: i for i, name in enumerate(order)}
        return sorted(entries, key=lambda e: rank.get(e.source, len(rank)))

    def _spec(self, source: str, target: str, shape: tuple[int, ...], transpose: bool) -> TensorSpec:
        info = self.reader.tensor(source)
        fill = (self.transfer.transpose_fill if transpose else self.transfer.copy_fill)(self.reader, source, target)
        dtype, raw = self._target_dtype(info.name, info.dtype, info.raw_dtype)
        param_id = info.param_id if info.param_id is not None else self.carried.param_ids.get(source)
        return TensorSpec(
            target,
            dtype,
            shape,
            info.nbytes,
            fill,
            param_id if self.to_format == BURNPACK else None,
            raw if self.to_format == BURNPACK else None,
        )

    def _target_dtype(self, name: str, dtype: str, raw: Any) -> tuple[str, Any]:
        if self.to_format != BURNPACK:
            return dtype, None
        if self.reader.header.format == BURNPACK:
            return dtype, raw
        restored = self.carried.dtypes.get(name)
        if restored is None:
            return dtype, None
        if DTYPE_TO_SAFETENSORS[restored] != DTYPE_TO_SAFETENSORS[dtype]:
            raise FormatError(f"syncd metadata says {restored} but the tensor is {dtype}", self.path, name)
        return restored, None

    def _restored_specs(self, taken: set[str]) -> list[TensorSpec]:
        """PyTorch-only tensors dropped on the way to Burn (BatchNorm counters) come back on the way out."""
        specs = []
        for name, (dtype, shape, data) in self.carried.dropped.items():
            if name in taken:
                raise FormatError(f"carried tensor '{name}' collides with a converted tensor", self.path)
            specs.append(TensorSpec(name, dtype, shape, len(data), _bytes_fill(data)))
            self.restored.append(name)
        return specs

    # -- metadata

    def _metadata(self, sha: str) -> tuple[dict[str, str], dict[str, Any]]:
        if self.to_format == SAFETENSORS:
            metadata = self._safetensors_metadata()
            scalars: dict[str, Any] = {}
        else:
            metadata, scalars = self._burnpack_metadata()
        if self.plan.target_layout in ("pytorch", "burn"):
            metadata[carry.LAYOUT] = self.plan.target_layout
        metadata[carry.SOURCE] = carry.file_label(os.path.basename(self.path))
        metadata[carry.SOURCE_SHA256] = sha
        return metadata, scalars

    def _safetensors_metadata(self) -> dict[str, str]:
        header = self.reader.header
        if header.format == SAFETENSORS:
            metadata = carry.own_metadata(header.metadata)
        else:
            metadata = dict(self.carried.safetensors_metadata or {})
            self._carry_burnpack_facts(metadata)
        if self.plan.target_layout == "pytorch":
            metadata["format"] = "pt"  # what Hugging Face loaders require of a PyTorch-layout file
        return metadata

    def _carry_burnpack_facts(self, metadata: dict[str, str]) -> None:
        header = self.reader.header
        target_of = {e.source: e.target for e in self.plan.entries}
        burn_metadata = carry.own_metadata(header.metadata)
        if burn_metadata:
            metadata[carry.BURN_METADATA] = carry.dumps(burn_metadata)
        if header.scalars:
            metadata[carry.SCALARS] = carry.encode_scalars(header.scalars)
        if header.facts.get("layout") != LAYOUT_ALIGNED:
            metadata[carry.BURN_LAYOUT] = header.facts["layout"]
        ids = {
            target_of[t.name]: str(t.param_id)
            for t in self.reader.tensors
            if t.param_id is not None and t.name in target_of
        }
        if ids:
            metadata[carry.PARAM_IDS] = carry.dumps(ids)
        dtypes = {
            target_of[t.name]: t.dtype
            for t in self.reader.tensors
            if t.dtype in carry.LOSSY_IN_SAFETENSORS and t.name in target_of
        }
        if dtypes:
            metadata[carry.DTYPES] = carry.dumps(dtypes)
        metadata[carry.DATA_ORDER] = carry.dumps(
            [target_of[t.name] for t in self.reader.tensors if t.name in target_of]
        )
        if self.carried.dropped and self.plan.target_layout != "pytorch":
            # only a PyTorch-layout file takes the counters back; a Burn-layout one carries them further
            metadata[carry.DROPPED] = carry.encode_dropped(self.carried.dropped)

    def _burnpack_metadata(self) -> tuple[dict[str, str], dict[str, Any]]:
        header = self.reader.header
        if header.format == BURNPACK:
            return carry.own_metadata(header.metadata), dict(header.scalars)
        metadata = dict(self.carried.burn_metadata or {})
        own = carry.own_metadata(header.metadata)
        if own.get("format") == "pt" and self.plan.target_layout == "burn":
            del own["format"]  # the way back to PyTorch layout adds it again; a keep round trip must not lose it
        if own:
            metadata[carry.SAFETENSORS_METADATA] = carry.dumps(own)
        dropped = {**self.carried.dropped, **self._dropped_tensors()}
        if dropped:
            metadata[carry.DROPPED] = carry.encode_dropped(dropped)
        return metadata, dict(self.carried.scalars)

    def _dropped_tensors(self) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
        dropped = {}
        for name in self.plan.dropped:
            info = self.reader.tensor(name)
            if info.nbytes > carry.MAX_DROPPED_BYTES:
                raise UnsupportedError(f"tensor '{name}' has no Burn counterpart and is too large to carry", self.path)
            dropped[name] = (info.dtype, info.shape, self.reader.read(name))
        return dropped

    def _burn_layout(self) -> str:
        if self.to_format != BURNPACK:
            return LAYOUT_ALIGNED
        if self.reader.header.format == BURNPACK:
            return self.reader.header.facts["layout"]
        return self.carried.burn_layout or LAYOUT_ALIGNED

    # -- writing

    def run(self) -> PublishResult:
        mode = os.fstat(self.reader.fd).st_mode & 0o777
        hasher = _SourceHasher(self.reader)
        with open_scratch(self.dest, mode) as scratch:
            try:
                header = self._write(scratch.fd)
            except OSError as exc:  # ENOSPC, EIO, EFBIG... name the file, keep the cause for the daemon
                raise SyncdError(f"cannot write the output ({exc.strerror or exc})", str(self.dest)) from exc
            # verify while the source is still being hashed on the other core; only the hash's place in the
            # header changes afterwards, and that is checked on its own
            self._verify(scratch.path)
            self._fill_in_source_hash(scratch.fd, header, hasher.result())
            _check_source_unchanged(self.reader)
            return publish(scratch, replace=self.request.overwrite, source=Path(self.path))

    def _write(self, fd: int) -> bytes:
        if self.to_format == BURNPACK:
            plan = write_burnpack(fd, self.specs, self.metadata, self.scalars, self.layout)
        else:
            plan = write_safetensors(fd, self.specs, self.metadata)
        self.output_size = plan.file_size
        return plan.header

    def _fill_in_source_hash(self, fd: int, header: bytes, sha: str) -> None:
        """The source hash is computed while the tensors are written, so the header went out with a placeholder
        of the same length: patching it in place keeps the header's size and every offset where it is."""
        placeholder = SHA_PLACEHOLDER.encode("ascii")
        if header.count(placeholder) != 1:
            raise SyncdError("cannot place the source hash in the output header", str(self.dest))
        self.metadata[carry.SOURCE_SHA256] = sha
        final = header.replace(placeholder, sha.encode("ascii"))
        pwrite_all(fd, final, 0)
        if os.pread(fd, len(final), 0) != final:
            raise VerificationError("the output header reads back different from what was written", str(self.dest))

    def _verify(self, written: Path) -> None:
        reader_type = BurnpackReader if self.to_format == BURNPACK else SafetensorsReader
        try:
            output = reader_type(written)
        except FormatError as exc:
            raise VerificationError(f"the written file does not read back: {exc.message}", str(self.dest)) from None
        with output:
            self._verify_table(output)
            for entry in self.plan.entries:
                self.transfer.verify(output, entry.target)
            for name in self.restored:
                if output.read(name) != self.carried.dropped[name][2]:
                    raise VerificationError(f"restored tensor '{name}' differs after writing", str(self.dest))

    def _verify_table(self, output: TensorFileReader) -> None:
        expected = {s.name: (s.dtype, s.shape) for s in self.specs}
        found = {t.name: (t.dtype, t.shape) for t in output.tensors}
        if self.to_format == SAFETENSORS:
            expected = {n: (DTYPE_TO_SAFETENSORS[d], s) for n, (d, s) in expected.items()}
            found = {n: (DTYPE_TO_SAFETENSORS[d], s) for n, (d, s) in found.items()}
        if expected != found:
            missing = sorted(set(expected) ^ set(found)) or sorted(n for n in expected if expected[n] != found[n])
            raise VerificationError(f"the written tensor table differs from the plan at {missing[:5]}", str(self.dest))
        if self.to_format == BURNPACK:
            ids = {s.name: s.param_id for s in self.specs}
            if any(ids[t.name] != t.param_id for t in output.tensors):
                raise VerificationError("param_ids differ after writing", str(self.dest))


def _naming_file(exc: SyncdError, path: str) -> SyncdError:
    """The adapters see a tensor table, not a file: put the file in front of their one-line message (the
    error keeps its type and its suggestion for --verbose and the log)."""
    if exc.path is None:
        exc.path = path
        exc.args = (f"{one_line(path)}: {exc.message}",)
    return exc


def _bytes_fill(data: bytes) -> Callable[[Any], None]:
    return lambda sink: sink.write(data)


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
