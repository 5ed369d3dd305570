"""One pass over the source (issue 15): exact output with any number of writers and any buffer size, and
every fault class the old full read-back caught is still caught without it: a wrong offset, a wrong
transpose, a torn source, a short write."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from safetensors.numpy import load_file, save_file

from syncd.engine.write import kernels, onepass
from syncd.engine.write.onepass import Move, OnePass
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

    def engine(self, cls: type[OnePass] = OnePass, **kw: int) -> OnePass:
        kw.setdefault("inline_bytes", 0)  # these sources are small: use the writer threads all the same
        return cls(self.reader.fd, self.reader.file_size, self.reader.path, self.fd, str(self.dest), self.moves, **kw)

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


def assert_pass_fails(
    source: Path, tmp_path: Path, error: type[Exception], match: str, cls: type[OnePass] = OnePass, **kw: int
) -> None:
    """One pass over `source` (with `cls`, e.g. a fault-injecting subclass) must fail with `error`."""
    output = _Output(source, tmp_path / "out.safetensors")
    with pytest.raises(error, match=match):
        output.engine(cls, **kw).run()
    output.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("workers", "slot_bytes", "block_bytes"),
    [(1, onepass.SLOT_BYTES, onepass.BLOCK_BYTES), (2, 8192, 4096), (4, 4000, 1000), (3, 1 << 20, 7)],
)
@pytest.mark.parametrize("inline", [False, True])  # writer threads, or all on the reading thread
def test_every_tensor_arrives_exact_with_any_writers_and_buffers(
    tmp_path: Path, workers: int, slot_bytes: int, block_bytes: int, inline: bool
) -> None:
    source = _source(tmp_path)
    output = _Output(source, tmp_path / "out.safetensors")
    engine = output.engine(
        workers=workers, slot_bytes=slot_bytes, block_bytes=block_bytes, inline_bytes=1 << 30 if inline else 0
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


def test_writeback_is_started_for_the_blocks_written_and_not_for_the_pieces_of_strips(tmp_path: Path) -> None:
    """The real sync_file_range, watched: each call covers the span of whole blocks written since the last one
    (not the whole file), and the output-row pieces of tensors written in strips are left to the fsync."""
    output = _Output(_source(tmp_path), tmp_path / "out.safetensors")
    engine = output.engine(workers=2, slot_bytes=8192, block_bytes=4096)  # a.weight, b.weight go in strips
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
    class Misplaced(OnePass):
        def _write(self, move: Move, data: memoryview, rel: int) -> None:
            super()._write(move, data, rel + 4 if move.name == "d.bias" and rel else rel)

    output = _Output(_source(tmp_path), tmp_path / "out.safetensors")
    engine = output.engine(Misplaced, block_bytes=4096)
    engine.run()
    with pytest.raises(VerificationError, match="'d.bias' was not written exactly once in full"):
        output.check(engine)
    output.close()


def _band_checks(extension: Any) -> dict[str, kernels.BandCheck]:
    """The in-cache check in both forms: numpy (the fallback) and the compiled extension's."""
    return {"numpy": kernels.band_check_numpy, "compiled": kernels.make_band_check(extension.check)}


@pytest.mark.parametrize("check", ["numpy", "compiled"])
@pytest.mark.parametrize("fault", ["not transposed", "last tile stale", "rows swapped"])
def test_a_wrong_transpose_is_caught_in_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, transpose_extension: Any, fault: str, check: str
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

    monkeypatch.setattr(kernels, "transpose_band", wrong)
    monkeypatch.setattr(kernels, "band_matches", _band_checks(transpose_extension)[check])
    output = _Output(_source(tmp_path), tmp_path / "out.safetensors")
    with pytest.raises(VerificationError, match="a transposed block does not match its source"):
        output.engine().run()
    output.close()


@pytest.mark.parametrize("check", ["numpy", "compiled"])
@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
@pytest.mark.parametrize("shape", [(100, 70), (1000, 700)])  # compared whole; sampled per tile
def test_the_tile_check_passes_a_right_transpose_and_fails_a_single_wrong_tile(
    transpose_extension: Any, shape: tuple[int, int], dtype: type, check: str
) -> None:
    matches = _band_checks(transpose_extension)[check]
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

    class Torn(OnePass):
        reads = 0

        def _read(self, buf: memoryview, offset: int) -> memoryview:
            Torn.reads += 1
            if Torn.reads == 2:  # a training job saves again while we are half-way through
                time.sleep(0.05)  # past the file system's timestamp granularity
                with open(source, "r+b") as handle:
                    handle.seek(-64, os.SEEK_END)
                    handle.write(bytes(64))  # still valid bools: only the change check can tell
            return super()._read(buf, offset)

    assert_pass_fails(
        source, tmp_path, SourceChangedError, "changed while it was being converted", Torn, block_bytes=4096
    )


def test_a_source_truncated_while_it_is_converted_is_caught(tmp_path: Path) -> None:
    source = _source(tmp_path)

    class Truncated(OnePass):
        def _read(self, buf: memoryview, offset: int) -> memoryview:
            if offset > 20000:
                os.truncate(source, 20000)
            return super()._read(buf, offset)

    assert_pass_fails(
        source, tmp_path, FormatError, "truncated while it was being converted", Truncated, block_bytes=4096
    )


def test_a_short_write_is_caught(tmp_path: Path) -> None:
    class Short(OnePass):
        def _pwrite(self, data: Any, offset: int) -> int:
            view = memoryview(data).cast("B")
            if len(view) > 100:  # what a write path that ignores pwrite's count would leave behind
                pwrite_all(self.out_fd, view[:-4], offset)
                return len(view) - 4
            return super()._pwrite(data, offset)

    output = _Output(_source(tmp_path), tmp_path / "out.safetensors")
    engine = output.engine(Short)
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
    engine = output.engine(slot_bytes=8192, block_bytes=4096)  # strided strips and whole pieces both
    engine.run()
    with SafetensorsReader(output.dest) as out:
        check_digests(engine.ledger, out)
        for name in ("a.weight", "d.bias"):
            where = out.tensor(name).offset + 100
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

    class FailsEarly(OnePass):
        def __post_init__(self) -> None:
            super().__post_init__()
            self._turn = _WatchedTurn()

        def _copy_block(self, slot: object, move: Move, rel: int, n: int) -> None:
            if move.name == "a.weight" and rel == 0:  # the first block: every later job waits behind it
                # fail only once a later job has read its block and waits for its turn: the failure must wake it
                assert self._turn.waited.wait(60), "no later job waited for its turn"  # type: ignore[attr-defined]
                self._free.put(slot)  # type: ignore[arg-type]
                raise FormatError("injected failure", self.src_path)
            super()._copy_block(slot, move, rel, n)  # type: ignore[arg-type]

    output = _Output(source, tmp_path / "out.safetensors")
    output.moves = [Move(m.name, m.src_offset, m.nbytes, m.dst_offset) for m in output.moves]  # all copies
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            output.engine(FailsEarly, workers=4, block_bytes=1024).run()
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
    in whole blocks and in strips: the ledger keeps one window per output tensor (issue 13, burn-compat.md
    §3.5 packed MHA/RNN tensors)."""
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
