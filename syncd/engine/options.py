"""Burn's store vocabulary applied to a conversion plan: key remapping, contiguous indices, filters, precision.

The converter calls, in order:

    refs, real = undo_renames(tensors, carried_renames)   # names a syncd output carried back to the originals
    plan = plan_conversion(refs, ...)                     # the layout adapter, on the original names
    names = apply_options(plan, real, options)            # filter, remap, contiguous indices, casts

Renames are undone *before* planning, so that module maps and inference see the names they were written for.
Remap rules see the source's names, as Burn's stores do (burn-store's `PytorchStore` / `SafetensorsStore`
remap the names as they are in the file, then their adapter renames `weight`/`bias` to `gamma`/`beta`): for a
PyTorch-layout source the rules match `norm1.weight`, for a `.bpk` source `norm1.gamma`. The layout adapter's
own change of a name (a norm's leaf, a packed tensor's pieces) is then made on the remapped name. A rule set
that moves some tensors of a module and not the others would split it: refused, naming both sides. Filters
match the names as they are in the file being converted. Every name the output gets is checked to be unique
before anything is written (NameCollisionError names both sources).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from operator import eq

from syncd.adapters import BURN, PYTORCH, AdapterPlan, PlanEntry, TensorRef
from syncd.adapters.keys import RemapRule, TensorFilter, apply_rules, check_unique, contiguous_indices, invert, renames
from syncd.adapters.precision import plan_casts
from syncd.errors import Kind, SyncdError

_LIST_LIMIT = 4  # tensor names shown per side of a split module


class SplitModuleError(SyncdError):
    """Remap rules that move some tensors of a module and not the others."""


class NothingLeftError(SyncdError):
    """A tensor filter that leaves none of the source's tensors (a setting, not the file, decides it)."""

    kind: Kind = "config"


# Burn's defaults for what a user leaves unsaid, by the format of the source, as the Burn store that reads that
# format has them: SafetensorsStore keeps indices as they are (crates/burn-store/src/safetensors/store.rs),
# PytorchStore makes them contiguous (crates/burn-store/src/pytorch/store.rs). docs/conversion-evidence.md
# lists where syncd's defaults differ from Burn's.
CONTIGUOUS_BY_DEFAULT = {"safetensors": False, "burnpack": False, "pytorch": True}


@dataclass(frozen=True)
class StoreOptions:
    remap: tuple[RemapRule, ...] = ()
    map_indices_contiguous: bool | None = None  # None: the source format's default (CONTIGUOUS_BY_DEFAULT)
    tensors: TensorFilter = field(default_factory=TensorFilter)
    precision: str | None = None  # f16 | bf16 | f32

    def for_conversion(self, source_format: str, target_format: str) -> StoreOptions:
        """These options with what they leave unsaid set as Burn's store for `source_format` has it, for an
        output Burn loads (a burnpack). A .safetensors output keeps the source's indices unless asked: PyTorch
        loads a state dict by its names, and `fc.0`, `fc.2` renumbered `fc.0`, `fc.1` fit no module of it."""
        if self.map_indices_contiguous is not None:
            return self
        default = target_format == "burnpack" and CONTIGUOUS_BY_DEFAULT.get(source_format, False)
        return replace(self, map_indices_contiguous=default)


@dataclass
class StorePlan:
    """What the options did to a plan: its entries with final names (sources are the file's real names)."""

    entries: list[PlanEntry]
    dropped: list[str]  # real source names with no slot on the target (carried by the converter)
    left_out: list[str]  # real source names the filter excluded
    casts: dict[str, str]  # real source name -> dtype it is cast to
    renames: dict[str, str]  # final name -> name before the rules, for the names the rules changed
    restored: dict[str, str]  # real source name -> original name given back from carried renames
    notes: list[str] = field(default_factory=list)  # what the user should know: index gaps, rules that matched nothing
    carried_names: dict[str, str] = field(default_factory=dict)  # carried tensor written back -> its final name
    carried_on: list[str] = field(default_factory=list)  # carried tensors the filter kept (the names they have)

    @classmethod
    def empty(cls) -> StorePlan:
        return cls([], [], [], {}, {}, {})


def undo_renames(tensors: Iterable[TensorRef], carried: dict[str, str]) -> tuple[list[TensorRef], dict[str, str]]:
    """The table with carried renames undone, and original name -> real name in the file."""
    tensors = list(tensors)
    if not carried:  # nothing was renamed (any source syncd did not write)
        return tensors, {t.name: t.name for t in tensors}
    original = invert([t.name for t in tensors], carried)
    refs = [TensorRef(original[t.name], t.dtype, t.shape) for t in tensors]
    return refs, {original[t.name]: t.name for t in tensors}


def apply_options(
    plan: AdapterPlan,
    refs: Sequence[TensorRef],
    real: dict[str, str],
    options: StoreOptions,
    restoring: Sequence[str] = (),
    to_layout: str = BURN,
) -> StorePlan:
    """Filter, rename and pick casts for `plan` (made over `refs`, whose names map to the file's by `real`).
    `restoring`: tensors a .bpk carried (BatchNorm counters), under their original names: the filter decides
    them by the name their module has in the file, as it does the file's tensors; written back to PyTorch's
    layout, the rules move them with their module. `to_layout`: the output's; only PyTorch's is given back the
    original names of what a syncd output carried renames of: elsewhere they stay as the file has them (what
    Burn loads), the record passed on for the way back."""
    kept, excluded = _filtered(plan.entries, real, options.tensors)
    left_out = list(dict.fromkeys(real[name] for e in excluded for name in e.sources))
    left_out += [real[name] for name in plan.dropped if not options.tensors.keeps(real[name])]
    dropped = [real[name] for name in plan.dropped if options.tensors.keeps(real[name])]
    # carried tensors (a BatchNorm's counter) are the file's too: the filter decides them as well, by the name
    # they would have in the file (their module where the file has it)
    in_file = _carried_in_file(restoring, real)
    left_out += [in_file[name] for name in restoring if not options.tensors.keeps(in_file[name])]
    had_tensors = bool(plan.entries or plan.dropped or restoring)
    restoring = [name for name in restoring if options.tensors.keeps(in_file[name])]
    if had_tensors and not (kept or restoring):  # (what it keeps with no slot there is metadata, no tensor)
        raise _nothing_left(options.tensors, dropped)
    casts = {}
    notes: list[str] = []
    if options.precision is not None:
        wanted = {name for e in kept for name in e.sources}
        by_name = [r for r in refs if r.name in wanted]
        planned = plan_casts(by_name, plan.kinds, options.precision, plan.packed)
        casts = {real[name]: dtype for name, dtype in planned.items()}
        if not casts:
            notes.append(_nothing_cast(options.precision))
    # (names kept as they are, the common case, told in C: these run over every tensor)
    real_as_is = all(map(eq, real.keys(), real.values()))
    gaps = to_layout == BURN  # (only a Burn Vec wants indices 0..n-1: PyTorch's Sequential has gaps of its own)
    if to_layout != PYTORCH:
        carried_on, restoring = restoring, []  # carried on in the output's metadata, not written back
        if not real_as_is:
            store = _keeping_file_names(kept, real, options, dropped, left_out, casts, gaps, notes)
            return replace(store, carried_on=carried_on)
    else:
        carried_on = restoring
    carried = [PlanEntry(name, name, False, ()) for name in restoring]
    final = final_names([*kept, *carried], options)
    targets = [e.target for e in kept]
    as_planned = all(map(eq, map(final.__getitem__, targets), targets)) and real_as_is
    return StorePlan(
        entries=kept if as_planned else [_with_real_sources(e, real, final[e.target]) for e in kept],
        carried_names={name: final[name] for name in restoring},
        carried_on=carried_on,
        dropped=dropped,
        left_out=left_out,
        casts=casts,
        renames={} if all(map(eq, final.keys(), final.values())) else renames(final),
        restored={} if real_as_is else {name: original for original, name in real.items() if name != original},
        notes=notes + _rule_notes(kept, options) + (_gap_notes(final.values(), options) if gaps else []),
    )


def _nothing_left(tensors: TensorFilter, slotless: list[str]) -> NothingLeftError:
    """A filter that leaves none of the source's tensors (or only ones the target has no slot for, which go into
    its metadata): an output of no tensor is no checkpoint, and published it would replace a good earlier one
    (the daemon's, at the source's next save)."""
    only = f", only {len(slotless)} with no slot there (as {slotless[0]})" if slotless else ""
    return NothingLeftError(f"the tensor filter leaves no tensor ({tensors.describe()}){only}; nothing written")


def _keeping_file_names(
    kept: list[PlanEntry],
    real: dict[str, str],
    options: StoreOptions,
    dropped: list[str],
    left_out: list[str],
    casts: dict[str, str],
    gaps: bool,
    notes: list[str],
) -> StorePlan:
    """apply_options' renaming where the carried renames are not undone: each entry under the file's name for
    it (its module where the file has it), the rules and contiguous indices on those, as on any file's names;
    the record the output carries takes each final name back to the original one."""
    moved = _module_moves(real)
    in_file = [
        _with_real_sources(
            entry, real, real[entry.target] if entry.target == entry.source else _moved(entry.target, moved)
        )
        for entry in kept
    ]
    original_of = {entry.target: planned.target for entry, planned in zip(in_file, kept, strict=True)}
    final = final_names(in_file, options)
    return StorePlan(
        entries=[entry._replace(target=final[entry.target]) for entry in in_file],
        dropped=dropped,
        left_out=left_out,
        casts=casts,
        renames={final[name]: original for name, original in original_of.items() if final[name] != original},
        restored={},
        notes=notes + _rule_notes(in_file, options) + (_gap_notes(final.values(), options) if gaps else []),
    )


def _nothing_cast(precision: str) -> str:
    """--precision that found nothing to cast: as Burn's HalfPrecisionAdapter, f16/bf16 cast F32 tensors only
    (a BF16 file asked for f16 stays BF16), f32 casts F16 and BF16 ones."""
    casts = "F16 and BF16" if precision == "f32" else "F32"
    return (
        f"note: --precision {precision} cast no tensor: it casts the {casts} tensors of the modules Burn's "
        "HalfPrecisionAdapter casts (Linear, Embedding, convolutions, norms but BatchNorm), and none is converted"
    )


def _module_moves(real: dict[str, str]) -> dict[str, str]:
    """Original module path -> the one the file has, for the modules carried renames moved."""
    return {
        original.rpartition(".")[0]: name.rpartition(".")[0]
        for original, name in real.items()
        if original != name and "." in original
    }


def _carried_in_file(carried: Sequence[str], real: dict[str, str]) -> dict[str, str]:
    """Each carried tensor's original name -> the name it would have in the file: under its module's name there."""
    if not carried:
        return {}
    moved = _module_moves(real)
    return {name: _moved(name, moved) for name in carried}


def _moved(target: str, modules: dict[str, str]) -> str:
    """A name the adapter gave (or a carried tensor's original name) under the module where the file has it:
    the longest moved module path it starts with, and what follows it kept (`module.1.weight` ->
    `module.1.gamma` in a file whose module is `1`: `1.gamma`; a packed attention's `2.attn.in_proj_weight`
    -> `2.attn.query.weight` in a file whose module is `1.attn`: `1.attn.query.weight`)."""
    segments = target.split(".")
    for cut in range(len(segments) - 1, 0, -1):
        module = ".".join(segments[:cut])
        if module in modules:
            return ".".join([modules[module], *segments[cut:]])
    return target


def _filtered(
    entries: list[PlanEntry], real: dict[str, str], tensors: TensorFilter
) -> tuple[list[PlanEntry], list[PlanEntry]]:
    """(kept, excluded) by the tensor filter, in one pass (`e not in kept` compared dataclasses, quadratic in
    the tensor count); no filter keeps the list as it is."""
    if tensors.keeps_all:
        return list(entries), []
    kept: list[PlanEntry] = []
    excluded: list[PlanEntry] = []
    for entry in entries:
        (kept if all(tensors.keeps(real[name]) for name in entry.sources) else excluded).append(entry)
    return kept, excluded


def final_names(entries: Sequence[PlanEntry], options: StoreOptions) -> dict[str, str]:
    """Each entry's target -> its final name: the rules on its source names, then the adapter's own change of
    the name (a norm's leaf, a packed tensor's pieces) on the remapped name, then contiguous indices."""
    check_modules_move_whole(entries, options.remap)
    if options.remap:
        mapped = {entry.target: _remapped_target(entry, options.remap) for entry in entries}
    else:  # no rules: every target as the adapter named it (without a call per tensor)
        mapped = {entry.target: entry.target for entry in entries}
    if options.map_indices_contiguous:
        renumbered = contiguous_indices(list(dict.fromkeys(mapped.values())))
        mapped = {target: renumbered[new] for target, new in mapped.items()}
    check_unique(mapped)
    return mapped


def _remapped_target(entry: PlanEntry, rules: Sequence[RemapRule]) -> str:
    """The entry's target with the rules applied to its source name(s). Source and target share a module
    path; what the adapter put after it (`weight` -> `gamma`, `in_proj_weight` -> `query.weight`) is put
    after the remapped module path."""
    if not rules:
        return entry.target
    heads = set()
    for piece in entry.pieces:
        module, tail = _split_common(piece.source, entry.target)
        remapped = apply_rules(piece.source, rules)
        if piece.source == entry.target:
            return remapped
        if not _ends_with_segments(remapped, tail):
            raise SyncdError(
                f"remap rules rename '{piece.source}' to '{remapped}', changing its '{tail}', which the layout "
                f"adapter turns into '{entry.target.removeprefix(module + '.') if module else entry.target}': "
                "rules may move a module, not change the names of its parameters"
            )
        heads.add(remapped[: len(remapped) - len(tail)])
    if len(heads) > 1:  # the pieces of one joined tensor moved apart: the split check names them
        raise SyncdError(f"remap rules move the pieces of '{entry.target}' to different modules: {sorted(heads)}")
    module, tail_target = _split_common(entry.pieces[0].source, entry.target)
    return heads.pop() + entry.target[len(module) + 1 if module else 0 :]


def _split_common(source: str, target: str) -> tuple[str, str]:
    """(the module path source and target share, whole segments; the rest of source after it)."""
    a, b = source.split("."), target.split(".")
    shared = 0
    while shared < min(len(a), len(b)) - 1 and a[shared] == b[shared]:
        shared += 1
    return ".".join(a[:shared]), ".".join(a[shared:])


def _ends_with_segments(name: str, tail: str) -> bool:
    return name == tail or name.endswith("." + tail)


def check_modules_move_whole(entries: Sequence[PlanEntry], rules: Sequence[RemapRule]) -> None:
    """Refuse rules that send the tensors of one module (a name minus its last segment) to different places:
    Burn keys a module's parameters on its one path, so a BatchNorm whose running stats moved and whose
    gamma/beta did not is two broken modules. Tensors at the root belong to no module."""
    if not rules:
        return
    moved: dict[str, dict[str, list[str]]] = {}
    for source in dict.fromkeys(piece.source for entry in entries for piece in entry.pieces):
        module, _, leaf = source.rpartition(".")
        if not module:
            continue
        remapped = apply_rules(source, rules)
        head, _, new_leaf = remapped.rpartition(".")
        moved.setdefault(module, {}).setdefault(head if new_leaf == leaf else remapped, []).append(source)
    for module, places in moved.items():
        if len(places) > 1:
            raise SplitModuleError(_split_message(module, places))


def _split_message(module: str, places: dict[str, list[str]]) -> str:
    sides = "; ".join(f"{_short(names)} -> '{place}'" for place, names in places.items())
    return (
        f"remap rules split module '{module}': {sides}; a module's tensors must move together (rules see the "
        "source's names, as in Burn: a PyTorch file's weight/bias/running_mean, a .bpk's gamma/beta)"
    )


def _short(names: list[str]) -> str:
    shown = ", ".join(names[:_LIST_LIMIT])
    return shown + (f" and {len(names) - _LIST_LIMIT} more" if len(names) > _LIST_LIMIT else "")


def _rule_notes(entries: Sequence[PlanEntry], options: StoreOptions) -> list[str]:
    """A rule that changed no name is most often written for other names (gamma where the file says weight).
    Each rule is tried on the names as the rules before it left them, as it is applied (`^model\\.=` then
    `^embed_tokens\\.=...` matches what the first made)."""
    if not options.remap:
        return []
    names = [piece.source for entry in entries for piece in entry.pieces]
    notes = []
    for rule in options.remap:
        if not any(rule.regex.search(name) for name in names):
            notes.append(
                f"note: remap rule '{rule.pattern}' matched no tensor name (rules see the source's names, as in Burn)"
            )
        names = [rule.apply(name) for name in names]
    return notes


def _gap_notes(names: Iterable[str], options: StoreOptions) -> list[str]:
    """Indices with gaps (an nn.Sequential with parameter-free layers between its Linears: fc.0, fc.2, fc.4)
    load into no Burn Vec, whose indices run 0..n-1; Burn's PytorchStore closes them by default, its
    SafetensorsStore does not, and neither does syncd unless asked."""
    if options.map_indices_contiguous:
        return []
    gaps = index_gaps(names)
    if not gaps:
        return []
    shown = "; ".join(", ".join(f"{prefix}{i}" for i in found) for prefix, found in gaps[:3])
    more = f" and {len(gaps) - 3} more" if len(gaps) > 3 else ""
    return [
        f"note: module indices with gaps: {shown}{more}; a Burn Vec expects 0..n-1: convert with "
        "--map-indices-contiguous (map_indices_contiguous: true in a watch), undone on the way back"
    ]


def index_gaps(names: Iterable[str]) -> list[tuple[str, list[int]]]:
    """(prefix, its indices) for every name prefix whose indices are not 0..n-1, in order of first appearance."""
    seen: dict[str, dict[int, None]] = {}
    # a module's tensors share its indices: each module path once, its prefixes built as its segments are read
    for module in dict.fromkeys(name.rpartition(".")[0] for name in names):
        prefix = ""
        for part in module.split(".") if module else ():
            if part.isdigit() and part.isascii():
                seen.setdefault(prefix, {})[int(part)] = None
            prefix += part + "."
    return [(prefix, sorted(found)) for prefix, found in seen.items() if sorted(found) != list(range(len(found)))]


def _with_real_sources(entry: PlanEntry, real: dict[str, str], target: str) -> PlanEntry:
    """The entry under its final name, reading the file's real names (a joined entry's parts too)."""
    parts = tuple(part._replace(source=real[part.source]) for part in entry.parts)
    return entry._replace(source=real[entry.source], target=target, parts=parts)
