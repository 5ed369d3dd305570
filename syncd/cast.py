"""Casting tensor bytes between F32 and F16/BF16 (the precision option; syncd/adapters/precision.py decides
which tensors). Round to nearest even, as the `half` crate Burn uses (burn-compat.md §3.4, §6) and numpy for
F16; a finite value too large for the target is refused, naming the tensor, never turned into inf.
"""

from __future__ import annotations

import numpy as np

from syncd.errors import UnsupportedError

ITEM = {"F32": 4, "F16": 2, "BF16": 2}


def cast_chunk(data: memoryview | bytes, from_dtype: str, to_dtype: str, name: str, path: str | None = None) -> bytes:
    """Cast whole little-endian elements; UnsupportedError naming the tensor if a finite value overflows."""
    if from_dtype == "F32":
        values = np.frombuffer(data, dtype="<f4")
        out = _f32_to_f16(values) if to_dtype == "F16" else _f32_to_bf16(values)
        _refuse_overflow(values, out, to_dtype, name, path)
        return out.tobytes()
    if to_dtype != "F32" or from_dtype not in ("F16", "BF16"):
        raise UnsupportedError(f"no cast from {from_dtype} to {to_dtype} (tensor '{name}')", path)
    if from_dtype == "F16":
        return np.frombuffer(data, dtype="<f2").astype("<f4").tobytes()
    wide = np.frombuffer(data, dtype="<u2").astype("<u4") << 16
    return wide.tobytes()


def _f32_to_f16(values: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return values.astype("<f2")


def _f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """Round to nearest even on the bit pattern; NaNs stay NaN (quiet), infinities stay infinite."""
    bits = values.view("<u4")
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype("<u2")
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():
        rounded[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype("<u2")
    return rounded


def _refuse_overflow(values: np.ndarray, out: np.ndarray, to_dtype: str, name: str, path: str | None) -> None:
    became_inf = _is_inf(out, to_dtype) & np.isfinite(values)
    if became_inf.any():
        worst = float(np.max(np.abs(values[became_inf])))
        limit = "65504" if to_dtype == "F16" else "3.39e38"
        raise UnsupportedError(
            f"tensor '{name}' holds {worst:g}, beyond {to_dtype}'s largest value {limit}: not casting it", path
        )


def _is_inf(out: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "F16":
        return np.isinf(out)
    return (out.view("<u2") & np.uint16(0x7FFF)) == np.uint16(0x7F80)


def cast_nbytes(nbytes: int, from_dtype: str, to_dtype: str) -> int:
    return nbytes // ITEM[from_dtype] * ITEM[to_dtype]
