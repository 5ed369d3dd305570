"""The compiled kernel (`_transpose.c`), loaded with ctypes: `load()` gives a `Library` or None.

The C side trusts its arguments, so every geometry is checked here against the sizes of the buffers it is
given, before any call: a bad geometry is a ValueError, never a write out of bounds. ctypes releases the GIL
for the call, so transposes on several threads run on several cores, as they did when this was a CPython
extension; a plain C library needs no Python headers to build, which is what makes it buildable everywhere
(setup.py).
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
from pathlib import Path
from typing import Any

ELEMENT_SIZES = (1, 2, 4, 8)
LIBRARY_STEM = "_transpose"  # built by setup.py beside this module, with the interpreter's extension suffix


def library_path(directory: Path = Path(__file__).parent) -> Path | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = directory / f"{LIBRARY_STEM}{suffix}"
        if path.is_file():
            return path
    return None


def load(path: Path | None = None) -> Library | None:
    """The library at `path` (default: the one installed beside this module), or None if it is absent or
    cannot be loaded (another architecture, a truncated file)."""
    path = path or library_path()
    if path is None:
        return None
    try:
        return Library(ctypes.CDLL(os.fspath(path)), path)
    except (OSError, AttributeError):
        return None


class _Pinned:
    """The address of a buffer's first byte, valid while this object lives (it holds the buffer exported)."""

    def __init__(self, buf: Any, writable: bool) -> None:
        view = memoryview(buf)
        if not view.c_contiguous:
            raise ValueError("the compiled kernel needs contiguous buffers")
        self.nbytes = view.nbytes
        self._keep: Any = view
        if self.nbytes == 0:
            self.address = 0
        elif not view.readonly:
            self._keep = ctypes.c_char.from_buffer(view)
            self.address = ctypes.addressof(self._keep)
        elif writable:
            raise ValueError("the compiled kernel cannot write into a read-only buffer")
        elif isinstance(buf, bytes):
            self.address = ctypes.cast(ctypes.c_char_p(buf), ctypes.c_void_p).value or 0
            self._keep = buf
        else:  # read-only and not bytes (never on the conversion's path, whose buffers are its own): a copy
            self._keep = ctypes.create_string_buffer(view.tobytes(), self.nbytes)
            self.address = ctypes.addressof(self._keep)


def _check_geometry(
    src: _Pinned, dst: _Pinned, rows: int, cols: int, itemsize: int, sstride: int, scol: int, stride: int, col: int
) -> None:
    if min(rows, cols, scol, col) < 0 or sstride < cols + scol or stride < rows + col or itemsize not in ELEMENT_SIZES:
        raise ValueError("bad transpose geometry")
    if rows and cols:
        if (rows - 1) * sstride + scol + cols > src.nbytes // itemsize:
            raise ValueError("buffers too small for the transpose")
        if (cols - 1) * stride + col + rows > dst.nbytes // itemsize:
            raise ValueError("buffers too small for the transpose")
        if src.address % itemsize or dst.address % itemsize:
            raise ValueError("buffers not aligned to the element size")


class Library:
    """The entry points, each checked here before the C side runs."""

    def __init__(self, cdll: ctypes.CDLL, path: Path) -> None:
        self.path = path
        size, void = ctypes.c_ssize_t, ctypes.c_void_p
        self._transpose = cdll.syncd_transpose
        self._transpose.argtypes = [void, void, size, size, size, size, size, size, size]
        self._transpose.restype = None
        self._check = cdll.syncd_check
        self._check.argtypes = [void, void, size, size, size, size, size, size, size, size, ctypes.c_uint64]
        self._check.restype = ctypes.c_int
        self._pwrite = cdll.syncd_pwrite_pieces
        self._pwrite.argtypes = [ctypes.c_int, void, size, size, ctypes.c_longlong, ctypes.c_longlong]
        self._pwrite.restype = ctypes.c_longlong
        self._pread = cdll.syncd_pread_pieces
        self._pread.argtypes = [ctypes.c_int, void, size, size, ctypes.c_longlong, ctypes.c_longlong]
        self._pread.argtypes += [size, size, size]
        self._pread.restype = ctypes.c_longlong
        self._copy = cdll.syncd_copy_pieces
        self._copy.argtypes = [void, void, size, size, size, size, size, size]
        self._copy.restype = None
        self._sums = cdll.syncd_piece_sums
        self._sums.argtypes = [void, size, size, size, size, ctypes.c_uint64, void, size, size, ctypes.c_int]
        self._sums.restype = None

    def transpose(
        self, src: Any, dst: Any, rows: int, cols: int, itemsize: int, sstride: int, scol: int, stride: int, col: int
    ) -> None:
        """dst[c, col + r] = src[r, scol + c], bit for bit; rows sstride and stride elements apart."""
        source, target = _Pinned(src, writable=False), _Pinned(dst, writable=True)
        _check_geometry(source, target, rows, cols, itemsize, sstride, scol, stride, col)
        if rows and cols:
            self._transpose(source.address, target.address, rows, cols, itemsize, sstride, scol, stride, col)

    def check(
        self,
        src: Any,
        dst: Any,
        rows: int,
        cols: int,
        itemsize: int,
        sstride: int,
        scol: int,
        stride: int,
        col: int,
        samples: int,
        seed: int,
    ) -> bool:
        """True if dst[c, col + r] == src[r, scol + c] at every element (samples 0) or at `samples` per tile."""
        source, target = _Pinned(src, writable=False), _Pinned(dst, writable=False)
        _check_geometry(source, target, rows, cols, itemsize, sstride, scol, stride, col)
        if samples < 0:
            raise ValueError("bad check geometry")
        if not (rows and cols):
            return True
        args = (rows, cols, itemsize, sstride, scol, stride, col, samples, seed & (2**64 - 1))
        return bool(self._check(source.address, target.address, *args))

    def pwrite_pieces(self, fd: int, buf: Any, count: int, segment: int, offset: int, stride: int) -> int:
        """The `count` pieces of `segment` bytes of buf, end to end, written at offset + k * stride; the bytes
        written (every piece whole, or OSError)."""
        data = _Pinned(buf, writable=False)
        if min(count, segment, offset, stride) < 0 or count * segment > data.nbytes:
            raise ValueError("bad pieces geometry")
        written = self._pwrite(fd, data.address, count, segment, offset, stride)
        if written < 0:
            raise OSError(-written, os.strerror(-written))
        return int(written)

    def pread_pieces(
        self,
        fd: int,
        buf: Any,
        count: int,
        segment: int,
        offset: int,
        stride: int,
        first_row: int = 0,
        total_rows: int | None = None,
        chunk: int = 0,
    ) -> int:
        """`count` pieces of `segment` bytes read from offset + k * stride into buf; the bytes read (fewer only
        at the end of the file; errors raise OSError). Piece k is row first_row + k of a block of total_rows
        (default: count) in buf: end to end, or with 0 < chunk < segment in bands of `chunk` bytes of every row,
        each band's rows end to end (see _transpose.c, place)."""
        data = _Pinned(buf, writable=True)
        if min(count, segment, offset, stride) < 0:
            raise ValueError("bad pieces geometry")
        rows, chunk = _placement(data, count, segment, first_row, total_rows, chunk)
        done = self._pread(fd, data.address, count, segment, offset, stride, first_row, rows, chunk)
        if done < 0:
            raise OSError(-done, os.strerror(-done))
        return int(done)

    def copy_pieces(
        self,
        src: Any,
        dst: Any,
        count: int,
        segment: int,
        stride: int,
        first_row: int = 0,
        total_rows: int | None = None,
        chunk: int = 0,
    ) -> None:
        """pread_pieces from a buffer: `count` pieces of `segment` bytes from src, stride bytes apart, placed in
        dst as pread_pieces places them."""
        source, target = _Pinned(src, writable=False), _Pinned(dst, writable=True)
        if min(count, segment) < 0 or stride < segment:
            raise ValueError("bad pieces geometry")
        rows, chunk = _placement(target, count, segment, first_row, total_rows, chunk)
        if count and (count - 1) * stride + segment > source.nbytes:
            raise ValueError("buffers too small for the pieces")
        if count:
            self._copy(source.address, target.address, count, segment, stride, first_row, rows, chunk)

    def piece_sums(
        self,
        buf: Any,
        rows: int,
        stride: int,
        row_bytes: int,
        piece_bytes: int,
        seed: int,
        out: Any,
        out_stride: int,
        first_word: int = 0,
        add: bool = False,
    ) -> None:
        """out[r * out_stride + p] = the checksum of piece p (piece_bytes long, the last one what is left) of
        row r (row_bytes long, rows `stride` bytes apart) of buf: kernels.piece_sums. With `first_word`, the
        pieces are parts of longer ones from that 4-byte word on; with `add`, their sums are added to out's."""
        data, sums = _Pinned(buf, writable=False), _Pinned(out, writable=True)
        _check_sums(data, sums, rows, stride, row_bytes, piece_bytes, out_stride)
        if first_word < 0:
            raise ValueError("bad checksum geometry")
        if rows:
            seed &= 2**64 - 1
            where = (sums.address, out_stride, first_word, add)
            self._sums(data.address, rows, stride, row_bytes, piece_bytes, seed, *where)


def _placement(
    target: _Pinned, count: int, segment: int, first_row: int, total_rows: int | None, chunk: int
) -> tuple[int, int]:
    """(total rows, chunk) of where pieces go in `target` (pread_pieces), checked against its size."""
    rows = count if total_rows is None else total_rows
    chunk = segment if chunk <= 0 else min(chunk, segment)
    if first_row < 0 or rows < first_row + count or rows * segment > target.nbytes:
        raise ValueError("bad pieces geometry")
    return rows, max(chunk, 1)


def _check_sums(
    data: _Pinned, sums: _Pinned, rows: int, stride: int, row_bytes: int, piece_bytes: int, out_stride: int
) -> None:
    if min(rows, row_bytes) < 0 or piece_bytes <= 0 or stride < row_bytes or (row_bytes | piece_bytes | stride) % 8:
        raise ValueError("bad checksum geometry")
    pieces = -(-row_bytes // piece_bytes)
    if out_stride < pieces or data.address % 8 or sums.address % 8:
        raise ValueError("bad checksum geometry")
    if rows and ((rows - 1) * stride + row_bytes > data.nbytes or ((rows - 1) * out_stride + pieces) * 8 > sums.nbytes):
        raise ValueError("buffers too small for the checksums")
