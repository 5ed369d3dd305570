"""Low-level file access shared by both format readers and writers.

Readers use `pread` rather than a memory map: a file that a training job truncates while we read it would
deliver SIGBUS through a mapping, which Python cannot turn into an error, and a daemon must survive that.
`pread` into buffers also keeps the process RSS independent of the file size.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from operator import attrgetter, lt
from typing import Any

from syncd.errors import TRANSIENT_ERRNOS, FormatError, IncompleteFileError, SourceChangedError
from syncd.formats.dtypes import BOOL_DTYPES, ITEMSIZE
from syncd.formats.table import Buffer, CheckpointHeader, TensorInfo, TensorSpec

READ_CHUNK = 8 << 20
StrOrBytesPath = str | bytes | os.PathLike[str] | os.PathLike[bytes]


@dataclass(frozen=True)
class FileStamp:
    """One version of one file as the kernel describes it, taken without reading the file: which file it is
    (dev, ino), its size, mtime and ctime. The kernel sets ctime on every write, truncate, chmod and utime
    call, so a same-size rewrite whose mtime was set back still shows (Linux >= 6.13 gives a fine-grained
    ctime to any change after a stat, so a write in the same clock tick as a stat is not lost).

    The one record of file identity: a conversion's source check, publish's replace-only-our-own-file, the
    daemon's state database and its config-file check all use it."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int  # 0: not known (a state database row written before ctimes were recorded)

    @classmethod
    def of(cls, info: os.stat_result) -> FileStamp:
        return cls(info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)

    @classmethod
    def of_fd(cls, fd: int) -> FileStamp:
        return cls.of(os.fstat(fd))

    @classmethod
    def of_path(cls, path: StrOrBytesPath, *, follow_symlinks: bool = True) -> FileStamp:
        return cls.of(os.stat(path, follow_symlinks=follow_symlinks))

    def same_file(self, other: FileStamp) -> bool:
        """The same file (device and inode), whatever its content."""
        return (self.dev, self.ino) == (other.dev, other.ino)

    def changed(self, now: FileStamp) -> bool:
        """True unless `now` is this same version of the file: the same file, size and mtime, and the same
        ctime where both are known."""
        if (self.dev, self.ino, self.size, self.mtime_ns) != (now.dev, now.ino, now.size, now.mtime_ns):
            return True
        return bool(self.ctime_ns and now.ctime_ns and self.ctime_ns != now.ctime_ns)

    def check_unchanged(self, now: FileStamp, path: str) -> None:
        """Raise SourceChangedError if the source stamped as this before it was read is not `now` any more."""
        if self.changed(now):
            raise source_changed(path)


def source_changed(path: str, how: str = "changed") -> SourceChangedError:
    """The one message for a source that changed (was replaced, was removed) while it was read: what was read
    may mix two versions, so nothing is published and the daemon looks again once the file is quiet."""
    return SourceChangedError(f"{how} while it was being converted; nothing was published", path)


def open_regular_file(path: str | os.PathLike[str], within: str | os.PathLike[str] | None = None) -> tuple[int, int]:
    """Open `path` read-only and return (fd, size); refuse anything that is not a regular file.

    O_NONBLOCK keeps a FIFO named like a checkpoint from blocking the caller; it has no effect on the
    regular files we go on to read. With `within`, the file is opened without following a final symlink and
    must really lie inside that directory (checked on the opened file, so a directory swapped for a symlink
    between a scan and the open cannot lead us out of the tree).
    """
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY | (os.O_NOFOLLOW if within is not None else 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise FormatError("no such file", str(path), kind="busy") from None
    except IsADirectoryError:
        raise FormatError("is a directory, not a checkpoint file", str(path)) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW's refusal, or (followed) a loop of symlinks
            why = "is a symlink; not following it" if within is not None else "is a loop of symlinks"
            raise FormatError(why, str(path)) from None
        raise _read_error(f"cannot open: {exc.strerror}", str(path), exc) from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise FormatError("not a regular file", str(path))
        if within is not None and not _opened_inside(fd, within):
            raise FormatError(f"resolves outside {os.fspath(within)}; not following it", str(path))
    except BaseException:
        os.close(fd)
        raise
    return fd, info.st_size


# Decoded headers cost far more memory than their bytes (an empty CBOR array: 1 byte, ~64 bytes as a Python
# list). Headers larger than DECODE_SCAN_ABOVE are priced first and refused past DECODE_BUDGET.
DECODE_SCAN_ABOVE = 1 << 20
DECODE_BUDGET = 128 << 20

# UTF-8 lead bytes of code points CPython stores in 4 bytes (U+10000 and up) and in 2 (U+0100 to U+FFFF).
_FOUR_BYTE_CHARS = re.compile(rb"[\xf0-\xf4]")
_TWO_BYTE_CHARS = re.compile(rb"[\xc4-\xef]")


def text_width(raw: bytes, start: int = 0, end: int | None = None) -> int:
    """Bytes per character of the str that `raw[start:end]`, UTF-8, decodes to: CPython stores a whole str at the
    width of its widest character, so one emoji in 100 MB of ASCII makes 400 MB of text."""
    stop = len(raw) if end is None else end
    # isascii scans a word at a time; the regex engine a byte at a time (4-5 ms per MiB of header)
    if (raw if start == 0 and stop == len(raw) else raw[start:stop]).isascii():
        return 1
    if _FOUR_BYTE_CHARS.search(raw, start, stop) is not None:
        return 4
    return 2 if _TWO_BYTE_CHARS.search(raw, start, stop) is not None else 1


def refuse_costly_decode(raw: bytes, price: Callable[[bytes], int], what: str, path: str) -> None:
    """Raise a FormatError if decoding `raw` (priced by `price`, an upper estimate) could exceed the budget."""
    if len(raw) <= DECODE_SCAN_ABOVE:
        return
    cost = price(raw)
    if cost > DECODE_BUDGET:
        raise FormatError(
            f"{what} of {len(raw)} bytes could need {cost >> 20} MiB to decode, more than the "
            f"{DECODE_BUDGET >> 20} MiB allowed: too many small items for a tensor table",
            path,
        )


def _opened_inside(fd: int, directory: str | os.PathLike[str]) -> bool:
    real = os.readlink(f"/proc/self/fd/{fd}")
    root = os.path.realpath(directory)
    return real == root or real.startswith(root.rstrip("/") + "/")


def _read_error(message: str, path: str, exc: OSError) -> FormatError:
    """Opening or reading failed in the file system, not in the file's content: the same errno means the same
    kind wherever it happens (an EIO or ENOMEM heals; a permission does not, but it is not the file's fault)."""
    return FormatError(message, path, kind="environment", transient=exc.errno in TRANSIENT_ERRNOS)


def pread_exact(fd: int, size: int, offset: int, path: str, what: str) -> bytes:
    """Read exactly `size` bytes at `offset`, or fail naming what was being read."""
    parts: list[bytes] = []
    got = 0
    while got < size:
        try:
            chunk = os.pread(fd, min(size - got, READ_CHUNK), offset + got)
        except OSError as exc:
            raise _read_error(f"cannot read {what}: {exc.strerror}", path, exc) from exc
        if not chunk:
            raise IncompleteFileError(f"file truncated while reading {what} (got {got} of {size} bytes)", path)
        parts.append(chunk)
        got += len(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def preadinto_exact(fd: int, buf: memoryview, offset: int, path: str, what: str) -> None:
    """Fill `buf` from `offset`, or fail naming what was being read."""
    done = 0
    while done < len(buf):
        try:
            n = os.preadv(fd, [buf[done:]], offset + done)
        except OSError as exc:
            raise _read_error(f"cannot read {what}: {exc.strerror}", path, exc) from exc
        if n == 0:
            raise IncompleteFileError(f"file truncated while reading {what}", path)
        done += n


def pwrite_all(fd: int, data: Buffer, offset: int) -> None:
    """Write all of `data` at `offset` (pwrite may write less than asked)."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


class TensorSink:
    """Where a tensor's bytes go: a fixed window of the output file, filled sequentially or by position.

    The writer checks afterwards that exactly the declared number of bytes arrived, so a producer that
    yields too few or too many bytes fails the write instead of corrupting the layout.
    """

    def __init__(self, fd: int, base: int, nbytes: int, name: str, check: Callable[[Buffer], None] | None):
        self.fd = fd
        self.base = base
        self.nbytes = nbytes
        self.name = name
        self.written = 0
        self._cursor = 0
        self._check = check

    def write(self, data: Buffer) -> None:
        self.pwrite(data, self._cursor)
        self._cursor += memoryview(data).nbytes

    def pwrite(self, data: Buffer, rel_offset: int) -> None:
        size = memoryview(data).nbytes
        if rel_offset < 0 or rel_offset + size > self.nbytes:
            raise FormatError(
                f"deferred source has inconsistent length (expected {self.nbytes}, "
                f"got a write reaching {rel_offset + size})",
                tensor=self.name,
            )
        if self._check is not None:
            self._check(data)
        pwrite_all(self.fd, data, self.base + rel_offset)
        self.written += size

    def finish(self) -> None:
        if self.written != self.nbytes:
            raise FormatError(
                f"deferred source has inconsistent length (expected {self.nbytes}, got {self.written})",
                tensor=self.name,
            )


def write_zeros(fd: int, offset: int, count: int) -> None:
    """Zero-fill explicitly: padding must be zero bytes on disk, not a hole we hope reads as zero."""
    block = bytes(min(count, 1 << 20))
    while count > 0:
        n = min(count, len(block))
        pwrite_all(fd, memoryview(block)[:n], offset)
        offset += n
        count -= n


# file order: by offset, then end (the same order as by offset, then size); attrgetter builds the keys in C
_BY_PLACE = attrgetter("offset", "nbytes")
_OFFSET = attrgetter("offset")


def _in_file_order(tensors: list[TensorInfo]) -> bool:
    """Whether the offsets rise strictly from one tensor to the next: then sorting by place keeps the order as it
    is (a writer's table usually lists its tensors in file order), and this is told in C without a key per tensor."""
    offsets = list(map(_OFFSET, tensors))
    return all(map(lt, offsets, islice(offsets, 1, None)))


class TensorFileReader:
    """Shared reading side of both formats: a validated table of tensors and lazy, bounded access to
    their bytes. Subclasses parse the header in `__init__` and fill `header` and `tensors`."""

    def __init__(self, path: str | os.PathLike[str], within: str | os.PathLike[str] | None = None) -> None:
        self.path = os.fspath(path)
        self.fd, self.file_size = open_regular_file(path, within)
        self._followed_symlink = within is None  # how the path was opened is how check_unchanged looks it up
        # before the first byte is read: what a conversion compares with at the end (check_unchanged)
        self.opened = FileStamp.of_fd(self.fd)
        self.tensors: list[TensorInfo] = []
        self._by_name: dict[str, TensorInfo] = {}
        self.header: CheckpointHeader
        try:
            self._parse()
        except BaseException:
            self.close()
            raise

    def _parse(self) -> None:
        """Read and validate the header; fill `header` and, through `_index`, `tensors`."""
        raise TypeError(f"{type(self).__name__} must define _parse")

    def _index(self, tensors: list[TensorInfo]) -> None:
        self.tensors = list(tensors) if _in_file_order(tensors) else sorted(tensors, key=_BY_PLACE)
        self._by_name = {t.name: t for t in tensors}

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self._by_name[name]
        except KeyError:
            raise FormatError(f"Tensor not found: {name}", self.path) from None

    def is_window(self, name: str) -> bool:
        """True when the tensor's bytes are exactly [offset, offset + nbytes) of the file, in C order, and no
        tensor before it in the file shares any of them: a converter may move them as one window in a pass
        over the file. Otherwise (a PyTorch view, a tied weight) `readinto` gathers them."""
        return True

    def all_windows(self) -> bool:
        """`is_window` of every tensor of the file, asked once for a whole plan."""
        return True

    def read(self, name: str) -> bytes:
        info = self.tensor(name)
        return pread_exact(self.fd, info.nbytes, info.offset, self.path, f"tensor '{name}'")

    def readinto(self, name: str, offset: int, buf: memoryview) -> None:
        info = self.tensor(name)
        if offset < 0 or offset + len(buf) > info.nbytes:
            raise FormatError(f"read past the end of tensor '{name}'", self.path)
        preadinto_exact(self.fd, buf, info.offset + offset, self.path, f"tensor '{name}'")

    def iter_chunks(self, name: str, chunk_size: int = READ_CHUNK) -> Iterator[memoryview]:
        """Yield the tensor's bytes in pieces through one reused buffer (valid until the next piece)."""
        info = self.tensor(name)
        buf = memoryview(bytearray(min(chunk_size, info.nbytes)))
        done = 0
        while done < info.nbytes:
            piece = buf[: min(len(buf), info.nbytes - done)]
            preadinto_exact(self.fd, piece, info.offset + done, self.path, f"tensor '{name}'")
            yield piece
            done += len(piece)

    def check_unchanged(self) -> None:
        """Raise SourceChangedError unless this is the same, unchanged file from the first byte read to now.

        Compared with the stamp taken before the header was read: identity, size, mtime and ctime. The path
        must still name that file (looked up as it was opened: a symlink followed on the command line, never
        in a watched tree): a source replaced or removed meanwhile is not published either (the new file, if
        any, gets its own conversion)."""
        now = FileStamp.of_fd(self.fd)
        self.opened.check_unchanged(now, self.path)
        try:
            at_path = FileStamp.of_path(self.path, follow_symlinks=self._followed_symlink)
        except FileNotFoundError:
            raise source_changed(self.path, "was removed") from None
        if not at_path.same_file(now):
            raise source_changed(self.path, "was replaced")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> TensorFileReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def bool_checker(dtype: str, name: str, path: str | None = None) -> Any:
    """Bool bytes must be exactly 0 or 1 (docs/burn-format.md#dtypes): a writer must not emit 0xFF for true."""
    if dtype not in BOOL_DTYPES:
        return None
    import numpy as np  # here: reading a table (`syncd inspect`) does not need numpy

    element = np.uint32 if dtype == "Bool(U32)" else np.uint8

    def check(data: Buffer) -> None:
        view = memoryview(data).cast("B")
        if len(view) % ITEMSIZE[dtype]:
            raise FormatError("bool data is not a whole number of elements", path, tensor=name)
        values = np.frombuffer(view, dtype=np.dtype(element).newbyteorder("<"))
        if values.size and values.max() > 1:
            raise FormatError("bool tensor holds a byte other than 0 or 1", path, tensor=name)

    return check


def write_tensors(fd: int, plan_starts: Iterable[tuple[TensorSpec, int]]) -> None:
    """Fill each tensor's window, zero-filling the gaps between them."""
    cursor = None
    for spec, absolute in plan_starts:
        if cursor is not None and absolute > cursor:
            write_zeros(fd, cursor, absolute - cursor)
        sink = TensorSink(fd, absolute, spec.nbytes, spec.name, bool_checker(spec.dtype, spec.name))
        spec.fill(sink)
        sink.finish()
        cursor = absolute + spec.nbytes if cursor is None else max(cursor, absolute + spec.nbytes)
