"""One pass over the source's bytes: each byte is read once into a cache-sized buffer, and that
read feeds both the identity hash (which takes the bytes in file order) and the conversion (but for tensors
larger than the strip buffer taken by columns, below, read twice and bound by checksums). The source is cut
into jobs in file order; worker threads, one per core, read, hash (in turn), transform, check and write them
in parallel. A small source, or one of small untransformed tensors only (batches of them, each job bound by
the interpreter rather than by copying), is converted on the calling thread.

Memory is bounded whatever the model: by a ring of buffer slots capped in bytes (RING_BYTES; a slot is taken
before a job is handed out and given back when its write is done, so no more is read than the writers can
take; each slot holds at most SLOT_BYTES read and BAND_BYTES transposed), plus one strip buffer (STRIP_BYTES)
for tensors larger than a slot: 112 + 96 MiB at most on any number of cores, of which a model touches only
what it needs (the process adds the interpreter and its imports, 30-45 MiB), and the checksums of a tensor
taken by columns (SUMS_BYTES at most, 16 bytes per row and group). Buffers are 64-byte aligned
(reads into buffers at 16 mod 64, where large bytearrays and numpy arrays land, cost three times as much).

What is moved is a list of `Move`s: a source window, a target window, and for transposed tensors the source
matrix shape. Untransformed tensors (and vectors: a [1, n] or [n, 1] transpose is the same bytes) go in
BLOCK_BYTES pieces; a transposed tensor up to SLOT_BYTES goes whole, one job (unless its output rows are
longer than a band: a narrow matrix). One up to STRIP_BYTES goes as one strip of the strip buffer: the writers
read its rows in parts, then transpose its columns in parts, its output rows written whole.

A larger one is taken by groups of columns (`_column_width` says when): every source row's piece of the group
is read into the strip buffer (one call of the compiled kernel per part), and the group's output rows, whole
and end to end in the output, are written a band at a time. The pieces land band by band (each band's rows end
to end), so that each band is transposed as a matrix of its own: read out of whole pieces a few KiB apart
(each row on another page), a band of the lm_head took three times as long. Those reads are not in file order, so
the tensor's bytes are also read in file order for the hash, and the two reads are bound by a checksum of
every piece (`_Bound`): this is the one place a source byte is read twice, and what is converted is still
proven to be what was hashed. (The first group's pieces are copied out of the read for the hash as it goes:
read once.) Tensors whose geometry does not suit that (rows not whole 8-byte words, output rows longer than a
band, pieces shorter than MIN_COLUMN_PIECE) go in strips of source rows read in file order, each output row
receiving one piece of the strip's height per strip. Every write lands in a WriteLedger (checks.py), every
transposed band is checked in cache.

`Seam` is where tests step into a pass to inject faults (a wrong read, transpose, place or write) without
reaching into its private methods.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os
import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING, Any, NamedTuple

from syncd.engine.hashing import DEFAULT_HASH, Hasher, block_digest, new_hasher
from syncd.engine.write.checks import Entry, Run, WriteLedger
from syncd.errors import FormatError, VerificationError
from syncd.formats.fileio import FileStamp, pwrite_all, source_changed
from syncd.formats.table import Buffer

if TYPE_CHECKING:
    from concurrent.futures import Future

BLOCK_BYTES = 2 << 20  # copy pieces: well under L2+L3, measured to keep pread/pwrite cheap
SLOT_BYTES = 16 << 20  # largest transpose read in one piece; larger ones go in strips of the strip buffer
STRIP_BYTES = 96 << 20  # the strip buffer: larger strips write longer output-row pieces (STRIP_BYTES / columns)
BAND_BYTES = 1 << 20  # transposed output produced and written this much at a time, in cache
WRITEBACK_BYTES = 32 << 20  # start the disk writes of the output every this many bytes written
INLINE_BYTES = 16 << 20  # sources up to this size are converted on the calling thread alone
MIN_COLUMN_PIECE = 512  # shortest row piece a tensor taken by columns reads (below it: strips)
SUMS_BYTES = 16 << 20  # the checksums binding the two reads of one tensor taken by columns, at most
RING_BYTES = 112 << 20  # all slots together; with the strip buffer, the buffer memory whatever the model


def _seed() -> int:
    """A seed of the sample positions of the in-cache checks, from the OS: nothing a caller does with
    `random` makes the positions predictable (and that module's import is left to whoever needs it)."""
    return int.from_bytes(os.urandom(8), "little")


def _preadv(fd: int, buf: memoryview, offset: int) -> int:
    return os.preadv(fd, [buf], offset)


def _same_place(name: str, offset: int) -> int:
    return offset


@dataclass(frozen=True)
class Seam:
    """Where a pass can be stepped into, one small function each; the defaults are the real ones. Tests put
    faults here (a torn or truncated source, a misplaced write, a wrong transpose, a short write) and the
    pass's checks must catch them.

    * read(fd, buffer, offset) -> bytes read: each read of the source.
    * transpose(src, out, rows, cols, itemsize, first, count): a band of a transposed tensor, the
      kernels.BandKernel geometry; None: the kernel in use (kernels.transpose_band).
    * place(tensor, offset) -> offset: where a write goes, as a byte offset in the tensor's output window;
      for a band of output-row pieces, where its first piece goes. What the ledger records follows it.
    * write(fd, data, offset) -> bytes that arrived: each write of the output; None: pwrite (the pieces of a
      band in one call of the compiled kernel, when built)."""

    read: Callable[[int, memoryview, int], int] = _preadv
    transpose: Callable[[Any, Any, int, int, int, int, int], None] | None = None
    place: Callable[[str, int], int] = _same_place
    write: Callable[[int, memoryview, int], int] | None = None


class Move(NamedTuple):
    """One target tensor: `nbytes` from `src_offset` in the source to `dst_offset` in the output (absolute);
    `matrix` = (rows, cols) of the source when it is written transposed. A named tuple: a pass makes one per
    tensor, through `move` (tuple.__new__, no Python frame), at a sixth of a frozen dataclass's cost."""

    name: str
    src_offset: int
    nbytes: int
    dst_offset: int
    itemsize: int = 1
    matrix: tuple[int, int] | None = None
    check: Callable[[Buffer], None] | None = None  # e.g. bool values must be 0 or 1
    # a piece of a target tensor made of several (planned.Joined): where it starts in the tensor and the
    # tensor's whole size; the ledger keeps one window per tensor, the pieces' writes tiling it together
    piece_at: int = 0
    tensor_nbytes: int | None = None


# move((name, src_offset, nbytes, dst_offset, itemsize, matrix, check, piece_at, tensor_nbytes)): all nine
move = functools.partial(tuple.__new__, Move)


def aligned(size: int) -> memoryview:
    """A page-aligned buffer of `size` bytes, every one of which its user writes: an anonymous mapping, its
    pages made at once where the system allows (_populated). (Not numpy: a conversion without
    transposes never imports it, which saves a tenth of a second of start-up.)"""
    populated = _populated(max(size, 1))
    if populated is None:
        populated = memoryview(mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))
    return populated[:size]


def _populated(size: int) -> memoryview | None:
    """`size` bytes of fresh pages, all made by the mapping call (MAP_POPULATE) rather than one fault at a time
    as they are first written (96 MiB: 0.05 s against 0.10-0.15 s faulted in by the strip's reads, on this VM),
    unmapped when the last view of them goes; None where the system does not have it. The call goes through
    ctypes, which releases the GIL: Python's mmap holds it meanwhile, stalling every writer."""
    libc, populate = _libc(), getattr(mmap, "MAP_POPULATE", 0)
    if libc is None or not populate:
        return None
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate
    address = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if address is None or address == ctypes.c_void_p(-1).value:  # (MAP_FAILED)
        return None
    pages = (ctypes.c_char * size).from_address(address)
    # not at exit: a daemon thread may still be in a pass then, and the process's end unmaps it all anyway
    weakref.finalize(pages, libc.munmap, address, size).atexit = False
    return memoryview(pages).cast("B")


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library's mmap and munmap, typed; None where there is none to load."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mapping, unmapping = libc.mmap, libc.munmap
    except (OSError, AttributeError):
        return None
    mapping.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    mapping.restype = ctypes.c_void_p
    unmapping.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    unmapping.restype = ctypes.c_int
    return libc


class _Slot:
    """Two reusable aligned buffers: what was read (up to SLOT_BYTES) and a band of its transpose (up to
    BAND_BYTES). Grown on demand."""

    def __init__(self) -> None:
        self._src = aligned(0)
        self._out = aligned(0)

    def src(self, size: int) -> memoryview:
        if len(self._src) < size:
            self._src = aligned(size)
        return self._src[:size]

    def out(self, size: int) -> memoryview:
        if len(self._out) < size:
            self._out = aligned(size)
        return self._out[:size]


class _Strip:
    """A block of a tensor larger than a slot in the strip buffer, shared by `parts` jobs: source rows
    first:first+count (a strip), or every source row's piece of columns first:first+count (a column group,
    `nbytes` long). Each part reads its share of the rows, waits until every share is read, then transposes its
    share of the columns. The last to finish gives the buffer back.

    `hashed` jobs of the read for the hash fill it instead (a tensor's first column group): its parts then read
    nothing and wait for those jobs as well. A column group's buffer is laid out in bands of `band` columns,
    each band's rows end to end (kernels.pread_pieces): each band a matrix of its own, transposed whole."""

    def __init__(
        self,
        buffer: memoryview,
        move: Move,
        first: int,
        count: int,
        parts: int,
        nbytes: int,
        hashed: int = 0,
        band: int = 0,
    ) -> None:
        self.whole = buffer  # the strip buffer, given back as it was taken
        self.buffer = buffer[:nbytes]
        self.move = move
        self.first, self.count = first, count
        self.parts = parts
        self.hashed = hashed
        self.band = band
        self.fillers = parts + hashed  # jobs that put rows into the buffer (the parts count, having read nothing)
        self.read = 0  # fillers whose rows are in the buffer (guarded by OnePass._turn)
        self.left = parts  # parts not finished
        self.lock = threading.Lock()

    def share(self, part: int, total: int) -> tuple[int, int]:
        """Part `part`'s share of `total` rows or columns."""
        return total * part // self.parts, total * (part + 1) // self.parts

    def leave(self, free: queue.Queue[memoryview]) -> None:
        with self.lock:
            self.left -= 1
            last = self.left == 0
        if last:
            free.put(self.whole)


class _Bound:
    """The two reads of a tensor taken by columns: the one in file order that feeds the hash, and the one by
    column groups that is converted. Each gives the checksum of every row's piece of every group
    (kernels.piece_sums, seeded afresh per tensor): the first as it is read, the second from the bands as
    placed, band by band (`add`); the last of them to finish compares the two sets. A source
    rewritten between the reads (which its timestamps may not show: a writer through mmap, a network file
    system's cached attributes) fails the pass as a changed source: the output never holds bytes other than the
    ones hashed."""

    def __init__(self, rows: int, groups: int, piece: int, contributors: int) -> None:
        self.groups, self.piece = groups, piece  # piece: the bytes of a row's piece of a group (the last: less)
        self.seed = _seed()
        self.hashed = bytearray(rows * groups * 8)
        self.converted = bytearray(rows * groups * 8)
        self.left = contributors
        self.lock = threading.Lock()

    def add(self, band: memoryview, rows: int, row_bytes: int, at: int) -> None:
        """A band of a column group as placed in the strip buffer (rows of row_bytes end to end, from byte `at`
        of the tensor's rows on) added to its group's converted sums: summed from where the transpose takes
        it, a piece read or placed wrong is caught as well as a changed source. Parts add in turn."""
        from syncd.engine.write import kernels

        group, within = divmod(at, self.piece)
        sums = memoryview(self.converted)[group * 8 :]
        with self.lock:
            kernels.piece_sums(
                band, rows, row_bytes, row_bytes, row_bytes, self.seed, sums, self.groups, within // 4, True
            )

    def done(self, path: str) -> None:
        with self.lock:
            self.left -= 1
            last = self.left == 0
        if last and self.hashed != self.converted:
            raise source_changed(path)


class _Writeback:
    """Starts the kernel's writeback of what was written so far, every WRITEBACK_BYTES, without waiting for
    it (sync_file_range SYNC_FILE_RANGE_WRITE): the disk writes overlap the conversion instead of all waiting
    for the fsync before publishing. Where the call is unavailable it does nothing; the fsync still decides.

    Only the span of whole blocks written since the last call is handed over, not the whole file: the kernel
    walks every page of the range it is given (on the 2 GiB case, whole-file calls were 17% of the CPU), and
    the output-row pieces of a tensor written in strips are not counted: they are left to the fsync, since a
    page written back before its other pieces arrive is written again. (Bands of whole output rows are
    counted, strips' whole ones and column groups' alike.)"""

    SYNC_FILE_RANGE_WRITE = 2

    def __init__(self, fd: int, every: int) -> None:
        self.fd = fd
        self.every = every
        self.pending = 0
        self.low, self.high = -1, 0  # the span of the blocks written since the last call
        self.lock = threading.Lock()
        self.call = _sync_file_range()

    def wrote(self, offset: int, nbytes: int) -> None:
        if self.call is None:
            return
        with self.lock:
            self.pending += nbytes
            self.low = offset if self.low < 0 else min(self.low, offset)
            self.high = max(self.high, offset + nbytes)
            if self.pending < self.every:
                return
            low, high = self.low, self.high
            self.pending, self.low, self.high = 0, -1, 0
        self.call(self.fd, low, high - low, self.SYNC_FILE_RANGE_WRITE)  # returns once the writes are queued


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


class _Abandoned(FormatError):
    """A job that gave up because another failed: not the failure to report."""


def _raise_first(futures: list[Future[None]]) -> None:
    """Raise the first failure in file order, a job's own rather than one that gave up because of it."""
    failures = [f.exception() for f in futures if f.exception() is not None]
    for failure in sorted(failures, key=lambda e: isinstance(e, _Abandoned)):  # (a stable sort)
        raise failure  # type: ignore[misc]


_SRC_OFFSET = attrgetter("src_offset")  # (the key of every move, in C)
_MATRIX, _NBYTES = attrgetter("matrix"), attrgetter("nbytes")


def _runs(moves: list[Move]) -> Iterator[list[Move]]:
    """`moves` (in source order) in runs, each lying end to end in both the source and the output."""
    run: list[Move] = []
    src_end = dst_end = -1  # where the run's last move ends, in the source and in the output
    for move in moves:
        _, src, nbytes, dst, _, _, _, _, _ = move
        if run and (src != src_end or dst != dst_end):
            yield run
            run = []
        run.append(move)
        src_end, dst_end = src + nbytes, dst + nbytes
    if run:
        yield run


# Threads of one pass, at most: a pass is bound by memory bandwidth and the disk well before this, and on a
# machine of a hundred cores more threads would only take tasks from a unit's TasksMax (each of the daemon's
# workers runs its own pass).
MAX_PASS_THREADS = 8


def default_workers() -> int:
    """The cores this process may run on (taskset and cgroups included), up to MAX_PASS_THREADS."""
    return max(1, min(MAX_PASS_THREADS, len(os.sched_getaffinity(0))))


@dataclass
class OnePass:
    """Reads `src_fd` once from 0 to `src_size`, writes every move into `out_fd`; `run()` returns the source
    hash. Make one per source file: a set's passes share one `hasher`, fed the files in turn."""

    src_fd: int
    src_size: int
    src_path: str
    out_fd: int
    out_path: str
    moves: list[Move]
    hash_name: str = DEFAULT_HASH
    workers: int = field(default_factory=default_workers)
    ring_bytes: int = RING_BYTES
    slot_bytes: int = SLOT_BYTES
    block_bytes: int = BLOCK_BYTES
    band_bytes: int = BAND_BYTES
    strip_bytes: int = STRIP_BYTES
    inline_bytes: int = INLINE_BYTES
    # a pass of small untransformed tensors only (all in batches) runs on the calling thread whatever its size:
    # each job is a Python loop over its tensors, which threads would only take turns at (no faster measured:
    # 40 MiB of 4 KiB tensors 29 ms inline against 30 ms, 200 MiB of 1 MiB tensors 45 ms against 51 ms)
    inline_small: bool = True
    min_column_piece: int = MIN_COLUMN_PIECE
    ledger: WriteLedger = field(default_factory=WriteLedger)
    progress: Callable[[int], None] | None = None  # told the bytes of each write as it lands
    hasher: Hasher | None = None  # default: a new one of hash_name; given: this file's bytes follow what it had
    # only [window[0], window[1]) of the source is read (the part one shard of an output set takes); what is
    # hashed is then not the file
    window: tuple[int, int] | None = None
    seam: Seam = field(default_factory=Seam)

    def __post_init__(self) -> None:
        self._hasher: Hasher = self.hasher if self.hasher is not None else new_hasher(self.hash_name)
        slots = max(2, min(self.workers + 2, self.ring_bytes // (self.slot_bytes + self.band_bytes)))
        self._free: queue.Queue[_Slot] = queue.Queue()
        for _ in range(slots):
            self._free.put(_Slot())
        self._slots = slots
        self._strips: queue.Queue[memoryview] = queue.Queue()  # the strip buffer, made when a tensor needs it
        self._strip_buffer: memoryview | None = None
        self._inline = (
            self.workers == 1 or self.src_size <= self.inline_bytes or (self.inline_small and self._small_only())
        )
        self._write_lock = threading.Lock()
        self._turn = threading.Condition()  # guards _hashed_to and _aborted
        self._hashed_to = 0  # every source byte before this offset has been hashed
        self._aborted = False
        self._writeback = _Writeback(self.out_fd, WRITEBACK_BYTES)

    def _small_only(self) -> bool:
        """Every move a tensor under a block, untransformed: all go in batches (_all_jobs). Checked in C."""
        matrices = list(map(_MATRIX, self.moves))
        return matrices.count(None) == len(matrices) and max(map(_NBYTES, self.moves), default=0) < self.block_bytes

    # -- the reading thread

    def run(self) -> str:
        """Convert; the source hash of the bytes converted. The source must not change meanwhile."""
        stamp = FileStamp.of_fd(self.src_fd)
        if stamp.size != self.src_size:
            raise source_changed(self.src_path)
        digest = self._run()
        stamp.check_unchanged(FileStamp.of_fd(self.src_fd), self.src_path)
        return digest

    def _run(self) -> str:
        self.ledger.expect_all(
            (name, (dst - at, nbytes if whole is None else whole))
            for name, _, nbytes, dst, _, _, _, at, whole in self.moves
        )
        if self._inline:
            # small files (the daemon's common case) and one core: no threads to start or hand work to
            for job in self._all_jobs():
                job[0](*job[1:])
            return self._hasher.hexdigest()
        from concurrent.futures import ThreadPoolExecutor  # here: a pass run inline starts no threads

        futures: list[Future[None]] = []
        with ThreadPoolExecutor(self.workers, thread_name_prefix="syncd-pass") as pool:
            try:
                for job in self._all_jobs():
                    futures.append(pool.submit(self._guarded, *job))
                    if self._aborted:  # a job failed: hand out no more (the reader would go on to the end)
                        break
            except BaseException:
                self._abort()
                raise
            finally:
                for future in futures:  # wait for every job
                    future.exception()
        _raise_first(futures)
        return self._hasher.hexdigest()

    def _all_jobs(self) -> Iterator[tuple]:
        """The whole source in file order as jobs, each holding a slot (taken here, so memory stays within
        the ring and jobs start in file order): what is converted, and between it what is only hashed.
        Runs of small untransformed tensors go as one job (one read for all of them): a job costs more than
        copying a 4 KiB tensor."""
        cursor, end = self.window or (0, self.src_size)
        batch_start = self._hashed_to = cursor
        batch: list[Move] = []
        block = self.block_bytes
        for move in sorted(self.moves, key=_SRC_OFFSET):
            name, offset, nbytes, _, _, matrix, _, piece_at, _ = move  # (one unpacking: a getter call per field)
            if not nbytes:  # an empty tensor takes no byte of the source, wherever its offsets put it
                self.ledger.record(name, Entry(piece_at, 0))
                continue
            if offset < cursor:
                raise FormatError(f"tensor '{name}' overlaps another in the source", self.src_path)
            small = matrix is None and 0 < nbytes < block
            if batch and (not small or offset + nbytes - batch_start > block):
                yield self._copy_batch, self._free.get(), batch_start, cursor, batch
                batch = []
            if not batch and offset > cursor:
                yield self._hash_only, self._free.get(), cursor, offset
            if small:
                if not batch:
                    batch_start = offset
                batch.append(move)
            else:
                yield from self._jobs(move)
            cursor = offset + nbytes
        if batch:
            yield self._copy_batch, self._free.get(), batch_start, cursor, batch
        if end > cursor:
            yield self._hash_only, self._free.get(), cursor, end

    def _guarded(self, job: Callable[..., None], *args: object) -> None:
        try:
            job(*args)
        except BaseException:
            self._abort()
            raise

    def _abort(self) -> None:
        with self._turn:
            self._aborted = True
            self._turn.notify_all()

    def _read(self, buf: memoryview, offset: int) -> memoryview:
        """Fill `buf` from the source at `offset`, a block at a time, and feed the hash in file order.

        Jobs read in parallel; the hash takes the bytes in file order. A block read when every byte before
        it has been hashed is hashed at once, while in cache; otherwise the job reads the rest of its
        region and then waits for its turn. Jobs start in file order, so the one whose turn it is never
        waits for a later one."""
        deferred: list[memoryview] = []
        for start in range(0, len(buf), self.block_bytes):
            piece = buf[start : start + self.block_bytes]
            self._pread(piece, offset + start)
            if not deferred and self._hashed_to == offset + start:
                self._hash(piece)
            else:
                deferred.append(piece)
        if deferred:
            first = offset + len(buf) - sum(len(p) for p in deferred)
            with self._turn:
                self._turn.wait_for(lambda: self._hashed_to == first or self._aborted)
                if self._aborted:
                    raise _Abandoned("conversion abandoned", self.src_path)
            for piece in deferred:
                self._hash(piece)
        return buf

    def _hash(self, piece: memoryview) -> None:
        """Only the job whose turn it is gets here: no other thread touches the hasher meanwhile."""
        self._hasher.update(piece)
        with self._turn:
            self._hashed_to += len(piece)
            self._turn.notify_all()

    def _pread(self, piece: memoryview, offset: int) -> None:
        done = 0
        while done < len(piece):
            try:
                n = self.seam.read(self.src_fd, piece[done:], offset + done)
            except OSError as exc:
                raise FormatError(f"cannot read: {exc.strerror}", self.src_path) from None
            if n == 0:
                raise source_changed(self.src_path, "truncated")  # it held these bytes when opened
            done += n

    def _hash_only(self, slot: _Slot, start: int, end: int) -> None:
        """Headers, padding, tensors not converted: read and hashed, not written."""
        try:
            for offset in range(start, end, self.block_bytes):
                self._read(slot.src(min(self.block_bytes, end - offset)), offset)
        finally:
            self._free.put(slot)

    def _jobs(self, move: Move) -> Iterator[tuple]:
        """The move as jobs of at most a slot each, or the parts of its strips: (function, slot, ...)."""
        if move.nbytes == 0:
            self.ledger.record(move.name, Entry(move.piece_at, 0))
            return
        if move.matrix is None or min(move.matrix) == 1:  # a vector's transpose is the same bytes
            for rel in range(0, move.nbytes, self.block_bytes):
                yield self._copy_block, self._free.get(), move, rel, min(self.block_bytes, move.nbytes - rel)
            return
        rows, cols = move.matrix
        if self._whole(move):
            yield self._transpose_whole, self._free.get(), move
            return
        width = self._column_width(move)
        if width:
            yield from self._column_jobs(move, width)
            return
        row_bytes = cols * move.itemsize
        if row_bytes > self.strip_bytes:
            raise FormatError(
                f"tensor '{move.name}' has rows of {row_bytes} bytes, more than the {self.strip_bytes} a "
                "transposing strip may hold",
                self.src_path,
            )
        height = self._strip_height(move)
        parts = self._parts()
        for r0 in range(0, rows, height):
            n = min(height, rows - r0)
            strip = _Strip(self._strip(n * row_bytes), move, r0, n, parts, n * row_bytes)
            for part in range(parts):
                yield self._strip_part, self._free.get(), strip, part

    def _whole(self, move: Move) -> bool:
        """A transposed `move` read whole into a slot, its output rows a band at most."""
        rows = move.matrix[0]  # type: ignore[index]
        return move.nbytes <= self.slot_bytes and rows * move.itemsize <= self.band_bytes

    def _strip_height(self, move: Move) -> int:
        """Source rows per strip of a `move` taken in strips."""
        # output-row pieces of at most a band: a narrow matrix ([N, 2]) must not grow the band buffers
        row_bytes = move.matrix[1] * move.itemsize  # type: ignore[index]
        return max(1, min(self.strip_bytes // row_bytes, self.band_bytes // move.itemsize))

    def _strip_need(self, move: Move) -> int:
        """The bytes of the strip buffer the largest block of `move` takes: 0 for a move that takes none."""
        if move.nbytes == 0 or move.matrix is None or min(move.matrix) == 1 or self._whole(move):
            return 0
        rows, cols = move.matrix
        width = self._column_width(move)
        if width:
            return rows * width * move.itemsize
        if cols * move.itemsize > self.strip_bytes:
            return 0  # refused when its jobs are made (_jobs)
        return min(rows, self._strip_height(move)) * cols * move.itemsize

    def _parts(self) -> int:
        """Jobs per block of the strip buffer: every part must be running at once (each waits for the others'
        rows), so no more than writer threads or slots."""
        return 1 if self._inline else max(1, min(self.workers, self._slots))

    def _column_width(self, move: Move) -> int:
        """The columns per group when `move` is best taken by columns, else 0.

        A tensor larger than the strip buffer, taken in strips of rows, writes each output row in pieces of the
        strip's height, and small scattered writes cost the kernel twice what whole ones do (page-cache work per
        write and per page, measured: 1 s of system time per GiB against 0.5). Taken by groups of columns
        instead, every source row gives the group a piece (reads, which cost the kernel little), and the group's
        output rows are whole and lie end to end: one long write each band. The bytes are read twice then (in
        file order for the hash, by groups for the conversion), bound by checksums (_Bound)."""
        from syncd.engine.write import kernels

        rows, cols = move.matrix  # type: ignore[misc]
        item, row_bytes = move.itemsize, cols * move.itemsize
        if not kernels.BY_COLUMNS:
            return 0
        if move.nbytes <= self.strip_bytes or row_bytes % 8 or row_bytes > self.slot_bytes:
            return 0  # one strip holds it (its output rows are whole), or rows no checksum or slot can take
        if rows * item > self.band_bytes:
            return 0  # output rows longer than a band: strips write them in band-sized pieces
        width = self.strip_bytes // (rows * item)
        width -= width % (8 // math.gcd(item, 8))  # pieces of whole 8-byte words, for the checksums
        groups = -(-cols // width) if width else 0
        if width * item < self.min_column_piece or width >= cols or 2 * rows * groups * 8 > SUMS_BYTES:
            return 0
        return width

    def _column_jobs(self, move: Move, width: int) -> Iterator[tuple]:
        """The tensor's bytes read in file order for the hash, in jobs of whole rows up to a block or of one row
        (read in parallel, checksummed in cache, hashed in turn), then converted group of columns by group.

        The first group is taken from the read for the hash, as it goes (its pieces copied into the strip buffer
        while in cache): it is not read a second time, which saves a pread per row and group (the heads case,
        3 groups of [32000, 4096] BF16: a third of the second read)."""
        rows, cols = move.matrix  # type: ignore[misc]
        parts = self._parts()
        groups = -(-cols // width)
        per = max(1, self.block_bytes // (cols * move.itemsize))  # (_column_width: a row fits a slot)
        jobs = -(-rows // per)
        bound = _Bound(rows, groups, width * move.itemsize, jobs + groups * parts)
        item = move.itemsize
        # bands of whole 8-byte words, each summed on its own (_Bound.add); _transpose_columns cuts its output
        words = 8 // math.gcd(item, 8)
        band = max(words, self.band_bytes // (rows * item) // words * words)
        first = _Strip(self._strip(rows * width * item), move, 0, width, parts, rows * width * item, jobs, band)
        for r0 in range(0, rows, per):
            yield self._hash_rows, self._free.get(), move, bound, r0, min(rows, r0 + per), first
        for c0 in range(0, cols, width):
            n = min(width, cols - c0)
            strip = self._strip(rows * n * item) if c0 else first.whole
            group = first if c0 == 0 else _Strip(strip, move, c0, n, parts, rows * n * item, band=band)
            for part in range(parts):
                yield self._column_part, self._free.get(), group, part, bound

    def _strip(self, nbytes: int) -> memoryview:
        """The strip buffer, once the previous strip is done with it, for a block of `nbytes`. Made on first use
        (a model without large transposed tensors never touches it), as large as the largest block of the pass:
        its pages are made at once (aligned), so none it would not use."""
        if self._strip_buffer is None:
            self._strip_buffer = aligned(max(self._strip_need(move) for move in self.moves))
            self._strips.put(self._strip_buffer)
        if nbytes > len(self._strip_buffer):
            raise AssertionError(f"a strip of {nbytes} bytes in a strip buffer of {len(self._strip_buffer)}")
        return self._strips.get()

    # -- the writing threads

    def _hash_rows(self, slot: _Slot, move: Move, bound: _Bound, r0: int, r1: int, first: _Strip) -> None:
        """Rows r0:r1 of a tensor taken by columns, read in file order for the hash, and the checksums of their
        pieces; nothing is written from this read, but their pieces of the `first` column group go to the strip
        buffer (summed there like every group's, as placed: what that group converts is what was hashed)."""
        from syncd.engine.write import kernels

        rows, cols = move.matrix  # type: ignore[misc]
        row_bytes = cols * move.itemsize
        piece, sums = bound.piece, memoryview(bound.hashed)[r0 * bound.groups * 8 :]
        try:
            data = self._read(slot.src((r1 - r0) * row_bytes), move.src_offset + r0 * row_bytes)
            kernels.piece_sums(data, r1 - r0, row_bytes, row_bytes, piece, bound.seed, sums, bound.groups, 0, False)
            kernels.copy_pieces(data, first.buffer, r1 - r0, piece, row_bytes, r0, rows, first.band * move.itemsize)
        finally:
            self._free.put(slot)
        self._filled(first)
        bound.done(self.src_path)

    def _column_part(self, slot: _Slot, group: _Strip, part: int, bound: _Bound) -> None:
        """Part `part` of a column group: read its share of the rows' pieces, wait for the other parts' pieces,
        then take its share of the group's bands: each summed as placed (the sums bound to the hashed read's),
        then transposed into whole output rows while in cache."""
        try:
            move = group.move
            rows, cols = move.matrix  # type: ignore[misc]
            item = move.itemsize
            lo, hi = group.share(part, rows)
            if hi > lo and not group.hashed:
                self._read_pieces(group, lo, hi, move.src_offset + (lo * cols + group.first) * item, cols * item)
            self._wait_for_parts(group)
            b0, b1 = group.share(part, -(-group.count // group.band))
            for first in range(b0 * group.band, min(b1 * group.band, group.count), group.band):
                n = min(group.band, group.count - first)  # a band: its own [rows, n] matrix
                block = group.buffer[rows * first * item : rows * (first + n) * item]
                bound.add(block, rows, n * item, (group.first + first) * item)
                self._transpose_columns(slot, move, block, 0, rows, 0, n, n, group.first + first)
        finally:
            self._free.put(slot)
            group.leave(self._strips)
        bound.done(self.src_path)

    def _read_pieces(self, group: _Strip, lo: int, hi: int, offset: int, stride: int) -> None:
        """Rows lo:hi's pieces of the group, from `offset` on, `stride` apart, into its bands (not hashed:
        _hash_rows hashes these bytes): one call of the compiled kernel, a pread per piece, unless a test stands
        in the seam's reads (each piece then read through it, placed by copy_pieces).

        Wide groups were read by whole rows, a block at a time, and their pieces copied out, while placing a
        piece in its bands cost a copy per band: a Llama lm_head's group ([32000, 4096] BF16, 3 KiB of each 8 KiB
        row) took 59 ms by pieces against 42 ms by rows. Once pieces were placed by tiles, pieces took 45 ms
        against 49 ms, and 36 ms against 76 ms at a sixth of the row ([16384, 8192] F32), and whole rows read
        the whole tensor again for every group: 2.25 GiB read for 1 GiB of [8192, 8192] F32 Linears, 1.63 GiB
        by pieces."""
        from syncd.engine.write import kernels

        rows, count, item = group.move.matrix[0], hi - lo, group.move.itemsize  # type: ignore[index]
        segment, chunk = group.count * item, group.band * item
        if self.seam.read is not _preadv:
            piece = memoryview(bytearray(segment))
            for k in range(count):
                self._pread(piece, offset + k * stride)
                kernels.copy_pieces(piece, group.buffer, 1, segment, segment, lo + k, rows, chunk)
            return
        try:
            done = kernels.pread_pieces(self.src_fd, group.buffer, count, segment, offset, stride, lo, rows, chunk)
        except OSError as exc:
            raise FormatError(f"cannot read: {exc.strerror}", self.src_path) from None
        if done < count * segment:
            raise source_changed(self.src_path, "truncated")  # it held these bytes when opened

    def _filled(self, strip: _Strip) -> None:
        """A job's rows are in the strip buffer."""
        with self._turn:
            strip.read += 1
            self._turn.notify_all()

    def _wait_for_parts(self, strip: _Strip) -> None:
        self._filled(strip)
        with self._turn:
            self._turn.wait_for(lambda: strip.read == strip.fillers or self._aborted)
            if self._aborted:
                raise _Abandoned("conversion abandoned", self.src_path)

    def _copy_block(self, slot: _Slot, move: Move, rel: int, n: int) -> None:
        try:
            data = self._read(slot.src(n), move.src_offset + rel)
            if move.check is not None:
                move.check(data)
            self._write(move, data, rel)
        finally:
            self._free.put(slot)

    def _copy_batch(self, slot: _Slot, start: int, end: int, moves: list[Move]) -> None:
        """Small untransformed tensors lying in [start, end) of the source: one read (gaps included, for the
        hash), then each run of them that lies end to end in the source and in the output written at once
        (tensors saved in the same order, as they commonly are: one pwrite for hundreds of tensors)."""
        try:
            data = self._read(slot.src(end - start), start)
            for run in _runs(moves):
                for move in run:
                    if move.check is not None:
                        move.check(data[move.src_offset - start : move.src_offset - start + move.nbytes])
                first, last = run[0], run[-1]
                self._write_run(run, data[first.src_offset - start : last.src_offset + last.nbytes - start])
        finally:
            self._free.put(slot)

    def _write_run(self, run: list[Move], data: memoryview) -> None:
        """Whole tensors lying end to end in `data` and in the output: one write, recorded as one run (the
        ledger works out each tensor's entry at the check; a digest per tensor only for the audit)."""
        first = run[0]
        shift = self.seam.place(first.name, first.piece_at) - first.piece_at
        written = self._pwrite(data, first.dst_offset + shift)
        self._writeback.wrote(first.dst_offset + shift, written)
        digests = None
        if self.ledger.digests:  # each tensor's bytes as they were handed to the write
            starts = [m.dst_offset - first.dst_offset for m in run]
            digests = [block_digest(data[at : min(at + m.nbytes, written)]) for at, m in zip(starts, run, strict=True)]
        self.ledger.record_run(Run(run, shift, written, digests))

    def _transpose_whole(self, slot: _Slot, move: Move) -> None:
        """A tensor up to a slot: read whole, its output rows written whole, a band at a time."""
        try:
            rows, cols = move.matrix  # type: ignore[misc]
            src = self._read(slot.src(move.nbytes), move.src_offset)
            self._transpose_columns(slot, move, src, 0, rows, 0, cols, cols, 0)
        finally:
            self._free.put(slot)

    def _strip_part(self, slot: _Slot, strip: _Strip, part: int) -> None:
        """Part `part` of a strip: read its share of the rows, wait for the other parts' rows, transpose its
        share of the columns."""
        try:
            move = strip.move
            cols = move.matrix[1]  # type: ignore[index]
            row_bytes = cols * move.itemsize
            lo, hi = strip.share(part, strip.count)
            if hi > lo:
                start = move.src_offset + (strip.first + lo) * row_bytes
                self._read(strip.buffer[lo * row_bytes : hi * row_bytes], start)
            self._wait_for_parts(strip)
            c0, c1 = strip.share(part, cols)
            self._transpose_columns(slot, move, strip.buffer, strip.first, strip.count, c0, c1, cols, 0)
        finally:
            self._free.put(slot)
            strip.leave(self._strips)

    def _transpose_columns(
        self, slot: _Slot, move: Move, src: memoryview, r0: int, n: int, c0: int, c1: int, width: int, shift: int
    ) -> None:
        """`src` holds n source rows from row r0 on, `width` columns each, from column `shift` on; its columns
        c0:c1 become output rows shift+c0:shift+c1 from column r0 on, a band of output rows at a time: each
        band is transposed, checked, hashed and written while it is in cache (a transposed buffer larger than
        the cache costs three times as much to write, measured). Byte buffers throughout: with the compiled
        kernel no numpy is needed (syncd.engine.write.kernels)."""
        from syncd.engine.write import kernels

        rows = move.matrix[0]  # type: ignore[index]
        item = move.itemsize
        transpose = self.seam.transpose or kernels.transpose_band
        band = max(1, self.band_bytes // (n * item))
        for first in range(c0, c1, band):
            count = min(band, c1 - first)
            out = slot.out(count * n * item)
            transpose(src, out, n, width, item, first, count)
            if not kernels.band_matches(src, out, n, width, item, first, count, _seed()):
                raise VerificationError(
                    f"tensor '{move.name}': a transposed block does not match its source", self.out_path
                )
            if n == rows:
                self._write(move, out, (shift + first) * rows * item)
            else:
                self._write_pieces(move, out, r0, shift + first, count)

    def _write(self, move: Move, data: memoryview, rel: int) -> None:
        rel = self.seam.place(move.name, move.piece_at + rel) - move.piece_at
        written = self._pwrite(data, move.dst_offset + rel)
        self._writeback.wrote(move.dst_offset + rel, written)  # (the pieces of _write_pieces are not)
        self.ledger.record(move.name, Entry(move.piece_at + rel, written, digest=self._digest(data[:written])))

    def _write_pieces(self, move: Move, out: memoryview, r0: int, c0: int, count: int) -> None:
        """`out` holds `count` pieces of output rows c0, c0+1, ..., each from column r0 on."""
        from syncd.engine.write import kernels

        rows = move.matrix[0]  # type: ignore[index]
        segment = len(out) // count
        stride = rows * move.itemsize
        first = self.seam.place(move.name, move.piece_at + c0 * stride + r0 * move.itemsize) - move.piece_at
        if self.seam.write is None:
            with self._write_lock:
                written = kernels.pwrite_pieces(self.out_fd, out, count, segment, move.dst_offset + first, stride)
            whole = written == len(out)
        else:
            whole = all(
                self.seam.write(self.out_fd, out[k * segment : (k + 1) * segment], move.dst_offset + first + k * stride)
                == segment
                for k in range(count)
            )
        if self.progress is not None:
            self.progress(len(out))
        entry = Entry(move.piece_at + first, segment if whole else -1, count, stride, self._digest(out))
        self.ledger.record(move.name, entry)

    def _digest(self, data: memoryview) -> int:
        """A write's digest, for the audit alone (planned.check_digests): 0 when the ledger keeps none. Taken
        over every byte written, it cost 0.03-0.04 s of CPU on a 500 MiB conversion, holding the GIL."""
        return block_digest(data) if self.ledger.digests else 0

    def _pwrite(self, data: Any, offset: int) -> int:
        """Write all of `data` at `offset`; the byte count that arrived (what the ledger records)."""
        view = memoryview(data).cast("B")
        if self.seam.write is not None:
            written = self.seam.write(self.out_fd, view, offset)
        else:
            with self._write_lock:  # the kernel serialises writes to one file anyway; waiting here sleeps, not spins
                pwrite_all(self.out_fd, view, offset)
            written = len(view)
        if self.progress is not None:
            self.progress(written)
        return written
