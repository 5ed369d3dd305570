"""One source checkpoint to one published output: open -> plan -> write -> verify -> publish.

Used by `syncd convert` and by the daemon's workers. The source (source.py) is one checkpoint file or a
sharded safetensors set read through its index, in one pass, shard after shard, into one output. The adapters
decide names, shapes and transposes from the tensor table alone; the store options (options.py: tensor
filter, remap rules, contiguous indices, precision casts through cast.py) apply to their plan; the target
format's type (targets.py) turns the plan into specs and metadata (what it cannot hold travels in `syncd.*`
metadata, see carry.py). `plan` builds all of that once, as a frozen `Conversion`. This module then moves the
bytes in one pass over the source (write/), checks what was written, and only then publishes. A safetensors
output may be written as a set (sets.py), shards first and the index last, each shard written in its own
pass over the part of the source it takes.
"""

from __future__ import annotations

import os
import time
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from syncd.adapters import (
    AUTO,
    BURN,
    KEEP,
    LAYOUT_CHOICES,
    PYTORCH,
    AdapterPlan,
    FileContext,
    ModuleMap,
    PlanEntry,
    plan_conversion,
    tensor_ref,
)
from syncd.adapters.evidence import metadata_layout
from syncd.engine import carry, hashing
from syncd.engine.context import gather_context, states_every_module
from syncd.engine.directions import converts_to
from syncd.engine.options import NothingLeftError, StoreOptions, StorePlan, apply_options, undo_renames
from syncd.engine.progress import ProgressCallback
from syncd.engine.publish import (
    Published,
    PublishResult,
    Scratch,
    ensure_destination_free,
    interrupts_held,
    open_scratch,
    publish,
    remove_stale_scratch_of,
    source_owner,
)
from syncd.engine.sets import set_paths, write_set
from syncd.engine.source import Source, open_source
from syncd.engine.targets import TARGETS, Fill, Target
from syncd.engine.write.planned import (
    VERIFY_CHOICES,
    FromSource,
    Joined,
    Written,
    check_digests,
    check_written,
    from_source,
    source_pieces,
    verify_full,
    write_planned,
)
from syncd.engine.write.views import ViewCopy, ViewPiece
from syncd.errors import (
    FormatError,
    SyncdError,
    UsageError,
    VerificationError,
    one_line,
)
from syncd.formats import BURNPACK, SAFETENSORS
from syncd.formats.fileio import FileStamp, TensorFileReader, open_regular_file, pwrite_all
from syncd.formats.registry import BY_NAME, checkpoint_stem
from syncd.formats.shards import (
    INDEX_SUFFIX,
    ShardLayout,
    find_index,
    is_index_name,
    is_set_index,
    layout_by_size,
    read_index,
    set_stem,
)
from syncd.formats.table import TensorInfo, TensorSpec

if TYPE_CHECKING:  # numpy-backed; imported where a conversion needs them (a plain copy does not)
    from syncd.engine.cast import CastCopy, JoinedCast

    Cast = CastCopy | JoinedCast


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
    replace_if: FileStamp | None = None
    # a set output: syncd's own earlier set (each file, its index included -> the identity it must still have
    # to be replaced; those the new set does not have are removed)
    replace_set: Mapping[Path, FileStamp] | None = None
    progress: ProgressCallback | None = None  # called with (bytes written, bytes to write) as the output fills
    # told now and then that the work moves on where no byte is written (the checks after the pass): the
    # daemon's stuck-worker check counts time without either
    alive: Callable[[], None] | None = None
    # remove what a writer killed while writing the outputs left (their scratch files) before writing them:
    # one-shot convert has no start-up sweep; the daemon has, and its rescans, and a conversion's look through
    # a directory of 40,000 entries cost more than its own work
    sweep_scratch: bool = True
    store: StoreOptions = field(default_factory=StoreOptions)  # remap, filter, precision
    shard_size: int | None = None  # write safetensors as a set split at this size (huggingface_hub's rule)
    one_file: bool = False  # one safetensors file even where a carried shard layout says otherwise
    # a --shard-size split keeps its index with one shard too (the daemon's destination is the index)
    always_index: bool = False
    hash_name: str = hashing.DEFAULT_HASH  # the source hash recorded: xxh3_128 | sha256
    verify: str = "fast"  # fast: checks taken while writing, table re-read; full: also every tensor re-read
    top_level_key: str | None = None  # a PyTorch checkpoint's key holding the tensors (Burn's with_top_level_key)
    # called with each output file's path and finished identity right before it is put in place (after its
    # fsync and the source's last check); may raise to stop it. The daemon records it there, so that an
    # output placed by a daemon killed before it could record the publish is still provably its own.
    before_placing: Callable[[Path, FileStamp], None] | None = None


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
    removed: list[Path] = field(default_factory=list)  # files of syncd's earlier set the new one no longer has
    # each file this conversion put in place, as it was once there (PublishResult.placed); not those found
    # already holding its bytes
    placed: dict[Path, FileStamp] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # shown without -v: guesses by convention, index gaps
    source_notes: list[str] = field(default_factory=list)  # what of the source was taken and what was left


def default_destination(source: Path, to_format: str) -> Path:
    extension = BY_NAME[to_format].extension
    if is_set_index(source):  # model.safetensors.index.json -> model.bpk
        return source.parent / (set_stem(source) + extension)
    return source.parent / (checkpoint_stem(source) + extension) if source.suffix else Path(f"{source}{extension}")


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
    with open_source(source_path, request.within, request.top_level_key) as source:
        to_format = request.to_format or converts_to(BY_NAME[source.header.format]).name
        if to_format not in TARGETS:  # a format syncd only reads (PyTorch's pickles)
            writes = " or ".join(target.format.extension for target in TARGETS.values())
            raise UsageError(
                f"cannot write a {to_format} checkpoint (syncd writes no pickles): write {writes}",
                str(request.dest) if request.dest else None,
            )
        dest = Path(request.dest) if request.dest else default_destination(source_path, to_format)
        conversion = plan(source, request, TARGETS[to_format](), dest)
        for path in conversion.output_paths():
            for member in source.files:
                _check_distinct(Path(member), path)
            if request.fail_early_if_exists and not request.overwrite:
                ensure_destination_free(path)
            if request.sweep_scratch:
                remove_stale_scratch_of(path)
        outcome, size, placed = write_verify_publish(conversion)
    return ConvertResult(
        status=outcome.status,
        source=source_path,
        dest=conversion.dest,
        to_format=to_format,
        tensors=len(conversion.specs),
        bytes=size,
        seconds=time.monotonic() - started,
        source_layout=conversion.plan.source_layout,
        target_layout=conversion.plan.target_layout,
        decisions=conversion.plan.decisions,
        dropped=conversion.plan.dropped,
        restored=conversion.restored,
        left_out=conversion.store.left_out,
        cast=sorted(conversion.store.casts),
        files=conversion.output_paths(),
        removed=list(outcome.removed),
        placed=placed,
        notes=conversion.plan.notes,
        source_notes=source_notes(conversion.source.header.facts),
    )


def _check_distinct(source: Path, dest: Path) -> None:
    if dest.resolve() == source.resolve():
        raise UsageError(f"the output would overwrite its own source {source}")


def source_notes(facts: dict[str, Any]) -> list[str]:
    """What a PyTorch checkpoint's reader took and left (its tensors under a key; epoch, optimizer state...)."""
    notes = []
    key = facts.get("top_level_key")
    if key is not None:
        why = "as asked" if facts.get("top_level_key_by") == "asked" else "the one usual key holding tensors"
        notes.append(f"tensors taken from top-level key {key!r} ({why})")
    left = facts.get("left")
    if left:
        shown = ", ".join(left[:10]) + (f" and {len(left) - 10} more" if len(left) > 10 else "")
        notes.append(f"not converted: {shown}")
    return notes


# -- plan


@dataclass(frozen=True)
class Conversion:
    """One planned conversion, built once by `plan` and only read afterwards: what is read, what is written
    under which name, the output's metadata."""

    request: ConvertRequest
    source: Source
    target: Target
    dest: Path  # the output (a set: its index, or the one file of a one-shard split)
    carried: carry.Carried
    plan: AdapterPlan  # after the store options (final names, filtered)
    store: StorePlan  # what filters, remap rules and casts did
    entries: list[PlanEntry]  # in output data order
    specs: list[TensorSpec]  # the planned tensors, then the carried ones written back (`restored`)
    metadata: dict[str, str]  # with a placeholder where the source hash goes (known once the source is read)
    scalars: dict[str, Any]
    restored: list[str]  # carried tensors written back
    casts: dict[str, Cast]  # output name -> the cast that fills it
    shards: ShardLayout | None  # a safetensors output written as a sharded set
    directory: Path  # where a set's files go

    def output_paths(self) -> list[Path]:
        return set_paths(self.shards, self.directory) if self.shards else [self.dest]


def plan(source: Source, request: ConvertRequest, target: Target, dest: Path) -> Conversion:
    """Adapt names and shapes (the store options included), then build the target's specs and metadata.
    Nothing is written yet."""
    carried = carry.parse(source.header.metadata, source.path)
    target.check_dtypes(source.tensors, source.path)
    adapted, store = _adapt(source, request, target, carried)
    if len(store.carried_on) != len(carried.dropped):  # the tensor filter left some out
        carried = replace(carried, dropped={name: carried.dropped[name] for name in store.carried_on})
    adapted = replace(adapted, decisions=[*source_notes(source.header.facts), *adapted.decisions])
    entries = target.order(adapted.entries, carried)
    casts = _casts(source, store, entries)
    specs = (
        [_tensor_spec(source, carried, target, entry, casts.get(entry.target)) for entry in entries]
        if casts
        else target.tensor_specs(source, carried, entries, typing.cast(list[Fill], _source_fills(source, entries)))
    )  # (the casts: mypy does not see a named tuple's __call__, python/mypy#9858)
    taken = {spec.name for spec in specs}
    restored = target.extra_specs(source, carried, adapted.target_layout, taken, store.carried_names)
    specs += restored
    metadata, scalars = target.metadata(source, carried, adapted, entries)
    cast = [e.target for e in entries if e.source in store.casts] if store.casts else []
    shards_carried = _carried_shards(target, source, carried, adapted, entries)
    carry.store_facts(metadata, shards_carried, store.renames, cast, next(iter(store.casts.values()), None), carried)
    carry.stamp(
        metadata,
        adapted.target_layout,
        os.path.basename(source.path),
        hashing.SOURCE_HASH_KEYS[request.hash_name],
        hashing.placeholder(request.hash_name),
    )
    carry.record_kinds(metadata, adapted.target_layout, adapted.kinds)
    carry.record_gamma_beta(metadata, adapted.gamma_beta)
    carry.record_guesses(metadata, adapted.guessed)
    shards = _output_shards(request, target, source, carried, store, dest, specs)
    # (a .bpk whose layout nothing records is Burn's; a PyTorch set's shards say format: pt)
    known = (
        carried.layout
        or metadata_layout(source.header.metadata)
        # (a .bpk made with --layout keep from a PyTorch file records no layout but carries its `format: pt`)
        or metadata_layout(carried.safetensors_metadata or {})
        or (BURN if source.header.format == BURNPACK else None)
    )
    if shards is not None and adapted.target_layout != PYTORCH and known == BURN:
        # a set holds what save_pretrained writes (PyTorch's layout, `format: pt`, no syncd record): a set of a
        # Burn-layout file read as PyTorch's on its next conversion, exit 0, every Linear left transposed
        raise UsageError(
            "a sharded set is written in PyTorch's layout, as save_pretrained writes it, and this output keeps "
            "the source's burn layout (--layout keep, layout: keep in a watch): write one file (--shard-size none "
            "or -o NAME.safetensors; shard_size left out in a watch)",
            str(dest),
        )
    if shards is not None and request.dest is not None and not dest.is_dir() and not is_index_name(dest):
        # (it used to be taken for a file name, its directory the parent: a set written where nobody asked)
        raise UsageError(
            f"-o names no directory, and the output is a set of {len(shards.files) + shards.with_index} files: "
            "give an existing directory, a name ending in .safetensors.index.json, or a .safetensors name for one "
            "file",
            str(dest),
        )
    directory = dest if dest.is_dir() else dest.parent
    if shards is not None:
        output = set_paths(shards, directory)[-1]  # the index (or the one file of a one-shard split)
    elif dest.is_dir():  # `-o DIR`: the default name, in that directory
        output = dest / default_destination(Path(source.path), target.format.name).name
    else:
        output = dest
    return Conversion(
        request=request,
        source=source,
        target=target,
        dest=output,
        carried=carried,
        plan=adapted,
        store=store,
        entries=entries,
        specs=specs,
        metadata=metadata,
        scalars=scalars,
        restored=[spec.name for spec in restored],
        casts=casts,
        shards=shards,
        directory=directory,
    )


def _adapt(
    source: Source, request: ConvertRequest, target: Target, carried: carry.Carried
) -> tuple[AdapterPlan, StorePlan]:
    """The layout adapter over the original names (renames a syncd output carried are undone first), then
    the store options: tensor filter, remap rules, contiguous indices, casts (see options.py)."""
    layout = request.layout
    to_layout = KEEP if layout == KEEP else target.native_layout
    source_layout = layout if layout in (PYTORCH, BURN) else AUTO
    context: FileContext | None = None
    try:
        # renames a syncd output carried are undone first: context, maps and inference see the original names
        refs, real = undo_renames([tensor_ref((t.name, t.dtype, t.shape)) for t in source.tensors], carried.renames)
        # our own record of what we wrote, the file's metadata and the config.json beside it
        mapped = states_every_module(request.module_map, (ref.name for ref in refs))
        context = gather_context(
            source.path,
            _metadata_as_evidence(source.header.metadata, carried),
            carried.layout,
            carried.kinds,
            mapped,
            len(source.tensors),
            carried.gamma_beta,
            source.header.format,
        )
        adapted = plan_conversion(
            refs,
            to_layout=to_layout,
            source_layout=source_layout,
            module_map=request.module_map,
            context=context,
        )
        restoring = list(carried.dropped)
        options = request.store.for_conversion(source.header.format, target.format.name)
        store = apply_options(adapted, refs, real, options, restoring, to_layout)
    except SyncdError as exc:
        raise _naming_file(_with_context_notes(exc, context), source.path) from None
    return _with_store(adapted, store), store


def _metadata_as_evidence(metadata: dict[str, str], carried: carry.Carried) -> dict[str, str]:
    """The file's metadata as layout evidence. A .bpk made with --layout keep from a PyTorch file records no
    layout, and its tensors are that file's as they were: the `format: pt` it carries from it says so (its
    refusal suggested burn layout, and the map used as printed transposed every Linear). A recorded layout
    outranks it (a .bpk converted to Burn's layout carries the same key)."""
    kept = (carried.safetensors_metadata or {}).get("format")
    if carried.layout is not None or kept is None or "format" in metadata:
        return metadata
    return {**metadata, "format": kept}


def _with_context_notes(exc: SyncdError, context: FileContext | None) -> SyncdError:
    """A refusal says why evidence the file's surroundings would give was passed over (a config.json that is not
    JSON, a model definition that could not be built): the refusal alone pointed at the tensors, not at it. A
    filter that leaves nothing owes nothing to that evidence."""
    if context is not None and not isinstance(exc, NothingLeftError) and context.notes and exc.path is None:
        exc.message = f"{exc.message} ({'; '.join(context.notes)})"
        exc.args = (exc.message,)
    return exc


def _with_store(plan: AdapterPlan, store: StorePlan) -> AdapterPlan:
    """The plan as the store options left it: final names, filtered; -v and the sync log list what the filter
    left out, and count renames and casts."""
    decisions = plan.decisions + [f"left out by the tensor filter: {name}" for name in store.left_out]
    if store.renames:
        decisions.append(f"renamed {len(store.renames)} tensors (remap rules, contiguous indices)")
    decisions += store.notes
    if store.restored:
        decisions.append(f"restored the original names of {len(store.restored)} tensors (carried renames)")
    for dtype in sorted(set(store.casts.values())):
        count = sum(1 for d in store.casts.values() if d == dtype)
        decisions.append(f"cast {count} tensors to {dtype} (precision)")
    notes = plan.notes + store.notes
    return replace(plan, entries=store.entries, dropped=store.dropped, decisions=decisions, notes=notes)


def _tensor_spec(
    source: Source, carried: carry.Carried, target: Target, entry: PlanEntry, cast: Cast | None
) -> TensorSpec:
    """An entry's spec: filled from the source in the one pass, or, when the precision option casts it, in its
    new dtype and filled by its cast."""
    if cast is None:
        return target.tensor_spec(source, carried, entry, typing.cast(Fill, _source_fill(source, entry)))  # (mypy#9858)
    spec = target.tensor_spec(source, carried, entry, cast.fill)
    nbytes = _cast_nbytes(spec.nbytes, cast.from_dtype, cast.to_dtype)
    return replace(spec, dtype=cast.to_dtype, raw_dtype=None, nbytes=nbytes)


def _source_fill(source: Source, entry: PlanEntry) -> FromSource | Joined | ViewCopy:
    """The one-pass fill of an entry: its source tensor (or a row range of it), or its pieces end to end. A
    source tensor that is not one window of its file (a PyTorch view, a tied weight) is copied on its own."""
    if not entry.parts:  # one source tensor (most entries): its fill without building the pieces' tuples
        reader = source.reader_of(entry.source)
        if not reader.is_window(entry.source):
            return _view_copy(source, entry)
        return FromSource(reader, entry.source, entry.transpose, entry.rows)
    if not all(source.reader_of(piece.source).is_window(piece.source) for piece in entry.pieces):
        return _view_copy(source, entry)
    pieces = tuple(
        FromSource(source.reader_of(piece.source), piece.source, piece.transpose, piece.rows) for piece in entry.pieces
    )
    return Joined(pieces) if entry.parts else pieces[0]


def _source_fills(source: Source, entries: list[PlanEntry]) -> list[FromSource | Joined | ViewCopy]:
    """Every entry's `_source_fill`. Where every source tensor is a window of its file (all but some PyTorch
    checkpoints), an entry of one whole source tensor is filled from it without a call per entry: this runs
    over the whole plan, once per tensor."""
    if not all(reader.all_windows() for reader in source.readers):
        return [_source_fill(source, entry) for entry in entries]
    reader_of = source.reader_of
    return [
        from_source((reader_of(entry.source), entry.source, entry.transpose, entry.rows))
        if not entry.parts
        else _source_fill(source, entry)
        for entry in entries
    ]


def _view_copy(source: Source, entry: PlanEntry) -> ViewCopy:
    pieces, at = [], 0
    for piece in entry.pieces:
        reader = source.reader_of(piece.source)
        pieces.append(ViewPiece(reader, piece.source, piece.transpose, piece.rows, at))
        info = reader.tensor(piece.source)
        at += _piece_nbytes(info.nbytes, info.shape, piece.rows)
    return ViewCopy(tuple(pieces))


def _casts(source: Source, store: StorePlan, entries: list[PlanEntry]) -> dict[str, Cast]:
    """The entries the precision option casts, by output name, each with the cast that fills it (cast.py)."""
    if not store.casts:
        return {}
    return {
        entry.target: _cast(source, store.casts, entry)
        for entry in entries
        if any(piece.source in store.casts for piece in entry.pieces)
    }


def _cast(source: Source, dtypes: dict[str, str], entry: PlanEntry) -> Cast:
    """A cast entry's fill: its pieces end to end (a join's parts), each cast (precision.py casts a packed
    module whole)."""
    from syncd.engine.cast import CastCopy, JoinedCast

    copies, at = [], 0
    for piece in entry.pieces:
        info = source.tensor(piece.source)
        to_dtype = dtypes[piece.source]
        reader = source.reader_of(piece.source)
        copies.append(CastCopy(reader, piece.source, info.dtype, to_dtype, piece.transpose, piece.rows, at))
        at += _cast_nbytes(_piece_nbytes(info.nbytes, info.shape, piece.rows), info.dtype, to_dtype)
    return copies[0] if len(copies) == 1 else JoinedCast(copies)


def _cast_nbytes(nbytes: int, from_dtype: str, to_dtype: str) -> int:
    from syncd.engine.cast import cast_nbytes

    return cast_nbytes(nbytes, from_dtype, to_dtype)


def _piece_nbytes(nbytes: int, shape: tuple[int, ...], rows: tuple[int, int] | None) -> int:
    """The bytes of rows r0:r1 of a tensor (all of it without `rows`)."""
    if rows is None:
        return nbytes
    return nbytes // shape[0] * (rows[1] - rows[0]) if shape and shape[0] else 0


def _carried_shards(
    target: Target, source: Source, carried: carry.Carried, plan: AdapterPlan, entries: list[PlanEntry]
) -> ShardLayout | None:
    """The shard layout a .bpk carries: the set it was converted from (only the tensors kept), or the one
    its own source carried."""
    if target.format.name == SAFETENSORS:
        return None
    if source.sharded is None:
        return carried.shards
    if not is_index_name(source.path):  # a set of torch.save shards: the way back is safetensors, one file
        return None
    kept = {name for e in entries for name in e.sources} | set(plan.dropped)
    sizes = {t.name: t.nbytes for t in source.tensors}
    return ShardLayout.of(source.sharded).restricted_to(kept, sizes)


def _output_shards(
    request: ConvertRequest,
    target: Target,
    source: Source,
    carried: carry.Carried,
    store: StorePlan,
    dest: Path,
    specs: list[TensorSpec],
) -> ShardLayout | None:
    """The set a safetensors output is written as, or None for one file: `--shard-size` splits anew; a layout
    carried from the original set, or the source's own when it is a safetensors set, is reproduced, unless one
    file is asked for (`--shard-size none`, or an explicit `-o X.safetensors`). `-o NAME.safetensors.index.json`
    gets that index, a set of one shard too (it got one plain file, named after the set)."""
    named_one_file = request.dest is not None and dest.name.endswith(".safetensors")
    named_index = request.dest is not None and is_index_name(dest)
    if named_one_file and request.shard_size is not None and target.format.name == SAFETENSORS:
        raise UsageError(
            "--shard-size splits the output into a set, and -o names one .safetensors file: give -o a directory "
            "or a name ending in .safetensors.index.json",
            str(dest),
        )
    if named_index and request.one_file and target.format.name == SAFETENSORS:
        raise UsageError(
            "--shard-size none writes one plain file, and -o names a set's index: give -o a .safetensors name or "
            "a directory, or leave --shard-size out",
            str(dest),
        )
    if target.format.name != SAFETENSORS or request.one_file or named_one_file:
        return None
    sizes = [(spec.name, spec.nbytes) for spec in specs]
    if not sizes and (request.shard_size is not None or named_index):
        _refuse_a_set_of_no_tensor(source)
    set_layout = carried.shards
    if set_layout is None and source.sharded is not None and is_index_name(source.path):
        # a safetensors set written as safetensors (a cast, remap rules, a filter): the same set, as a .bpk made
        # from it would carry it back (it was written as one shard under the index's name)
        set_layout = ShardLayout.of(source.sharded)
    if named_index and request.shard_size is None and set_layout is None:
        # a file that carries no set, asked for as one: a set of one shard and its index, as the daemon writes
        # it with a watch's shard_size (it wrote one safetensors file under the index's name)
        return layout_by_size(sizes, None, dest.name, always_index=True)
    if request.shard_size is not None:
        # model.bpk, model.safetensors, ckpt.pt, a set's model.safetensors.index.json: model-00001-of-0000N...
        stem = set_stem(source.path) if is_set_index(source.path) else checkpoint_stem(source.path)
        index_name = dest.name if is_index_name(dest) else f"{stem}{INDEX_SUFFIX}"
        return layout_by_size(sizes, request.shard_size, index_name, always_index=request.always_index or named_index)
    if set_layout is None:
        return None
    # the carried set names tensors as they were before this conversion's remap rules (store.renames: final
    # name -> name before the rules)
    layout = set_layout.with_names({before: final for final, before in store.renames.items()})
    unlisted = sorted({name for name, _ in sizes} - set(layout.weight_map()))
    if unlisted:
        raise UsageError(
            f"the sharded set {source.path} records does not name {len(unlisted)} of the tensors written (e.g. "
            f"'{unlisted[0]}'), so it cannot be written as that set: give --shard-size SIZE to split anew, or "
            "--shard-size none for one file",
            str(dest),
        )
    layout = layout.restricted_to({name for name, _ in sizes}, dict(sizes))
    if named_index:  # `-o NAME.safetensors.index.json`: that name, and shards named after it
        layout = layout.named_after(dest.name)
    if store.casts or carried.precision is not None:  # the dtypes, so the sizes, are no longer the set's
        layout = layout.with_total_size(sum(size for _, size in sizes))
    return layout


def _refuse_a_set_of_no_tensor(source: Source) -> None:
    """A set of no tensor is an index with an empty weight_map, which no reader (syncd's own included) takes
    for a set: refused before anything is written, where one plain file of none is still written."""
    raise UsageError(
        "no tensor to put in a set (an index lists at least one): write one file (--shard-size none or "
        "-o NAME.safetensors; shard_size left out in a watch)",
        str(source.path),
    )


# -- write, verify, publish


def write_verify_publish(c: Conversion) -> tuple[PublishResult, int, dict[Path, FileStamp]]:
    """Write, check and publish the output; what publish did, the bytes the output takes, and each file put
    in place as it was once there."""
    if c.shards is not None:
        results, removed, size = _write_set(c)
        placed = {result.path: result.placed for result in results if result.placed is not None}
        return _set_result(c, results, removed), size, placed
    result, size = _write_one_pass(c)
    return result, size, {result.path: result.placed} if result.placed is not None else {}


def _write_one_pass(c: Conversion) -> tuple[PublishResult, int]:
    """One output file: planned, written in one pass over the source (a set: its shards in the index's order),
    which gives the source hash; checked without reading the data back, the hash filled in, then published."""
    mode = os.fstat(c.source.primary.fd).st_mode & 0o777
    with open_scratch(c.dest, mode, owner=source_owner(c.source.primary.fd)) as scratch:
        try:
            header, size, starts = _laid_out(c)
            written = write_planned(
                scratch.fd,
                str(scratch.path),
                header,
                size,
                list(zip(c.specs, starts, strict=True)),
                c.source.readers,
                c.request.hash_name,
                progress=c.request.progress,
                prefix=c.source.hash_prefix(),
                digests=c.request.verify == "full",
            )
        except OSError as exc:  # ENOSPC, EIO, EFBIG... name the file, keep the cause for the daemon
            raise SyncdError.from_os_error("cannot write the output", str(c.dest), exc) from exc
        verify_one_pass(c, scratch.path, scratch.fd, written, c.specs, size)
        _fill_in_source_hash(c, scratch.fd, header, written.source_hash)
        return _publish(scratch, c), size


def _laid_out(c: Conversion) -> tuple[bytes, int, list[int]]:
    """The target's layout of the output; what the format cannot hold (metadata past its size limit, from a
    set's index text carried as it was) names the source it comes from."""
    try:
        # Ctrl-C or SIGTERM held while the header is encoded: cbor2's C encoder swallows an exception raised in
        # the isinstance checks it makes ("Exception ignored in: [12288]"), and the conversion went on to exit 0
        with interrupts_held():
            return c.target.lay_out(c.source, c.carried, c.specs, c.metadata, c.scalars)
    except FormatError as exc:
        raise _naming_file(exc, c.source.path) from None


def verify_one_pass(
    c: Conversion, written_path: Path, fd: int, written: Written, specs: list[TensorSpec], size: int
) -> None:
    """Re-read the written header and table (a fresh reader validates them as any reader would): the table
    must be the plan's, and the ledger of writes must tile it exactly. The data is not read back (it would
    come from the page cache just written); transposed blocks were checked in cache as they were written.
    Cast tensors are checked by their casts, restored ones re-read. `--verify full` also re-reads every tensor.
    `specs`, `size`: what this file holds (one shard of a set: its tensors).

    The file is opened anew through the descriptor it was written with (/proc/self/fd), not by its path: a
    directory moved or renamed meanwhile changes the path, not the file (the source's own check then says
    whether it moved, a condition retried later)."""
    try:
        output = c.target.format.reader(f"/proc/self/fd/{fd}")
    except FormatError as exc:
        raise VerificationError(f"the written file does not read back: {exc.message}", str(c.dest)) from None
    output.path = str(written_path)  # what messages name
    alive = c.request.alive or (lambda: None)
    with output:
        _verify_table(c, output, specs)
        c.target.check_written(specs, output, str(c.dest))
        check_written(written.ledger, output, size, fd)
        if c.request.verify == "full":
            check_digests(written.ledger, output)
            verify_full(
                [(piece, s.name, at) for s in specs for piece, at in source_pieces(s.fill)], output, alive=alive
            )
        carried_as = {final: carried for carried, final in c.store.carried_names.items()}
        restored = set(c.restored)
        # without restored or cast tensors only views are checked here: the others are not gone through
        for spec in specs if restored or c.casts else [s for s in specs if isinstance(s.fill, ViewCopy)]:
            if spec.name in restored:
                if output.read(spec.name) != c.carried.dropped[carried_as.get(spec.name, spec.name)][2]:
                    raise VerificationError(f"restored tensor '{spec.name}' differs after writing", str(c.dest))
            elif spec.name in c.casts:
                c.casts[spec.name].verify(output, spec.name)
            elif isinstance(spec.fill, ViewCopy):
                spec.fill.verify(output, spec.name)
            alive()


def _write_set(c: Conversion) -> tuple[list[PublishResult], list[Path], int]:
    """A sharded safetensors output: every shard written in a pass over the part of the source it takes and
    checked in its scratch file, then the shards published and the index last (sets.py). A set holds what
    save_pretrained writes, so no syncd metadata and no hash."""
    assert c.shards is not None
    progress = _SetProgress(sum(spec.nbytes for spec in c.specs), c.request.progress)
    results, removed = write_set(
        c.specs,
        c.shards,
        c.directory,
        mode=os.fstat(c.source.primary.fd).st_mode & 0o777,
        owner=source_owner(c.source.primary.fd),
        replace=c.request.overwrite,
        write_shard=lambda scratch, header, size, placed: _write_shard(c, scratch, header, size, placed, progress),
        before_publish=c.source.check_unchanged,
        source=Path(c.source.path),
        replace_if=c.request.replace_set,
        before_placing=c.request.before_placing,
        compare_existing=not c.request.fail_early_if_exists,
    )
    size = sum(os.stat(path).st_size for path in c.output_paths())
    return results, removed, size


def _set_result(c: Conversion, results: list[PublishResult], removed: list[Path]) -> PublishResult:
    """The set's publish as one result: in sync only if every file was."""
    statuses = {result.status for result in results}
    status: Published = "in_sync" if statuses == {"in_sync"} else "replaced" if "replaced" in statuses else "published"
    return PublishResult(status, c.dest, tuple(removed))


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
            scratch.fd,
            str(scratch.path),
            header,
            size,
            placed,
            c.source.readers,
            progress=progress.shard(),
            part=True,
            digests=c.request.verify == "full",
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
    final = header.replace(placeholder, digest.encode("ascii"))
    pwrite_all(fd, final, 0)
    if os.pread(fd, len(final), 0) != final:
        raise VerificationError("the output header reads back different from what was written", str(c.dest))


def _verify_table(c: Conversion, output: TensorFileReader, specs: list[TensorSpec]) -> None:
    if _same_in_order(specs, output.tensors, c.target.stored_dtype):
        return  # (most outputs: the table lists the plan's tensors in its order)
    expected = _table_of(specs, c.target.stored_dtype)
    found = _table_of(output.tensors, c.target.stored_dtype)
    if expected != found:
        missing = sorted(set(expected) ^ set(found)) or sorted(n for n in expected if expected[n] != found[n])
        raise VerificationError(f"the written tensor table differs from the plan at {missing[:5]}", str(c.dest))


_NAME, _DTYPE, _SHAPE = attrgetter("name"), attrgetter("dtype"), attrgetter("shape")


def _same_in_order(specs: list[TensorSpec], tensors: list[TensorInfo], stored: dict[str, str] | None) -> bool:
    """True if `tensors` are `specs` in the same order, each with its name, dtype as the format stores it and
    shape: their tables (_table_of) are then equal. Compared column by column in C, no record per tensor; the
    dtypes are mapped in the same order as _table_of maps them (an unknown one fails the same way)."""
    if list(map(_NAME, specs)) != list(map(_NAME, tensors)):
        return False
    planned, found = map(_DTYPE, specs), map(_DTYPE, tensors)
    if stored is not None:
        planned, found = map(stored.__getitem__, planned), map(stored.__getitem__, found)
    return list(planned) == list(found) and list(map(_SHAPE, specs)) == list(map(_SHAPE, tensors))


def _table_of(tensors: Sequence[TensorSpec | TensorInfo], stored: dict[str, str] | None) -> dict[str, tuple[str, Any]]:
    """name -> (dtype as the format stores it, shape), built in C: it runs over every tensor, twice."""
    dtypes = map(_DTYPE, tensors) if stored is None else map(stored.__getitem__, map(_DTYPE, tensors))
    return dict(zip(map(_NAME, tensors), zip(dtypes, map(_SHAPE, tensors), strict=True), strict=True))


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
    told = c.request.before_placing

    def before_placing() -> None:
        c.source.check_unchanged()
        if told is not None:
            told(scratch.dest, FileStamp.of_fd(scratch.fd))

    return publish(
        scratch,
        replace=c.request.overwrite,
        replace_if=c.request.replace_if,
        source=Path(c.source.path),
        before_placing=before_placing,
    )


def source_digest(source: Path, within: Path, hash_name: str) -> str | None:
    """The hash of a source as a conversion records it : one file's bytes, or a set's
    index followed by every shard it lists, in the index's order; None if any part cannot be read."""
    parts = [source]
    if is_set_index(source):
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
