"""One source checkpoint to one published output: open -> plan -> write -> verify -> publish.

Used by `syncd convert` and by the daemon's workers. The adapters decide names, shapes and transposes
from the tensor table alone, and the store options (remap rules) may rename their output; the target format's
type (targets.py) turns the plan into specs and metadata (what it cannot hold travels in `syncd.*` metadata,
see carry.py). This module moves the bytes in one pass over the source (passwrite.py), checks what was written,
and only then publishes.

Issue 16: the source may be a sharded safetensors set (its index; formats/shards.py), read in the same one
pass, shard after shard, into one output; the store options
(stores.py: tensor filter, remap rules, contiguous indices, precision casts through cast.py) apply to the plan;
a safetensors output may be written as a set (setout.py), shards first and the index last, each shard
written in its own pass over the part of the source it takes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
from syncd.engine import carry, hashing
from syncd.engine.context import gather_context
from syncd.engine.options import StoreOptions, StorePlan, apply_options, undo_renames
from syncd.engine.progress import ProgressCallback
from syncd.engine.publish import FileIdentity, PublishResult, Scratch, ensure_destination_free, open_scratch, publish
from syncd.engine.sets import set_paths, write_set
from syncd.engine.targets import TARGETS, Target
from syncd.engine.write.planned import (
    VERIFY_CHOICES,
    FromSource,
    Joined,
    Written,
    check_digests,
    check_written,
    source_pieces,
    verify_full,
    write_planned,
)
from syncd.errors import (
    FormatError,
    SourceChangedError,
    SyncdError,
    UsageError,
    VerificationError,
    one_line,
)
from syncd.formats import SAFETENSORS, open_checkpoint
from syncd.formats.fileio import TensorFileReader, open_regular_file, pwrite_all
from syncd.formats.registry import BY_NAME
from syncd.formats.shards import (
    INDEX_SUFFIX,
    ShardedReader,
    ShardIndex,
    ShardLayout,
    find_index,
    is_index_name,
    layout_by_size,
    read_index,
)
from syncd.formats.table import TensorInfo, TensorSpec

if TYPE_CHECKING:  # numpy-backed; imported where a conversion needs them (a plain copy does not)
    from syncd.engine.cast import CastCopy

# The key-remapping seam: (source name, output name) pairs in, the same pairs with output names rewritten out.


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
    # replace the destination only if it is still exactly this file (syncd's own earlier output of this source)
    replace_if: FileIdentity | None = None
    progress: ProgressCallback | None = None  # called with (bytes written, bytes to write) as the output fills
    store: StoreOptions = field(default_factory=StoreOptions)  # remap, filter, precision (issue 16)
    shard_size: int | None = None  # write safetensors as a set split at this size (huggingface_hub's rule)
    one_file: bool = False  # one safetensors file even where a carried shard layout says otherwise
    hash_name: str = hashing.DEFAULT_HASH  # the source hash recorded: xxh3_128 | sha256
    verify: str = "fast"  # fast: checks taken while writing, table re-read; full: also every tensor re-read


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
    left_out: list[str] = field(default_factory=list)  # excluded by the tensor filter
    cast: list[str] = field(default_factory=list)  # tensors whose precision changed
    files: list[Path] = field(default_factory=list)  # every file written (a set: its shards, then its index)
    notes: list[str] = field(default_factory=list)  # shown without -v: guesses by convention, index gaps


def default_destination(source: Path, to_format: str) -> Path:
    extension = BY_NAME[to_format].extension
    if is_index_name(source):  # model.safetensors.index.json -> model.bpk
        return source.parent / (source.name.removesuffix(INDEX_SUFFIX) + extension)
    return source.with_suffix(extension) if source.suffix else Path(f"{source}{extension}")


def convert(request: ConvertRequest) -> ConvertResult:
    """open -> plan -> write -> verify -> publish."""
    started = time.monotonic()
    source_path = Path(request.source)
    if source_path.is_dir():  # a directory holding a sharded set stands for its index
        source_path = Path(find_index(source_path))
    if request.layout not in LAYOUT_CHOICES:
        raise UsageError(f"--layout must be one of {', '.join(LAYOUT_CHOICES)}, got {request.layout!r}")
    if request.hash_name not in hashing.HASH_CHOICES:
        raise UsageError(f"--hash must be one of {', '.join(hashing.HASH_CHOICES)}, got {request.hash_name!r}")
    if request.verify not in VERIFY_CHOICES:
        raise UsageError(f"--verify must be one of {', '.join(VERIFY_CHOICES)}, got {request.verify!r}")
    with open_source(source_path, request.within) as source:
        to_format = request.to_format or BY_NAME[source.header.format].converts_to
        dest = Path(request.dest) if request.dest else default_destination(source_path, to_format)
        conversion = plan(source, request, TARGETS[to_format](), dest)
        for path in conversion.output_paths():
            for member in source.files:
                _check_distinct(Path(member), path)
            if request.fail_early_if_exists and not request.overwrite:
                ensure_destination_free(path)
        outcome = write_verify_publish(conversion)
    return ConvertResult(
        status=outcome.status,
        source=source_path,
        dest=conversion.dest,
        to_format=to_format,
        tensors=len(conversion.specs),
        bytes=conversion.output_size,
        seconds=time.monotonic() - started,
        source_layout=conversion.plan.source_layout,
        target_layout=conversion.plan.target_layout,
        decisions=conversion.plan.decisions,
        dropped=conversion.plan.dropped,
        restored=conversion.restored,
        left_out=conversion.store.left_out,
        cast=sorted(conversion.store.casts),
        files=conversion.output_paths(),
        notes=conversion.plan.notes,
    )


def _check_distinct(source: Path, dest: Path) -> None:
    if dest.resolve() == source.resolve():
        raise UsageError(f"the output would overwrite its own source {source}")


# -- open


class Source:
    """The tensors a conversion reads, behind one interface: one checkpoint file, or a sharded safetensors set
    read through its index (formats/shards.py checks the index and shards agree). `reader_of` says which file
    holds a tensor; the header (format, metadata, scalars) and the permission bits are the first file's; a
    set's `path` is its index, and its hash covers the index and then every shard (see source_digest)."""

    def __init__(self, readers: list[TensorFileReader], sharded: ShardedReader | None = None) -> None:
        self.readers = readers
        self.primary = readers[0]
        self.header = self.primary.header
        self.sharded = sharded
        self.path = sharded.path if sharded is not None else self.primary.path
        self.files = [self.path, *(r.path for r in readers)] if sharded is not None else [self.path]
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

    def hash_prefix(self) -> bytes:
        """What the source hash takes before the files' bytes: a set's index, as it was read."""
        return self.sharded.index.raw if self.sharded is not None else b""

    def check_unchanged(self) -> None:
        """Every file read is the same, unchanged file it was when opened (a set: every shard and the index)."""
        for reader in self.readers:
            check_source_unchanged(reader)
        if self.sharded is not None:
            check_index_unchanged(self.sharded.index)

    def close(self) -> None:
        for reader in self.readers:
            reader.close()

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def open_source(path: Path, within: Path | None) -> Source:
    if is_index_name(path):
        sharded = ShardedReader(path, within)
        return Source([shard.reader for shard in sharded.shards], sharded)
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
    output_size: int = 0
    store: StorePlan = field(default_factory=StorePlan.empty)  # what filters, remap rules and casts did
    casts: dict[str, CastCopy] = field(default_factory=dict)  # output name -> its cast
    shards: ShardLayout | None = None  # a safetensors output written as a sharded set
    directory: Path = Path()  # where a set's files go

    def output_paths(self) -> list[Path]:
        return set_paths(self.shards, self.directory) if self.shards else [self.dest]


def plan(source: Source, request: ConvertRequest, target: Target, dest: Path) -> Conversion:
    """Adapt names and shapes (the store options included), then build the target's specs and metadata.
    Nothing is written yet."""
    carried = carry.parse(source.header.metadata, source.path)
    target.check_dtypes(source.tensors, source.path)
    adapted, store = _adapt(source, request, target, carried)
    c = Conversion(request, source, target, dest, carried, adapted, store=store)
    c.entries = target.order(adapted.entries, c)
    c.specs = [_cast_spec(c, entry, target.tensor_spec(c, entry, _fill(c, entry))) for entry in c.entries]
    c.specs += target.extra_specs(c, {spec.name for spec in c.specs})
    c.metadata, c.scalars = target.metadata(c)
    cast = [e.target for e in c.entries if e.source in store.casts]
    carry.store_facts(
        c.metadata, _carried_shards(c), store.renames, cast, next(iter(store.casts.values()), None), carried
    )
    carry.stamp(
        c.metadata,
        adapted.target_layout,
        os.path.basename(source.path),
        hashing.SOURCE_HASH_KEYS[request.hash_name],
        hashing.placeholder(request.hash_name),
    )
    carry.record_kinds(c.metadata, adapted.target_layout, adapted.kinds)
    carry.record_guesses(c.metadata, adapted.guessed)
    c.shards = _output_shards(c, explicit_dest=request.dest is not None)
    c.directory = dest if dest.is_dir() else dest.parent
    if c.shards is not None:
        c.dest = set_paths(c.shards, c.directory)[-1]  # the index (or the one file of a one-shard split)
    elif dest.is_dir():  # `-o DIR`: the default name, in that directory
        c.dest = dest / default_destination(Path(source.path), target.format.name).name
    return c


def _source_fill(c: Conversion, entry: PlanEntry) -> FromSource | Joined:
    """The one-pass fill of an entry: its source tensor (or a row range of it), or its pieces end to end."""
    pieces = tuple(
        FromSource(c.source.reader_of(piece.source), piece.source, piece.transpose, piece.rows)
        for piece in entry.pieces
    )
    return Joined(pieces) if entry.parts else pieces[0]


def _adapt(
    source: Source, request: ConvertRequest, target: Target, carried: carry.Carried
) -> tuple[AdapterPlan, StorePlan]:
    """The layout adapter over the original names (renames a syncd output carried are undone first), then
    the store options: tensor filter, remap rules, contiguous indices, casts (see stores.py)."""
    layout = request.layout
    to_layout = KEEP if layout == KEEP else target.format.native_layout
    source_layout = layout if layout in (PYTORCH, BURN) else AUTO
    # our own record of what we wrote, the file's metadata and the config.json beside it (issue 13)
    context = gather_context(source.path, source.header.metadata, carried.layout, carried.kinds)
    try:
        # renames a syncd output carried are undone first: context, maps and inference see the original names
        refs, real = undo_renames([TensorRef(t.name, t.dtype, t.shape) for t in source.tensors], carried.renames)
        adapted = plan_conversion(
            refs,
            to_layout=to_layout,
            source_layout=source_layout,
            module_map=request.module_map,
            context=context,
        )
        restoring = list(carried.dropped) if to_layout == PYTORCH else []
        options = request.store.for_source(source.header.format)
        store = apply_options(adapted, refs, real, options, restoring)
    except SyncdError as exc:
        raise _naming_file(exc, source.path) from None
    return _with_store(adapted, store), store


def _with_store(plan: AdapterPlan, store: StorePlan) -> AdapterPlan:
    """The plan as the store options left it: final names, filtered; -v and the sync log list what the filter
    left out, and count renames and casts."""
    plan.entries = store.entries
    plan.dropped = store.dropped
    plan.decisions += [f"left out by the tensor filter: {name}" for name in store.left_out]
    if store.renames:
        plan.decisions.append(f"renamed {len(store.renames)} tensors (remap rules, contiguous indices)")
    plan.decisions += store.notes
    plan.notes += store.notes
    if store.restored:
        plan.decisions.append(f"restored the original names of {len(store.restored)} tensors (carried renames)")
    for dtype in sorted(set(store.casts.values())):
        count = sum(1 for d in store.casts.values() if d == dtype)
        plan.decisions.append(f"cast {count} tensors to {dtype} (precision)")
    return plan


def _cast_spec(c: Conversion, entry: PlanEntry, spec: TensorSpec) -> TensorSpec:
    """A tensor the precision option casts is written in its new dtype (filled by its CastCopy)."""
    copy = c.casts.get(entry.target)
    if copy is None:
        return spec
    return replace(
        spec, dtype=copy.to_dtype, raw_dtype=None, nbytes=_cast_nbytes(spec.nbytes, copy.from_dtype, copy.to_dtype)
    )


def _cast_nbytes(nbytes: int, from_dtype: str, to_dtype: str) -> int:
    from syncd.engine.cast import cast_nbytes

    return cast_nbytes(nbytes, from_dtype, to_dtype)


def _carried_shards(c: Conversion) -> ShardLayout | None:
    """The shard layout a .bpk carries: the set it was converted from (only the tensors kept), or the one
    its own source carried."""
    if c.target.format.name == SAFETENSORS:
        return None
    if c.source.sharded is None:
        return c.carried.shards
    kept = {name for e in c.entries for name in e.sources} | set(c.plan.dropped)
    sizes = {t.name: t.nbytes for t in c.source.tensors}
    return ShardLayout.of(c.source.sharded).restricted_to(kept, sizes)


def _output_shards(c: Conversion, explicit_dest: bool) -> ShardLayout | None:
    """The set a safetensors output is written as, or None for one file: `--shard-size` splits anew; a layout
    carried from the original set is reproduced, unless one file is asked for (`--shard-size none`, or an
    explicit `-o X.safetensors`)."""
    one_file = c.request.one_file or (explicit_dest and c.dest.name.endswith(".safetensors"))
    if c.target.format.name != SAFETENSORS or one_file:
        return None
    sizes = [(spec.name, spec.nbytes) for spec in c.specs]
    if c.request.shard_size is not None:
        stem = Path(c.source.path).name.removesuffix(INDEX_SUFFIX).removesuffix(".bpk")
        index_name = c.dest.name if is_index_name(c.dest) else f"{stem}{INDEX_SUFFIX}"
        return layout_by_size(sizes, c.request.shard_size, index_name)
    if c.carried.shards is None:
        return None
    layout = c.carried.shards.restricted_to({name for name, _ in sizes}, dict(sizes))
    if c.store.casts or c.carried.precision is not None:  # the dtypes, so the sizes, are no longer the set's
        layout = layout.with_total_size(sum(size for _, size in sizes))
    return layout


def _fill(c: Conversion, entry: PlanEntry) -> Callable[[Any], None]:
    """A tensor's fill: moved from the source in the one pass, or cast on its own (cast.py)."""
    if not any(piece.source in c.store.casts for piece in entry.pieces):
        return _source_fill(c, entry)
    from syncd.engine.cast import CastCopy, JoinedCast

    copies, at = [], 0
    for piece in entry.pieces:  # a join's parts end to end, each cast (precision.py casts a packed module whole)
        info = c.source.tensor(piece.source)
        to_dtype = c.store.casts[piece.source]
        copies.append(
            CastCopy(
                c.source.reader_of(piece.source), piece.source, info.dtype, to_dtype, piece.transpose, piece.rows, at
            )
        )
        at += _cast_nbytes(_piece_nbytes(info.nbytes, info.shape, piece.rows), info.dtype, to_dtype)
    copy = copies[0] if len(copies) == 1 else JoinedCast(copies)
    c.casts[entry.target] = copy
    return copy.fill


def _piece_nbytes(nbytes: int, shape: tuple[int, ...], rows: tuple[int, int] | None) -> int:
    """The bytes of rows r0:r1 of a tensor (all of it without `rows`)."""
    if rows is None:
        return nbytes
    return nbytes // shape[0] * (rows[1] - rows[0]) if shape and shape[0] else 0


# -- write, verify, publish


def write_verify_publish(c: Conversion) -> PublishResult:
    return _write_set(c) if c.shards is not None else _write_one_pass(c)


def _write_one_pass(c: Conversion) -> PublishResult:
    """One output file: planned, written in one pass over the source (a set: its shards in the index's order),
    which gives the source hash; checked without reading the data back, the hash filled in, then published."""
    mode = os.fstat(c.source.primary.fd).st_mode & 0o777
    with open_scratch(c.dest, mode) as scratch:
        try:
            header, c.output_size, starts = c.target.lay_out(c)
            written = write_planned(
                scratch.fd,
                str(scratch.path),
                header,
                c.output_size,
                list(zip(c.specs, starts, strict=True)),
                c.source.readers,
                c.request.hash_name,
                progress=c.request.progress,
                prefix=c.source.hash_prefix(),
            )
        except OSError as exc:  # ENOSPC, EIO, EFBIG... name the file, keep the cause for the daemon
            raise SyncdError.from_os_error("cannot write the output", str(c.dest), exc) from exc
        verify_one_pass(c, scratch.path, scratch.fd, written, c.specs, c.output_size)
        _fill_in_source_hash(c, scratch.fd, header, written.source_hash)
        return _publish(scratch, c)


def verify_one_pass(
    c: Conversion, written_path: Path, fd: int, written: Written, specs: list[TensorSpec], size: int
) -> None:
    """Re-read the written header and table (a fresh reader validates them as any reader would): the table
    must be the plan's, and the ledger of writes must tile it exactly. The data is not read back (it would
    come from the page cache just written); transposed blocks were checked in cache as they were written.
    Cast tensors are checked by their casts, restored ones re-read. `--verify full` also re-reads every tensor.
    `specs`, `size`: what this file holds (one shard of a set: its tensors)."""
    try:
        output = c.target.format.reader(written_path)
    except FormatError as exc:
        raise VerificationError(f"the written file does not read back: {exc.message}", str(c.dest)) from None
    with output:
        _verify_table(c, output, specs)
        c.target.check_written(c, output)
        check_written(written.ledger, output, size, fd)
        if c.request.verify == "full":
            check_digests(written.ledger, output)
            verify_full([(piece, s.name, at) for s in specs for piece, at in source_pieces(s.fill)], output)
        carried_as = {final: carried for carried, final in c.store.carried_names.items()}
        for spec in specs:
            if spec.name in c.restored:
                if output.read(spec.name) != c.carried.dropped[carried_as.get(spec.name, spec.name)][2]:
                    raise VerificationError(f"restored tensor '{spec.name}' differs after writing", str(c.dest))
            elif spec.name in c.casts:
                c.casts[spec.name].verify(output, spec.name)


def _write_set(c: Conversion) -> PublishResult:
    """A sharded safetensors output: every shard written in a pass over the part of the source it takes and
    checked in its scratch file, then the shards published and the index last (setout.py). A set holds what
    save_pretrained writes, so no syncd metadata and no hash."""
    assert c.shards is not None
    progress = _SetProgress(sum(spec.nbytes for spec in c.specs), c.request.progress)
    results = write_set(
        c.specs,
        c.shards,
        c.directory,
        mode=os.fstat(c.source.primary.fd).st_mode & 0o777,
        replace=c.request.overwrite,
        write_shard=lambda scratch, header, size, placed: _write_shard(c, scratch, header, size, placed, progress),
        before_publish=c.source.check_unchanged,
        source=Path(c.source.path),
    )
    c.output_size = sum(os.stat(path).st_size for path in c.output_paths())
    statuses = {result.status for result in results}
    status = "in_sync" if statuses == {"in_sync"} else "replaced" if "replaced" in statuses else "published"
    return PublishResult(status, c.dest)  # type: ignore[arg-type]


def _write_shard(
    c: Conversion,
    scratch: Scratch,
    header: bytes,
    size: int,
    placed: list[tuple[TensorSpec, int]],
    progress: _SetProgress,
) -> None:
    try:
        written = write_planned(
            scratch.fd, str(scratch.path), header, size, placed, c.source.readers, progress=progress.shard(), part=True
        )
    except OSError as exc:  # ENOSPC, EIO, EFBIG... name the file, keep the cause for the daemon
        raise SyncdError.from_os_error("cannot write the output", str(scratch.dest), exc) from exc
    verify_one_pass(c, scratch.path, scratch.fd, written, [spec for spec, _ in placed], size)


class _SetProgress:
    """The progress of a set's shards, each written in its own pass, told as one count over the set."""

    def __init__(self, total: int, callback: ProgressCallback | None) -> None:
        self.total = total
        self.done = 0
        self.callback = callback

    def shard(self) -> Callable[[int, int], None] | None:
        """The progress callback of the next shard's pass (the shards are written one after another)."""
        callback = self.callback
        if callback is None:
            return None
        start = self.done

        def told(done: int, total: int) -> None:
            self.done = start + done
            callback(self.done, self.total)

        return told


def _fill_in_source_hash(c: Conversion, fd: int, header: bytes, digest: str) -> None:
    """The source hash is known once the source has been read, so the header went out with a placeholder of
    the same length: patching it in place keeps the header's size and every offset where it is."""
    placeholder = hashing.placeholder(c.request.hash_name).encode("ascii")
    if header.count(placeholder) != 1:
        raise SyncdError("cannot place the source hash in the output header", str(c.dest))
    c.metadata[hashing.SOURCE_HASH_KEYS[c.request.hash_name]] = digest
    final = header.replace(placeholder, digest.encode("ascii"))
    pwrite_all(fd, final, 0)
    if os.pread(fd, len(final), 0) != final:
        raise VerificationError("the output header reads back different from what was written", str(c.dest))


def _verify_table(c: Conversion, output: TensorFileReader, specs: list[TensorSpec]) -> None:
    same = c.target.comparable
    expected = {s.name: (same(s.dtype), s.shape) for s in specs}
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


def _publish(scratch: Scratch, c: Conversion) -> PublishResult:
    """Publish the finished output; the source is proven unchanged as late as possible, right before the
    output is put in place (after its fsync)."""
    return publish(
        scratch,
        replace=c.request.overwrite,
        replace_if=c.request.replace_if,
        source=Path(c.source.path),
        before_placing=c.source.check_unchanged,
    )


def check_source_unchanged(reader: TensorFileReader) -> None:
    """Raise SourceChangedError unless the source is the same, unchanged file from the first byte read to now.

    Compared with the fstat taken before the header was read: identity (dev, ino), size, mtime and ctime.
    The kernel sets ctime on every write, truncate and utime call, so a same-size rewrite whose mtime was
    set back still shows (Linux >= 6.13 gives a fine-grained ctime to any change after a stat, so a write in
    the same clock tick as our open is not lost). The path must still name that file: a source replaced or
    removed meanwhile is not published either (the new file, if any, gets its own conversion).
    """
    before, now = reader.stat_at_open, os.fstat(reader.fd)
    unpublished = "while it was being converted; nothing was published"
    if _stamp(now) != _stamp(before):
        raise SourceChangedError(f"changed {unpublished}", reader.path)
    try:
        at_path = os.lstat(reader.path)
    except FileNotFoundError:
        raise SourceChangedError(f"was removed {unpublished}", reader.path) from None
    if (at_path.st_dev, at_path.st_ino) != (now.st_dev, now.st_ino):
        raise SourceChangedError(f"was replaced {unpublished}", reader.path)


def check_index_unchanged(index: ShardIndex) -> None:
    """As check_source_unchanged, for a set's index: read whole when the set was opened (its bytes begin the
    set's hash), it must still be that file, unchanged, at its path."""
    unpublished = "while it was being converted; nothing was published"
    try:
        now = os.stat(index.path)
    except FileNotFoundError:
        raise SourceChangedError(f"was removed {unpublished}", index.path) from None
    if index.opened is not None and _stamp(now) != _stamp(index.opened):
        raise SourceChangedError(f"changed {unpublished}", index.path)


def _stamp(info: os.stat_result) -> tuple[int, ...]:
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def source_digest(source: Path, within: Path, hash_name: str) -> str | None:
    """The hash of a source as a conversion records it : one file's bytes, or a set's
    index followed by every shard it lists, in the index's order; None if any part cannot be read."""
    parts = [source]
    if is_index_name(source):
        try:
            files = read_index(source, within).files
        except SyncdError:
            return None
        parts += [source.parent / name for name in files]
    sha = hashing.new_hasher(hash_name)
    for part in parts:
        try:
            fd, size = open_regular_file(part, within)
        except SyncdError:
            return None
        try:
            hash_fd(sha, fd, size)
        except OSError:
            return None
        finally:
            os.close(fd)
    return sha.hexdigest()


def hash_fd(sha: hashing.Hasher, fd: int, size: int) -> None:
    """Feed the first `size` bytes of an open regular file to `sha` (never more: a file growing meanwhile is
    not read forever)."""
    offset = 0
    while offset < size:
        chunk = os.pread(fd, min(8 << 20, size - offset), offset)
        if not chunk:
            break
        sha.update(chunk)
        offset += len(chunk)
