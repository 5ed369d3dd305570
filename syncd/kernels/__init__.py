"""Bit-exact transposes: a compiled cache-blocked kernel when it was built, numpy otherwise.

Both move elements as unsigned integers of their width (never as floats), so every bit pattern, signalling
NaNs included, arrives unchanged, and both give identical bytes (tests/test_kernels.py holds them to it).
The compiled kernel (`_transpose.c`, an optional extension built by `pip install`) walks the matrix in
32x32 tiles (4x4 SSE2 blocks for 4-byte elements) and releases the GIL, so transposes on several threads
use several cores; numpy's best bit-exact form copies a few source rows at a time, about half as fast on
blocks in cache (measured in the commit that added the kernel).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

STRIP_ROWS = 16  # source rows per numpy assignment: measured fastest for a transposing copy

Kernel = Callable[[np.ndarray, np.ndarray, int], None]


def transpose_numpy(src: np.ndarray, out: np.ndarray, first_col: int = 0) -> None:
    """out[:, first_col:first_col+rows] = src.T, a few source rows at a time (cache-friendly)."""
    rows = src.shape[0]
    for r0 in range(0, rows, STRIP_ROWS):
        r1 = min(rows, r0 + STRIP_ROWS)
        out[:, first_col + r0 : first_col + r1] = src[r0:r1].T


def columns_numpy(src: np.ndarray, out: np.ndarray, first: int) -> None:
    """out = src[:, first:first+len(out)].T for a contiguous `src`: a band of columns, transposed."""
    transpose_numpy(src[:, first : first + out.shape[0]], out, 0)


def _compiled() -> Kernel | None:
    if os.environ.get("SYNCD_KERNEL") == "numpy":  # for measuring and testing the fallback
        return None
    try:
        from syncd.kernels import _transpose
    except ImportError:
        return None
    return make_compiled(_transpose.transpose)


def make_compiled(raw: Callable[..., None]) -> Kernel:
    """Wrap the extension's transpose(src, dst, rows, cols, itemsize, src_stride, src_col, dst_stride, dst_col)
    as a Kernel. `src` may be a band of columns of a larger row-major matrix (rows contiguous, elements
    adjacent), `out` must be contiguous."""

    def transpose_compiled(src: np.ndarray, out: np.ndarray, first_col: int = 0) -> None:
        rows, cols = src.shape
        if out.shape[0] != cols or first_col + rows > out.shape[1] or src.dtype != out.dtype:
            raise ValueError(f"cannot transpose {src.shape} into columns {first_col}.. of {out.shape}")
        if not out.flags.c_contiguous or (rows > 1 and src.strides[1] != src.itemsize and cols > 1):
            raise ValueError("the compiled transpose needs row-major matrices")
        if rows == 0 or cols == 0:
            return
        stride = src.strides[0] // src.itemsize if rows > 1 else cols
        if src.strides[0] % src.itemsize or stride < cols:
            raise ValueError("the compiled transpose needs row-major matrices")
        span = (rows - 1) * stride + cols  # the source's rows, as one contiguous run of elements
        flat = np.lib.stride_tricks.as_strided(src, shape=(span,), strides=(src.itemsize,))
        raw(flat, out, rows, cols, src.itemsize, stride, 0, out.shape[1], first_col)

    return transpose_compiled


def make_columns(raw: Callable[..., None]) -> Kernel:
    """The extension's transpose as `columns(src, out, first)`: out = src[:, first:first+len(out)].T, with
    `src` and `out` contiguous (no view of the band is built: this runs once per band of every tensor)."""

    def columns_compiled(src: np.ndarray, out: np.ndarray, first: int) -> None:
        rows, cols = src.shape
        if out.shape[1] != rows or first + out.shape[0] > cols or src.dtype != out.dtype:
            raise ValueError(f"cannot transpose columns {first}.. of {src.shape} into {out.shape}")
        raw(src, out, rows, out.shape[0], src.itemsize, cols, first, rows, 0)

    return columns_compiled


_KERNEL = _compiled()
transpose: Kernel = _KERNEL or transpose_numpy
columns: Kernel = columns_numpy
if _KERNEL is not None:
    from syncd.kernels import _transpose

    columns = make_columns(_transpose.transpose)
KERNEL_NAME = "compiled" if _KERNEL is not None else "numpy"
