"""Bit-exact transposes: a compiled cache-blocked kernel when it was built, numpy otherwise.

Both move elements as unsigned integers of their width (never as floats), so every bit pattern, signalling
NaNs included, arrives unchanged, and both give identical bytes (tests/test_kernels.py holds them to it).
The compiled kernel (`_transpose.c`, a plain C library built by `pip install` and loaded with ctypes by
compiled.py) walks the matrix in 32x32 tiles (SSE2 blocks of 4x4 for 4-byte elements, 8x8 for 2-byte) and
releases the GIL, so transposes on several threads use several cores. numpy's best bit-exact form copies a
few source rows at a time: 0.3-1 GiB/s on the bands of large tensors, against 2-4 GiB/s compiled. setup.py
makes sure a compiler is there at install time (Zig's, from the ziglang wheel, on a machine without one).

The one-pass writer uses the band forms on plain byte buffers: `transpose_band` (a band of columns of a
source block, transposed) and `band_matches` (the in-cache check of that band, checks.py's rule). With the
compiled kernel neither touches numpy, so a transposing conversion does not import it (0.1 s of CPU) nor pay its
per-call overhead on the check of every band (0.15 s of CPU per GiB, measured on linear-f32-1g); without it
both run on numpy views of the same buffers.

`pwrite_pieces` writes the output-row pieces of a tensor transposed in strips (each piece at its own offset):
one call of the compiled kernel for a whole band, or one `os.pwrite` per piece without it. `pread_pieces` is
its reverse, for a tensor taken by columns: a group of columns read piece by piece out of every source row;
`copy_pieces` takes the same pieces out of rows already in a buffer (the read for the hash).
`piece_sums` is the checksum that binds that read, as placed, to the hashed one (onepass.py): every 4-byte word
offset by a constant of its place, squared exactly and summed (mod 2**64), per piece of every row (why that
catches a changed word and a swap: `_transpose.c`); a piece laid out in bands is summed band by band. These
last three exist only compiled (BY_COLUMNS).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from syncd.engine.write.checks import FULL_CHECK_ELEMENTS, SAMPLES_PER_TILE, check_transposed
from syncd.engine.write.kernels.compiled import Library, load

if TYPE_CHECKING:
    import numpy as np

STRIP_ROWS = 16  # source rows per numpy assignment: measured fastest for a transposing copy

Kernel = Callable[["np.ndarray", "np.ndarray", int], None]
# (src, out, rows, cols, itemsize, first, count): out (count x rows) = columns first:first+count of src (rows x cols)
BandKernel = Callable[[Any, Any, int, int, int, int, int], None]
# the same geometry and a seed for the sample positions: True if out holds that transpose
BandCheck = Callable[[Any, Any, int, int, int, int, int, int], bool]
# (fd, buf, count, segment, offset, stride) -> bytes written
PiecesWriter = Callable[[int, Any, int, int, int, int], int]
# (fd, buf, count, segment, offset, stride, first_row, total_rows, chunk) -> bytes read (fewer only at the end of
# the file); piece k is row first_row + k of a block of total_rows rows laid out in bands of chunk bytes
PiecesReader = Callable[[int, Any, int, int, int, int, int, int, int], int]
# (src, dst, count, segment, stride, first_row, total_rows, chunk): PiecesReader from a buffer
PiecesCopier = Callable[[Any, Any, int, int, int, int, int, int], None]


# (buf, rows, stride, row_bytes, piece_bytes, seed, out, out_stride, first_word, add): out[r * out_stride + p] =
# the sum of piece p of row r; with first_word, of pieces that are parts of longer ones from that 4-byte word
# on; with add, added to what out holds
PieceSums = Callable[[Any, int, int, int, int, int, Any, int, int, bool], None]


def transpose_numpy(src: np.ndarray, out: np.ndarray, first_col: int = 0) -> None:
    """out[:, first_col:first_col+rows] = src.T, a few source rows at a time (cache-friendly)."""
    rows = src.shape[0]
    for r0 in range(0, rows, STRIP_ROWS):
        r1 = min(rows, r0 + STRIP_ROWS)
        out[:, first_col + r0 : first_col + r1] = src[r0:r1].T


def _views(src: Any, out: Any, rows: int, cols: int, itemsize: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """numpy views of a band's byte buffers: the source block (rows x cols) and the band (count x rows)."""
    import numpy as np

    dtype = np.dtype(f"u{itemsize}")
    # frombuffer refuses buffers too small for the geometry (ValueError)
    return (
        np.frombuffer(src, dtype, rows * cols).reshape(rows, cols),
        np.frombuffer(out, dtype, count * rows).reshape(count, rows),
    )


def band_numpy(src: Any, out: Any, rows: int, cols: int, itemsize: int, first: int, count: int) -> None:
    if first < 0 or first + count > cols:
        raise ValueError(f"cannot transpose columns {first}..{first + count} of {cols}")
    block, band = _views(src, out, rows, cols, itemsize, count)
    transpose_numpy(block[:, first : first + count], band, 0)


def band_check_numpy(
    src: Any, out: Any, rows: int, cols: int, itemsize: int, first: int, count: int, seed: int
) -> bool:
    import numpy as np

    block, band = _views(src, out, rows, cols, itemsize, count)
    return check_transposed(block[:, first : first + count], band, 0, np.random.default_rng(seed))


def pwrite_pieces_python(fd: int, buf: Any, count: int, segment: int, offset: int, stride: int) -> int:
    """The `count` pieces of `segment` bytes of `buf`, end to end, written at offset + k * stride; the bytes
    written (all of them: pwrite's short counts are retried, errors raise OSError)."""
    view = memoryview(buf).cast("B")
    if min(count, segment, offset, stride) < 0 or count * segment > len(view):
        raise ValueError("bad pieces geometry")  # as the compiled form: never a short piece taken for whole
    for k in range(count):
        piece, at = view[k * segment : (k + 1) * segment], offset + k * stride
        while piece:
            n = os.pwrite(fd, piece, at)
            piece, at = piece[n:], at + n
    return count * segment


def _needs_the_compiled_kernel(*args: Any) -> Any:
    raise RuntimeError("reading a tensor by columns needs the compiled kernel")  # BY_COLUMNS is False then


def _compiled() -> Library | None:
    if os.environ.get("SYNCD_KERNEL") == "numpy":  # for measuring and testing the fallback
        return None
    return load()


def make_compiled(raw: Callable[..., None]) -> Kernel:
    """Wrap the compiled transpose(src, dst, rows, cols, itemsize, src_stride, src_col, dst_stride, dst_col)
    as a Kernel. `src` may be a band of columns of a larger row-major matrix (rows contiguous, elements
    adjacent), `out` must be contiguous."""

    def transpose_compiled(src: np.ndarray, out: np.ndarray, first_col: int = 0) -> None:
        import numpy as np

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


def make_band(raw: Callable[..., None]) -> BandKernel:
    """The compiled transpose as a BandKernel on byte buffers (this runs once per band of every tensor)."""

    def band_compiled(src: Any, out: Any, rows: int, cols: int, itemsize: int, first: int, count: int) -> None:
        if first < 0 or first + count > cols:
            raise ValueError(f"cannot transpose columns {first}..{first + count} of {cols}")
        raw(src, out, rows, count, itemsize, cols, first, rows, 0)

    return band_compiled


def make_band_check(raw: Callable[..., bool]) -> BandCheck:
    """The compiled check as a BandCheck: checks.py's rule (small blocks whole, larger ones sampled)."""

    def check_compiled(
        src: Any, out: Any, rows: int, cols: int, itemsize: int, first: int, count: int, seed: int
    ) -> bool:
        samples = 0 if rows * count <= FULL_CHECK_ELEMENTS else SAMPLES_PER_TILE
        return raw(src, out, rows, count, itemsize, cols, first, rows, 0, samples, seed & (2**64 - 1))

    return check_compiled


_LIBRARY = _compiled()
transpose: Kernel = transpose_numpy
transpose_band: BandKernel = band_numpy
band_matches: BandCheck = band_check_numpy
pwrite_pieces: PiecesWriter = pwrite_pieces_python
pread_pieces: PiecesReader = _needs_the_compiled_kernel
piece_sums: PieceSums = _needs_the_compiled_kernel
copy_pieces: PiecesCopier = _needs_the_compiled_kernel
if _LIBRARY is not None:
    transpose = make_compiled(_LIBRARY.transpose)
    transpose_band = make_band(_LIBRARY.transpose)
    band_matches = make_band_check(_LIBRARY.check)
    pwrite_pieces = _LIBRARY.pwrite_pieces
    pread_pieces = _LIBRARY.pread_pieces
    piece_sums = _LIBRARY.piece_sums
    copy_pieces = _LIBRARY.copy_pieces
KERNEL_NAME = "compiled" if _LIBRARY is not None else "numpy"
# Large tensors taken by groups of columns (onepass.py) only with the compiled kernel: without it, each row's
# piece is a Python call and its checksum numpy temporaries (measured on [8192, 8192] F32: twice the time and
# 500 MiB of memory), so the fallback keeps to strips of rows.
BY_COLUMNS = _LIBRARY is not None
