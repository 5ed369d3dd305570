"""One pass over the source: exact output with any number of writers and any buffer size, any shape
and element size, and every fault class the old full read-back caught is still caught without it: a wrong
offset, a wrong transpose, a torn source, a short write; in tensors transposed whole, in strips and by columns
alike.
Faults are put in through the pass's `Seam`."""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

from syncd.engine.write import kernels, onepass
from syncd.engine.write.checks import WriteLedger
from syncd.engine.write.kernels import compiled
from syncd.engine.write.onepass import Move, OnePass, Seam
from syncd.engine.write.planned import check_digests
from syncd.errors import FormatError, SourceChangedError, VerificationError
from syncd.formats.dtypes import ITEMSIZE
from syncd.formats.fileio import bool_checker, pwrite_all
from syncd.formats.safetensors import SafetensorsReader, plan_safetensors
from syncd.formats.table import TensorSpec


def _source(tmp_path: Path, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    tensors = {
        "a.weight": rng.standard_normal((300, 170)).astype(np.float32),  # transposed
        "b.weight": rng.standard_normal((64, 1000)).astype(np.float32),  # transposed, wide
        "c.weight": rng.integers(0, 1 << 16, size=(33, 31), dtype=np.uint16).view(np.float16),  # 2-byte
        "d.bias": rng.standard_normal(4097).astype(np.float32),  # copied
        "e.flag": rng.integers(0, 2, size=100, dtype=np.uint8).astype(np.bool_),  # copied, checked
        "f.empty": np.zeros((0, 5), dtype=np.float32),
    }
    path = tmp_path / "src.safetensors"
    save_file(tensors, str(path))
    return path


class _Output:
    """A real safetensors output planned from the source: transposed weights, copied rest."""

    def __init__(self, source: Path, dest: Path) -> None:
        self.reader = SafetensorsReader(source)
        self.dest = dest
        infos = self.reader.tensors
        self.transposed = {t.name for t in infos if t.name.endswith(".weight")}
        specs = [
            TensorSpec(
                t.name,
                t.dtype,
                tuple(reversed(t.shape)) if t.name in self.transposed else t.shape,
                t.nbytes,
                fill=lambda sink: None,
            )
            for t in infos
        ]
        self.plan = plan_safetensors(specs)
        self.fd = os.open(dest, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(self.fd, self.plan.file_size)
        pwrite_all(self.fd, self.plan.header, 0)
        self.moves = [
            Move(
                t.name,
                t.offset,
                t.nbytes,
                self.plan.starts[i],
                ITEMSIZE[t.dtype],
                t.shape if t.name in self.transposed else None,
                bool_checker(t.dtype, t.name),
            )
            for i, t in enumerate(infos)
        ]

    def engine(self, **kw: Any) -> OnePass:
        kw.setdefault("inline_bytes", 0)  # these sources are small: use the writer threads all the same
        kw.setdefault("inline_small", False)  # and so are their tensors
        return OnePass(
            self.reader.fd, self.reader.file_size, self.reader.path, self.fd, str(self.dest), self.moves, **kw
        )

    def check(self, engine: OnePass) -> None:
        try:
            with SafetensorsReader(self.dest) as out:
                table = {t.name: (t.offset, t.nbytes) for t in out.tensors}
        except FormatError as exc:  # the structural re-read: a header that does not parse is a failed write
            raise VerificationError(f"the written header does not read back: {exc}", str(self.dest)) from None
        engine.ledger.check(table, self.plan.file_size, os.fstat(self.fd).st_size, str(self.dest))

    def close(self) -> None:
        os.close(self.fd)
        self.reader.close()


def assert_pass_fails(source: Path, tmp_path: Path, error: type[Exception], match: str, **kw: Any) -> None:
    """One pass over `source` (with e.g. a fault-injecting `seam`) must fail with `error`."""
    output = _Output(source, tmp_path / "out.safetensors")
    with pytest.raises(error, match=match):
        output.engine(**kw).run()
    output.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("workers", "slot_bytes", "strip_bytes", "block_bytes", "min_column_piece"),
    [
        (1, onepass.SLOT_BYTES, onepass.STRIP_BYTES, onepass.BLOCK_BYTES, onepass.MIN_COLUMN_PIECE),
        (2, 8192, 16384, 4096, onepass.MIN_COLUMN_PIECE),  # strips of several rows
        (4, 4000, 4000, 1000, onepass.MIN_COLUMN_PIECE),  # strips of one row of b.weight
        (3, 8192, 1 << 20, 7, onepass.MIN_COLUMN_PIECE),  # strips holding whole tensors
        (3, 1 << 20, 1 << 20, 7, onepass.MIN_COLUMN_PIECE),
        (2, 8192, 16384, 4096, 8),  # a.weight and b.weight by groups of columns
        (3, 8192, 16384, 1000, 8),  # the same, hashed in reads shorter than a row of b.weight
    ],
)
@pytest.mark.parametrize("inline", [False, True])  # writer threads, or all on the reading thread
def test_every_tensor_arrives_exact_with_any_writers_and_buffers(
    tmp_path: Path,
    workers: int,
    slot_bytes: int,
    strip_bytes: int,
    block_bytes: int,
    min_column_piece: int,
    inline: bool,
) -> None:
    source = _source(tmp_path)
    output = _Output(source, tmp_path / "out.safetensors")
    engine = output.engine(
        workers=workers,
        slot_bytes=slot_bytes,
        strip_bytes=strip_bytes,
        block_bytes=block_bytes,
        inline_bytes=1 << 30 if inline else 0,
        min_column_piece=min_column_piece,
    )
    digest = engine.run()
    output.check(engine)
    output.close()
    assert digest == xxhash.xxh3_128_hexdigest(source.read_bytes())  # what `xxhsum -H2` prints
    before, after = load_file(str(source)), load_file(str(tmp_path / "out.safetensors"))
    for name, value in before.items():
        expected = value.T if name in output.transposed else value
        assert after[name].shape == expected.shape
        assert after[name].tobytes() == np.ascontiguousarray(expected).tobytes(), name


@pytest.mark.parametrize("inline", [False, True])
@pytest.mark.parametrize("reads", ["compiled", "through the seam"])
def test_column_groups_laid_out_in_bands_arrive_exact(tmp_path: Path, inline: bool, reads: str) -> None:
    """Each row's piece of a column group goes to the group's bands (5 columns each, the last 2 wide), read by
    the compiled kernel or piece by piece through the seam's reads, or copied out of the read for the hash
    (the first group); each band transposed whole."""
    source = _source(tmp_path)
    output = _Output(source, tmp_path / "out.safetensors")
    seam = Seam() if reads == "compiled" else Seam(read=lambda fd, buf, offset: os.preadv(fd, [buf], offset))
    engine = output.engine(seam=seam, inline_bytes=1 << 30 if inline else 0, **BANDS)
    assert engine._column_width(next(m for m in output.moves if m.name == "a.weight")) == 12
    engine.run()
    output.check(engine)
    output.close()
    before, after = load_file(str(source)), load_file(str(tmp_path / "out.safetensors"))
    for name, value in before.items():
        expected = value.T if name in output.transposed else value
        assert after[name].tobytes() == np.ascontiguousarray(expected).tobytes(), name


def test_writeback_is_started_for_the_blocks_written_and_not_for_the_pieces_of_strips(tmp_path: Path) -> None:
    """The real sync_file_range, watched: each call covers the span of whole blocks written since the last one
    (not the whole file), and the output-row pieces of tensors written in strips are left to the fsync."""
    output = _Output(_source(tmp_path), tmp_path / "out.safetensors")
    engine = output.engine(workers=2, slot_bytes=8192, strip_bytes=16384, block_bytes=4096)  # a, b.weight: strips
    writeback = engine._writeback
    assert writeback.call is not None
    calls: list[tuple[int, int]] = []
    real = writeback.call

    def watched(fd: int, offset: int, nbytes: int, flags: int) -> int:
        calls.append((offset, nbytes))
        return real(fd, offset, nbytes, flags)

    writeback.call, writeback.every = watched, 1  # every write starts its writeback
    engine.run()
    output.check(engine)
    windows = {m.name: (m.dst_offset, m.dst_offset + m.nbytes) for m in output.moves}
    blocks = [windows[name] for name in ("c.weight", "d.bias", "e.flag")]
    assert calls and all(n > 0 for _, n in calls)
    for offset, nbytes in calls:  # inside a tensor written in blocks: never a strip tensor's piece, never 0, 0
        assert any(lo <= offset and offset + nbytes <= hi for lo, hi in blocks), (offset, nbytes)
    covered = sum(n for offset, n in calls if windows["d.bias"][0] <= offset < windows["d.bias"][1])
    assert covered == windows["d.bias"][1] - windows["d.bias"][0]
    output.close()


def test_the_sha256_option_records_sha256(tmp_path: Path) -> None:
    source = _source(tmp_path)
    output = _Output(source, tmp_path / "out.safetensors")
    assert output.engine(hash_name="sha256").run() == hashlib.sha256(source.read_bytes()).hexdigest()
    output.close()


def test_memory_is_capped_by_the_ring_not_the_model(tmp_path: Path) -> None:
    source = _source(tmp_path)
    output = _Output(source, tmp_path / "out.safetensors")
    engine = output.engine(workers=8, slot_bytes=4096, band_bytes=1024, ring_bytes=4 * (4096 + 1024))
    assert engine._free.qsize() == 4  # slots = ring / (source + band buffers), whatever the worker count
    engine.run()
    output.check(engine)
    output.close()


def test_the_strip_buffer_is_as_large_as_the_largest_block_of_the_pass(tmp_path: Path) -> None:
    """Its pages are made at once (aligned): it must not hold more than the pass's largest strip takes (here
    b.weight, F32 [64, 1000], in one strip: 256,000 bytes, in a strip buffer that could hold 1 MiB)."""
    output = _Output(_source(tmp_path), tmp_path / "out.safetensors")
    engine = output.engine(workers=3, slot_bytes=8192, strip_bytes=1 << 20, block_bytes=7)
    engine.run()
    output.check(engine)
    assert engine._strip_buffer is not None and len(engine._strip_buffer) == 64 * 1000 * 4
    output.close()


def test_an_aligned_buffer_is_in_memory_before_it_is_written_and_given_back_with_its_last_view() -> None:
    """Its pages are made when it is (MAP_POPULATE), not one fault at a time as its first writes land; they are
    unmapped once nothing holds them (a view of a view included)."""
    page = os.sysconf("SC_PAGE_SIZE")

    def resident() -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * page

    before = resident()
    buffer = onepass.aligned(32 << 20)
    assert resident() - before >= 31 << 20
    assert len(buffer) == 32 << 20 and not buffer.readonly
    part = buffer[4096:8192]
    del buffer
    assert resident() - before >= 31 << 20  # still held by `part`
    del part
    assert resident() - before < 8 << 20


# -- fault injection: each class the full read-back caught


def test_a_block_written_at_a_wrong_offset_is_caught(tmp_path: Path) -> None:
    output = _Output(_source(tmp_path), tmp_path / "out.safetensors")
    engine = output.engine(block_bytes=4096)
    moves = engine.moves
    engine.moves = [
        m if m.name != "d.bias" else Move(m.name, m.src_offset, m.nbytes, m.dst_offset + 4) for m in moves
    ]  # the writes follow a wrong window: the re-read header disagrees
    engine.run()
    with pytest.raises(VerificationError, match="'d.bias' was written at .* but the header says"):
        output.check(engine)
    output.close()


def test_a_piece_written_to_a_wrong_place_in_its_window_is_caught(tmp_path: Path) -> None:
    def misplaced(name: str, offset: int) -> int:
        return offset + 4 if name == "d.bias" and offset else offset

    output = _Output(_source(tmp_path), tmp_path / "out.safetensors")
    engine = output.engine(block_bytes=4096, seam=Seam(place=misplaced))
    engine.run()
    with pytest.raises(VerificationError, match="'d.bias' was not written exactly once in full"):
        output.check(engine)
    output.close()


def _band_checks(library: compiled.Library) -> dict[str, kernels.BandCheck]:
    """The in-cache check in both forms: numpy (the fallback) and the compiled kernel's."""
    return {"numpy": kernels.band_check_numpy, "compiled": kernels.make_band_check(library.check)}


# the geometries of a transposing pass: tensors read whole; in strips of the strip buffer, several parts each;
# by groups of columns of the strip buffer (a.weight, F32 [300, 170]: 13 columns, 12 for whole 8-byte words),
# each group one band, or laid out in bands of 5 columns (5, 5 and 2 of a.weight's 12; 23 of b.weight's 64)
WHOLE: dict[str, int] = {}
STRIPS = {"slot_bytes": 8192, "strip_bytes": 16384, "workers": 3}
COLUMNS = {**STRIPS, "min_column_piece": 8}
BANDS = {**COLUMNS, "band_bytes": 300 * 4 * 5}
# wide groups (a.weight: 60, 60 and 50 columns of 170, a third of a row or more, once read by whole rows) and
# b.weight's ([64, 1000]: 280 columns a group), a piece at a time like the others, a block of 4 KiB
WIDE = {**COLUMNS, "strip_bytes": 300 * 4 * 60, "block_bytes": 4096}
GEOMETRIES = pytest.mark.parametrize(
    "geometry",
    [WHOLE, STRIPS, COLUMNS, BANDS, WIDE],
    ids=["whole", "strips", "columns", "columns in bands", "wide column groups"],
)


@GEOMETRIES
@pytest.mark.parametrize("check", ["numpy", "compiled"])
@pytest.mark.parametrize("fault", ["not transposed", "last tile stale", "rows swapped"])
def test_a_wrong_transpose_is_caught_in_cache(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    compiled_kernel: compiled.Library,
    fault: str,
    check: str,
    geometry: dict[str, int],
) -> None:
    def wrong(src: Any, out: Any, rows: int, cols: int, itemsize: int, first: int, count: int) -> None:
        dtype = np.dtype(f"u{itemsize}")
        band = np.frombuffer(src, dtype, rows * cols).reshape(rows, cols)[:, first : first + count]
        result = np.frombuffer(out, dtype, count * rows).reshape(count, rows)
        result[:] = band.T
        if fault == "not transposed":
            result.reshape(-1)[:] = np.ascontiguousarray(band).reshape(-1)
        elif fault == "last tile stale":
            result[-17:, -17:] = 0
            result[-1, -1] ^= 1
        else:  # two source rows traded places
            result[:, [0, 1]] = result[:, [1, 0]]

    monkeypatch.setattr(kernels, "band_matches", _band_checks(compiled_kernel)[check])
    output = _Output(_source(tmp_path), tmp_path / "out.safetensors")
    with pytest.raises(VerificationError, match="a transposed block does not match its source"):
        output.engine(seam=Seam(transpose=wrong), **geometry).run()
    output.close()


@GEOMETRIES
def test_a_tile_transposed_twice_is_caught_in_cache(tmp_path: Path, geometry: dict[str, int]) -> None:
    """A band of the output transposed, then transposed again in place (as a kernel called twice would)."""

    def twice(src: Any, out: Any, rows: int, cols: int, itemsize: int, first: int, count: int) -> None:
        kernels.transpose_band(src, out, rows, cols, itemsize, first, count)
        band = np.frombuffer(out, np.dtype(f"u{itemsize}"), count * rows)
        band[:] = np.ascontiguousarray(band.reshape(count, rows).T).reshape(-1)

    assert_pass_fails(
        _source(tmp_path),
        tmp_path,
        VerificationError,
        "does not match its source",
        seam=Seam(transpose=twice),
        **geometry,
    )


@GEOMETRIES
@pytest.mark.parametrize("shift", ["one element", "one output row"])
def test_a_tile_written_at_a_wrong_offset_is_caught(tmp_path: Path, geometry: dict[str, int], shift: str) -> None:
    """The second band of a.weight goes one element (or one output row) further than planned: the writes no
    longer tile the tensor's window."""
    bands: list[int] = []
    step = 4 if shift == "one element" else 300 * 4  # a.weight is F32 [300, 170]: output rows of 300

    def misplaced(name: str, offset: int) -> int:
        if name != "a.weight":
            return offset
        bands.append(offset)
        return offset + step if len(bands) == 2 else offset

    output = _Output(_source(tmp_path), tmp_path / "out.safetensors")
    engine = output.engine(seam=Seam(place=misplaced), **{"band_bytes": 8192, **geometry})
    engine.run()
    assert len(bands) > 2
    with pytest.raises(VerificationError, match="'a.weight' was not written exactly once in full"):
        output.check(engine)
    output.close()


@GEOMETRIES
@pytest.mark.parametrize("reported", ["as it was", "as whole"])
def test_a_torn_tile_is_caught(tmp_path: Path, geometry: dict[str, int], reported: str) -> None:
    """The third write into a.weight's window stops half-way (the disk filled up, say). Reported as it was,
    the ledger catches it; reported whole (a write path that ignores pwrite's count), the audit's re-read of
    every write's digest does."""
    output = _Output(_source(tmp_path), tmp_path / "out.safetensors")
    window = next((m.dst_offset, m.dst_offset + m.nbytes) for m in output.moves if m.name == "a.weight")
    calls: list[int] = []

    def torn(fd: int, data: memoryview, offset: int) -> int:
        if window[0] <= offset < window[1]:
            calls.append(offset)
            if len(calls) == 3:
                pwrite_all(fd, data[: len(data) // 2], offset)
                return len(data) // 2 if reported == "as it was" else len(data)
        pwrite_all(fd, data, offset)
        return len(data)

    engine = output.engine(seam=Seam(write=torn), **{"band_bytes": 8192, **geometry})
    engine.run()
    assert len(calls) > 3
    if reported == "as it was":
        with pytest.raises(VerificationError, match="'a.weight' was not written exactly once in full"):
            output.check(engine)
    else:
        output.check(engine)
        with SafetensorsReader(output.dest) as out, pytest.raises(VerificationError, match="'a.weight' reads back"):
            check_digests(engine.ledger, out)
    output.close()


@pytest.mark.parametrize("check", ["numpy", "compiled"])
@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
@pytest.mark.parametrize("shape", [(100, 70), (1000, 700)])  # compared whole; sampled per tile
def test_the_tile_check_passes_a_right_transpose_and_fails_a_single_wrong_tile(
    compiled_kernel: compiled.Library, shape: tuple[int, int], dtype: type, check: str
) -> None:
    matches = _band_checks(compiled_kernel)[check]
    rows, cols = shape
    item = np.dtype(dtype).itemsize
    src = np.random.default_rng(rows).integers(0, np.iinfo(dtype).max, shape, dtype=dtype, endpoint=True)
    out = np.ascontiguousarray(src.T)

    def passes(result: np.ndarray, seed: int) -> bool:
        return matches(memoryview(src).cast("B"), memoryview(result).cast("B"), rows, cols, item, 0, cols, seed)

    assert all(passes(out, seed) for seed in range(20))
    for r0 in (0, 64, rows - rows % 32):  # tiles at the edges (short ones) included
        for c0 in (0, 32, cols - cols % 32):
            bad = out.copy()
            bad[c0 : c0 + 32, r0 : r0 + 32] += 1
            assert not passes(bad, r0 * cols + c0), (r0, c0)
    swapped = out.copy()
    swapped[:, [5, 6]] = swapped[:, [6, 5]]  # two source rows traded places along a band of tiles
    assert not passes(swapped, 1)
    assert not passes(np.ascontiguousarray(src).reshape(out.shape), 2)  # not transposed
    band = np.ascontiguousarray(src[:, 16:48].T)  # a band of columns: checked against its own columns only
    assert matches(memoryview(src).cast("B"), memoryview(band).cast("B"), rows, cols, item, 16, 32, 3)
    assert not matches(memoryview(src).cast("B"), memoryview(band).cast("B"), rows, cols, item, 15, 32, 3)


def test_a_source_rewritten_while_it_is_converted_is_caught(tmp_path: Path) -> None:
    source = _source(tmp_path)
    reads = []

    def torn(fd: int, buf: memoryview, offset: int) -> int:
        reads.append(offset)
        if len(reads) == 2:  # a training job saves again while we are half-way through
            time.sleep(0.05)  # past the file system's timestamp granularity
            with open(source, "r+b") as handle:
                handle.seek(-64, os.SEEK_END)
                handle.write(bytes(64))  # still valid bools: only the change check can tell
        return os.preadv(fd, [buf], offset)

    assert_pass_fails(
        source, tmp_path, SourceChangedError, "changed while it was being converted", block_bytes=4096, seam=Seam(torn)
    )


@pytest.mark.parametrize("layout", [COLUMNS, BANDS], ids=["one band", "bands"])
@pytest.mark.parametrize("rows", ["first", "last"])
def test_bytes_converted_by_columns_that_are_not_the_bytes_hashed_are_caught(
    tmp_path: Path, rows: str, layout: dict[str, int]
) -> None:
    """A tensor taken by columns is read twice: in file order for the hash, by groups of columns for the
    conversion. A source that changes between the two without its timestamps showing it (a writer through mmap,
    a network file system's cached attributes) is stood in for by a seam that flips one bit of one piece of the
    second read: the in-cache checks compare the output with that read and pass, so only the checksums binding
    the two reads can tell."""
    source = _source(tmp_path)
    with SafetensorsReader(source) as reader:
        window = next((t.offset, t.offset + t.nbytes) for t in reader.tensors if t.name == "a.weight")
    pieces: list[int] = []
    # the first piece read by columns: row 0's of the second group (12 columns; the first group is converted
    # from the read for the hash itself), or the very last piece
    wrong = window[0] + 12 * 4 if rows == "first" else window[1] - 8

    def flipped(fd: int, buf: memoryview, offset: int) -> int:
        n = os.preadv(fd, [buf], offset)
        if window[0] <= offset < window[1] and len(buf) < 170 * 4:  # a row's piece: the read by columns
            pieces.append(offset)
            if offset == wrong:
                buf[0] ^= 1
        return n

    assert_pass_fails(
        source, tmp_path, SourceChangedError, "changed while it was being converted", seam=Seam(flipped), **layout
    )
    # every row's piece of each of the 15 groups but the first, each read once
    assert len(pieces) == 300 * 14 and len(set(pieces)) == len(pieces)
    assert all((offset - window[0]) % (170 * 4) >= 12 * 4 for offset in pieces)


def test_a_first_column_group_taken_wrong_from_the_read_for_the_hash_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first group's pieces are copied out of the rows read for the hash, and summed as placed: a copy that
    takes the wrong bytes (here each row's piece one element further on) converts other bytes than the hashed
    ones, and the checksums binding the two tell."""
    real = kernels.copy_pieces

    def shifted(src: Any, *args: Any) -> None:
        real(memoryview(src)[4:], *args)

    monkeypatch.setattr(kernels, "copy_pieces", shifted)
    source = _source(tmp_path)
    assert_pass_fails(source, tmp_path, SourceChangedError, "changed while it was being converted", **COLUMNS)


@pytest.mark.parametrize("layout", [COLUMNS, BANDS, WIDE], ids=["one band", "bands", "wide groups"])
@pytest.mark.parametrize("placer", ["pread_pieces", "copy_pieces"])
def test_a_piece_placed_wrong_in_the_strip_buffer_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: dict[str, int], placer: str
) -> None:
    """The pieces of a column group are placed in the strip buffer by the kernel (laid out in bands), then
    transposed and checked against what was placed: a piece placed wrong would be transposed faithfully and
    pass that check. The converted side's checksums are taken from the bands as placed, where the transpose
    takes them, so here one byte of the first piece each call placed, changed after the call (the read of the
    later groups, or the copy of the first out of the read for the hash), fails the pass."""
    real = getattr(kernels, placer)
    calls: list[int] = []

    def misplacing(*args: Any) -> Any:
        done = real(*args)
        buf, segment, first_row, chunk = args[1], args[3], args[-3], args[-1]  # (both take these in this order)
        memoryview(buf).cast("B")[first_row * min(chunk, segment)] ^= 0x10
        calls.append(first_row)
        return done

    monkeypatch.setattr(kernels, placer, misplacing)
    source = _source(tmp_path)
    assert_pass_fails(source, tmp_path, SourceChangedError, "changed while it was being converted", **layout)
    assert calls


def test_a_source_truncated_while_it_is_converted_is_caught(tmp_path: Path) -> None:
    """A change of the source, not a bad file: it held these bytes when it was opened (a training loop
    saving again over the same name truncates it first); the daemon looks again once it is quiet."""
    source = _source(tmp_path)

    def truncated(fd: int, buf: memoryview, offset: int) -> int:
        if offset > 20000:
            os.truncate(source, 20000)
        return os.preadv(fd, [buf], offset)

    assert_pass_fails(
        source,
        tmp_path,
        SourceChangedError,
        "truncated while it was being converted; nothing was published",
        block_bytes=4096,
        seam=Seam(truncated),
    )


def _short(fd: int, data: memoryview, offset: int) -> int:
    """What a write path that ignores pwrite's count would leave behind: the last 4 bytes of a write missing."""
    if len(data) > 100:
        pwrite_all(fd, data[:-4], offset)
        return len(data) - 4
    pwrite_all(fd, data, offset)
    return len(data)


def test_a_short_write_is_caught(tmp_path: Path) -> None:
    output = _Output(_source(tmp_path), tmp_path / "out.safetensors")
    engine = output.engine(seam=Seam(write=_short))
    engine.run()
    with pytest.raises(VerificationError, match="was not written exactly once in full"):
        output.check(engine)
    output.close()


def test_an_output_cut_short_after_writing_is_caught(tmp_path: Path) -> None:
    output = _Output(_source(tmp_path), tmp_path / "out.safetensors")
    engine = output.engine()
    engine.run()
    os.ftruncate(output.fd, output.plan.file_size - 1)
    with pytest.raises(VerificationError, match="does not read back|bytes were planned"):
        output.check(engine)
    output.close()


def test_a_bool_byte_other_than_0_or_1_is_refused(tmp_path: Path) -> None:
    source = _source(tmp_path)
    output = _Output(source, tmp_path / "out.safetensors")
    flag = output.reader.tensor("e.flag")
    with open(source, "r+b") as handle:
        handle.seek(flag.offset + 3)
        handle.write(b"\x02")
    output.close()
    assert_pass_fails(source, tmp_path, FormatError, "bool tensor holds a byte other than 0 or 1")


def test_the_audit_finds_bytes_changed_after_they_were_written(tmp_path: Path) -> None:
    output = _Output(_source(tmp_path), tmp_path / "out.safetensors")
    engine = output.engine(slot_bytes=8192, strip_bytes=16384, block_bytes=4096)  # strided strips and whole pieces
    engine.run()
    _assert_the_audit_finds_a_flipped_bit(output, engine, ("a.weight", "d.bias"), 100)


def _assert_the_audit_finds_a_flipped_bit(output: _Output, engine: OnePass, names: tuple[str, ...], at: int) -> None:
    """The audit passes the output as written, then fails on one bit flipped `at` bytes into each tensor of
    `names` in turn (each flip undone before the next)."""
    with SafetensorsReader(output.dest) as out:
        check_digests(engine.ledger, out)
        for name in names:
            where = out.tensor(name).offset + at
            original = os.pread(output.fd, 1, where)
            os.pwrite(output.fd, bytes([original[0] ^ 1]), where)
            with pytest.raises(VerificationError, match=f"'{name}' reads back different"):
                check_digests(engine.ledger, out)
            os.pwrite(output.fd, original, where)
    output.close()


class _WatchedTurn(threading.Condition):
    """A pass's turn condition that says when a job first waits on it for its turn to hash."""

    def __init__(self) -> None:
        super().__init__()
        self.waited = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waited.set()  # set holding the lock: whoever takes it next finds this job waiting
        return super().wait(timeout)


def test_a_failing_job_releases_the_jobs_waiting_for_their_turn(tmp_path: Path) -> None:
    source = _source(tmp_path)
    output = _Output(source, tmp_path / "out.safetensors")
    output.moves = [Move(m.name, m.src_offset, m.nbytes, m.dst_offset) for m in output.moves]  # all copies
    first = min(m.src_offset for m in output.moves)

    turn = _WatchedTurn()

    def fails_early(fd: int, buf: memoryview, offset: int) -> int:
        if offset == first:  # the first tensor's first block, before any later one has had its turn
            # fail only once a later job has read its block and waits for its turn: the failure must wake it
            assert turn.waited.wait(60), "no later job waited for its turn"
            raise OSError(5, "injected failure")
        return os.preadv(fd, [buf], offset)

    outcome: list[BaseException] = []

    def run() -> None:
        try:
            engine = output.engine(workers=4, block_bytes=1024, seam=Seam(fails_early))
            engine._turn = turn  # the pass's turn to hash, watched
            engine.run()
        except BaseException as exc:
            outcome.append(exc)

    runner = threading.Thread(target=run)
    runner.start()
    runner.join(60)  # a hang, not slowness: the waiting jobs must give up once one has failed
    assert not runner.is_alive()
    assert len(outcome) == 1 and "injected failure" in str(outcome[0])
    output.close()


@pytest.mark.parametrize(("slot_bytes", "workers"), [(onepass.SLOT_BYTES, 1), (1024, 2), (300, 3)])
def test_pieces_of_tensors_split_and_joined_arrive_exact_and_tile_their_windows(
    tmp_path: Path, slot_bytes: int, workers: int
) -> None:
    """A packed source's row ranges as tensors of their own, and three tensors joined into one, transposed,
    in whole blocks and in strips: the ledger keeps one window per output tensor (packed MHA/RNN tensors,
    docs/burn-adapters.md#packed-modules)."""
    rng = np.random.default_rng(5)
    parts = {name: rng.standard_normal((40, 24)).astype(np.float32) for name in ("q", "k", "v")}
    packed = rng.standard_normal((60, 24)).astype(np.float32)
    save_file({**parts, "packed": packed}, str(tmp_path / "src.safetensors"))
    reader = SafetensorsReader(tmp_path / "src.safetensors")
    info = {t.name: t for t in reader.tensors}
    specs = [TensorSpec("joined", "F32", (72, 40), 72 * 40 * 4, fill=lambda sink: None)]
    specs += [TensorSpec(f"split{k}", "F32", (24, 20), 24 * 20 * 4, fill=lambda sink: None) for k in range(3)]
    plan = plan_safetensors(specs)
    fd = os.open(tmp_path / "out.safetensors", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.ftruncate(fd, plan.file_size)
    pwrite_all(fd, plan.header, 0)
    piece = 40 * 24 * 4
    moves = [
        Move(
            "joined",
            info[name].offset,
            piece,
            plan.starts[0] + k * piece,
            4,
            (40, 24),
            piece_at=k * piece,
            tensor_nbytes=3 * piece,
        )
        for k, name in enumerate(("q", "k", "v"))
    ]
    rows = 20 * 24 * 4
    moves += [
        Move(f"split{k}", info["packed"].offset + k * rows, rows, plan.starts[1 + k], 4, (20, 24)) for k in range(3)
    ]
    engine = OnePass(
        reader.fd,
        reader.file_size,
        reader.path,
        fd,
        str(tmp_path / "out.safetensors"),
        moves,
        workers=workers,
        slot_bytes=slot_bytes,
        strip_bytes=max(slot_bytes, 24 * 4 * 3),  # strips of a few rows
        band_bytes=256,
        inline_bytes=0,
    )
    engine.run()
    with SafetensorsReader(tmp_path / "out.safetensors") as out:
        table = {t.name: (t.offset, t.nbytes) for t in out.tensors}
        engine.ledger.check(table, plan.file_size, os.fstat(fd).st_size, str(tmp_path / "out.safetensors"))
        check_digests(engine.ledger, out)
    os.close(fd)
    reader.close()
    written = load_file(str(tmp_path / "out.safetensors"))
    assert np.array_equal(written["joined"], np.concatenate([parts[n].T for n in ("q", "k", "v")]))
    for k in range(3):
        assert np.array_equal(written[f"split{k}"], packed[20 * k : 20 * (k + 1)].T)


# -- every shape and element size, whole and in strips, both kernels: numpy's transpose, byte for byte

DIMS = st.one_of(st.sampled_from([1, 2, 3, 31, 32, 33, 64, 97, 127, 257]), st.integers(1, 300))


@pytest.fixture(params=["compiled", "numpy"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, compiled_kernel: compiled.Library) -> str:
    """The kernels in use: the compiled ones, or what a machine without a compiler gets."""
    if request.param == "compiled":
        monkeypatch.setattr(kernels, "transpose_band", kernels.make_band(compiled_kernel.transpose))
        monkeypatch.setattr(kernels, "band_matches", kernels.make_band_check(compiled_kernel.check))
        monkeypatch.setattr(kernels, "pwrite_pieces", compiled_kernel.pwrite_pieces)
        monkeypatch.setattr(kernels, "pread_pieces", compiled_kernel.pread_pieces)
        monkeypatch.setattr(kernels, "piece_sums", compiled_kernel.piece_sums)
        monkeypatch.setattr(kernels, "BY_COLUMNS", True)
    else:
        monkeypatch.setattr(kernels, "transpose_band", kernels.band_numpy)
        monkeypatch.setattr(kernels, "band_matches", kernels.band_check_numpy)
        monkeypatch.setattr(kernels, "pwrite_pieces", kernels.pwrite_pieces_python)
        monkeypatch.setattr(kernels, "BY_COLUMNS", False)  # without the compiled kernel: strips
    return str(request.param)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=DIMS,
    cols=DIMS,
    itemsize=st.sampled_from([1, 2, 4, 8]),
    workers=st.integers(1, 3),
    strip_rows=st.integers(1, 40),
    band_bytes=st.sampled_from([1, 100, 4096, 1 << 20]),
    by_columns=st.booleans(),
)
def test_every_shape_and_element_size_gives_numpys_transpose(
    kernel: str,
    rows: int,
    cols: int,
    itemsize: int,
    workers: int,
    strip_rows: int,
    band_bytes: int,
    by_columns: bool,
) -> None:
    """A matrix behind a few bytes of header, transposed by the pass: in strips of `strip_rows` rows, or by
    groups of columns as many bytes (where its rows are whole 8-byte words), or whole when it fits a slot; by 1
    to 3 writers, in bands from one column to all of them."""
    rng = np.random.default_rng(rows * 1000 + cols)
    matrix = rng.integers(0, 256, size=(rows, cols * itemsize), dtype=np.uint8).view(f"u{itemsize}")
    expected = np.ascontiguousarray(matrix.T).tobytes()
    nbytes = rows * cols * itemsize
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "src", Path(tmp) / "dst"
        src.write_bytes(b"header.." + matrix.tobytes() + b"tail")
        src_fd, dst_fd = os.open(src, os.O_RDONLY), os.open(dst, os.O_RDWR | os.O_CREAT, 0o644)
        os.ftruncate(dst_fd, 16 + nbytes)
        try:
            engine = OnePass(
                src_fd,
                nbytes + 12,
                str(src),
                dst_fd,
                str(dst),
                [Move("m", 8, nbytes, 16, itemsize, (rows, cols))],
                workers=workers,
                # strips, or whole; by columns, a slot holds a row (read whole for the hash) but not the matrix
                slot_bytes=max(64, cols * itemsize) if by_columns else 64 if strip_rows < 20 else 1 << 20,
                strip_bytes=strip_rows * cols * itemsize,
                band_bytes=band_bytes,
                min_column_piece=8 if by_columns else onepass.MIN_COLUMN_PIECE,
                inline_bytes=0,
            )
            assert engine.run() == xxhash.xxh3_128_hexdigest(src.read_bytes())
            engine.ledger.check({"m": (16, nbytes)}, 16 + nbytes, os.fstat(dst_fd).st_size, str(dst))
            slots = list(engine._free.queue)  # a narrow matrix's output rows must not grow the band buffers
            assert all(len(slot._out) <= max(band_bytes, itemsize) for slot in slots)
        finally:
            os.close(src_fd)
            os.close(dst_fd)
        assert dst.read_bytes()[16:] == expected


def _many_small(tmp_path: Path) -> _Output:
    """200 small tensors saved in order: they go in runs, each written at once."""
    rng = np.random.default_rng(9)
    save_file(
        {f"t{i:03d}.bias": rng.standard_normal(10 + i % 7).astype(np.float32) for i in range(200)},
        str(tmp_path / "src.safetensors"),
    )
    return _Output(tmp_path / "src.safetensors", tmp_path / "out.safetensors")


def test_runs_of_small_tensors_arrive_exact_in_few_writes(tmp_path: Path) -> None:
    output = _many_small(tmp_path)
    writes: list[int] = []

    def counted(fd: int, data: memoryview, offset: int) -> int:
        writes.append(len(data))
        pwrite_all(fd, data, offset)
        return len(data)

    engine = output.engine(workers=2, seam=Seam(write=counted))
    engine.run()
    output.check(engine)
    output.close()
    assert len(writes) < 10  # 200 tensors
    before, after = load_file(str(tmp_path / "src.safetensors")), load_file(str(tmp_path / "out.safetensors"))
    assert all(after[name].tobytes() == value.tobytes() for name, value in before.items())


@pytest.mark.parametrize("fault", ["short", "misplaced"])
def test_a_run_of_small_tensors_written_short_or_misplaced_is_caught(tmp_path: Path, fault: str) -> None:
    output = _many_small(tmp_path)
    runs: list[str] = []

    def third_run_misplaced(name: str, offset: int) -> int:
        runs.append(name)
        return offset + 4 if len(runs) == 3 else offset

    seam = Seam(write=_short) if fault == "short" else Seam(place=third_run_misplaced)
    engine = output.engine(workers=2, block_bytes=1024, seam=seam)  # a run per 1 KiB batch
    engine.run()
    with pytest.raises(VerificationError, match="was not written exactly once in full"):
        output.check(engine)
    output.close()


def test_the_audit_finds_a_small_tensor_changed_after_its_run_was_written(tmp_path: Path) -> None:
    output = _many_small(tmp_path)
    engine = output.engine(workers=2, block_bytes=1024)  # runs of a few tensors each
    engine.run()
    output.check(engine)
    assert engine.ledger.runs and not engine.ledger.entries  # every tensor went in a run
    # first, middle and last of their runs or not
    _assert_the_audit_finds_a_flipped_bit(output, engine, ("t000.bias", "t101.bias", "t199.bias"), 5)


def test_a_ledger_kept_without_digests_checks_the_writes_but_refuses_an_audit(tmp_path: Path) -> None:
    output = _many_small(tmp_path)
    engine = output.engine(workers=2, block_bytes=1024, ledger=WriteLedger(digests=False))
    engine.run()
    output.check(engine)
    with SafetensorsReader(output.dest) as out, pytest.raises(VerificationError, match="without their digests"):
        check_digests(engine.ledger, out)
    output.close()


@GEOMETRIES
def test_a_ledger_kept_without_digests_takes_none_of_any_write(tmp_path: Path, geometry: dict[str, int]) -> None:
    """Only the audit reads a write's digest: a conversion that will not audit (--verify fast) takes none, of
    blocks, bands or pieces of strips alike, and its writes are checked all the same."""
    output = _Output(_source(tmp_path), tmp_path / "out.safetensors")
    engine = output.engine(ledger=WriteLedger(digests=False), **geometry)
    engine.run()
    output.check(engine)
    entries = [entry for tensor in engine.ledger.entries.values() for entry in tensor]
    assert entries and all(entry.digest == 0 for entry in entries)
    assert all(run.digests is None for run in engine.ledger.runs)
    output.close()


def test_a_small_tensor_written_twice_is_caught(tmp_path: Path) -> None:
    """A run that lands whole and in place still counts each of its tensors once: one written again (here
    by a second pass over the same source) no longer tiles its window exactly once."""
    output = _many_small(tmp_path)
    engine = output.engine(workers=2, block_bytes=1024)
    engine.run()
    again = output.engine(workers=2, block_bytes=1024, ledger=engine.ledger)
    again.moves = [m for m in again.moves if m.name == "t150.bias"]
    again.run()
    with pytest.raises(VerificationError, match="'t150.bias' was not written exactly once in full"):
        output.check(engine)
    output.close()


def test_a_pass_of_small_untransformed_tensors_only_runs_on_the_calling_thread(tmp_path: Path) -> None:
    """Whatever the source's size: its jobs are batches of tensors, which threads would only take turns at.
    One tensor to transpose, or one of a block or more, and the writer threads are used as before."""
    output = _many_small(tmp_path)
    assert output.engine(workers=2, inline_small=True)._inline
    assert not output.engine(workers=2, inline_small=False)._inline
    output.moves = [output.moves[0]._replace(nbytes=onepass.BLOCK_BYTES), *output.moves[1:]]
    assert not output.engine(workers=2, inline_small=True)._inline
    output.close()
    output = _Output(_source(tmp_path), tmp_path / "out2.safetensors")
    assert output.transposed and not output.engine(workers=2, inline_small=True)._inline
    output.close()
