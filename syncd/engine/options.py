"""Burn's store vocabulary applied to a conversion plan: key remapping, contiguous indices, filters, precision.

The converter calls, in order:

    refs, real = undo_renames(tensors, carried_renames)   # names a syncd output carried back to the originals
    plan = plan_conversion(refs, ...)                     # the layout adapter, on the original names
    names = apply_options(plan, real, options)            # filter, remap, contiguous indices, casts

Renames are undone *before* planning, so that module maps and inference see the names they were written for;
remap rules run *after* the layout adapter, as a Burn user writes them (on `gamma`, not `weight`); filters match
the names as they are in the file being converted. Every name the output gets is checked to be unique before
anything is written (NameCollisionError names both sources).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from syncd.adapters import AdapterPlan, PlanEntry, TensorRef
from syncd.adapters.keys import RemapRule, TensorFilter, invert, rename_all, renames
from syncd.adapters.precision import plan_casts


@dataclass(frozen=True)
class StoreOptions:
    remap: tuple[RemapRule, ...] = ()
    map_indices_contiguous: bool = False
    tensors: TensorFilter = field(default_factory=TensorFilter)
    precision: str | None = None  # f16 | bf16 | f32


@dataclass
class StorePlan:
    """What the options did to a plan: its entries with final names (sources are the file's real names)."""

    entries: list[PlanEntry]
    dropped: list[str]  # real source names with no slot on the target (carried by the converter)
    left_out: list[str]  # real source names the filter excluded
    casts: dict[str, str]  # real source name -> dtype it is cast to
    renames: dict[str, str]  # final name -> name before the rules, for the names the rules changed
    restored: dict[str, str]  # real source name -> original name given back from carried renames

    @classmethod
    def empty(cls) -> StorePlan:
        return cls([], [], [], {}, {}, {})


def undo_renames(tensors: Iterable[TensorRef], carried: dict[str, str]) -> tuple[list[TensorRef], dict[str, str]]:
    """The table with carried renames undone, and original name -> real name in the file."""
    tensors = list(tensors)
    original = invert([t.name for t in tensors], carried)
    refs = [TensorRef(original[t.name], t.dtype, t.shape) for t in tensors]
    return refs, {original[t.name]: t.name for t in tensors}


def apply_options(
    plan: AdapterPlan, refs: Sequence[TensorRef], real: dict[str, str], options: StoreOptions
) -> StorePlan:
    """Filter, rename and pick casts for `plan` (made over `refs`, whose names map to the file's by `real`)."""
    kept: list[PlanEntry] = []
    excluded: list[PlanEntry] = []
    for entry in plan.entries:  # one pass: `e not in kept` compared dataclasses, quadratic in the tensor count
        (kept if all(options.tensors.keeps(real[name]) for name in entry.sources) else excluded).append(entry)
    left_out = list(dict.fromkeys(real[name] for e in excluded for name in e.sources))
    left_out += [real[name] for name in plan.dropped if not options.tensors.keeps(real[name])]
    dropped = [real[name] for name in plan.dropped if options.tensors.keeps(real[name])]
    final = rename_all([e.target for e in kept], options.remap, options.map_indices_contiguous)
    casts = {}
    if options.precision is not None:
        wanted = {name for e in kept for name in e.sources}
        by_name = [r for r in refs if r.name in wanted]
        planned = plan_casts(by_name, plan.kinds, options.precision, plan.packed)
        casts = {real[name]: dtype for name, dtype in planned.items()}
    return StorePlan(
        entries=[_with_real_sources(e, real, final[e.target]) for e in kept],
        dropped=dropped,
        left_out=left_out,
        casts=casts,
        renames=renames(final),
        restored={name: original for original, name in real.items() if name != original},
    )


def _with_real_sources(entry: PlanEntry, real: dict[str, str], target: str) -> PlanEntry:
    """The entry under its final name, reading the file's real names (a joined entry's parts too)."""
    parts = tuple(replace(part, source=real[part.source]) for part in entry.parts)
    return replace(entry, source=real[entry.source], target=target, parts=parts)
