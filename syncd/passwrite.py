"""Writing a planned output in one pass over its source, and checking it (issue 15).

A converter plans the output (header bytes, where each tensor goes) as usual; tensors that come from the
source are given a `FromSource` fill. `write_planned` writes the header, the zero padding and the small
tensors that come from elsewhere (carried in metadata) directly, and hands every `FromSource` tensor to one
`OnePass` over the source, which returns the source hash. `check_written` is the check without read-back:
the output's header and table are re-read and the ledger of writes must tile it exactly. `verify_full` is the
audit (`--verify full`): every tensor of the output re-read and compared with its source.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from syncd.blockcheck import Entry, WriteLedger
from syncd.errors import FormatError, VerificationError
from syncd.formats.dtypes import ITEMSIZE
from syncd.formats.fileio import TensorFileReader, TensorSink, bool_checker, pwrite_all, write_zeros
from syncd.formats.table import TensorSpec
from syncd.hashing import DEFAULT_HASH, block_digest
from syncd.onepass import Move, OnePass, default_workers

VERIFY_CHOICES = ("fast", "full")


@dataclass(frozen=True)
class FromSource:
    """A TensorSpec fill naming the source tensor it comes from; `transpose`: written as its 2-D transpose."""

    reader: TensorFileReader
    name: str
    transpose: bool = False

    def __call__(self, sink: TensorSink) -> None:
        raise TypeError(f"tensor '{self.name}' is written by write_planned, in one pass over its source")


@dataclass
class Written:
    source_hash: str  # of `reader`, the source's primary file
    ledger: WriteLedger
    other_hashes: dict[str, str] = field(default_factory=dict)  # path -> hash of further files (sharded sources)


def write_planned(fd: int, path: str, header: bytes, file_size: int, placed: Sequence[tuple[TensorSpec, int]],
                  reader: TensorFileReader, hash_name: str = DEFAULT_HASH, workers: int | None = None,
                  progress: Callable[[int, int], None] | None = None) -> Written:
    """Write a whole output: `header` at 0, each (spec, absolute start) of `placed`, zeros in between.
    `FromSource` tensors may come from several files (a sharded checkpoint): one pass over each, `reader`'s
    always (its hash is the one recorded)."""
    os.ftruncate(fd, file_size)
    pwrite_all(fd, header, 0)
    ledger = WriteLedger()
    counted = _Progress(sum(spec.nbytes for spec, _ in placed), progress) if progress else None
    moves: dict[TensorFileReader, list[Move]] = {reader: []}
    cursor = len(header)
    for spec, start in sorted(placed, key=lambda p: p[1]):
        if start > cursor:
            write_zeros(fd, cursor, start - cursor)  # padding is zero bytes on disk, not a hole
        cursor = max(cursor, start + spec.nbytes)
        if isinstance(spec.fill, FromSource):
            moves.setdefault(spec.fill.reader, []).append(_move(spec, start, spec.fill))
        else:
            _write_small(fd, spec, start, ledger)
            if counted:
                counted.add(spec.nbytes)
    if file_size > cursor:
        write_zeros(fd, cursor, file_size - cursor)
    hashes = {
        source.path: OnePass(source.fd, source.file_size, source.path, fd, path, source_moves, hash_name,
                             workers or default_workers(), ledger=ledger,
                             progress=counted.add if counted else None).run()
        for source, source_moves in moves.items()
    }
    primary = hashes.pop(reader.path)
    return Written(primary, ledger, hashes)


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


def _move(spec: TensorSpec, start: int, fill: FromSource) -> Move:
    info = fill.reader.tensor(fill.name)
    if info.nbytes != spec.nbytes:
        raise FormatError(f"tensor '{spec.name}' needs {spec.nbytes} bytes, its source has {info.nbytes}",
                          fill.reader.path)
    if not fill.transpose:  # copied as bytes: the element size does not matter (QFloat, sub-byte floats)
        return Move(spec.name, info.offset, info.nbytes, start, 1, None, bool_checker(spec.dtype, spec.name))
    if len(info.shape) != 2 or tuple(reversed(info.shape)) != tuple(spec.shape) or info.dtype not in ITEMSIZE:
        raise FormatError(f"tensor '{fill.name}' ({info.dtype} {list(info.shape)}) cannot be written transposed as "
                          f"{list(spec.shape)}", fill.reader.path)
    return Move(spec.name, info.offset, info.nbytes, start, ITEMSIZE[info.dtype], (info.shape[0], info.shape[1]),
                bool_checker(spec.dtype, spec.name))


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


def check_written(ledger: WriteLedger, output: TensorFileReader, file_size: int, fd: int) -> None:
    """The check without read-back: `output` is a fresh reader of the written file (its header and table
    re-read and re-validated); every window it lists must be the one written, exactly once in full."""
    table = {t.name: (t.offset, t.nbytes) for t in output.tensors}
    ledger.check(table, file_size, os.fstat(fd).st_size, output.path)


def verify_full(pairs: Sequence[tuple[TensorFileReader, str, str, bool]], output: TensorFileReader,
                block: int = 4 << 20) -> None:
    """The audit: re-read every (source reader, source name, target name, transposed) tensor from the output
    and compare it with its source, independently of the writer's code and checks."""
    for reader, src_name, out_name, transposed in pairs:
        src, out = reader.tensor(src_name), output.tensor(out_name)
        expected = tuple(reversed(src.shape)) if transposed else src.shape
        if out.nbytes != src.nbytes or tuple(out.shape) != tuple(expected):
            raise VerificationError(f"tensor '{out_name}' has shape {list(out.shape)}, expected {list(expected)}",
                                    output.path)
        same = _same_transposed if transposed and src.nbytes else _same_bytes
        if not same(reader, src_name, output, out_name, block):
            raise VerificationError(f"tensor '{out_name}' differs from its source '{src_name}'", output.path)


def check_digests(ledger: WriteLedger, output: TensorFileReader) -> None:
    """Part of the audit: every write, re-read from the output, has the XXH3-64 it had when it was written
    (told apart from a difference with the source, this says the bytes changed after syncd wrote them)."""
    for name, entries in ledger.entries.items():
        if name not in ledger.windows or ledger.windows[name][1] == 0:
            continue
        base = ledger.windows[name][0]
        for entry in entries:
            pieces = [os.pread(output.fd, entry.length, base + entry.start + k * entry.stride)
                      for k in range(max(1, entry.count))]
            if block_digest(b"".join(pieces)) != entry.digest:
                raise VerificationError(f"tensor '{name}' reads back different from what was written", output.path)


def _same_bytes(reader: TensorFileReader, src_name: str, output: TensorFileReader, out_name: str,
                block: int) -> bool:
    nbytes = reader.tensor(src_name).nbytes
    a, b = bytearray(min(block, nbytes)), bytearray(min(block, nbytes))
    for done in range(0, nbytes, block):
        n = min(block, nbytes - done)
        reader.readinto(src_name, done, memoryview(a)[:n])
        output.readinto(out_name, done, memoryview(b)[:n])
        if memoryview(a)[:n] != memoryview(b)[:n]:
            return False
    return True


def _same_transposed(reader: TensorFileReader, src_name: str, output: TensorFileReader, out_name: str,
                     block: int) -> bool:
    """Source rows r0:r1 against columns r0:r1 of the output, read back row by row."""
    import numpy as np

    info = reader.tensor(src_name)
    rows, cols = info.shape
    itemsize = ITEMSIZE[info.dtype]
    dtype = np.dtype(f"u{itemsize}")
    strip = max(1, block // (cols * itemsize))
    for r0 in range(0, rows, strip):
        n = min(strip, rows - r0)
        src = np.empty((n, cols), dtype=dtype)
        reader.readinto(src_name, r0 * cols * itemsize, memoryview(src).cast("B"))
        got = np.empty((cols, n), dtype=dtype)
        view = memoryview(got).cast("B")
        for c in range(cols):
            output.readinto(out_name, (c * rows + r0) * itemsize, view[c * n * itemsize : (c + 1) * n * itemsize])
        if not np.array_equal(got.T, src):
            return False
    return True

