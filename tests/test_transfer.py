"""The byte movers: transposes in both paths (whole and strip by strip) and the read-back verification."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from convcheck import verify_tensor
from formatgen import bytes_spec

from syncd import transfer
from syncd.errors import VerificationError
from syncd.formats.burnpack import BurnpackReader, write_burnpack
from syncd.formats.table import TensorSpec


def _source(tmp_path: Path, matrix: np.ndarray) -> BurnpackReader:
    path = tmp_path / "src.bpk"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    write_burnpack(fd, [bytes_spec("w", "F32", matrix.shape, matrix.tobytes())])
    os.close(fd)
    return BurnpackReader(path)


def _write(path: Path, name: str, shape: tuple[int, ...], nbytes: int, fill) -> BurnpackReader:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    write_burnpack(fd, [TensorSpec(name, "F32", shape, nbytes, fill)])
    os.close(fd)
    return BurnpackReader(path)


@pytest.mark.parametrize("whole_bytes", [transfer.WHOLE_BYTES, 64])  # 64: forces the strip-by-strip path
def test_transpose_is_exact_and_verifies(tmp_path: Path, whole_bytes: int) -> None:
    matrix = np.arange(37 * 23, dtype=np.float32).reshape(37, 23)
    with _source(tmp_path, matrix) as src:
        mover = transfer.Transfer(whole_bytes)
        with _write(tmp_path / "out.bpk", "w", (23, 37), matrix.nbytes, mover.transpose_fill(src, "w", "w")) as out:
            assert np.array_equal(np.frombuffer(out.read("w"), np.float32).reshape(23, 37), matrix.T)
            mover.verify(out, "w")
            verify_tensor(src, "w", out, "w", transpose=True)


def test_verification_catches_a_transpose_that_was_not_done(tmp_path: Path) -> None:
    matrix = np.arange(6 * 4, dtype=np.float32).reshape(6, 4)
    with _source(tmp_path, matrix) as src:
        mover = transfer.Transfer()
        _write(tmp_path / "good.bpk", "w", (4, 6), matrix.nbytes, mover.transpose_fill(src, "w", "w")).close()
        untransposed = _write(tmp_path / "bad.bpk", "w", (4, 6), matrix.nbytes, lambda sink: sink.write(matrix))
        with untransposed, pytest.raises(VerificationError, match="reads back different"):
            mover.verify(untransposed, "w")


def test_verification_catches_a_changed_byte(tmp_path: Path) -> None:
    matrix = np.ones((8, 8), dtype=np.float32)
    with _source(tmp_path, matrix) as src:
        mover = transfer.Transfer()
        out_path = tmp_path / "out.bpk"
        _write(out_path, "w", (8, 8), matrix.nbytes, mover.copy_fill(src, "w", "w")).close()
        with BurnpackReader(out_path) as out:
            offset = out.tensor("w").offset
        with open(out_path, "r+b") as handle:
            handle.seek(offset + 17)
            handle.write(b"\x7f")
        with BurnpackReader(out_path) as out, pytest.raises(VerificationError):
            mover.verify(out, "w")
