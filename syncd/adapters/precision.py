"""Precision: which tensors Burn's HalfPrecisionAdapter would cast, and the casts themselves.

HalfPrecisionAdapter (docs/burn-adapters.md#half-precision) converts float tensors of Linear, Embedding,
Conv*/ConvTranspose*, DeformConv2d, LayerNorm, GroupNorm, InstanceNorm, RmsNorm and PRelu modules (transformers'
Conv1D is a Linear there), and leaves BatchNorm alone ("running_var underflows in F16") along with every other
module. Like it, only F32 tensors are cast going down
(`f16`, or `bf16` as FloatCastAdapter would) and only F16/BF16 ones going up (`f32`). Casting down is lossy, so it is
opt-in; a value too large for the target is refused (naming the tensor) rather than turned into inf. The byte-level
casts are in syncd/engine/cast.py.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from syncd.adapters.model import CONV_KINDS, LINEAR, LINEAR_IN_OUT, NORM, PRELU, TensorRef

PRECISIONS = ("f16", "bf16", "f32")
TARGET_DTYPE = {"f16": "F16", "bf16": "BF16", "f32": "F32"}
# module kinds as the adapters name them; "Conv" and "Norm" are what inference calls a convolution and an
# affine norm it cannot name more exactly (all of which HalfPrecisionAdapter converts)
HALF_KINDS = frozenset(
    {
        LINEAR,
        LINEAR_IN_OUT,  # transformers' Conv1D (GPT-2): a Linear in Burn, so HalfPrecisionAdapter casts it too
        "Embedding",
        *CONV_KINDS,
        "Conv",
        "DeformConv2d",
        "LayerNorm",
        "GroupNorm",
        "InstanceNorm",
        "RmsNorm",
        NORM,
        PRELU,
    }
)


def module_of(name: str) -> str:
    return name.rpartition(".")[0]


def plan_casts(
    tensors: Sequence[TensorRef], kinds: Mapping[str, str], precision: str, packed: Collection[str] = ()
) -> dict[str, str]:
    """Source tensor name -> dtype to cast it to, for the tensors `precision` converts (possibly none).
    `packed`: the tensors of packed MHA/RNN modules, which Burn holds as Linears, so the
    HalfPrecisionAdapter casts them all (docs/burn-adapters.md#half-precision)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    target = TARGET_DTYPE[precision]
    sources = ("F16", "BF16") if precision == "f32" else ("F32",)
    return {
        t.name: target
        for t in tensors
        if t.dtype in sources and t.dtype != target and (t.name in packed or kinds.get(module_of(t.name)) in HALF_KINDS)
    }
