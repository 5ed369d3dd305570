"""Writing a planned output in one pass over its source, and checking it.

A converter plans the output (header bytes, where each tensor goes) as usual; tensors that come from the
source are given a `FromSource` fill. `write_planned` writes the header, the zero padding and the small
tensors that come from elsewhere (carried in metadata) directly, and hands every `FromSource` tensor to one
`OnePass` over the source, which returns the source hash. A sharded source set is one pass per shard in the
index's order, all feeding one hash after the index's bytes; a shard of an output set reads only the part of
the source its tensors lie in. `check_written` is the check without read-back:
the output's header and table are re-read and the ledger of writes must tile it exactly. `verify_full` is the
audit (`--verify full`): every tensor of the output re-read and compared with its source.

A fill may also name a row range of its source (`FromSource.rows`: a piece of a PyTorch packed tensor going to
Burn) or be `Joined`: an output tensor made of pieces, each (its byte offset within the output tensor, a source
tensor, transposed or not), Burn's separate Linears going back into PyTorch's packed tensor
(docs/burn-adapters.md#packed-modules). Each piece is one Move; the ledger keeps one window per output tensor, which its
pieces' writes tile.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from operator import attrgetter, itemgetter
from typing import Any, NamedTuple

from syncd.engine.hashing import DEFAULT_HASH, block_digest, new_hasher
from syncd.engine.write.checks import Entry, WriteLedger
from syncd.engine.write.onepass import Move, OnePass, default_workers, move
from syncd.errors import FormatError, VerificationError
from syncd.formats.dtypes import BOOL_DTYPES, ITEMSIZE
from syncd.formats.fileio import TensorFileReader, TensorSink, bool_checker, pwrite_all, write_zeros
from syncd.formats.table import TensorSpec

VERIFY_CHOICES = ("fast", "full")


class FromSource(NamedTuple):
    """A TensorSpec fill naming the source tensor it comes from; `transpose`: written as its 2-D transpose;
    `rows`: only rows r0:r1 of its first dimension (a piece of a PyTorch packed tensor), which in a
    C-contiguous tensor are one contiguous byte range. A named tuple: a conversion makes one per tensor,
    through `from_source` (tuple.__new__, no Python frame)."""

    reader: TensorFileReader
    name: str
    transpose: bool = False
    rows: tuple[int, int] | None = None

    def __call__(self, sink: TensorSink) -> None:
        raise TypeError(f"tensor '{self.name}' is written by write_planned, in one pass over its source")

    def window(self) -> tuple[int, int, tuple[int, ...]]:
        """(absolute offset in the source file, byte length, shape) of what is moved."""
        info = self.reader.tensor(self.name)
        if self.rows is None:  # (most fills)
            return info.offset, info.nbytes, info.shape
        r0, r1 = self.rows
        if not info.shape or not 0 <= r0 <= r1 <= info.shape[0]:
            raise FormatError(f"tensor '{self.name}' {list(info.shape)} has no rows {r0}:{r1}", self.reader.path)
        row_bytes = info.nbytes // info.shape[0] if info.shape[0] else 0
        return info.offset + r0 * row_bytes, (r1 - r0) * row_bytes, (r1 - r0, *info.shape[1:])


# from_source((reader, name, transpose, rows)): all four
from_source = partial(tuple.__new__, FromSource)


@dataclass(frozen=True)
class Joined:
    """A TensorSpec fill: the output tensor is `pieces` laid end to end in order (Burn's separate Linears
    joined into a PyTorch packed tensor), each moved like any FromSource."""

    pieces: tuple[FromSource, ...]

    def __call__(self, sink: TensorSink) -> None:
        raise TypeError("a joined tensor is written by write_planned, in one pass over its source")

    def placed(self) -> list[tuple[FromSource, int]]:
        """Each piece with its byte offset within the output tensor."""
        placed, at = [], 0
        for piece in self.pieces:
            placed.append((piece, at))
            at += piece.window()[1]
        return placed


def source_pieces(fill: object) -> list[tuple[FromSource, int]]:
    """What a one-pass fill moves: (piece, byte offset within its output tensor); [] for other fills."""
    if isinstance(fill, FromSource):  # (most fills: tested first)
        return [(fill, 0)]
    return fill.placed() if isinstance(fill, Joined) else []


@dataclass
class Written:
    source_hash: str  # of every source file in turn (a set: its index's bytes first), as convert.source_digest
    ledger: WriteLedger


def write_planned(
    fd: int,
    path: str,
    header: bytes,
    file_size: int,
    placed: Sequence[tuple[TensorSpec, int]],
    readers: Sequence[TensorFileReader],
    hash_name: str = DEFAULT_HASH,
    workers: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    prefix: bytes = b"",
    part: bool = False,
    digests: bool = True,
) -> Written:
    """Write a whole output: `header` at 0, each (spec, absolute start) of `placed`, zeros in between.
    `FromSource` tensors may come from several files (the shards of a set, `readers` in the set's order): one
    pass over each in turn, every one of them feeding one hash, after `prefix` (a set's index). `part`: the
    output takes a part of the source (a shard of an output set): only the span of each file its tensors
    lie in is read, and no source hash is returned. `digests`: keep a digest of every small tensor written
    in a run, for the audit (check_digests); the checks of a fast verification do not read them."""
    os.ftruncate(fd, file_size)
    pwrite_all(fd, header, 0)
    ledger = WriteLedger(digests=digests)
    counted = _Progress(sum(spec.nbytes for spec, _ in placed), progress) if progress else None
    moves = _place(fd, placed, len(header), file_size, ledger, counted)
    hasher = new_hasher(hash_name)
    hasher.update(prefix)
    for source in readers:
        source_moves = moves.pop(source.path, [])
        if part and not source_moves:
            continue
        OnePass(
            source.fd,
            source.file_size,
            source.path,
            fd,
            path,
            source_moves,
            hash_name,
            workers or default_workers(),
            ledger=ledger,
            progress=counted.add if counted else None,
            hasher=hasher,
            window=_span(source_moves) if part else None,
        ).run()
    if moves:
        raise FormatError(f"tensors come from {sorted(moves)[0]}, not a file of the source", path)
    return Written("" if part else hasher.hexdigest(), ledger)


def _span(moves: Sequence[Move]) -> tuple[int, int]:
    """The part of a source file that `moves` read: from the first one's start to the last one's end."""
    return min(m.src_offset for m in moves), max(m.src_offset + m.nbytes for m in moves)


def _place(
    fd: int,
    placed: Sequence[tuple[TensorSpec, int]],
    cursor: int,
    file_size: int,
    ledger: WriteLedger,
    counted: _Progress | None,
) -> dict[str, list[Move]]:
    """Write the zero padding and the tensors that come from elsewhere; the moves of the rest, per source file."""
    moves: dict[str, list[Move]] = {}
    # the source file of the last move and its list: runs of tensors come from one file
    path: str | None = None
    into: list[Move] = []
    for spec, start in sorted(placed, key=itemgetter(1)):
        if start > cursor:
            write_zeros(fd, cursor, start - cursor)  # padding is zero bytes on disk, not a hole
        nbytes = spec.nbytes
        if start + nbytes > cursor:
            cursor = start + nbytes
        fill = spec.fill
        if isinstance(fill, FromSource) and fill.rows is None and not fill.transpose and spec.dtype not in BOOL_DTYPES:
            # (most tensors: one whole source tensor copied as it is; _move's first case without its frames)
            reader = fill.reader
            info = reader.tensor(fill.name)
            if info.nbytes != nbytes:
                raise FormatError(
                    f"tensor '{spec.name}' needs {nbytes} bytes, its source has {info.nbytes}", reader.path
                )
            if reader.path != path:
                path = reader.path
                into = moves.setdefault(path, [])
            into.append(move((spec.name, info.offset, nbytes, start, 1, None, None, 0, None)))
            continue
        pieces = source_pieces(fill)
        if pieces:
            for piece, at in pieces:
                moves.setdefault(piece.reader.path, []).append(_move(spec, start, piece, at, len(pieces) > 1))
        else:
            _write_small(fd, spec, start, ledger)
            if counted:
                counted.add(spec.nbytes)
    if file_size > cursor:
        write_zeros(fd, cursor, file_size - cursor)
    return moves


class _Progress:
    """Bytes written so far, reported as (done, total) to a progress callback (writers run in parallel)."""

    def __init__(self, total: int, callback: Callable[[int, int], None]) -> None:
        self.total = total
        self.done = 0
        self.callback = callback
        self.lock = threading.Lock()
        callback(0, total)

    def add(self, count: int) -> None:
        with self.lock:
            self.done += count
            self.callback(self.done, self.total)


def _move(spec: TensorSpec, start: int, fill: FromSource, at: int, joined: bool) -> Move:
    """The move of one piece landing `at` bytes into `spec`'s window (0 and not `joined`: the whole tensor)."""
    offset, nbytes, shape = fill.window()
    if (at + nbytes > spec.nbytes) if joined else (nbytes != spec.nbytes):
        raise FormatError(f"tensor '{spec.name}' needs {spec.nbytes} bytes, its source has {nbytes}", fill.reader.path)
    check = bool_checker(spec.dtype, spec.name, fill.reader.path) if spec.dtype in BOOL_DTYPES else None
    if not fill.transpose and not joined:  # (most tensors: copied whole)
        return move((spec.name, offset, nbytes, start, 1, None, check, 0, None))
    piece = {"piece_at": at, "tensor_nbytes": spec.nbytes} if joined else {}
    if not fill.transpose:  # copied as bytes: the element size does not matter (QFloat, sub-byte floats)
        return Move(spec.name, offset, nbytes, start + at, 1, None, check, **piece)
    dtype = fill.reader.tensor(fill.name).dtype
    expected = tuple(reversed(shape))
    fits = expected[1:] == tuple(spec.shape[1:]) if joined else expected == tuple(spec.shape)
    if len(shape) != 2 or not fits or dtype not in ITEMSIZE:
        raise FormatError(
            f"tensor '{fill.name}' ({dtype} {list(shape)}) cannot be written transposed as {list(spec.shape)}",
            fill.reader.path,
        )
    return Move(spec.name, offset, nbytes, start + at, ITEMSIZE[dtype], (shape[0], shape[1]), check, **piece)


def _write_small(fd: int, spec: TensorSpec, start: int, ledger: WriteLedger) -> None:
    """A tensor from elsewhere (metadata): through a sink that records each write in the ledger."""
    ledger.expect(spec.name, start, spec.nbytes)

    class _Recorded(TensorSink):
        def pwrite(self, data: Any, rel_offset: int) -> None:
            super().pwrite(data, rel_offset)
            ledger.record(spec.name, Entry(rel_offset, memoryview(data).nbytes, digest=block_digest(data)))

    sink = _Recorded(fd, start, spec.nbytes, spec.name, bool_checker(spec.dtype, spec.name))
    spec.fill(sink)
    sink.finish()
    if spec.nbytes == 0:
        ledger.record(spec.name, Entry(0, 0))


_NAME, _OFFSET, _NBYTES = attrgetter("name"), attrgetter("offset"), attrgetter("nbytes")


def check_written(ledger: WriteLedger, output: TensorFileReader, file_size: int, fd: int) -> None:
    """The check without read-back: `output` is a fresh reader of the written file (its header and table
    re-read and re-validated); every window it lists must be the one written, exactly once in full."""
    tensors = output.tensors  # (the table built in C: it holds every tensor)
    names, offsets, sizes = map(_NAME, tensors), map(_OFFSET, tensors), map(_NBYTES, tensors)
    table = dict(zip(names, zip(offsets, sizes, strict=True), strict=True))
    ledger.check(table, file_size, os.fstat(fd).st_size, output.path)


def verify_full(
    pieces: Sequence[tuple[FromSource, str, int]],
    output: TensorFileReader,
    block: int = 4 << 20,
    alive: Callable[[], None] = lambda: None,
) -> None:
    """The audit: re-read every (source piece, target name, byte offset within the target) from the output
    and compare it with its source, independently of the writer's code and checks. `alive` is told after
    each piece (the work moves on)."""
    for fill, out_name, at in pieces:
        alive()
        offset, nbytes, shape = fill.window()
        src_at = offset - fill.reader.tensor(fill.name).offset
        out = output.tensor(out_name)
        expected = tuple(reversed(shape)) if fill.transpose else shape
        whole = at == 0 and nbytes == out.nbytes
        if at + nbytes > out.nbytes or (whole and tuple(out.shape) != tuple(expected)):
            raise VerificationError(
                f"tensor '{out_name}' has shape {list(out.shape)}, expected {list(expected)}", output.path
            )
        window = _Window(fill.reader, fill.name, src_at, output, out_name, at)
        same = (
            _same_transposed(window, shape, block) if fill.transpose and nbytes else _same_bytes(window, nbytes, block)
        )
        if not same:
            raise VerificationError(f"tensor '{out_name}' differs from its source '{fill.name}'", output.path)


def check_digests(ledger: WriteLedger, output: TensorFileReader) -> None:
    """Part of the audit: every write, re-read from the output, has the XXH3-64 it had when it was written
    (told apart from a difference with the source, this says the bytes changed after syncd wrote them); a
    run of small tensors, each of its tensors."""
    if not ledger.digests:
        raise VerificationError("the writes were recorded without their digests: nothing to audit", output.path)
    from_runs = [named for run in ledger.runs for named in run.entries()]
    for name, entries in [*ledger.entries.items(), *((name, [entry]) for name, entry in from_runs)]:
        if name not in ledger.windows or ledger.windows[name][1] == 0:
            continue
        base = ledger.windows[name][0]
        for entry in entries:
            pieces = [
                os.pread(output.fd, entry.length, base + entry.start + k * entry.stride)
                for k in range(max(1, entry.count))
            ]
            if block_digest(b"".join(pieces)) != entry.digest:
                raise VerificationError(f"tensor '{name}' reads back different from what was written", output.path)


@dataclass(frozen=True)
class _Window:
    """A source tensor from byte `src_at` on, and where it went: output tensor `out_name` from byte `out_at`."""

    reader: TensorFileReader
    src_name: str
    src_at: int
    output: TensorFileReader
    out_name: str
    out_at: int


def _same_bytes(w: _Window, nbytes: int, block: int) -> bool:
    a, b = bytearray(min(block, nbytes)), bytearray(min(block, nbytes))
    for done in range(0, nbytes, block):
        n = min(block, nbytes - done)
        w.reader.readinto(w.src_name, w.src_at + done, memoryview(a)[:n])
        w.output.readinto(w.out_name, w.out_at + done, memoryview(b)[:n])
        if memoryview(a)[:n] != memoryview(b)[:n]:
            return False
    return True


def _same_transposed(w: _Window, shape: tuple[int, ...], block: int) -> bool:
    """Source rows r0:r1 against columns r0:r1 of the output, read back row by row."""
    import numpy as np

    rows, cols = shape
    itemsize = ITEMSIZE[w.reader.tensor(w.src_name).dtype]
    dtype = np.dtype(f"u{itemsize}")
    strip = max(1, block // (cols * itemsize))
    for r0 in range(0, rows, strip):
        n = min(strip, rows - r0)
        src = np.empty((n, cols), dtype=dtype)
        w.reader.readinto(w.src_name, w.src_at + r0 * cols * itemsize, src.data.cast("B"))
        got = np.empty((cols, n), dtype=dtype)
        view = got.data.cast("B")
        for c in range(cols):
            w.output.readinto(
                w.out_name, w.out_at + (c * rows + r0) * itemsize, view[c * n * itemsize : (c + 1) * n * itemsize]
            )
        if not np.array_equal(got.T, src):
            return False
    return True
