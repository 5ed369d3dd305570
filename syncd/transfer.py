"""Moving tensor bytes from a source file into an output file, and checking them afterwards.

Memory stays bounded by one block whatever the model or tensor size: sources are read with `pread` into
reused buffers (a mapping of a file someone truncates would kill us with SIGBUS), and a transposed tensor is
written in tiles straight into a shared mapping of our own scratch file, whose pages are dropped from the
process once each strip is done. The pages stay in the page cache, so nothing is lost and RSS stays flat.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from syncd.errors import VerificationError
from syncd.formats.dtypes import ITEMSIZE
from syncd.formats.fileio import TensorFileReader, TensorSink, preadinto_exact

BLOCK_BYTES = 16 << 20  # one strip of source rows; bounds the memory of every transfer
TILE = 256  # elements per side of a transpose tile, sized to stay in L2
PAGE = mmap.PAGESIZE

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass(frozen=True)
class Transfer:
    """One output tensor's bytes: the source tensor, and whether its 2-D layout is transposed."""

    reader: TensorFileReader
    source: str
    transpose: bool


def copy_fill(reader: TensorFileReader, name: str) -> Callable[[TensorSink], None]:
    def fill(sink: TensorSink) -> None:
        for piece in reader.iter_chunks(name, BLOCK_BYTES):
            sink.write(piece)

    return fill


def transpose_fill(reader: TensorFileReader, name: str) -> Callable[[TensorSink], None]:
    """Write the transpose of a 2-D source tensor [a, b] as [b, a], strip by strip of source rows."""

    def fill(sink: TensorSink) -> None:
        info = reader.tensor(name)
        rows, cols = info.shape
        itemsize = ITEMSIZE[info.dtype]
        if rows and cols:
            with _Window(sink.fd, sink.base, info.nbytes, writable=True) as window:
                _transpose_into(reader, name, window, rows, cols, itemsize)
        sink.filled_through_mapping()

    return fill


def _row_strips(reader: TensorFileReader, name: str, rows: int, cols: int, itemsize: int):
    """Yield (first_row, array[strip_rows, cols]) reading whole source rows into one reused buffer."""
    row_bytes = cols * itemsize
    strip_rows = max(1, BLOCK_BYTES // row_bytes)
    buf = bytearray(min(rows, strip_rows) * row_bytes)
    for r0 in range(0, rows, strip_rows):
        n = min(strip_rows, rows - r0)
        view = memoryview(buf)[: n * row_bytes]
        reader.readinto(name, r0 * row_bytes, view)
        yield r0, np.frombuffer(view, dtype=_UINT[itemsize]).reshape(n, cols)


def _transpose_into(reader: TensorFileReader, name: str, window: _Window, rows: int, cols: int, itemsize: int) -> None:
    out = window.array(_UINT[itemsize], (cols, rows))
    for r0, strip in _row_strips(reader, name, rows, cols, itemsize):
        _transpose_strip_into(strip, out, r0)
        window.release()


def _transpose_strip_into(strip: np.ndarray, out: np.ndarray, r0: int) -> None:
    """out[:, r0:r0+n] = strip.T, tile by tile so both sides stay in cache."""
    n, cols = strip.shape
    for c0 in range(0, cols, TILE):
        c1 = min(cols, c0 + TILE)
        out[c0:c1, r0 : r0 + n] = strip[:, c0:c1].T


class _Window:
    """A shared mapping of one tensor's bytes in our own scratch file (page-aligned underneath). Only our
    scratch files are mapped: no one else can truncate them under us."""

    def __init__(self, fd: int, offset: int, nbytes: int, writable: bool) -> None:
        start = offset - offset % mmap.PAGESIZE
        self.skip = offset - start
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self.map = mmap.mmap(fd, self.skip + nbytes, flags=mmap.MAP_SHARED, prot=prot, offset=start)
        self.nbytes = nbytes

    def array(self, dtype: type, shape: tuple[int, ...]) -> np.ndarray:
        count = self.nbytes // np.dtype(dtype).itemsize
        return np.frombuffer(self.map, dtype=dtype, count=count, offset=self.skip).reshape(shape)

    def release(self) -> None:
        # Dirty shared pages survive MADV_DONTNEED in the page cache; only our resident set shrinks.
        self.map.madvise(mmap.MADV_DONTNEED)

    def __enter__(self) -> _Window:
        return self

    def __exit__(self, *exc: object) -> None:
        # an exception's traceback may still hold a view; the mapping then goes with it
        with contextlib.suppress(BufferError):
            self.map.close()


# ---------------------------------------------------------------------------------------------- verify


def verify_tensor(
    source: TensorFileReader, src_name: str, output: TensorFileReader, out_name: str, transpose: bool
) -> None:
    """Compare one written tensor with its source, after the transform, block by block."""
    info = source.tensor(src_name)
    if transpose:
        _verify_transposed(source, info.name, output, out_name)
        return
    out_info = output.tensor(out_name)
    if out_info.nbytes != info.nbytes:
        raise VerificationError(
            f"tensor '{out_name}' has {out_info.nbytes} bytes, its source {info.nbytes}", output.path
        )
    a = memoryview(bytearray(min(BLOCK_BYTES, info.nbytes)))
    b = memoryview(bytearray(len(a)))
    for done in range(0, info.nbytes, len(a) or 1):
        n = min(len(a), info.nbytes - done)
        source.readinto(src_name, done, a[:n])
        output.readinto(out_name, done, b[:n])
        if a[:n] != b[:n]:
            raise VerificationError(
                f"tensor '{out_name}' differs from its source '{src_name}' after writing", output.path
            )


def _verify_transposed(source: TensorFileReader, src_name: str, output: TensorFileReader, out_name: str) -> None:
    info = source.tensor(src_name)
    out_info = output.tensor(out_name)
    rows, cols = info.shape
    if out_info.shape != (cols, rows) or rows == 0 or cols == 0:
        if out_info.shape != (cols, rows):
            raise VerificationError(
                f"tensor '{out_name}' has shape {list(out_info.shape)}, expected {[cols, rows]}", output.path
            )
        return
    itemsize = ITEMSIZE[info.dtype]
    fd = os.open(output.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        with _Window(fd, out_info.offset, out_info.nbytes, writable=False) as window:
            if not _matches_transposed(source, src_name, window, rows, cols, itemsize):
                raise VerificationError(
                    f"tensor '{out_name}' is not the transpose of its source '{src_name}'", output.path
                )
    finally:
        os.close(fd)


def _matches_transposed(
    source: TensorFileReader, name: str, window: _Window, rows: int, cols: int, itemsize: int
) -> bool:
    out = window.array(_UINT[itemsize], (cols, rows))
    for r0, strip in _row_strips(source, name, rows, cols, itemsize):
        if not np.array_equal(out[:, r0 : r0 + strip.shape[0]].T, strip):
            return False
        window.release()
    return True


def read_all(reader: TensorFileReader, name: str) -> bytes:
    """Small tensors only (carried metadata)."""
    info = reader.tensor(name)
    buf = bytearray(info.nbytes)
    preadinto_exact(reader.fd, memoryview(buf), info.offset, reader.path, f"tensor '{name}'")
    return bytes(buf)
