"""plan_conversion: from a tensor table to the renames, transposes and drops that put it in another layout."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from syncd.adapters.infer import (
    PACKED_PYTORCH_LEAF,
    Evidence,
    Module,
    ModuleKind,
    group_modules,
    kind_of,
    layout_evidence,
    split_name,
)
from syncd.adapters.model import (
    AUTO,
    BATCH_NORM,
    BURN,
    INSTANCE_NORM,
    KEEP,
    LINEAR,
    NEUTRAL,
    NORM_KINDS,
    PRELU,
    PYTORCH,
    SOURCE_LAYOUTS,
    TARGET_LAYOUTS,
    UNKNOWN,
    AdapterPlan,
    LayoutAmbiguityError,
    PlanEntry,
    TensorRef,
)
from syncd.adapters.modulemap import ModuleMap
from syncd.errors import SyncdError, UnsupportedError, UsageError
from syncd.formats.dtypes import ITEMSIZE

# Leaf renames PyTorch -> Burn (burn-compat.md §3.2 for the norms; §3.5 for PRelu, which Burn's own adapter
# leaves alone, and InstanceNorm, which it skips: we rename both).
_NORM_TO_BURN = {"weight": "gamma", "bias": "beta"}
_PRELU_TO_BURN = {"weight": "alpha"}
# PyTorch tensors with no Burn slot, per kind (burn-compat.md §4): Burn's load_file rejects unused tensors
# (§2.3), so they are dropped going to Burn and reported for the converter to carry in metadata.
_NO_BURN_SLOT = {
    BATCH_NORM: ("num_batches_tracked",),
    INSTANCE_NORM: ("running_mean", "running_var", "num_batches_tracked"),
}
_LIST_LIMIT = 6  # names shown in a one-line error before "and N more"


@dataclass(frozen=True)
class _Step:
    """What happens to one source tensor."""

    target: str | None  # None: dropped
    transpose: bool = False


def plan_conversion(
    tensors: Sequence[TensorRef],
    *,
    to_layout: str,
    source_layout: str = AUTO,
    module_map: ModuleMap | None = None,
) -> AdapterPlan:
    """Plan the conversion of a tensor table to `to_layout` ("burn" | "pytorch" | "keep").

    `source_layout` "auto" decides from the tensors (then from the map's `layout:`); "pytorch"/"burn" states it
    and must agree with whatever the tensors show. Raises AmbiguousLayoutError where the evidence does not
    decide (with `.suggestion`, the module-map YAML that would), UnsupportedError for tensors the target
    cannot take, ConfigError when the module map does not fit the tensors, SyncdError on duplicate names.
    """
    _check_arguments(to_layout, source_layout)
    _check_unique(tensors)
    if to_layout == KEEP:
        return _keep_plan(tensors)
    modules = group_modules(tensors)
    classified = [(module, kind_of(module, module_map)) for module in modules]
    evidence = [e for module, kind in classified for e in layout_evidence(module, kind)]
    source, source_note = _decide_layout(evidence, source_layout, module_map)
    _refuse_undecided(classified, source, to_layout)
    converting = source not in (None, to_layout)
    steps: dict[str, _Step] = {}
    decisions = [f"source layout: {source_note}", f"target layout: {to_layout}"]
    if not converting:
        decisions.append(f"nothing to adapt: identity plan ({_why_identity(source, to_layout)})")
    for module, kind in classified:
        module_steps, action = _module_steps(module, kind, to_layout) if converting else ({}, "unchanged")
        steps.update(module_steps)
        if module.params:
            decisions.append(f"{module.label}: {_kind_label(kind)} ({kind.reason}) -> {action}")
    if module_map is not None:
        decisions += [
            f"module map: pattern {p!r} matched no module" for p in module_map.unused_patterns(m.path for m in modules)
        ]
    plan = _build_plan(tensors, steps, source or NEUTRAL, to_layout, decisions)
    plan.kinds = {module.path: kind.kind for module, kind in classified}
    return plan


def apply_plan(tensors: Iterable[TensorRef], plan: AdapterPlan) -> list[TensorRef]:
    """The table the plan produces (names and shapes; dtypes unchanged), in the plan's order."""
    by_name = {tensor.name: tensor for tensor in tensors}
    return [TensorRef(e.target, by_name[e.source].dtype, e.shape) for e in plan.entries]


# ---------------------------------------------------------------------------------------------------------
# arguments and the identity cases


def _check_arguments(to_layout: str, source_layout: str) -> None:
    if to_layout not in TARGET_LAYOUTS:
        raise UsageError(f"unknown target layout {to_layout!r} (expected one of {', '.join(TARGET_LAYOUTS)})")
    if source_layout not in SOURCE_LAYOUTS:
        raise UsageError(f"unknown source layout {source_layout!r} (expected one of {', '.join(SOURCE_LAYOUTS)})")


def _check_unique(tensors: Sequence[TensorRef]) -> None:
    duplicates = sorted(name for name, n in Counter(t.name for t in tensors).items() if n > 1)
    if duplicates:
        raise SyncdError(f"duplicate tensor names in the source: {_short_list(duplicates)}")


def _keep_plan(tensors: Sequence[TensorRef]) -> AdapterPlan:
    entries = [PlanEntry(t.name, t.name, False, t.shape) for t in tensors]
    return AdapterPlan(entries, [], KEEP, KEEP, ["layout keep: names and shapes copied as they are"], {})


def _why_identity(source: str | None, target: str) -> str:
    if source is None:
        return "no tensor in the file differs between the pytorch and burn layouts"
    return f"the file is already in {target} layout"


# ---------------------------------------------------------------------------------------------------------
# the file's layout


def _decide_layout(
    evidence: list[Evidence], source_layout: str, module_map: ModuleMap | None
) -> tuple[str | None, str]:
    """(layout or None when nothing shows it, a note for the decisions). A file is in one layout."""
    stated, origin = _stated_layout(source_layout, module_map)
    if stated is not None:
        against = [e for e in evidence if e.layout != stated]
        if against:
            raise _contradiction_error(stated, origin, against)
        return stated, f"{stated} ({origin})"
    layouts = {e.layout for e in evidence}
    if len(layouts) > 1:
        raise _conflict_error(evidence)
    if not layouts:
        return None, f"{NEUTRAL} (nothing in the file shows a layout)"
    layout = layouts.pop()
    return layout, f"{layout} (shown by {_short_list([_label(e.module) for e in evidence])})"


def _stated_layout(source_layout: str, module_map: ModuleMap | None) -> tuple[str | None, str]:
    # The explicit argument (--layout) wins over the map's `layout:` line.
    if source_layout != AUTO:
        return source_layout, "--layout"
    if module_map is not None and module_map.layout is not None:
        return module_map.layout, f"layout: in {module_map.source}"
    return None, ""


def _contradiction_error(stated: str, origin: str, against: list[Evidence]) -> LayoutAmbiguityError:
    listed = "; ".join(f"{_label(e.module)} ({e.reason})" for e in against)
    message = (
        f"source layout {stated} ({origin}) contradicts the tensors: {_clip(listed)}; "
        "map such modules as Other to leave them unchanged"
    )
    suggestion = _map_yaml([(_label(e.module), "Other", "left unchanged") for e in against])
    return _ambiguity(message, suggestion, [e.module for e in against])


def _conflict_error(evidence: list[Evidence]) -> LayoutAmbiguityError:
    by_layout = {layout: [e for e in evidence if e.layout == layout] for layout in (PYTORCH, BURN)}
    sides = "; ".join(
        f"{layout} from {_short_list([_label(e.module) for e in found])}" for layout, found in by_layout.items()
    )
    message = (
        f"conflicting layout evidence ({sides}); a file is in one layout: map the odd modules "
        "as Other to leave them unchanged"
    )
    minority = min(by_layout.values(), key=len)
    suggestion = _map_yaml([(_label(e.module), "Other", e.reason) for e in minority])
    details = [f"  {_label(e.module)}: {e.layout} ({e.reason})" for e in evidence]
    return _ambiguity(message, suggestion, [e.module for e in evidence], details)


# ---------------------------------------------------------------------------------------------------------
# refusing what the evidence does not decide (burn-compat.md §3.6: never guess silently)


def _refuse_undecided(classified: list[tuple[Module, ModuleKind]], source: str | None, target: str) -> None:
    if source == target:
        return  # identity: nothing depends on the undecided kinds
    undecided = [kind for _, kind in classified if kind.kind == UNKNOWN]
    # Without a layout, every Linear weight might or might not need its transpose.
    layoutless = [m for m, k in classified if source is None and k.kind == LINEAR]
    if not undecided and not layoutless:
        return
    parts = []
    if undecided:
        listed = ", ".join(f"{_label(k.path)} ({_question(k)})" for k in undecided)
        parts.append(
            f"the tensors do not decide what {len(undecided)} module(s) are: {_clip(listed)}; "
            "state them in a module map"
        )
    if layoutless:
        listed = ", ".join(f"{m.params['weight'].name} {list(m.shape('weight'))}" for m in layoutless)
        parts.append(
            f"nothing shows whether the file is in pytorch or burn layout, which decides whether "
            f"these Linear weights are transposed: {_clip(listed)}; pass --layout pytorch|burn"
        )
    lines = [(k.path or "(root)", k.options[0], _alternatives(k.options)) for k in undecided]
    needs_layout = source is None and (layoutless or any(LINEAR in k.options for k in undecided))
    suggestion = _map_yaml(lines, PYTORCH if needs_layout else None)
    details = [f"  {k.path or '(root)'}: {k.reason}" for k in undecided]
    details += [
        f"  {m.params['weight'].name}: Linear weight {list(m.shape('weight'))}, layout unknown" for m in layoutless
    ]
    names = [k.path for k in undecided] + [m.path for m in layoutless]
    raise _ambiguity(f"cannot convert to {target} layout: " + "; also ".join(parts), suggestion, names, details)


def _question(kind: ModuleKind) -> str:
    # the one-line message asks the question; the reasons with shapes go to `details`
    return f"{' or '.join(sorted(kind.options))}?" if len(kind.options) > 1 else kind.reason


def _alternatives(options: tuple[str, ...]) -> str:
    rest = options[1:]
    return f"or {' or '.join(rest)}" if rest else "left unchanged"


def _map_yaml(lines: list[tuple[str, str, str]], layout: str | None = None) -> str:
    """Module-map YAML that settles the listed modules; comments name the alternatives."""
    out = ["# module map (YAML, as for --modules) that would settle it; check each line against the model"]
    if layout is not None:
        out.append(f"layout: {layout}  # or burn: the layout the file is in (same as --layout {layout})")
    if lines:
        out.append("modules:")
        out += [f'  "{path}": {kind}  # {comment}' for path, kind, comment in lines]
    return "\n".join(out)


def _ambiguity(
    message: str, suggestion: str, undecided: list[str], details: list[str] | None = None
) -> LayoutAmbiguityError:
    return LayoutAmbiguityError(
        message,
        suggestion=suggestion,
        undecided=[_label(name) for name in undecided],
        details="\n".join([*(details or []), suggestion]),
    )


# ---------------------------------------------------------------------------------------------------------
# per-module steps when the layout really changes


def _module_steps(module: Module, kind: ModuleKind, target: str) -> tuple[dict[str, _Step], str]:
    _refuse_packed(module, target)
    if kind.kind == LINEAR:
        return _linear_steps(module)
    if kind.kind in NORM_KINDS or kind.kind == PRELU:
        return _rename_steps(module, kind.kind, target)
    return {}, "unchanged"


def _refuse_packed(module: Module, target: str) -> None:
    packed = [t.name for t in module.extras if PACKED_PYTORCH_LEAF.fullmatch(split_name(t.name)[1])]
    if packed and target == BURN:
        raise UnsupportedError(
            f"tensor '{packed[0]}': PyTorch packs several parameters in it (MHA in_proj or "
            "RNN gates); splitting it into Burn's separate Linears is not supported "
            "(burn-compat.md §3.6 item 6); convert with --layout keep"
        )


def _linear_steps(module: Module) -> tuple[dict[str, _Step], str]:
    # burn-compat.md §3.2: Linear weight, rank 2 -> transpose [a, b] -> [b, a]; the bias is untouched.
    weight = module.params["weight"]
    if weight.dtype not in ITEMSIZE:
        raise UnsupportedError(
            f"tensor '{weight.name}': cannot transpose a {weight.dtype} tensor (no fixed "
            "element size); convert with --layout keep"
        )
    rows, cols = weight.shape
    return {weight.name: _Step(weight.name, transpose=True)}, f"transpose weight [{rows}, {cols}] -> [{cols}, {rows}]"


def _rename_steps(module: Module, kind: str, target: str) -> tuple[dict[str, _Step], str]:
    to_burn = _PRELU_TO_BURN if kind == PRELU else _NORM_TO_BURN
    renames = to_burn if target == BURN else {burn: torch for torch, burn in to_burn.items()}
    present = {leaf: new for leaf, new in renames.items() if leaf in module.params}
    steps = {module.params[leaf].name: _Step(_with_leaf(module, new)) for leaf, new in present.items()}
    notes = [f"rename {', '.join(f'{leaf}->{new}' for leaf, new in present.items())}"] if present else []
    if target == BURN:
        dropped = [leaf for leaf in _NO_BURN_SLOT.get(kind, ()) if leaf in module.params]
        steps.update({module.params[leaf].name: _Step(None) for leaf in dropped})
        if dropped:
            notes.append(f"drop {', '.join(dropped)} (no Burn slot; burn-compat.md §4)")
    elif kind == BATCH_NORM:
        # The converter re-adds the counter from metadata when it recorded one; we never invent it. PyTorch
        # does not need it: BatchNorm fills in 0 for a state dict without version metadata (load_file's), so
        # load_state_dict(strict=True) passes (checked with torch 2.13 in tests/test_convert.py).
        notes.append(
            "no num_batches_tracked in a Burn file: restored from metadata if recorded, "
            "otherwise left out (PyTorch's BatchNorm starts it at 0 when loading a state dict without it)"
        )
    return steps, "; ".join(notes) or "unchanged"


def _with_leaf(module: Module, leaf: str) -> str:
    return f"{module.path}.{leaf}" if module.path else leaf


# ---------------------------------------------------------------------------------------------------------
# assembling the plan


def _build_plan(
    tensors: Sequence[TensorRef], steps: dict[str, _Step], source: str, target: str, decisions: list[str]
) -> AdapterPlan:
    entries, dropped = [], []
    for tensor in tensors:
        step = steps.get(tensor.name, _Step(tensor.name))
        if step.target is None:
            dropped.append(tensor.name)
            continue
        shape = tensor.shape[::-1] if step.transpose else tensor.shape
        entries.append(PlanEntry(tensor.name, step.target, step.transpose, shape))
    _check_no_collisions(entries)
    return AdapterPlan(entries, dropped, source, target, decisions)


def _check_no_collisions(entries: list[PlanEntry]) -> None:
    sources_by_target: dict[str, list[str]] = {}
    for entry in entries:
        sources_by_target.setdefault(entry.target, []).append(entry.source)
    clashes = [
        f"{target} <- {' and '.join(sources)}" for target, sources in sources_by_target.items() if len(sources) > 1
    ]
    if clashes:
        raise SyncdError(f"output names collide: {_short_list(clashes)}")


# ---------------------------------------------------------------------------------------------------------
# wording


def _kind_label(kind: ModuleKind) -> str:
    return "undecided" if kind.kind == UNKNOWN else kind.kind


def _label(path: str) -> str:
    return path or "(root)"


def _short_list(items: list[str]) -> str:
    shown = ", ".join(items[:_LIST_LIMIT])
    return shown + (f" and {len(items) - _LIST_LIMIT} more" if len(items) > _LIST_LIMIT else "")


def _clip(text: str, limit: int = 400) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
