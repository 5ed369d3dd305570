"""Moving tensor bytes from a source file into an output file, and checking them afterwards.

Memory stays bounded whatever the model or tensor size: sources are read with `pread` into buffers reused
for every tensor (a mapping of a file someone truncates would kill us with SIGBUS), and outputs are written
with `pwrite`. A transposed tensor up to WHOLE_BYTES is read whole, transposed into a second reused buffer
and written in one piece; a larger one goes strip by strip of source rows, each strip's transpose written
into its place in every output row. Reused buffers matter: first-touching fresh pages costs more than the
transpose itself.

Verification: while writing, a CRC-32 of every source byte is taken as it is read; after the file is written
it is re-read from disk (through a fresh reader, so its header is parsed anew), transposed back where it was
transposed, and must give the same CRCs. That catches a wrong offset, a short or failed write, a header that
does not describe the data, and a transpose done wrong.
"""

from __future__ import annotations

import ctypes
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from syncd.errors import VerificationError
from syncd.formats.dtypes import ITEMSIZE
from syncd.formats.fileio import TensorFileReader, TensorSink

BLOCK_BYTES = 16 << 20  # copy and verify chunks
WHOLE_BYTES = 64 << 20  # transposes up to this size happen in memory in one piece
STRIP_ROWS = 16  # source rows per numpy assignment: measured fastest for a transposing copy

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass
class _Check:
    """How to check one written tensor: against its source directly (copied), or against CRC-32s of the
    source rows taken while transposing."""

    crcs: list[int] = field(default_factory=list)
    strip_rows: int = 0  # transposed: one CRC per strip of this many source rows
    rows: int = 0
    cols: int = 0
    source: tuple[TensorFileReader, str] | None = None  # copied: compared with the source byte for byte


class Transfer:
    """The buffers and checks of one conversion; make one per conversion (not shared between threads)."""

    def __init__(self, whole_bytes: int = WHOLE_BYTES) -> None:
        self.whole_bytes = whole_bytes  # transposes up to this size in one piece, larger ones by strips
        self._buffers: dict[str, bytearray] = {}
        self.checks: dict[str, _Check] = {}

    def buffer(self, key: str, size: int) -> memoryview:
        buf = self._buffers.get(key)
        if buf is None or len(buf) < size:
            buf = self._buffers[key] = bytearray(size)
        return memoryview(buf)[:size]

    # -- writing

    def copy_fill(self, reader: TensorFileReader, name: str, target: str) -> Callable[[TensorSink], None]:
        """Copy a tensor unchanged: in the kernel (copy_file_range, as cp does) unless its bytes must be
        checked on the way (bool tensors); verification compares the written bytes with the source's."""

        def fill(sink: TensorSink) -> None:
            info = reader.tensor(name)
            self.checks[target] = _Check(source=(reader, name))
            if not sink.checks_data and sink.copy_from(reader.fd, info.offset, info.nbytes):
                return
            buf = self.buffer("a", min(BLOCK_BYTES, info.nbytes))
            for done in range(0, info.nbytes, len(buf) or 1):
                piece = buf[: min(len(buf), info.nbytes - done)]
                reader.readinto(name, done, piece)
                sink.write(piece)

        return fill

    def transpose_fill(self, reader: TensorFileReader, name: str, target: str) -> Callable[[TensorSink], None]:
        """Write the transpose of a 2-D source tensor [a, b] as [b, a]."""

        def fill(sink: TensorSink) -> None:
            info = reader.tensor(name)
            rows, cols = info.shape
            itemsize = ITEMSIZE[info.dtype]
            if info.nbytes == 0:  # nothing to move; a dimension may still be huge ([2**40, 0]): never loop over it
                self.checks[target] = _Check([0])
            elif info.nbytes <= self.whole_bytes:
                self._transpose_whole(reader, name, target, sink, rows, cols, itemsize)
            else:
                self._transpose_strips(reader, name, target, sink, rows, cols, itemsize)

        return fill

    def _transpose_whole(self, reader: TensorFileReader, name: str, target: str, sink: TensorSink, rows: int,
                         cols: int, itemsize: int) -> None:
        nbytes = rows * cols * itemsize
        src = self.buffer("a", nbytes)
        out = self.buffer("b", nbytes)
        reader.readinto(name, 0, src)
        _transpose(_matrix(src, itemsize, rows, cols), _matrix(out, itemsize, cols, rows), 0)
        self.checks[target] = _Check([zlib.crc32(src)], strip_rows=rows, rows=rows, cols=cols)
        sink.write(out)

    def _transpose_strips(self, reader: TensorFileReader, name: str, target: str, sink: TensorSink, rows: int,
                          cols: int, itemsize: int) -> None:
        """Source rows r0:r1 become columns r0:r1 of every output row: one pwrite per output row per strip."""
        strip_rows = max(1, (self.whole_bytes // 2) // (cols * itemsize))
        check = self.checks[target] = _Check(strip_rows=strip_rows, rows=rows, cols=cols)
        for r0 in range(0, rows, strip_rows):
            n = min(strip_rows, rows - r0)
            src = self.buffer("a", n * cols * itemsize)
            out = self.buffer("b", n * cols * itemsize)
            reader.readinto(name, r0 * cols * itemsize, src)
            _transpose(_matrix(src, itemsize, n, cols), _matrix(out, itemsize, cols, n), 0)
            check.crcs.append(zlib.crc32(src))
            segment = n * itemsize
            for c in range(cols):
                sink.pwrite(out[c * segment : (c + 1) * segment], (c * rows + r0) * itemsize)

    # -- verifying

    def verify(self, output: TensorFileReader, target: str) -> None:
        """Re-read `target` from the written file and compare it with the CRCs taken while writing."""
        check = self.checks.get(target)
        if check is None:
            raise VerificationError(f"tensor '{target}' was never written", output.path)
        if check.source is not None:
            same = _same_bytes(*check.source, output, target, self)
        else:
            same = (_strip_crcs(output, target, check, self) if check.strip_rows else [0]) == check.crcs
        if not same:
            raise VerificationError(f"tensor '{target}' reads back different from what was written", output.path)


def _matrix(buf: memoryview, itemsize: int, rows: int, cols: int) -> np.ndarray:
    return np.frombuffer(buf, dtype=_UINT[itemsize], count=rows * cols).reshape(rows, cols)


def _transpose(src: np.ndarray, out: np.ndarray, first_col: int) -> None:
    """out[:, first_col:first_col+rows] = src.T, a few source rows at a time (cache-friendly)."""
    rows = src.shape[0]
    for r0 in range(0, rows, STRIP_ROWS):
        r1 = min(rows, r0 + STRIP_ROWS)
        out[:, first_col + r0 : first_col + r1] = src[r0:r1].T


def _same_bytes(source: TensorFileReader, src_name: str, output: TensorFileReader, out_name: str,
                transfer: Transfer) -> bool:
    nbytes = source.tensor(src_name).nbytes
    if output.tensor(out_name).nbytes != nbytes:
        return False
    a = transfer.buffer("a", min(BLOCK_BYTES, nbytes))
    b = transfer.buffer("b", len(a))
    for done in range(0, nbytes, len(a) or 1):
        n = min(len(a), nbytes - done)
        source.readinto(src_name, done, a[:n])
        output.readinto(out_name, done, b[:n])
        if not _equal(a, b, n):
            return False
    return True


_libc = ctypes.CDLL(None)
_libc.memcmp.restype = ctypes.c_int
_libc.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


def _equal(a: memoryview, b: memoryview, n: int) -> bool:
    """memcmp of the first n bytes of two writable buffers: Python's memoryview == compares element by
    element, and slicing a bytearray to compare it would copy it."""
    if n == 0:
        return True
    address = ctypes.c_char.from_buffer
    return _libc.memcmp(ctypes.addressof(address(a)), ctypes.addressof(address(b)), n) == 0


def _strip_crcs(output: TensorFileReader, name: str, check: _Check, transfer: Transfer) -> list[int]:
    """Transpose the written tensor back, strip by strip, and take the CRCs of what comes out: they must be
    those of the source rows, so a transpose done wrong (or not done) fails just like a bad write."""
    info = output.tensor(name)
    itemsize = ITEMSIZE[info.dtype]
    if info.shape != (check.cols, check.rows):
        raise VerificationError(f"tensor '{name}' has shape {list(info.shape)}", output.path)
    crcs = []
    for r0 in range(0, check.rows, check.strip_rows):
        n = min(check.strip_rows, check.rows - r0)
        segment = n * itemsize
        written = transfer.buffer("b", check.cols * segment)
        if n == check.rows:
            output.readinto(name, 0, written)
        else:
            for c in range(check.cols):
                output.readinto(name, (c * check.rows + r0) * itemsize, written[c * segment : (c + 1) * segment])
        back = transfer.buffer("a", check.cols * segment)
        _transpose(_matrix(written, itemsize, check.cols, n), _matrix(back, itemsize, n, check.cols), 0)
        crcs.append(zlib.crc32(back))
    return crcs
