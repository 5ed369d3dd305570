"""plan_conversion: from a tensor table to the renames, transposes and drops that put it in another layout."""

from __future__ import annotations

import functools
import json
import math
import operator
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from syncd.adapters.evidence import architecture_for, decoder_lm_class, metadata_layout
from syncd.adapters.infer import (
    Evidence,
    KindSources,
    Module,
    ModuleKind,
    group_modules,
    kind_of,
    layout_evidence,
    order_vocab_options,
    resolve_with_layout,
    settle_output_heads,
)
from syncd.adapters.model import (
    AUTO,
    BATCH_NORM,
    BURN,
    BY_NAME,
    BY_SHAPE,
    EMBEDDING,
    INSTANCE_NORM,
    KEEP,
    LAYOUTS,
    LINEAR,
    LINEAR_IN_OUT,
    NEUTRAL,
    NORM_KINDS,
    OTHER,
    PRELU,
    PYTORCH,
    SOURCE_LAYOUTS,
    TARGET_LAYOUTS,
    UNKNOWN,
    AdapterPlan,
    FileContext,
    LayoutAmbiguityError,
    PlanEntry,
    TensorRef,
    plan_entry,
)
from syncd.adapters.modulemap import ModuleMap
from syncd.adapters.packed import PackedModule, find_packed, packed_entries
from syncd.errors import SyncdError, UnsupportedError, UsageError
from syncd.formats.dtypes import ITEMSIZE

# Leaf renames PyTorch -> Burn (docs/burn-adapters.md#norms: Burn renames the norms; not PRelu, which Burn's own adapter
# leaves alone, and InstanceNorm, which it skips: we rename both).
_NORM_TO_BURN = {"weight": "gamma", "bias": "beta"}
_PRELU_TO_BURN = {"weight": "alpha"}
# PyTorch tensors with no Burn slot, per kind (docs/burn-adapters.md#keys-without-a-counterpart): Burn's load_file
# rejects unused tensors, so they are dropped going to Burn and reported for the converter to carry in metadata.
_NO_BURN_SLOT = {
    BATCH_NORM: ("num_batches_tracked",),
    INSTANCE_NORM: ("running_mean", "running_var", "num_batches_tracked"),
}
_LIST_LIMIT = 6  # names shown in a one-line error before "and N more"


class _Step(NamedTuple):
    """What happens to one source tensor. A named tuple: one is made per renamed tensor, by `_step` without
    a Python frame (a third of a frozen dataclass's cost)."""

    target: str | None  # None: dropped
    transpose: bool = False


_BURN_NORM_LEAVES = frozenset({"gamma", "beta"})
_BURN_LEAVES = _BURN_NORM_LEAVES | {"alpha"}
# FileContext.container of the formats not Burn's own (syncd/formats/registry.py); None (a table planned on
# its own, not read from a file) counts as Burn's
FOREIGN_FORMATS = frozenset({"safetensors", "pytorch"})
BURNS_FORMAT = "burnpack"
_step = functools.partial(tuple.__new__, _Step)  # _step((target, transpose))
_DROPPED = _Step(None)


def plan_conversion(
    tensors: Sequence[TensorRef],
    *,
    to_layout: str,
    source_layout: str = AUTO,
    module_map: ModuleMap | None = None,
    context: FileContext | None = None,
) -> AdapterPlan:
    """Plan the conversion of a tensor table to `to_layout` ("burn" | "pytorch" | "keep").

    `source_layout` "auto" decides from the evidence; "pytorch"/"burn" states it and must agree with whatever
    the names show. `context` is what the file's surroundings say (its metadata, its syncd record, the
    config.json beside it). Raises AmbiguousLayoutError where the evidence does not decide (with
    `.suggestion`, the module-map YAML that would), UnsupportedError for tensors the target cannot take,
    ConfigError when the module map does not fit the tensors, SyncdError on duplicate names.
    """
    _check_arguments(to_layout, source_layout)
    _check_unique(tensors)
    if to_layout == KEEP:
        return _keep_plan(tensors)
    context = context or FileContext()
    architecture, table_note = architecture_for(context.config)
    sources = KindSources(module_map, dict(context.recorded_kinds), architecture, context.definition)
    packed = find_packed(tensors, sources)
    in_packed = {t.name for module in packed for t in module.tensors.values()}
    modules = group_modules((t for t in tensors if t.name not in in_packed) if in_packed else tensors)
    classified = [(module, kind_of(module, sources)) for module in modules]
    vocab = _vocab_size(context.config)
    classified = order_vocab_options(settle_output_heads(classified, decoder_lm_class(context.config), vocab), vocab)
    extra = [module.evidence() for module in packed]
    source, source_note = _decide_layout(classified, source_layout, module_map, context, extra)
    classified = _resolve_with_layout(classified, source)
    _refuse_undecided(classified, source, to_layout, context.container)
    converting = source not in (None, to_layout)
    steps: dict[str, _Step] = {}
    decisions = [f"source layout: {source_note}", f"target layout: {to_layout}", *context.notes]
    if context.definition is not None:
        decisions.append(f"module types from the {context.definition.source}")
    if architecture is not None:
        decisions.append(f"config.json {architecture.matched_by}: known architecture {architecture.family}")
    elif table_note is not None and context.definition is None:
        decisions.append(table_note)
    if not converting:
        decisions.append(f"nothing to adapt: identity plan ({_why_identity(source, to_layout)})")
    module_lines = []
    for module, kind in classified:
        if not converting:
            action = "unchanged"
        elif to_layout == PYTORCH and module.path in context.gamma_beta and kind.kind in NORM_KINDS:
            action = "unchanged: gamma/beta, as its PyTorch source named them (syncd.gamma_beta)"
        else:
            action = _add_module_steps(steps, module, kind, to_layout)
        if module.params:
            module_lines.append((module.label, f"{_kind_label(kind)} ({kind.reason}) -> {action}"))
    decisions += collapse_by_index(module_lines)
    by_convention = [kind for _, kind in classified if kind.by == BY_NAME and kind.kind != UNKNOWN]
    guessed = _convention_note(by_convention)
    joined = _packed_steps(packed, converting, decisions)
    if module_map is not None:
        paths = [m.path for m in modules] + [m.path for m in packed]
        decisions += [f"module map: pattern {p!r} matched no module" for p in module_map.unused_patterns(paths)]
    plan = _build_plan(tensors, steps, source or NEUTRAL, to_layout, decisions, joined)
    plan.kinds = {module.path: kind.kind for module, kind in classified}
    plan.kinds.update({module.path: module.kind for module in packed if module.kind is not None})
    plan.packed = frozenset(t.name for module in packed for t in module.tensors.values())
    if converting and to_layout == BURN:
        plan.gamma_beta = frozenset(
            module.path
            for module, kind in classified
            if kind.kind in NORM_KINDS and _BURN_NORM_LEAVES & module.params.keys()
        )
    if guessed and converting:
        plan.decisions.append(guessed)
        plan.notes.append(guessed)
        plan.guessed = {kind.path: f"{kind.kind}: {kind.reason}" for kind in by_convention}
    return plan


def collapse_by_index(lines: list[tuple[str, str]]) -> list[str]:
    """`path: decision` lines, one per module, except that modules whose paths differ in their index segments
    only and whose decisions read the same share one line where the first of them stood:
    `layers.{0..31}.mlp.up: ...`, `layers.{0..31}.experts.{0..7}.w1: ...` (every combination of the indices
    shown is one of the modules; where they do not all occur, each module keeps its line). A 32-layer model's
    300 lines are a dozen, in `-v` and in every sync log record."""
    groups: dict[tuple[str, str, bool], list[tuple[int, ...]]] = {}
    for (_, text), (template, indices) in zip(lines, _index_templates([label for label, _ in lines]), strict=True):
        groups.setdefault((template, text, bool(indices)), []).append(indices)
    out = []
    for (template, text, indexed), members in groups.items():
        if not indexed:  # a label without indices (or with braces of its own) stands as it is
            out += [f"{template}: {text}"] * len(members)
            continue
        sets = [sorted({member[k] for member in members}) for k in range(len(members[0]))]
        if len(members) > 1 and math.prod(map(len, sets)) == len(members):
            out.append(f"{_filled(template, [_index_set(values) for values in sets])}: {text}")
        else:
            out += [f"{_filled(template, [str(i) for i in member])}: {text}" for member in members]
    return out


def _index_templates(labels: list[str]) -> list[tuple[str, tuple[int, ...]]]:
    """`_index_template` of each label, over the segments of all of them at once (a model has thousands of
    modules: a regex call per label cost more than the rest of its decision line). Labels that hold a
    newline or a brace of their own are taken one by one."""
    joined = ".\n.".join(labels)  # a newline: a segment of its own between two labels
    if joined.count("\n") != len(labels) - 1 or "{" in joined or "}" in joined:
        return [_index_template(label) for label in labels]
    segments = joined.split(".")
    # (as _INDEX_SEGMENT: ASCII digits without a leading zero)
    indexed = [s.isdigit() and s.isascii() and (s[0] != "0" or len(s) == 1) for s in segments]
    values = [int(s) for s, index in zip(segments, indexed, strict=True) if index]
    shown = ".".join(["{}" if index else s for s, index in zip(segments, indexed, strict=True)]).split(".\n.")
    out = []
    taken = 0
    for label, template in zip(labels, shown, strict=True):
        count = template.count("{}")  # (no label holds braces of its own: each `{}` is an index)
        if count:
            out.append((template, tuple(values[taken : taken + count])))
            taken += count
        else:
            out.append((label, ()))
    return out


def _index_template(label: str) -> tuple[str, tuple[int, ...]]:
    """(`label` with each index segment as `{}`, the indices), or (label, ()) for a label holding braces of
    its own (an index is a segment of digits without a leading zero: `01` is a name, not the number 1)."""
    if "{" in label or "}" in label:
        return label, ()
    found = _INDEX_SEGMENT.findall(label)
    return (_INDEX_SEGMENT.sub("{}", label), tuple(map(int, found))) if found else (label, ())


def _filled(template: str, parts: list[str]) -> str:
    pieces = template.split("{}")
    return "".join(piece + part for piece, part in zip(pieces, [*parts, ""], strict=True))


# a whole dot-separated segment of ASCII digits without a leading zero
_INDEX_SEGMENT = re.compile(r"(?<![^.])(0|[1-9][0-9]*)(?![^.])", re.ASCII)


def _index_set(indices: list[int]) -> str:
    """`{0..31}`, `{0,2,4}`, `{0..3,8..11}`, or `5` alone: the indices in order, runs of three or more as
    ranges."""
    ordered = sorted(set(indices))
    if len(ordered) == 1:
        return str(ordered[0])
    runs: list[list[int]] = []
    for index in ordered:
        if runs and index == runs[-1][-1] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    text = [f"{run[0]}..{run[-1]}" if len(run) >= 3 else ",".join(map(str, run)) for run in runs]
    return "{" + ",".join(text) + "}"


def _vocab_size(config: dict[str, object] | None) -> int | None:
    vocab = (config or {}).get("vocab_size")
    return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None


def _convention_note(guessed: list[ModuleKind]) -> str | None:
    """One line listing every kind taken on a naming convention alone, so a wrong guess can be found later."""
    if not guessed:
        return None
    listed = ", ".join(f"{_label(k.path)} ({k.kind})" for k in guessed[:_LIST_LIMIT])
    more = f" and {len(guessed) - _LIST_LIMIT} more" if len(guessed) > _LIST_LIMIT else ""
    return (
        f"note: {len(guessed)} module kind(s) decided by naming convention alone: {listed}{more}; check them "
        "(their reasons: convert -v, syncd log --json) or state them in a module map "
        "(`syncd modules` writes a model's exact map)"
    )


def _packed_steps(packed: list[PackedModule], converting: bool, decisions: list[str]) -> list[PlanEntry]:
    """The split or joined entries of PyTorch's packed modules (docs/burn-adapters.md#packed-modules), with a
    decision line each; none when the layout does not change (their tensors are copied as they are)."""
    entries = []
    for module in packed:
        found, action = packed_entries(module) if converting else ([], "unchanged")
        entries += found
        decisions.append(f"{module.label}: {module.kind or 'packed'} ({module.reason}) -> {action}")
    return entries


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
    classified: list[tuple[Module, ModuleKind]],
    source_layout: str,
    module_map: ModuleMap | None,
    context: FileContext,
    extra: list[Evidence],
) -> tuple[str | None, str]:
    """(layout or None when nothing shows it, a note for the decisions). A file is in one layout.

    Strongest first: --layout, the map's `layout:`, the file's own syncd record; then the
    `format: pt` metadata and parameter names (strong evidence, which must agree); then the shapes (a bias
    matching one dimension), which the stronger evidence outranks. A shape-inferred Linear that contradicts
    a pytorch layout is a LinearInOut (transformers' Conv1D), not a contradiction.
    """
    kinds = {module.path: kind for module, kind in classified}
    evidence = [e for module, kind in classified for e in layout_evidence(module, kind)] + extra
    meta = metadata_layout(context.metadata)
    if meta is not None:
        evidence.append(Evidence(_METADATA, meta, "format: pt metadata"))
    stated, origin = _stated_layout(source_layout, module_map, context)
    if stated is not None:
        # (in a .bpk, a module of one's own naming its parameters weight/bias says nothing against burn)
        # (pytorch layout's only, as _shown_by_pytorch_too has it: told before the call, made per module)
        mine = (
            [e for e in evidence if e.layout == PYTORCH and _shown_by_pytorch_too(e, kinds, BURNS_FORMAT)]
            if context.container == BURNS_FORMAT
            else []
        )
        against = [e for e in evidence if e.layout != stated and not _deducible(e, stated, kinds) and e not in mine]
        if against:
            raise _contradiction_error(stated, origin, against)
        return stated, f"{stated} ({origin})"
    # (only evidence of the layout the file's format does not point to can be such: told before the call,
    # which would otherwise be made for every module of the model)
    suspect = PYTORCH if context.container == BURNS_FORMAT else BURN if context.container in FOREIGN_FORMATS else None
    conventional = [e for e in evidence if e.layout == suspect and _shown_by_pytorch_too(e, kinds, context.container)]
    evidence = [e for e in evidence if e not in conventional]
    strong = [e for e in evidence if e.strong]
    if len({e.layout for e in strong}) > 1:
        raise _conflict_error(strong, evidence, kinds)
    decided = strong or evidence
    if len({e.layout for e in decided}) > 1:
        raise _conflict_error(evidence, evidence, kinds)
    if not decided and conventional:
        return None, _conventional_note(conventional, context.container)
    if not decided:
        return None, f"{NEUTRAL} (nothing in the file shows a layout)"
    layout = decided[0].layout
    against = [e for e in evidence if e.layout != layout and not _deducible(e, layout, kinds)]
    if against:
        raise _conflict_error(evidence, evidence, kinds)
    return layout, f"{layout} ({_shown_by(decided)})"


_METADATA = "(metadata)"


def _shown_by_pytorch_too(evidence: Evidence, kinds: dict[str, ModuleKind], container: str | None) -> bool:
    """Evidence of one layout that a file of the other shows as well, by the file's format:

    In a file not in Burn's own format, evidence of burn layout:
    * Burn's parameter names (`gamma`, `beta`, `alpha`) of a module whose kind its tensors or its name
      suggest: Burn's norm or PRelu, or a PyTorch module of its own that names its parameters so
      (x-transformers' RMSNorm `gamma`, a LayerNorm with `gamma`/`beta`, a Snake activation's `alpha`);
    * a bias matching dim 1 of a weight its shapes alone call a Linear: Burn's Linear, or transformers'
      Conv1D (GPT-2's layers), which a PyTorch file keeps [in, out] too.
    In a .bpk, evidence of pytorch layout by names: `weight`/`bias` of a module whose kind its tensors or its
    name suggest, which a Burn module of one's own may name so (an RMSNorm written by hand); Burn's norms say
    gamma/beta, but its store may also save PyTorch's layout (BurnToPyTorchAdapter).

    Such evidence agrees with the file's layout or is outranked, but never shows it alone: a file read in the
    other layout keeps every Linear untransposed, exit 0. (Running stats beside the names: a BatchNorm, whose
    names each side spells its own way, and PyTorch's alone counts its batches.)"""
    kind = kinds.get(evidence.module)
    if kind is None or kind.kind == BATCH_NORM:
        return False
    if container == BURNS_FORMAT:
        return evidence.layout == PYTORCH and evidence.strong and kind.by in (BY_NAME, BY_SHAPE)
    if container not in FOREIGN_FORMATS or evidence.layout != BURN:
        return False
    if not evidence.strong:
        return _deducible(evidence, PYTORCH, kinds)
    return kind.by in (BY_NAME, BY_SHAPE)


def _conventional_note(conventional: list[Evidence], container: str | None) -> str:
    """The decision line of a file whose layout only such evidence pointed to (it is refused if it matters)."""
    shown = ", ".join(_label(e.module) for e in conventional[:_LIST_LIMIT])
    if container == BURNS_FORMAT:
        return (
            f"{NEUTRAL} (only what a Burn file may show too points to pytorch, in {shown}: in Burn's own format, "
            "a Burn module of one's own may name its parameters weight or bias)"
        )
    what = " and ".join(
        text
        for text, kept in (
            ("a PyTorch module may name its parameters gamma, beta or alpha too", any(e.strong for e in conventional)),
            ("transformers' Conv1D keeps its weight [in, out] too", any(not e.strong for e in conventional)),
        )
        if kept
    )
    return (
        f"{NEUTRAL} (only what a PyTorch file shows too points to burn, in {shown}: in a "
        f"{container or 'file'} that is not Burn's own format, {what})"
    )


def _deducible(evidence: Evidence, layout: str, kinds: dict[str, ModuleKind]) -> bool:
    """Weak burn evidence of a shape-inferred Linear in a pytorch-layout file: a Conv1D, not a conflict."""
    kind = kinds.get(evidence.module)
    return (
        layout == PYTORCH
        and evidence.layout == BURN
        and not evidence.strong
        and kind is not None
        and kind.kind == LINEAR
        and kind.by == BY_SHAPE
    )


def _shown_by(evidence: list[Evidence]) -> str:
    parts = []
    if _METADATA in map(_MODULE, evidence):
        parts.append("format: pt metadata")
    # (every module of a model may show it: only the few listed are labelled)
    strong = [e.module for e in evidence if e.strong and e.module != _METADATA]
    weak = [e.module for e in evidence if not e.strong]
    if strong:
        parts.append(f"names of {_short_list_of_modules(strong)}")
    if weak:
        parts.append(f"shapes of {_short_list_of_modules(weak)}")
    return "shown by " + "; ".join(parts)


_MODULE = operator.attrgetter("module")


def _stated_layout(source_layout: str, module_map: ModuleMap | None, context: FileContext) -> tuple[str | None, str]:
    # The explicit argument (--layout) wins over the map's `layout:` line, which wins over the file's record.
    if source_layout != AUTO:
        return source_layout, "--layout"
    if module_map is not None and module_map.layout is not None:
        return module_map.layout, f"layout: in {module_map.source}"
    if context.recorded_layout in LAYOUTS:
        return context.recorded_layout, "recorded in the file: syncd.layout"
    return None, ""


def _resolve_with_layout(
    classified: list[tuple[Module, ModuleKind]], layout: str | None
) -> list[tuple[Module, ModuleKind]]:
    first = [(module, resolve_with_layout(module, kind, layout, None)) for module, kind in classified]
    in_out = frozenset(m.path.rpartition(".")[2] for m, k in first if k.kind == LINEAR_IN_OUT)
    if not in_out:
        return first
    return [(module, resolve_with_layout(module, kind, layout, in_out)) for module, kind in first]


def _contradiction_error(stated: str, origin: str, against: list[Evidence]) -> LayoutAmbiguityError:
    listed = "; ".join(f"{_label(e.module)} ({e.reason})" for e in against)
    message = (
        f"source layout {stated} ({origin}) contradicts the tensors: {_clip(listed)}; "
        "map such modules as Other to leave them unchanged"
    )
    suggestion = _map_yaml([(_label(e.module), "Other", "left unchanged") for e in against])
    return _ambiguity(message, suggestion, [e.module for e in against])


def _conflict_error(
    shown: list[Evidence], evidence: list[Evidence], kinds: dict[str, ModuleKind]
) -> LayoutAmbiguityError:
    by_layout = {layout: [e for e in shown if e.layout == layout] for layout in (PYTORCH, BURN)}
    sides = "; ".join(
        f"{layout} from {_short_list([_label(e.module) for e in found])}" for layout, found in by_layout.items()
    )
    message = (
        f"conflicting layout evidence ({sides}); a file is in one layout: map the odd modules "
        "as Other to leave them unchanged"
    )
    odd, layout = _fewest_odd(evidence, kinds)
    if odd or layout is None:
        suggestion = _map_yaml([(_label(e.module), "Other", e.reason) for e in odd])
    else:
        # nothing is odd in `layout` but shape-inferred Linears that read as Conv1D there, which only a stated
        # layout lets through (_deducible): the map states it, and names them (an empty map settled nothing)
        in_out = [(_label(e.module), LINEAR_IN_OUT, "or Other") for e in evidence if _deducible(e, layout, kinds)]
        suggestion = _map_yaml(in_out, layout)
    details = [f"  {_label(e.module)}: {e.layout} ({e.reason})" for e in evidence]
    return _ambiguity(message, suggestion, [e.module for e in shown], details)


def _fewest_odd(evidence: list[Evidence], kinds: dict[str, ModuleKind]) -> tuple[list[Evidence], str | None]:
    """The modules to map as Other so that everything left agrees, and the layout that needs fewest (the
    metadata cannot be mapped away: its layout is the only choice when it speaks)."""
    choices = []
    for layout in LAYOUTS:
        odd = [e for e in evidence if e.layout != layout and not _deducible(e, layout, kinds)]
        if not any(e.module == _METADATA for e in odd):
            choices.append((odd, layout))
    return min(choices, key=lambda choice: len({e.module for e in choice[0]})) if choices else ([], None)


# ---------------------------------------------------------------------------------------------------------
# refusing what the evidence does not decide (docs/burn-adapters.md#ambiguous-cases: never guess silently)


def _refuse_undecided(
    classified: list[tuple[Module, ModuleKind]], source: str | None, target: str, container: str | None
) -> None:
    if source == target:
        return  # identity: nothing depends on the undecided kinds
    undecided = [kind for _, kind in classified if kind.kind == UNKNOWN]
    # Without a layout, every Linear weight might or might not need its transpose, and a norm's gamma its
    # rename (a norm by its name alone says no layout: _named_by_convention).
    layoutless = [m for m, k in classified if source is None and k.kind == LINEAR]
    unnamed = [
        m for m, k in classified if source is None and k.kind in (*NORM_KINDS, PRELU) and _BURN_LEAVES & m.params.keys()
    ]
    if not undecided and not layoutless and not unnamed:
        return
    parts = []
    if undecided:
        listed = ", ".join(f"{_label(k.path)} ({_question(k)})" for k in undecided)
        parts.append(
            f"the tensors do not decide what {len(undecided)} module(s) are: {_clip(listed)}; "
            "state them in a module map (`syncd modules` writes a model's exact map from its definition)"
        )
    if layoutless:
        listed = ", ".join(f"{m.params['weight'].name} {list(m.shape('weight'))}" for m in layoutless)
        parts.append(
            f"nothing shows whether the file is in pytorch or burn layout, which decides whether "
            f"these Linear weights are transposed: {_clip(listed)}; pass --layout pytorch|burn "
            "(a watch: layout: pytorch|burn)"
        )
    if unnamed:
        listed = ", ".join(_label(m.path) for m in unnamed)
        parts.append(
            f"nothing shows whether the gamma, beta or alpha of these modules are Burn's names for PyTorch's: "
            f"{_clip(listed)}; "
            "pass --layout pytorch|burn (a watch: layout: pytorch|burn)"
        )
    lines = _suggested_lines(classified)
    needs_layout = source is None and (layoutless or any(k.options[0] == LINEAR for k in undecided))
    # the layout the file's format makes likelier: Burn writes .bpk in its own layout (a .bpk in PyTorch's is
    # syncd's --layout keep, whose carried `format: pt` shows it, engine/convert.py); used as printed, the other
    # one made a wrong file
    likelier = BURN if container == BURNS_FORMAT else PYTORCH
    suggestion = _map_yaml(lines, likelier if needs_layout else None)
    details = [f"  {k.path or '(root)'}: {k.reason}" for k in undecided]
    details += [
        f"  {m.params['weight'].name}: Linear weight {list(m.shape('weight'))}, layout unknown" for m in layoutless
    ]
    names = [k.path for k in undecided] + [m.path for m in layoutless + unnamed]
    raise _ambiguity(f"cannot convert to {target} layout: " + "; also ".join(parts), suggestion, names, details)


def _suggested_lines(classified: list[tuple[Module, ModuleKind]]) -> list[tuple[str, str, str]]:
    """(pattern, kind, comment) lines settling every undecided module, as the fewest globs.

    Each undecided module gets its likeliest kind (name evidence first, see infer.py). The pattern tried first
    is `**.<last segment>`, then the path with its numeric segments as `*`, then the exact path; a glob is
    taken only when every module it matches is undecided with the same suggested kind or already decided as
    that kind, so the map applied as printed changes nothing else.
    """
    decided = {m.path: k.kind for m, k in classified if m.params and k.kind != UNKNOWN}
    parents = {m.path.rpartition(".")[0] for m, _ in classified if m.path}
    suggested = {k.path: _likeliest(k, decided, parents) for _, k in classified if k.kind == UNKNOWN}
    kind_of_path = {**decided, **suggested}
    lines: dict[str, tuple[str, str]] = {}
    for _, kind in classified:
        if kind.kind != UNKNOWN:
            continue
        want = suggested[kind.path]
        for pattern in _candidate_patterns(kind.path):
            rule = ModuleMap.from_dict({"modules": {pattern: want}}).rules[0]
            matched = [path for path in kind_of_path if rule.regex.fullmatch("." + path if path else "")]
            if all(kind_of_path[path] == want for path in matched):
                lines.setdefault(pattern, (want, _alternatives(kind.options, want)))
                break
    return _merge_single_letters([(pattern, want, comment) for pattern, (want, comment) in lines.items()])


def _likeliest(kind: ModuleKind, decided: dict[str, str], parents: set[str]) -> str:
    """The kind to suggest. An unnamed lone 1-D weight right after a norm in a Sequential (`3` after `2`) is
    an activation's (PRelu): a norm does not follow a norm. One beside child modules (timm ConvNeXt's
    `blocks.0.gamma`, a layer scale held by the block) is no norm or PRelu, which hold nothing else: Other.
    An `embed_out` beside an `embed_in` is word2vec's output embedding; elsewhere GPT-NeoX's head (its
    `embed_in` lies inside the model). Otherwise the order inference gave."""
    if OTHER in kind.options and kind.path in parents:
        return OTHER
    parent, _, index = kind.path.rpartition(".")
    if index == "embed_out" and {EMBEDDING, LINEAR} <= set(kind.options):
        embed_in = f"{parent}.embed_in" if parent else "embed_in"
        return EMBEDDING if decided.get(embed_in) == EMBEDDING else LINEAR
    if PRELU in kind.options and index.isdigit() and int(index) > 0:
        before = decided.get(f"{parent}.{int(index) - 1}" if parent else str(int(index) - 1))
        if before in NORM_KINDS:
            return PRELU
    return kind.options[0]


def _merge_single_letters(lines: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """`**.q`, `**.k`, `**.v` of one kind -> `**.[kqv]` (T5's projections): the same modules, fewer lines."""
    letters: dict[tuple[str, str], list[str]] = {}
    for pattern, want, comment in lines:
        last = pattern[3:]
        if pattern.startswith("**.") and len(last) == 1 and last.isalnum():
            letters.setdefault((want, comment), []).append(last)
    merged, done = [], set()
    for pattern, want, comment in lines:
        group = letters.get((want, comment), [])
        if pattern[3:] not in group or not pattern.startswith("**.") or len(group) < 2:
            merged.append((pattern, want, comment))
        elif (want, comment) not in done:
            done.add((want, comment))
            merged.append((f"**.[{''.join(sorted(group))}]", want, comment))
    return merged


def _candidate_patterns(path: str) -> list[str]:
    if not path:
        return [""]
    segments = path.split(".")
    patterns = []
    if not segments[-1].isdigit() and not any(c in segments[-1] for c in "*?["):
        patterns.append(f"**.{segments[-1]}")
    numbered = ".".join("*" if segment.isdigit() else segment for segment in segments)
    if numbered != path:
        patterns.append(numbered)
    return [*patterns, path]


def _question(kind: ModuleKind) -> str:
    # the one-line message asks the question; the reasons with shapes go to `details`
    return f"{' or '.join(sorted(kind.options))}?" if len(kind.options) > 1 else kind.reason


def _alternatives(options: tuple[str, ...], chosen: str) -> str:
    rest = [option for option in options if option != chosen]
    return f"or {' or '.join(rest)}" if rest else "left unchanged"


def _map_yaml(lines: list[tuple[str, str, str]], layout: str | None = None) -> str:
    """Module-map YAML that settles the listed modules; comments name the alternatives."""
    out = ["# module map (YAML, as for --modules) that would settle it; check each line against the model"]
    if layout is not None:
        other = BURN if layout == PYTORCH else PYTORCH
        out.append(f"layout: {layout}  # or {other}: the layout the file is in (same as --layout {layout})")
    if lines:
        out.append("modules:")
        out += [f"  {_yaml_key(path)}: {kind}  # {comment}" for path, kind, comment in lines]
    return "\n".join(out)


def _yaml_key(path: str) -> str:
    # JSON string syntax is YAML: quotes, backslashes and control characters in a module name stay exact
    return json.dumps(path, ensure_ascii=False)


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


def _add_module_steps(steps: dict[str, _Step], module: Module, kind: ModuleKind, target: str) -> str:
    """Add the steps of one module's tensors to `steps` (written in place: one module of thousands, no dict of
    its own to merge) and return the decision's action."""
    if kind.kind == LINEAR:
        return _linear_steps(steps, module)
    if kind.kind == LINEAR_IN_OUT:
        # docs/burn-adapters.md#linear: Burn's Linear weight is [in, out], which is how Conv1D stores it already
        return "unchanged: weight stays [in, out] (Burn's Linear layout)"
    if kind.kind in NORM_KINDS or kind.kind == PRELU:
        return _rename_steps(steps, module, kind.kind, target)
    return "unchanged"


def _linear_steps(steps: dict[str, _Step], module: Module) -> str:
    # docs/burn-adapters.md#linear: Linear weight, rank 2 -> transpose [a, b] -> [b, a]; the bias is untouched.
    weight = module.params["weight"]
    if weight.dtype not in ITEMSIZE:
        raise UnsupportedError(
            f"tensor '{weight.name}': cannot transpose a {weight.dtype} tensor (no fixed "
            "element size); convert with --layout keep"
        )
    rows, cols = weight.shape
    steps[weight.name] = _Step(weight.name, transpose=True)
    return f"transpose weight [{rows}, {cols}] -> [{cols}, {rows}]"


def _rename_steps(steps: dict[str, _Step], module: Module, kind: str, target: str) -> str:
    params = module.params
    changes, action = _leaf_changes(kind, target, frozenset(params))
    prefix = f"{module.path}." if module.path else ""  # _with_leaf, inline: once per norm of the model
    for leaf, new in changes:
        steps[params[leaf].name] = _step((prefix + new, False)) if new else _DROPPED
    return action


@functools.lru_cache(maxsize=256)
def _leaf_changes(kind: str, target: str, leaves: frozenset[str]) -> tuple[tuple[tuple[str, str | None], ...], str]:
    """What a norm or PRelu holding `leaves` becomes on `target`: (leaf, its new leaf or None when dropped)
    and the decision's action. The same few answers for every norm of a model: worked out once each."""
    to_burn = _PRELU_TO_BURN if kind == PRELU else _NORM_TO_BURN
    renames = to_burn if target == BURN else {burn: torch for torch, burn in to_burn.items()}
    present = [(leaf, new) for leaf, new in renames.items() if leaf in leaves]
    notes = [f"rename {', '.join(f'{leaf}->{new}' for leaf, new in present)}"] if present else []
    changes: list[tuple[str, str | None]] = list(present)
    if target == BURN:
        dropped = [leaf for leaf in _NO_BURN_SLOT.get(kind, ()) if leaf in leaves]
        changes += [(leaf, None) for leaf in dropped]
        if dropped:
            notes.append(f"drop {', '.join(dropped)} (no Burn slot)")
    elif kind == BATCH_NORM:
        # The converter re-adds the counter from metadata when it recorded one; we never invent it. PyTorch
        # does not need it: BatchNorm fills in 0 for a state dict without version metadata (load_file's), so
        # load_state_dict(strict=True) passes (checked with torch 2.13 in tests/test_convert.py).
        notes.append(
            "no num_batches_tracked in a Burn file: restored from metadata if recorded, "
            "otherwise left out (PyTorch's BatchNorm starts it at 0 when loading a state dict without it)"
        )
    return tuple(changes), "; ".join(notes) or "unchanged"


def _with_leaf(module: Module, leaf: str) -> str:
    return f"{module.path}.{leaf}" if module.path else leaf


# ---------------------------------------------------------------------------------------------------------
# assembling the plan


def _build_plan(
    tensors: Sequence[TensorRef],
    steps: dict[str, _Step],
    source: str,
    target: str,
    decisions: list[str],
    packed: list[PlanEntry],
) -> AdapterPlan:
    """Entries in source data order; a split or joined entry goes where the first of its sources is."""
    placed: dict[str, list[PlanEntry]] = {}
    if packed:
        position = {tensor.name: i for i, tensor in enumerate(tensors)}
        for entry in packed:
            placed.setdefault(min(entry.sources, key=position.__getitem__), []).append(entry)
    consumed = {name for entry in packed for name in entry.sources}
    entries, dropped = [], []
    for tensor in tensors:
        if tensor.name in consumed:
            entries += placed.get(tensor.name, [])
            continue
        step = steps.get(tensor.name)
        if step is None:  # most tensors: copied under their own name
            entries.append(plan_entry((tensor.name, tensor.name, False, tensor.shape, None, ())))
        elif step.target is None:
            dropped.append(tensor.name)
        else:
            shape = tensor.shape[::-1] if step.transpose else tensor.shape
            entries.append(plan_entry((tensor.name, step.target, step.transpose, shape, None, ())))
    _check_no_collisions(entries)
    return AdapterPlan(entries, dropped, source, target, decisions)


def _check_no_collisions(entries: list[PlanEntry]) -> None:
    if len({entry.target for entry in entries}) == len(entries):
        return  # every name once: nothing to list
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


def _short_list_of_modules(paths: list[str]) -> str:
    """_short_list of the modules' labels, labelling only those shown."""
    shown = ", ".join(map(_label, paths[:_LIST_LIMIT]))
    return shown + (f" and {len(paths) - _LIST_LIMIT} more" if len(paths) > _LIST_LIMIT else "")


def _clip(text: str, limit: int = 400) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
