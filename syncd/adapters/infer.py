"""What each module of a tensor table is, and what its tensors say about the file's layout.

A module is a tensor name minus its last `.segment` (the leaf). Only the leaves below take part in layout
adaptation; tensors with any other leaf (buffers, custom parameters) always pass through unchanged.
Kinds come from a module map when one matches, else from names, shapes and siblings; where those do not
decide, the kind is UNKNOWN and `options` lists the kinds a module map could state (never guessed).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from syncd.adapters.model import (
    BATCH_NORM,
    BURN,
    CONV,
    CONV_KINDS,
    EMBEDDING,
    INSTANCE_NORM,
    LAYER_NORM,
    LINEAR,
    NORM,
    NORM_KINDS,
    OTHER,
    PRELU,
    PYTORCH,
    RMS_NORM,
    UNKNOWN,
    TensorRef,
)
from syncd.adapters.modulemap import ModuleMap, ModuleRule
from syncd.errors import ConfigError, UnsupportedError

RUNNING_STATS = frozenset({"running_mean", "running_var", "num_batches_tracked"})
PYTORCH_AFFINE = frozenset({"weight", "bias"})
BURN_AFFINE = frozenset({"gamma", "beta"})
ADAPTABLE_LEAVES = PYTORCH_AFFINE | BURN_AFFINE | RUNNING_STATS | {"alpha"}

# PyTorch tensors that pack several Burn parameters into one (MHA in_proj, RNN gates, burn-compat.md §3.5,
# §3.6 item 6, §4): their names exist only on the PyTorch side, and Burn has no single slot for them.
PACKED_PYTORCH_LEAF = re.compile(
    r"in_proj_(?:weight|bias)|[qkv]_proj_weight|bias_[kv]|(?:weight|bias)_(?:ih|hh|hr)_l\d+(?:_reverse)?"
)

# Which leaves each mapped kind may hold (either side's names), burn-compat.md §3.5.
_ALLOWED_LEAVES: dict[str, frozenset[str]] = {
    LINEAR: PYTORCH_AFFINE,
    EMBEDDING: frozenset({"weight"}),
    **{kind: PYTORCH_AFFINE for kind in CONV_KINDS},
    BATCH_NORM: PYTORCH_AFFINE | BURN_AFFINE | RUNNING_STATS,
    LAYER_NORM: PYTORCH_AFFINE | BURN_AFFINE,
    "GroupNorm": PYTORCH_AFFINE | BURN_AFFINE,
    # PyTorch InstanceNorm with track_running_stats also has running stats (no Burn slot, §4)
    INSTANCE_NORM: PYTORCH_AFFINE | BURN_AFFINE | RUNNING_STATS,
    RMS_NORM: frozenset({"weight", "gamma"}),
    PRELU: frozenset({"weight", "alpha"}),
}


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


@dataclass(frozen=True)
class ModuleKind:
    path: str
    kind: str  # a MAP_KINDS kind, NORM, CONV or UNKNOWN
    reason: str  # why, in words, for the decision line
    rule: str | None = None  # the module-map pattern that decided, if one did
    options: tuple[str, ...] = ()  # for UNKNOWN: kinds a module map could state, the likelier first


@dataclass(frozen=True)
class Evidence:
    module: str
    layout: str
    reason: str


def split_name(name: str) -> tuple[str, str]:
    """(module path, leaf): `a.b.weight` -> (`a.b`, `weight`); `weight` -> (``, `weight`)."""
    module, _, leaf = name.rpartition(".")
    return module, leaf


def group_modules(tensors: Iterable[TensorRef]) -> list[Module]:
    """Modules in order of first appearance."""
    modules: dict[str, Module] = {}
    for tensor in tensors:
        path, leaf = split_name(tensor.name)
        module = modules.setdefault(path, Module(path))
        if leaf in ADAPTABLE_LEAVES:
            module.params[leaf] = tensor
        else:
            module.extras.append(tensor)
    return list(modules.values())


def kind_of(module: Module, module_map: ModuleMap | None) -> ModuleKind:
    """An explicit module map always wins over inference."""
    rule = module_map.lookup(module.path) if module_map is not None else None
    if rule is None:
        return infer_kind(module)
    if not module.params and not rule.is_exact:
        # a glob sweeping over a module of buffers only: nothing there for any kind to adapt
        return ModuleKind(module.path, OTHER, "no layer parameters: unchanged")
    return mapped_kind(module, rule, module_map.source if module_map is not None else "module map")


# ---------------------------------------------------------------------------------------------------------
# inference from names, shapes and siblings (burn-compat.md §3.6 lists what cannot be decided this way)


def infer_kind(module: Module) -> ModuleKind:
    leaves = set(module.params)
    if not leaves:
        return ModuleKind(module.path, OTHER, "no layer parameters: unchanged")
    if leaves & RUNNING_STATS:
        return _infer_batch_norm(module)
    if "alpha" in leaves:
        return _infer_prelu(module)
    if leaves & BURN_AFFINE:
        return _infer_burn_norm(module)
    if "weight" in leaves:
        return _infer_from_weight(module)
    if leaves == {"bias"}:
        return ModuleKind(module.path, OTHER, "bias without weight: same in both layouts")
    return _unknown(module, f"unexpected tensors {_leaf_list(module)}")


def _infer_batch_norm(module: Module) -> ModuleKind:
    # running_mean/running_var siblings identify BatchNorm (burn-compat.md §3.6 item 4)
    affine = set(module.params) - RUNNING_STATS
    consistent = (affine <= PYTORCH_AFFINE or affine <= BURN_AFFINE) and _all_rank(module, affine | _stats(module), 1)
    if not consistent:
        return _unknown(module, f"running stats beside {_leaf_list(module)}")
    return ModuleKind(module.path, BATCH_NORM, "running_mean/running_var siblings")


def _infer_prelu(module: Module) -> ModuleKind:
    if set(module.params) == {"alpha"} and len(module.shape("alpha")) == 1:
        return ModuleKind(module.path, PRELU, f"1-D alpha {list(module.shape('alpha'))}")
    return _unknown(module, f"alpha beside {_leaf_list(module)}")


def _infer_burn_norm(module: Module) -> ModuleKind:
    leaves = set(module.params)
    if "gamma" in leaves and leaves <= BURN_AFFINE and _all_rank(module, leaves, 1) and _same_shapes(module, leaves):
        return ModuleKind(module.path, NORM, f"1-D {'/'.join(sorted(leaves, key=len))}: a norm")
    return _unknown(module, f"unexpected tensors {_leaf_list(module)}")


def _infer_from_weight(module: Module) -> ModuleKind:
    leaves = set(module.params)
    weight = module.shape("weight")
    bias = module.shape("bias") if "bias" in leaves else None
    if not leaves <= PYTORCH_AFFINE or (bias is not None and len(bias) != 1):
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
        # burn-compat.md §3.6 item 1: bias-free Linear (transpose) vs Embedding (don't)
        return _unknown(
            module,
            f"2-D weight {list(weight)} without bias: Linear or Embedding",
            _rank_by_name(module.path, (LINEAR, EMBEDDING), EMBEDDING, ("emb",)),
        )
    if bias[0] not in weight:
        return _unknown(module, f"bias {list(bias)} fits neither dimension of weight {list(weight)}")
    return ModuleKind(module.path, LINEAR, _linear_reason(weight, bias))


def _infer_vector(module: Module, weight: tuple[int, ...], bias: tuple[int, ...] | None) -> ModuleKind:
    if bias == weight:
        return ModuleKind(
            module.path, NORM, f"1-D weight/bias {list(weight)}, no running stats: LayerNorm, GroupNorm or InstanceNorm"
        )
    if bias is None:
        # burn-compat.md §3.6 item 4: RmsNorm (Burn `gamma`) vs PRelu (Burn `alpha`) differ in target names
        return _unknown(
            module,
            f"lone 1-D weight {list(weight)}: RmsNorm/LayerNorm (gamma) or PRelu (alpha)",
            _rank_by_name(module.path, (RMS_NORM, PRELU), PRELU, ("act", "relu")),
        )
    return _unknown(module, f"1-D weight {list(weight)} with bias {list(bias)}")


def _linear_reason(weight: tuple[int, ...], bias: tuple[int, ...]) -> str:
    rows, cols = weight
    if rows == cols:
        return f"square weight {list(weight)} with bias: layout from the rest of the file"
    # burn-compat.md §3.5: PyTorch weight [out, in], Burn weight [in, out]; bias is [out] on both sides
    dim, layout = (0, PYTORCH) if bias[0] == rows else (1, BURN)
    return f"bias {list(bias)} matches dim {dim} -> {layout} layout"


def _unknown(module: Module, reason: str, options: tuple[str, ...] = (OTHER,)) -> ModuleKind:
    return ModuleKind(module.path, UNKNOWN, reason, options=options)


def _rank_by_name(path: str, options: tuple[str, ...], named: str, hints: tuple[str, ...]) -> tuple[str, ...]:
    """Order the options for the *suggestion* only: a name hint (e.g. 'emb') puts its kind first.

    Never used to decide a kind: the user still has to confirm the line in a module map.
    """
    last = path.rpartition(".")[2].lower()
    if any(hint in last for hint in hints):
        return (named, *[o for o in options if o != named])
    return options


# ---------------------------------------------------------------------------------------------------------
# a module map's statement, checked against the tensors it is applied to


def mapped_kind(module: Module, rule: ModuleRule, source: str) -> ModuleKind:
    kind = rule.kind
    reason = f"module map {rule.pattern!r}"
    if kind == OTHER:
        return ModuleKind(module.path, OTHER, f"{reason}: left unchanged", rule.pattern)
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
    return ModuleKind(module.path, kind, reason, rule.pattern)


def _check_mapped_shapes(module: Module, rule: ModuleRule, source: str) -> None:
    kind = rule.kind
    if kind in (LINEAR, EMBEDDING, *CONV_KINDS):
        want = 2 if kind in (LINEAR, EMBEDDING) else int(kind[-2]) + 2  # Conv2d -> rank 4
        _require(
            module,
            "weight" in module.params and len(module.shape("weight")) == want,
            rule,
            source,
            f"a rank-{want} weight",
        )
        if "bias" in module.params:
            bias = module.shape("bias")
            fits = len(bias) == 1 and (kind != LINEAR or bias[0] in module.shape("weight"))
            _require(module, fits, rule, source, "a 1-D bias matching the weight")
        return
    vectors = set(module.params) - {"num_batches_tracked"}
    if not _all_rank(module, vectors, 1):
        # Burn's norms and PRelu hold 1-D parameters only (burn-compat.md §3.5, §4: multi-dim LayerNorm)
        raise UnsupportedError(
            f"{module.label}: {kind} tensors {_shapes(module)} are not 1-D; Burn's {kind} holds 1-D parameters only"
        )


def _require(module: Module, ok: bool, rule: ModuleRule, source: str, what: str) -> None:
    if not ok:
        raise ConfigError(
            f"modules.{rule.pattern!r}: maps {module.label!r} to {rule.kind}, which needs {what}, "
            f"but it has {_shapes(module)}",
            source,
        )


# ---------------------------------------------------------------------------------------------------------
# layout evidence: what the tensors of one module say about the file's layout


def layout_evidence(module: Module, kind: ModuleKind) -> list[Evidence]:
    found: dict[str, list[str]] = {}
    for tensor in module.extras:
        if PACKED_PYTORCH_LEAF.fullmatch(split_name(tensor.name)[1]):
            found.setdefault(PYTORCH, []).append(f"PyTorch packed tensor {split_name(tensor.name)[1]}")
    if kind.kind == LINEAR:
        _linear_evidence(module, found)
    elif kind.kind in NORM_KINDS or kind.kind == PRELU:
        _name_evidence(module, found)
    return [Evidence(module.path, layout, "; ".join(reasons)) for layout, reasons in found.items()]


def _linear_evidence(module: Module, found: dict[str, list[str]]) -> None:
    # Only a non-square weight with a bias shows which dimension is [out] (burn-compat.md §3.6 item 2).
    if "bias" not in module.params:
        return
    weight, bias = module.shape("weight"), module.shape("bias")
    if weight[0] != weight[1]:
        reason = _linear_reason(weight, bias)
        found.setdefault(PYTORCH if bias[0] == weight[0] else BURN, []).append(reason)


def _name_evidence(module: Module, found: dict[str, list[str]]) -> None:
    # Norm and PRelu parameter names differ by side (burn-compat.md §3.2, §3.5); num_batches_tracked is
    # PyTorch-only (§4).
    pytorch_names = [leaf for leaf in ("weight", "bias", "num_batches_tracked") if leaf in module.params]
    burn_names = [leaf for leaf in ("gamma", "beta", "alpha") if leaf in module.params]
    if pytorch_names:
        found.setdefault(PYTORCH, []).append(f"{'/'.join(pytorch_names)} names")
    if burn_names:
        found.setdefault(BURN, []).append(f"{'/'.join(burn_names)} names")


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
