"""Checks that prove a written file corresponds to its source without reading it back.

A full read-back of the output cannot reach the disk (it reads the page cache syncd just wrote), so it
proves only what checks taken while writing prove too, at a second pass over every byte. Instead:

* every transposed block is checked in cache against the block it came from (`check_transposed`): one row
  and one column of every 32x32 tile of the result, at a random offset per block, must equal the source's
  column and row. A transpose done wrong (not done, dimensions swapped, a tile misplaced or left stale)
  fails; the check does not share code with the transposing kernel.
* every write is recorded in a `WriteLedger` (where, how much, an XXH3-64 of the bytes as written); after
  the last write the ledger must tile each tensor's window of the *re-read* output table exactly once, and
  the file must have its planned size. A block written at a wrong offset, a short write, a window left
  partly unwritten or a header that does not describe where the data went all fail. A run of small tensors
  written in one write is recorded as that write (`record_run`): what each of its tensors received is worked
  out at the check, from where the run landed and how much of it arrived, as if each had its own entry.
* the source's change check (its FileStamp, formats/fileio.py, before and after) catches a source rewritten
  while it was converted ("torn"); the recorded source hash is of the very bytes that were converted.

`--verify full` re-reads everything for audits (`verify_full` in convert).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from threading import Lock
from typing import TYPE_CHECKING, Protocol

from syncd.errors import VerificationError
from syncd.records import cheap_init

if TYPE_CHECKING:
    from collections.abc import Iterator

    import numpy as np

TILE = 32  # the compiled kernel's tile edge; the numpy kernel's strips are 16 rows, a divisor of it


FULL_CHECK_ELEMENTS = 1 << 16  # blocks up to this many elements are compared whole
SAMPLES_PER_TILE = 4


def check_transposed(
    src: np.ndarray, out: np.ndarray, first_col: int = 0, rng: np.random.Generator | None = None
) -> bool:
    """True if out[:, first_col:first_col+rows] holds src.T.

    Small blocks are compared whole. Larger ones at SAMPLES_PER_TILE elements of every TILE x TILE tile, each
    at its own random place: that touches about one cache line in eight of the block, where a whole row and
    column per tile would stream through all of it (0.3-0.6 s/GiB measured). A systematic fault (no
    transpose, swapped dimensions, a misplaced or stale tile, two rows swapped along a band of tiles) fails
    with near certainty; a lone flipped element is not what a transpose gets wrong.

    This is the numpy form, used with the numpy kernel; `check` in kernels/_transpose.c applies the same rule in C
    beside the compiled kernel (syncd.engine.write.kernels.band_matches picks the one in use).
    """
    import numpy as np

    rows, cols = src.shape
    if rows == 0 or cols == 0:
        return True
    if out.shape[0] != cols or out.shape[1] < first_col + rows:
        return False
    window = out[:, first_col : first_col + rows]
    if rows * cols <= FULL_CHECK_ELEMENTS:
        return bool(np.array_equal(window.T, src))
    gen = rng if rng is not None else np.random.default_rng()
    shape = (SAMPLES_PER_TILE, -(-rows // TILE), -(-cols // TILE))  # samples x tile rows x tile columns
    r = np.minimum(np.arange(0, rows, TILE)[:, None] + gen.integers(0, TILE, shape), rows - 1)
    c = np.minimum(np.arange(0, cols, TILE)[None, :] + gen.integers(0, TILE, shape), cols - 1)
    return bool(np.array_equal(src[r, c], window[c, r]))


@cheap_init
@dataclass(frozen=True)
class Entry:
    """`count` writes of `length` bytes at window offsets start, start+stride, ... (stride 0: one write)
    and the XXH3-64 of them."""

    start: int
    length: int
    count: int = 1
    stride: int = 0
    digest: int = 0


class RunPiece(Protocol):
    """A tensor (or a piece of one) in a run written at once: its place in its tensor's window, its size."""

    @property
    def name(self) -> str: ...
    @property
    def piece_at(self) -> int: ...
    @property
    def nbytes(self) -> int: ...


class Run:
    """One write of pieces lying end to end: meant for the first one's place plus `shift` (0 unless a fault
    moved it), `written` of their bytes arrived; `digests`: each piece's XXH3-64 as written, when kept."""

    __slots__ = ("pieces", "shift", "written", "digests")

    def __init__(self, pieces: Sequence[RunPiece], shift: int, written: int, digests: list[int] | None) -> None:
        self.pieces = pieces
        self.shift = shift
        self.written = written
        self.digests = digests

    def entries(self) -> Iterator[tuple[str, Entry]]:
        """Each piece's entry, as a write of its own would have recorded it."""
        at = 0
        for k, piece in enumerate(self.pieces):
            arrived = max(0, min(piece.nbytes, self.written - at))
            digest = self.digests[k] if self.digests is not None else 0
            yield piece.name, Entry(piece.piece_at + self.shift, arrived, 1, 0, digest)
            at += piece.nbytes


@dataclass
class WriteLedger:
    """Every write of a conversion, per target tensor (thread-safe: the writers run in parallel). `digests`:
    whether writes keep a digest (a run of small tensors, one per tensor), which only the audit
    (`--verify full`, planned.check_digests) reads; without, their entries hold 0."""

    windows: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (absolute offset, nbytes)
    entries: dict[str, list[Entry]] = field(default_factory=lambda: defaultdict(list))
    runs: list[Run] = field(default_factory=list)
    digests: bool = True
    _lock: Lock = field(default_factory=Lock)

    def expect(self, name: str, offset: int, nbytes: int) -> None:
        self.windows[name] = (offset, nbytes)

    def expect_all(self, windows: Iterable[tuple[str, tuple[int, int]]]) -> None:
        """`expect` of each (name, (offset, nbytes)), without a call per tensor."""
        self.windows.update(windows)

    def record(self, name: str, entry: Entry) -> None:
        with self._lock:
            self.entries[name].append(entry)

    def record_run(self, run: Run) -> None:
        with self._lock:
            self.runs.append(run)

    def check(self, table: dict[str, tuple[int, int]], file_size: int, actual_size: int, path: str) -> None:
        """The writes tile every window of the re-read `table` (name -> (offset, nbytes)) exactly once."""
        if actual_size != file_size:
            raise VerificationError(f"the output is {actual_size} bytes, {file_size} were planned", path)
        whole, entries = self._run_entries()
        for name, (offset, nbytes) in self.windows.items():
            if table.get(name) != (offset, nbytes):
                raise VerificationError(
                    f"tensor '{name}' was written at {offset} ({nbytes} bytes) but the header says {table.get(name)}",
                    path,
                )
            in_run = whole.get(name)
            if in_run == nbytes:  # its one write: a run that put all of it at its place (most tensors)
                continue
            found = entries.get(name, []) if in_run is None else [Entry(0, in_run)]
            if not _tiles(found, nbytes):
                raise VerificationError(f"tensor '{name}' was not written exactly once in full", path)

    def _run_entries(self) -> tuple[dict[str, int], dict[str, list[Entry]]]:
        """(name -> nbytes of the tensors whose only write is a whole one at their place, in a run that
        arrived whole and unmoved; every other tensor's entries, those of runs included). A tensor written
        twice, or also by another write, is among the others: its entries then do not tile its window."""
        whole: dict[str, int] = {}
        entries: dict[str, list[Entry]] = defaultdict(list)
        for name, found in self.entries.items():
            entries[name].extend(found)
        for run in self.runs:
            if run.shift == 0 and run.written == sum(piece.nbytes for piece in run.pieces):
                for piece in run.pieces:
                    if piece.piece_at == 0 and piece.name not in whole and piece.name not in entries:
                        whole[piece.name] = piece.nbytes
                    else:
                        entries[piece.name].append(Entry(piece.piece_at, piece.nbytes))
            else:
                for name, entry in run.entries():
                    entries[name].append(entry)
        for name in whole.keys() & entries.keys():  # written whole by a run, and again: back among the others
            entries[name].append(Entry(0, whole.pop(name)))
        return whole, entries


def _tiles(entries: list[Entry], nbytes: int) -> bool:
    """True if the entries cover [0, nbytes) exactly once: either contiguous pieces, or strided pieces (a
    transposed tensor written strip by strip) that share one stride, the output row, and form a grid: their
    column ranges tile the row, and for each column range their rows tile all rows."""
    if nbytes == 0:
        return all(e.length == 0 for e in entries)
    if len(entries) == 1 and not entries[0].stride:  # a tensor written in one piece (most of them)
        return entries[0].start == 0 and entries[0].length == nbytes
    strided = [e for e in entries if e.stride]
    if not strided:
        return _covers([(e.start, e.length) for e in entries], nbytes)
    stride = strided[0].stride
    if len(strided) != len(entries) or any(e.stride != stride for e in strided) or nbytes % stride:
        return False
    by_columns: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for e in strided:
        by_columns[(e.start % stride, e.length)].append((e.start // stride, e.count))
    return _covers(list(by_columns), stride) and all(_covers(rows, nbytes // stride) for rows in by_columns.values())


def _covers(pieces: list[tuple[int, int]], size: int) -> bool:
    cursor = 0
    for start, length in sorted(pieces):
        if start != cursor or length < 0:
            return False
        cursor += length
    return cursor == size
