"""What each module of a tensor table is, and what its tensors say about the file's layout.

A module is a tensor name minus its last `.segment` (the leaf). Only the leaves below take part in layout
adaptation; tensors with any other leaf (buffers, custom parameters) always pass through unchanged.
Kinds come from a module map when one matches, else from names, shapes and siblings; where those do not
decide, the kind is UNKNOWN and `options` lists the kinds a module map could state (never guessed).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from syncd.adapters.evidence import (
    CONV1D_NAMES,
    Architecture,
    matrix_name_kind,
    suggested_matrix_kind,
    vector_name_kind,
)
from syncd.adapters.model import (
    BATCH_NORM,
    BURN,
    BY_CONFIG,
    BY_DEFINITION,
    BY_MAP,
    BY_NAME,
    BY_RECORD,
    BY_SHAPE,
    CONV,
    CONV_KINDS,
    EMBEDDING,
    INSTANCE_NORM,
    LAYER_NORM,
    LINEAR,
    LINEAR_IN_OUT,
    NORM,
    NORM_KINDS,
    OTHER,
    PACKED_KINDS,
    PRELU,
    PYTORCH,
    RECORDED_KINDS,
    RMS_NORM,
    UNKNOWN,
    ModelDefinition,
    TensorRef,
)
from syncd.adapters.modulemap import ModuleMap, ModuleRule
from syncd.errors import ConfigError, UnsupportedError

RUNNING_STATS = frozenset({"running_mean", "running_var", "num_batches_tracked"})
PYTORCH_AFFINE = frozenset({"weight", "bias"})
BURN_AFFINE = frozenset({"gamma", "beta"})
# A module named `LayerNorm` holding gamma/beta says nothing of the layout: PyTorch files of transformers'
# BERT-era families spell them so (its loader renames `LayerNorm.gamma`/`.beta` to weight/bias, and since
# transformers 5 save_pretrained writes ESM's so), and a Burn file converted from such a model keeps the
# module's name (docs/burn-adapters.md#norms).
HF_LEGACY_NORM = "LayerNorm"
ADAPTABLE_LEAVES = PYTORCH_AFFINE | BURN_AFFINE | RUNNING_STATS | {"alpha"}

# Which leaves each mapped kind may hold (either side's names), docs/burn-adapters.md#module-kinds.
_ALLOWED_LEAVES: dict[str, frozenset[str]] = {
    LINEAR: PYTORCH_AFFINE,
    LINEAR_IN_OUT: PYTORCH_AFFINE,
    EMBEDDING: frozenset({"weight"}),
    **{kind: PYTORCH_AFFINE for kind in CONV_KINDS},
    BATCH_NORM: PYTORCH_AFFINE | BURN_AFFINE | RUNNING_STATS,
    LAYER_NORM: PYTORCH_AFFINE | BURN_AFFINE,
    "GroupNorm": PYTORCH_AFFINE | BURN_AFFINE,
    # PyTorch InstanceNorm with track_running_stats also has running stats (no Burn slot,
    # docs/burn-adapters.md#keys-without-a-counterpart)
    INSTANCE_NORM: PYTORCH_AFFINE | BURN_AFFINE | RUNNING_STATS,
    RMS_NORM: frozenset({"weight", "gamma"}),
    PRELU: frozenset({"weight", "alpha"}),
    NORM: PYTORCH_AFFINE | BURN_AFFINE,
    CONV: PYTORCH_AFFINE,
}

# Undecided modules whose kind the file's layout settles once it is known (see resolve_with_layout).
LONE_GAMMA = "lone gamma"
LONE_WEIGHT = "lone weight"


@dataclass
class Module:
    path: str  # "" for tensors whose name has no '.'
    params: dict[str, TensorRef] = field(default_factory=dict)  # adaptable leaf -> tensor
    extras: list[TensorRef] = field(default_factory=list)  # tensors with other leaves

    @property
    def label(self) -> str:
        return self.path or "(root)"

    def shape(self, leaf: str) -> tuple[int, ...]:
        return self.params[leaf].shape


class ModuleKind(NamedTuple):
    """What a module is, and why. A named tuple: one is made per module, the common ones by `_module_kind`
    without a Python frame (a third of a frozen dataclass's cost)."""

    path: str
    kind: str  # a MAP_KINDS kind, NORM, CONV or UNKNOWN
    reason: str  # why, in words, for the decision line
    rule: str | None = None  # the module-map pattern that decided, if one did
    options: tuple[str, ...] = ()  # for UNKNOWN: kinds a module map could state, the likelier first
    by: str = BY_SHAPE  # where the kind came from: BY_MAP, BY_RECORD, BY_CONFIG, BY_NAME or BY_SHAPE
    pending: str | None = None  # LONE_GAMMA / LONE_WEIGHT: the file's layout may still settle it


_module_kind = functools.partial(tuple.__new__, ModuleKind)  # every field, in order


@dataclass(frozen=True)
class KindSources:
    """Everything that states kinds, strongest first: the user's map, the model's definition, the file's own
    record, the table."""

    module_map: ModuleMap | None = None
    recorded: dict[str, str] = field(default_factory=dict)
    architecture: Architecture | None = None
    definition: ModelDefinition | None = None  # the model's own module types: strongest after the map


class Evidence(NamedTuple):
    """What a module's tensors say about the file's layout. A named tuple: one is made per module, by
    `_evidence` without a Python frame (a third of a frozen dataclass's cost)."""

    module: str
    layout: str
    reason: str
    strong: bool = True  # names and metadata; False for "a bias matches dim N", which they outrank


_evidence = functools.partial(tuple.__new__, Evidence)  # _evidence((module, layout, reason, strong))


def split_name(name: str) -> tuple[str, str]:
    """(module path, leaf): `a.b.weight` -> (`a.b`, `weight`); `weight` -> (``, `weight`)."""
    module, _, leaf = name.rpartition(".")
    return module, leaf


def group_modules(tensors: Iterable[TensorRef]) -> list[Module]:
    """Modules in order of first appearance."""
    modules: dict[str, Module] = {}
    for tensor in tensors:
        path, _, leaf = tensor.name.rpartition(".")  # split_name, inline: once per tensor
        module = modules.get(path)
        if module is None:  # (setdefault would build a Module per tensor, to throw most of them away)
            module = modules[path] = Module(path)
        if leaf in ADAPTABLE_LEAVES:
            module.params[leaf] = tensor
        else:
            module.extras.append(tensor)
    return list(modules.values())


def kind_of(module: Module, sources: KindSources) -> ModuleKind:
    """The strongest statement wins: an explicit module map, then the file's record, then config.json's
    architecture, then the module's names and shapes (the evidence order)."""
    module_map = sources.module_map
    rule = module_map.lookup(module.path) if module_map is not None else None
    if rule is not None:
        if not module.params and not rule.is_exact:
            # a glob sweeping over a module of buffers only: nothing there for any kind to adapt
            return ModuleKind(module.path, OTHER, "no layer parameters: unchanged")
        return mapped_kind(module, rule, module_map.source if module_map is not None else "module map")
    if not module.params:
        return ModuleKind(module.path, OTHER, "no layer parameters: unchanged")
    if sources.definition is not None:
        defined = _defined_kind(module, sources.definition)
        if defined is not None:
            return defined
    recorded = _recorded_kind(module, sources.recorded.get(module.path)) if sources.recorded else None
    if recorded is not None:
        return recorded
    if sources.architecture is not None:
        found = _table_kind(module, sources.architecture)
        if found is not None:
            return found
    return infer_kind(module)


def _defined_kind(module: Module, definition: ModelDefinition) -> ModuleKind | None:
    """The type of the module that owns these tensors in the model's definition; a kind that does not fit
    the tensors (a file from another version of the model) is passed over, and the other evidence decides."""
    kind = definition.kinds.get(module.path)
    if kind is None or kind in PACKED_KINDS:
        return None
    try:
        rule = ModuleMap.from_dict({"modules": {module.path or "": kind}}, source=definition.source).rules[0]
        mapped_kind(module, rule, definition.source)
    except (ConfigError, UnsupportedError):
        return None
    return ModuleKind(module.path, kind, definition.source, by=BY_DEFINITION)


def _recorded_kind(module: Module, kind: str | None) -> ModuleKind | None:
    """A syncd-made file says what it was converted with; a record that does not fit the tensors is ignored
    (the file's metadata is as untrusted as the rest of it: a Linear recorded for a module without its
    weight would otherwise reach the steps that transpose that weight)."""
    if kind is None or kind not in RECORDED_KINDS or not _fits_record(module, kind):
        return None
    return _module_kind((module.path, kind, "recorded in the file (syncd.kinds)", None, (), BY_RECORD, None))


def _fits_record(module: Module, kind: str) -> bool:
    """The tensors' names and shapes can be those of a `kind`: as a module map stating it is checked
    (_check_mapped_shapes); Conv, which only inference names, as inference names it."""
    if kind == OTHER:
        return True
    if not module.params.keys() <= _ALLOWED_LEAVES.get(kind, frozenset()):
        return False
    if kind == CONV:
        bias = module.shape("bias") if "bias" in module.params else (0,)
        return "weight" in module.params and len(module.shape("weight")) >= 3 and len(bias) == 1
    return _weight_lacks(module, kind) is None if kind in _WEIGHT_RANK else _all_vectors(module)


def _table_kind(module: Module, architecture: Architecture) -> ModuleKind | None:
    rule = architecture.module_map.lookup(module.path)
    if rule is None:
        return None
    try:
        found = mapped_kind(module, rule, architecture.module_map.source)
    except (ConfigError, UnsupportedError):
        return None  # the family's rule does not fit this module: its names and shapes decide
    reason = f"config.json {architecture.matched_by}: known architecture {architecture.family}, {rule.pattern!r}"
    return ModuleKind(module.path, found.kind, reason, rule.pattern, by=BY_CONFIG)


# ---------------------------------------------------------------------------------------------------------
# conventions checked against the rest of the file


def settle_output_heads(
    classified: list[tuple[Module, ModuleKind]], lm_class: str | None, vocab: int | None
) -> list[tuple[Module, ModuleKind]]:
    """In a decoder-only language model (`lm_class`), a bias-free [vocab, hidden] weight at the top of the module
    tree beside an embedding of the same shape deeper in it is the output head, a Linear, whatever its name
    says (GPT-NeoX writes it `embed_out`): the embed* convention alone would keep it [vocab, hidden]. Where
    more than one top-level module could be that head, none is guessed: undecided, a module map settles it."""
    if lm_class is None:
        return classified
    groups: dict[tuple[int, ...], list[tuple[Module, ModuleKind]]] = {}
    for module, kind in classified:
        # (an Embedding by its name, or a weight no name decides: GPT-NeoX's `embed_out`)
        either = kind.kind == UNKNOWN and {EMBEDDING, LINEAR} <= set(kind.options)
        if (kind.kind == EMBEDDING or either) and set(module.params) == {"weight"}:
            shape = module.shape("weight")
            if len(shape) == 2 and (vocab is None or shape[0] == vocab):
                groups.setdefault(shape, []).append((module, kind))
    settled: dict[str, ModuleKind] = {}
    for shape, group in groups.items():
        top = [(m, k) for m, k in group if "." not in m.path and (k.by == BY_NAME or k.kind == UNKNOWN)]
        deeper = [m for m, k in group if "." in m.path and k.kind == EMBEDDING]
        if not top or not deeper:
            continue
        beside = f"beside the embedding {deeper[0].path} {list(shape)} in a {lm_class}"
        if len(top) == 1:
            module = top[0][0]
            reason = f"2-D weight {list(shape)} without bias {beside}: its output head, whatever its name says"
            settled[module.path] = ModuleKind(module.path, LINEAR, reason, by=BY_NAME)
        else:
            for module, _ in top:
                reason = f"2-D weight {list(shape)} without bias {beside}: the output head or an embedding"
                settled[module.path] = _unknown(module, reason, (LINEAR, EMBEDDING))
    return [(module, settled.get(module.path, kind)) for module, kind in classified]


def order_vocab_options(
    classified: list[tuple[Module, ModuleKind]], vocab: int | None
) -> list[tuple[Module, ModuleKind]]:
    """What to suggest first for an undecided bias-free [vocab, hidden] weight (config.json's vocab_size): an
    Embedding inside the model (CTRL's `transformer.w`), the output head (a Linear) at its top. A suggestion
    only: the module stays undecided, and the refusal prints the map."""
    if vocab is None:
        return classified
    ordered = []
    for module, kind in classified:
        if kind.kind == UNKNOWN and set(kind.options) == {LINEAR, EMBEDDING} and module.shape("weight")[0] == vocab:
            first = EMBEDDING if "." in module.path else LINEAR
            options = (first, LINEAR if first == EMBEDDING else EMBEDDING)
            reason = f"{kind.reason}; [vocab_size, hidden] {'inside the model' if first == EMBEDDING else 'at its top'}"
            kind = ModuleKind(kind.path, UNKNOWN, reason, options=options)
        ordered.append((module, kind))
    return ordered


# ---------------------------------------------------------------------------------------------------------
# inference from names, shapes and siblings (docs/burn-adapters.md#ambiguous-cases lists what cannot be decided so)


def infer_kind(module: Module) -> ModuleKind:
    leaves = module.params.keys()  # (a view, not a set of its own: this runs once per module of the model)
    if not leaves:
        return ModuleKind(module.path, OTHER, "no layer parameters: unchanged")
    if not leaves.isdisjoint(RUNNING_STATS):
        return _infer_batch_norm(module)
    if "alpha" in leaves:
        return _infer_prelu(module)
    if not leaves.isdisjoint(BURN_AFFINE):
        return _infer_burn_norm(module)
    if "weight" in leaves:
        return _infer_from_weight(module)
    if leaves == {"bias"}:
        return ModuleKind(module.path, OTHER, "bias without weight: same in both layouts")
    return _unknown(module, f"unexpected tensors {_leaf_list(module)}")


def _infer_batch_norm(module: Module) -> ModuleKind:
    # running_mean/running_var siblings identify BatchNorm (docs/burn-adapters.md#ambiguous-cases item 4)
    affine = set(module.params) - RUNNING_STATS
    consistent = (affine <= PYTORCH_AFFINE or affine <= BURN_AFFINE) and _all_rank(module, affine | _stats(module), 1)
    if not consistent:
        return _unknown(module, f"running stats beside {_leaf_list(module)}")
    # an InstanceNorm built with track_running_stats=True holds the same five tensors: the file cannot tell
    # them apart, and BatchNorm is by far the likelier; the reason says how to state the other
    return ModuleKind(
        module.path, BATCH_NORM, "running_mean/running_var siblings (an InstanceNorm tracking them: map it so)"
    )


def _infer_prelu(module: Module) -> ModuleKind:
    if set(module.params) == {"alpha"} and len(module.shape("alpha")) == 1:
        return ModuleKind(module.path, PRELU, f"1-D alpha {list(module.shape('alpha'))}")
    return _unknown(module, f"alpha beside {_leaf_list(module)}")


def _infer_burn_norm(module: Module) -> ModuleKind:
    params = module.params
    leaves = params.keys()
    if leaves == {"gamma"} and len(params["gamma"].shape) == 1:
        return _lone_vector(module, "gamma")
    if "gamma" in leaves and leaves <= BURN_AFFINE:
        # 1-D, and a beta (if any) of the same shape (_all_rank and _same_shapes, spelled out for the two names)
        gamma, beta = params["gamma"].shape, params.get("beta")
        if len(gamma) == 1 and (beta is None or beta.shape == gamma):
            return _module_kind((module.path, NORM, _burn_norm_reason(frozenset(leaves)), None, (), BY_SHAPE, None))
    return _unknown(module, f"unexpected tensors {_leaf_list(module)}")


@functools.lru_cache(maxsize=4)
def _burn_norm_reason(leaves: frozenset[str]) -> str:
    """The same line for every gamma/beta norm (a model has hundreds of them): made once per set of names."""
    return f"1-D {'/'.join(sorted(leaves, key=len))}: a norm"


def _lone_vector(module: Module, leaf: str) -> ModuleKind:
    """A lone 1-D weight or gamma: a norm without bias (RmsNorm), PRelu (weight only) or a custom multiplier
    such as timm's LayerScale `gamma` (docs/burn-adapters.md#ambiguous-cases item 4). Its module's name decides; else a
    1-element weight is a PRelu (a norm over one feature normalises nothing); else the file's layout may (see
    resolve_with_layout); else it is undecided."""
    shape = list(module.shape(leaf))
    named = vector_name_kind(module.path, leaf)
    if named is not None:
        kind, pattern = named
        what = {OTHER: "a layer scale: left unchanged", RMS_NORM: "a norm without bias", PRELU: "a PRelu"}[kind]
        return ModuleKind(module.path, kind, f"lone 1-D {leaf} {shape}, named {pattern!r}: {what}", by=BY_NAME)
    if leaf == "weight" and shape == [1]:
        return ModuleKind(module.path, PRELU, "lone 1-element weight: a PRelu (a norm over 1 feature is a no-op)")
    options = (RMS_NORM, PRELU, OTHER) if leaf == "weight" else (RMS_NORM, OTHER)
    what = (
        "RmsNorm/LayerNorm (gamma), PRelu (alpha) or a custom parameter"
        if leaf == "weight"
        else ("RmsNorm (weight) or a custom parameter such as a layer scale")
    )
    pending = LONE_WEIGHT if leaf == "weight" else LONE_GAMMA
    return ModuleKind(module.path, UNKNOWN, f"lone 1-D {leaf} {shape}: {what}", options=options, pending=pending)


def _infer_from_weight(module: Module) -> ModuleKind:
    params = module.params
    weight = params["weight"].shape
    bias_ref = params.get("bias")
    bias = bias_ref.shape if bias_ref is not None else None
    if not params.keys() <= PYTORCH_AFFINE or (bias is not None and len(bias) != 1):
        return _unknown(module, f"unexpected tensors {_leaf_list(module)}")
    if len(weight) >= 3:
        return ModuleKind(module.path, CONV, f"rank-{len(weight)} weight: a convolution, same in both layouts")
    if len(weight) == 2:
        return _infer_matrix(module, weight, bias)
    if len(weight) == 1:
        return _infer_vector(module, weight, bias)
    return _unknown(module, f"weight of shape {list(weight)}")


def _infer_matrix(module: Module, weight: tuple[int, ...], bias: tuple[int, ...] | None) -> ModuleKind:
    if bias is None:
        # docs/burn-adapters.md#ambiguous-cases item 1: bias-free Linear (transpose) vs Embedding (don't); the name may
        # say
        named = matrix_name_kind(module.path)
        if named is not None:
            kind, pattern = named
            return ModuleKind(
                module.path, kind, f"2-D weight {list(weight)} without bias, named {pattern!r}", by=BY_NAME
            )
        return _unknown(
            module, f"2-D weight {list(weight)} without bias: Linear or Embedding", suggested_matrix_kind(module.path)
        )
    if bias[0] not in weight:
        return _unknown(module, f"bias {list(bias)} fits neither dimension of weight {list(weight)}")
    return _module_kind((module.path, LINEAR, _linear_reason(weight, bias), None, (), BY_SHAPE, None))


def _infer_vector(module: Module, weight: tuple[int, ...], bias: tuple[int, ...] | None) -> ModuleKind:
    if bias == weight:  # (a model's many norms)
        return _module_kind((module.path, NORM, _norm_reason(weight), None, (), BY_SHAPE, None))
    if bias is None:
        return _lone_vector(module, "weight")
    return _unknown(module, f"1-D weight {list(weight)} with bias {list(bias)}")


@functools.lru_cache(maxsize=1024)
def _norm_reason(weight: tuple[int, ...]) -> str:
    """The same line for every norm of one width: made once (a model has hundreds of them)."""
    return f"1-D weight/bias {list(weight)}, no running stats: LayerNorm, GroupNorm or InstanceNorm"


def _linear_reason(weight: tuple[int, ...], bias: tuple[int, ...]) -> str:
    rows, cols = weight
    if rows == cols:
        return f"square weight {list(weight)} with bias: layout from the rest of the file"
    # docs/burn-adapters.md#linear: PyTorch weight [out, in], Burn weight [in, out]; bias is [out] on both sides
    dim, layout = (0, PYTORCH) if bias[0] == rows else (1, BURN)
    return f"bias {list(bias)} matches dim {dim} -> {layout} layout"


def _unknown(module: Module, reason: str, options: tuple[str, ...] = (OTHER,)) -> ModuleKind:
    return ModuleKind(module.path, UNKNOWN, reason, options=options)


# ---------------------------------------------------------------------------------------------------------
# a module map's statement, checked against the tensors it is applied to


def mapped_kind(module: Module, rule: ModuleRule, source: str) -> ModuleKind:
    kind = rule.kind
    reason = f"module map {rule.pattern!r}"
    if kind == OTHER:
        return ModuleKind(module.path, OTHER, f"{reason}: left unchanged", rule.pattern, by=BY_MAP)
    if kind in PACKED_KINDS:
        # packed modules are found before this (packed.py): this one holds none of their tensors
        raise ConfigError(
            f"modules.{rule.pattern!r}: maps {module.label!r} to {kind}, but it holds no {kind} tensors "
            f"(tensors: {_leaf_list(module)}); map it as Other to leave it unchanged",
            source,
        )
    leaves = set(module.params)
    stray = sorted(leaves - _ALLOWED_LEAVES[kind])
    if stray or not leaves:
        what = f"has {module.label}.{stray[0]}" if stray else "has none of its tensors"
        raise ConfigError(
            f"modules.{rule.pattern!r}: maps {module.label!r} to {kind}, but it {what} "
            f"(tensors: {_leaf_list(module)}); map it as Other to leave it unchanged",
            source,
        )
    _check_mapped_shapes(module, rule, source)
    return ModuleKind(module.path, kind, reason, rule.pattern, by=BY_MAP)


_WEIGHT_RANK = {LINEAR: 2, LINEAR_IN_OUT: 2, EMBEDDING: 2, **{k: int(k[-2]) + 2 for k in CONV_KINDS}}  # Conv2d: 4


def _check_mapped_shapes(module: Module, rule: ModuleRule, source: str) -> None:
    kind = rule.kind
    if kind in _WEIGHT_RANK:
        lacking = _weight_lacks(module, kind)
        if lacking is not None:
            raise ConfigError(
                f"modules.{rule.pattern!r}: maps {module.label!r} to {kind}, which needs {lacking}, "
                f"but it has {_shapes(module)}",
                source,
            )
        return
    if not _all_vectors(module):
        # Burn's norms and PRelu hold 1-D parameters only (docs/burn-adapters.md#norms)
        raise UnsupportedError(
            f"{module.label}: {kind} tensors {_shapes(module)} are not 1-D; Burn's {kind} holds 1-D parameters only"
        )


def _weight_lacks(module: Module, kind: str) -> str | None:
    """What a module of a weighted kind (_WEIGHT_RANK) needs that its tensors do not give, or None: the
    plan's steps take its weight's rows and columns, and the layout evidence its bias against them."""
    want = _WEIGHT_RANK[kind]
    if "weight" not in module.params or len(module.shape("weight")) != want:
        return f"a rank-{want} weight"
    if "bias" in module.params:
        bias, weight = module.shape("bias"), module.shape("weight")
        fits = len(bias) == 1 and (
            bias[0] in weight if kind == LINEAR else bias[0] == weight[-1] if kind == LINEAR_IN_OUT else True
        )
        if not fits:
            return "a 1-D bias matching the weight"
    return None


def _all_vectors(module: Module) -> bool:
    """Every tensor but a BatchNorm's counter 1-D (a loop, not _all_rank's generator: it runs once per norm)."""
    for leaf, tensor in module.params.items():  # noqa: SIM110 (all() of a generator: a frame per norm)
        if len(tensor.shape) != 1 and leaf != "num_batches_tracked":
            return False
    return True


# ---------------------------------------------------------------------------------------------------------
# layout evidence: what the tensors of one module say about the file's layout


def layout_evidence(module: Module, kind: ModuleKind) -> list[Evidence]:
    """Names are strong evidence; "a bias matches dim N" is weak: names and metadata outrank it."""
    if kind.kind in NORM_KINDS or kind.kind == PRELU:  # (a side's names once each: one reason per side)
        leaves = frozenset(module.params)
        if module.path.rpartition(".")[2] == HF_LEGACY_NORM:
            leaves -= BURN_AFFINE
        return [_evidence((module.path, side, reason, True)) for side, reason in _names_shown(leaves)]
    found: dict[tuple[str, bool], list[str]] = {}
    if kind.kind == LINEAR:
        _linear_evidence(module, found)
    return [Evidence(module.path, layout, "; ".join(reasons), strong) for (layout, strong), reasons in found.items()]


def _linear_evidence(module: Module, found: dict[tuple[str, bool], list[str]]) -> None:
    # Only a non-square weight with a bias shows which dimension is [out] (docs/burn-adapters.md#ambiguous-cases item
    # 2).
    if "bias" not in module.params:
        return
    weight, bias = module.shape("weight"), module.shape("bias")
    if weight[0] != weight[1]:
        reason = _linear_reason(weight, bias)
        found.setdefault((PYTORCH if bias[0] == weight[0] else BURN, False), []).append(reason)


@functools.lru_cache(maxsize=256)
def _names_shown(leaves: frozenset[str]) -> tuple[tuple[str, str], ...]:
    """(layout, reason) for each side whose parameter names are among `leaves`: worked out once per set. Norm
    and PRelu parameter names differ by side (docs/burn-adapters.md#norms); num_batches_tracked is PyTorch-only."""
    pytorch_names = [leaf for leaf in ("weight", "bias", "num_batches_tracked") if leaf in leaves]
    burn_names = [leaf for leaf in ("gamma", "beta", "alpha") if leaf in leaves]
    shown = []
    if pytorch_names:
        shown.append((PYTORCH, f"{'/'.join(pytorch_names)} names"))
    if burn_names:
        shown.append((BURN, f"{'/'.join(burn_names)} names"))
    return tuple(shown)


def resolve_with_layout(
    module: Module, kind: ModuleKind, layout: str | None, in_out: frozenset[str] | None
) -> ModuleKind:
    """Kinds the file's layout settles, once it is known.

    * A shape-inferred Linear whose bias matches dim 1 in a pytorch-layout file cannot be a torch Linear
      (that stores [out, in]): it is a LinearInOut, transformers' Conv1D, kept as it is.
    * A lone gamma in a pytorch-layout file is no PyTorch norm (they say weight): a custom parameter such as
      a layer scale, left unchanged; a lone 1-D weight in a burn-layout file likewise (Burn says gamma/alpha).
    * In a file holding LinearInOut modules (`in_out`: their last path segments; None for a first pass),
      a square Linear with bias inferred from its shapes alone could be either: undecided (a module map
      settles it; LinearInOut is suggested first when a LinearInOut module has the same last segment).
    * In a burn-layout file, a Linear named as transformers' Conv1D layers are (GPT-2's `c_attn`) is [in, out]
      either way, and PyTorch may want it so (Conv1D) or transposed (nanoGPT's nn.Linear of the same name):
      undecided, where it went to PyTorch transposed, a GPT-2 with every Conv1D weight the wrong way.
    """
    if kind.by != BY_SHAPE:
        return kind
    if kind.kind == LINEAR and layout == BURN and module.path.rpartition(".")[2] in CONV1D_NAMES:
        reason = f"weight {list(module.shape('weight'))} in a burn-layout file, named as transformers' Conv1D layers"
        return _unknown(module, reason + ": Linear or LinearInOut (Conv1D)", (LINEAR_IN_OUT, LINEAR))
    if kind.kind == LINEAR and layout == PYTORCH and _bias_matches_dim_1(module):
        weight = list(module.shape("weight"))
        reason = f"bias {list(module.shape('bias'))} matches dim 1 of {weight} in a pytorch-layout file: [in, out]"
        return ModuleKind(module.path, LINEAR_IN_OUT, reason + " (transformers Conv1D)")
    if kind.pending == LONE_GAMMA and layout == PYTORCH or kind.pending == LONE_WEIGHT and layout == BURN:
        leaf = "gamma" if kind.pending == LONE_GAMMA else "weight"
        reason = f"lone 1-D {leaf} in a {layout}-layout file: no {layout} norm or PRelu names it so; left unchanged"
        return ModuleKind(module.path, OTHER, reason)
    if kind.kind == LINEAR and in_out and layout == PYTORCH and _is_square(module):
        sibling = module.path.rpartition(".")[2] in in_out
        options = (LINEAR_IN_OUT, LINEAR) if sibling else (LINEAR, LINEAR_IN_OUT)
        reason = f"square weight {list(module.shape('weight'))} with bias in a file with Conv1D layers"
        return _unknown(module, reason + ": Linear or LinearInOut (Conv1D)", options)
    return kind


def _bias_matches_dim_1(module: Module) -> bool:
    if "bias" not in module.params or len(module.shape("weight")) != 2:
        return False
    weight = module.shape("weight")
    return weight[0] != weight[1] and module.shape("bias")[0] == weight[1]


def _is_square(module: Module) -> bool:
    weight = module.shape("weight") if "weight" in module.params else ()
    return len(weight) == 2 and weight[0] == weight[1]


# ---------------------------------------------------------------------------------------------------------
# small helpers


def _stats(module: Module) -> set[str]:
    return set(module.params) & {"running_mean", "running_var"}


def _all_rank(module: Module, leaves: Iterable[str], rank: int) -> bool:
    return all(len(module.shape(leaf)) == rank for leaf in leaves)


def _same_shapes(module: Module, leaves: Iterable[str]) -> bool:
    return len({module.shape(leaf) for leaf in leaves}) <= 1


def _leaf_list(module: Module) -> str:
    return ", ".join(module.params) or "none"


def _shapes(module: Module) -> str:
    return ", ".join(f"{leaf} {list(t.shape)}" for leaf, t in module.params.items())
