"""The transpose kernels: the compiled one and the numpy fallback give identical, bit-exact bytes.

The compiled kernel is built here from the shipped C source with the project's own setup.py (into a temporary
directory), so this test covers it whether or not the checkout was installed with a compiler present; and
with Zig's compiler, as setup.py builds it on a machine without one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, build_kernel

from syncd.engine.write.kernels import Kernel, band_numpy, make_band, make_compiled, transpose_numpy
from syncd.engine.write.kernels.compiled import Library, load

SHAPES = [(1, 1), (1, 7), (7, 1), (31, 33), (32, 32), (64, 96), (100, 3), (3, 100), (257, 129), (4, 1000)]


@pytest.fixture(scope="module")
def compiled_transpose(compiled_kernel: Library) -> Kernel:
    return make_compiled(compiled_kernel.transpose)


def _kernels(compiled: Kernel) -> list[tuple[str, Kernel]]:
    return [("numpy", transpose_numpy), ("compiled", compiled)]


def _random(shape: tuple[int, int], dtype: type, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    info = np.iinfo(dtype)
    return rng.integers(0, info.max, size=shape, dtype=dtype, endpoint=True)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
def test_both_kernels_transpose_every_shape_bit_for_bit(compiled_transpose: Kernel, dtype: type) -> None:
    for i, shape in enumerate(SHAPES):
        src = _random(shape, dtype, i)
        for name, kernel in _kernels(compiled_transpose):
            out = np.full((shape[1], shape[0]), 0xA5, dtype=dtype)
            kernel(src, out, 0)
            assert np.array_equal(out, src.T), (name, shape)
            assert out.tobytes() == np.ascontiguousarray(src.T).tobytes()


def test_both_kernels_write_into_a_column_window_and_nowhere_else(compiled_transpose: Kernel) -> None:
    src = _random((37, 45), np.uint32, 7)
    for name, kernel in _kernels(compiled_transpose):
        out = np.full((45, 100), 0xDEADBEEF, dtype=np.uint32)
        kernel(src, out, 50)
        assert np.array_equal(out[:, 50:87], src.T), name
        assert (out[:, :50] == 0xDEADBEEF).all() and (out[:, 87:] == 0xDEADBEEF).all(), name


def test_both_kernels_transpose_a_band_of_columns_of_a_larger_matrix(compiled_transpose: Kernel) -> None:
    whole = _random((53, 90), np.uint32, 11)
    for name, kernel in _kernels(compiled_transpose):
        for c0, c1 in [(0, 32), (32, 64), (64, 90), (5, 6), (0, 90)]:
            out = np.empty((c1 - c0, 53), dtype=np.uint32)
            kernel(whole[:, c0:c1], out, 0)
            assert np.array_equal(out, whole[:, c0:c1].T), (name, c0, c1)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
def test_both_band_kernels_transpose_each_band_of_a_byte_buffer(compiled_kernel: Library, dtype: type) -> None:
    whole = _random((70, 100), dtype, 12)
    item = whole.itemsize
    src = memoryview(whole).cast("B")
    for name, kernel in [("numpy", band_numpy), ("compiled", make_band(compiled_kernel.transpose))]:
        for c0, c1 in [(0, 32), (32, 64), (64, 100), (99, 100), (0, 100)]:
            out = bytearray(b"\x07" * ((c1 - c0) * 70 * item))
            kernel(src, out, 70, 100, item, c0, c1 - c0)
            assert bytes(out) == np.ascontiguousarray(whole[:, c0:c1].T).tobytes(), (name, c0, c1)
        with pytest.raises(ValueError):
            kernel(src, bytearray(10 * 70 * item), 70, 100, item, 95, 10)  # past the last column
        with pytest.raises(ValueError):
            kernel(src, bytearray(10 * 70 * item - 1), 70, 100, item, 0, 10)  # the band does not fit


def test_signalling_nans_and_odd_float_bits_survive_unchanged(compiled_transpose: Kernel) -> None:
    # float32 signalling NaN (quiet bit clear), a NaN with payload, -0.0, a denormal, infinities; and the
    # bfloat16 and float64 counterparts: a float load/store on x87 or a BLAS copy could quieten the sNaN
    specials32 = np.array(
        [0x7F800001, 0xFF800001, 0x7FBFFFFF, 0x7FC00001, 0x80000000, 0x00000001, 0x7F800000, 0xFF800000],
        dtype=np.uint32,
    )
    specials16 = np.array([0x7F81, 0xFF81, 0x7FC1, 0x8000, 0x0001, 0x7F80], dtype=np.uint16)
    specials64 = np.array([0x7FF0000000000001, 0xFFF0000000000001, 0x7FF8000000000001, 1 << 63], dtype=np.uint64)
    for specials in (specials32, specials16, specials64):
        src = np.resize(specials, 40 * 33).reshape(40, 33)
        for name, kernel in _kernels(compiled_transpose):
            out = np.zeros((33, 40), dtype=src.dtype)
            kernel(src, out, 0)
            assert out.tobytes() == np.ascontiguousarray(src.T).tobytes(), (name, src.dtype)
            assert set(np.unique(out)) == set(np.unique(specials)), name


def test_both_kernels_agree_with_each_other_on_float_data(compiled_transpose: Kernel) -> None:
    values = np.random.default_rng(3).standard_normal((300, 170)).astype(np.float32)
    values[5, 7] = np.float32(np.nan)
    src = values.view(np.uint32)
    outs = []
    for _, kernel in _kernels(compiled_transpose):
        out = np.empty((170, 300), dtype=np.uint32)
        kernel(src, out, 0)
        outs.append(out.tobytes())
    assert outs[0] == outs[1] == np.ascontiguousarray(src.T).tobytes()


def test_the_compiled_kernel_refuses_what_does_not_fit(compiled_transpose: Kernel) -> None:
    src = np.zeros((4, 6), dtype=np.uint32)
    with pytest.raises(ValueError):
        compiled_transpose(src, np.zeros((6, 3), dtype=np.uint32), 0)  # 4 columns needed, 3 there
    with pytest.raises(ValueError):
        compiled_transpose(src, np.zeros((6, 4), dtype=np.uint16), 0)  # element sizes differ
    with pytest.raises(ValueError):
        compiled_transpose(src, np.zeros((6, 8), dtype=np.uint32)[:, ::2], 0)  # not contiguous
    with pytest.raises(ValueError):
        compiled_transpose(
            np.zeros((4, 12), dtype=np.uint32)[:, ::2], np.zeros((6, 4), dtype=np.uint32), 0
        )  # strided elements


def test_the_fallback_is_chosen_when_asked_and_gives_the_same_bytes() -> None:
    code = (
        "import numpy as np; from syncd.engine.write import kernels; a = np.arange(12, dtype=np.uint32).reshape(3, 4); "
        "o = np.empty((4, 3), np.uint32); kernels.transpose(a, o); print(kernels.KERNEL_NAME, o.tobytes().hex())"
    )
    env = {"PYTHONPATH": str(REPO), "SYNCD_KERNEL": "numpy"}
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True).stdout
    name, data = out.split()
    assert name == "numpy"
    assert bytes.fromhex(data) == np.arange(12, dtype=np.uint32).reshape(3, 4).T.copy().tobytes()


@pytest.mark.slow
def test_a_machine_without_a_c_compiler_builds_the_kernel_with_zigs(tmp_path: Path) -> None:
    # $CC naming no program stands for a machine without a C compiler: setuptools alone would fail to build
    library = build_kernel(tmp_path, env={"CC": str(tmp_path / "no-such-cc")})
    assert b"clang version" in library.read_bytes()  # Zig's compiler is clang's (its .comment section says so)
    loaded = load(library)
    assert loaded is not None
    zig_transpose = make_compiled(loaded.transpose)
    for dtype in (np.uint8, np.uint16, np.uint32, np.uint64):
        src = _random((257, 129), dtype, 21)
        out = np.zeros((129, 257), dtype=dtype)
        zig_transpose(src, out, 0)
        assert out.tobytes() == np.ascontiguousarray(src.T).tobytes(), dtype


def _build_requirements(tree: Path, compiler: str) -> list[str]:
    """What setup.py, as the PEP 517 backend pip calls, asks pip to install before it builds `tree` (editable
    and wheel, which must agree), with $CC set to `compiler`."""
    code = (
        "import json, setup; print(json.dumps([setup.get_requires_for_build_editable(), "
        "setup.get_requires_for_build_wheel()]))"
    )
    env = {**os.environ, "CC": compiler}
    done = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, check=True, capture_output=True, text=True)
    editable, wheel = json.loads(done.stdout.splitlines()[-1])
    assert {r for r in editable if "ziglang" in r} == {r for r in wheel if "ziglang" in r}
    return [r for r in wheel if "ziglang" in r]


def test_the_build_asks_for_zigs_compiler_only_where_no_c_compiler_works(tmp_path: Path) -> None:
    tree = tmp_path / "tree"  # a copy: the hooks write the package's metadata into the tree they build
    shutil.copytree(REPO / "syncd", tree / "syncd", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, tree / name)
    assert _build_requirements(tree, str(tmp_path / "no-such-cc")) == ["ziglang>=0.11"]
    working = f"{sys.executable} -m ziglang cc"  # a compiler that works here, whatever the machine has
    assert _build_requirements(tree, working) == []


def test_both_piece_writers_place_each_piece_and_refuse_what_the_buffer_does_not_hold(
    compiled_kernel: Library, tmp_path: Path
) -> None:
    from syncd.engine.write.kernels import pwrite_pieces_python

    data = bytes(range(12))  # three pieces of 4 bytes, to go 10 bytes apart from offset 3
    for name, write in [("numpy", pwrite_pieces_python), ("compiled", compiled_kernel.pwrite_pieces)]:
        path = tmp_path / name
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            assert write(fd, data, 3, 4, 3, 10) == 12, name
            with pytest.raises(ValueError):
                write(fd, data, 4, 4, 3, 10)  # a fourth piece the buffer does not hold
        finally:
            os.close(fd)
        assert path.read_bytes() == b"\0" * 3 + data[0:4] + b"\0" * 6 + data[4:8] + b"\0" * 6 + data[8:12], name
        with pytest.raises(OSError):
            write(fd, data, 3, 4, 3, 10)  # the descriptor is closed: an error, never a count


def piece_sums_numpy(
    buf: bytes, rows: int, stride: int, row_bytes: int, piece_bytes: int, seed: int, out: np.ndarray, out_stride: int
) -> None:
    """The compiled checksum's definition in numpy, written apart from it: each 4-byte word w_k of a piece,
    offset by seed + k * 0x9E3779B9 (mod 2**32), squared exactly; the squares summed mod 2**64."""
    words = np.frombuffer(buf, np.uint32)
    for r in range(rows):
        row = words[r * stride // 4 : (r * stride + row_bytes) // 4]
        for p, start in enumerate(range(0, len(row), piece_bytes // 4)):
            piece = row[start : start + piece_bytes // 4]
            places = np.uint32(seed & 0xFFFFFFFF) + np.arange(len(piece), dtype=np.uint32) * np.uint32(0x9E3779B9)
            x = (piece + places).astype(np.uint64)
            out[r * out_stride + p] = (x * x).sum(dtype=np.uint64)


def test_the_piece_reader_reads_each_piece_and_stops_where_the_file_ends(
    compiled_kernel: Library, tmp_path: Path
) -> None:
    path = tmp_path / "src"
    path.write_bytes(bytes(range(256)) * 4)  # 1 KiB
    read = compiled_kernel.pread_pieces
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = bytearray(3 * 16)
        assert read(fd, buf, 3, 16, 8, 100) == 48
        assert bytes(buf) == b"".join(path.read_bytes()[8 + k * 100 : 24 + k * 100] for k in range(3))
        assert read(fd, bytearray(32), 2, 16, 1000, 10) == 30  # 16, then the 14 before the end
        with pytest.raises(ValueError):
            read(fd, bytearray(16), 2, 16, 0, 16)  # a second piece the buffer does not hold
    finally:
        os.close(fd)
    with pytest.raises(OSError):
        read(fd, bytearray(16), 1, 16, 0, 16)  # the descriptor is closed: an error, never a count


def test_the_piece_copier_copies_each_piece_and_refuses_a_geometry_past_its_buffers(compiled_kernel: Library) -> None:
    src = bytes(range(256)) * 4  # 1 KiB
    dst = bytearray(3 * 16)
    compiled_kernel.copy_pieces(src, dst, 3, 16, 100)
    assert bytes(dst) == b"".join(src[k * 100 : k * 100 + 16] for k in range(3))
    for count, segment, stride, target in [
        (2, 16, 1016, 32),  # a second piece past the source
        (3, 16, 100, 32),  # a third piece the target does not hold
        (3, 16, 8, 48),  # pieces that overlap in the source
    ]:
        with pytest.raises(ValueError):
            compiled_kernel.copy_pieces(src, bytearray(target), count, segment, stride)


def _in_bands(pieces: list[bytes], first_row: int, rows: int, chunk: int, size: int) -> bytes:
    """What a block of `rows` rows laid out in bands of `chunk` bytes holds with `pieces` as rows first_row...
    (zeros elsewhere), written apart from the kernel: band j is every row's bytes j*chunk.. end to end."""
    block = bytearray(size)
    segment = len(pieces[0])
    for k, piece in enumerate(pieces):
        for at in range(0, segment, chunk):
            n = min(chunk, segment - at)
            place = at * rows + (first_row + k) * n
            block[place : place + n] = piece[at : at + n]
    return bytes(block)


@pytest.mark.parametrize("chunk", [16, 24, 40, 48])  # bands of 16 bytes; 24, then the 16 left; 40 and 8; whole
def test_pieces_read_or_copied_into_bands_land_where_each_band_is_a_matrix_of_its_own(
    compiled_kernel: Library, tmp_path: Path, chunk: int
) -> None:
    src = bytes(range(256)) * 4  # 1 KiB
    path = tmp_path / "src"
    path.write_bytes(src)
    pieces = [src[8 + k * 100 : 56 + k * 100] for k in range(3)]  # 48 bytes each
    expected = _in_bands(pieces, 2, 6, chunk, 6 * 48)  # rows 2, 3, 4 of a block of 6
    copied = bytearray(6 * 48)
    compiled_kernel.copy_pieces(src[8:], copied, 3, 48, 100, 2, 6, chunk)
    assert bytes(copied) == expected
    fd = os.open(path, os.O_RDONLY)
    try:
        read = bytearray(6 * 48)
        assert compiled_kernel.pread_pieces(fd, read, 3, 48, 8, 100, 2, 6, chunk) == 3 * 48
        assert bytes(read) == expected
        with pytest.raises(ValueError):
            compiled_kernel.pread_pieces(fd, bytearray(6 * 48), 3, 48, 8, 100, 4, 6, chunk)  # rows 4-6 of 6
        with pytest.raises(ValueError):
            compiled_kernel.pread_pieces(fd, bytearray(5 * 48), 3, 48, 8, 100, 2, 6, chunk)  # 6 rows in 5's room
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    ("chunk", "segment"), [(8, 40), (16, 96), (32, 200), (64, 64 * 5), (24, 100), (32, 32 * 3), (4096, 40_000)]
)
@pytest.mark.parametrize("count", [1, 15, 16, 17, 50])
def test_many_pieces_read_or_copied_into_bands_land_as_one_by_one(
    compiled_kernel: Library, tmp_path: Path, chunk: int, segment: int, count: int
) -> None:
    """Pieces placed in bands go a few rows at a time, band by band, each band width its own copy: every count
    around that tile, the common widths and others, a last band narrower than the rest, rows after 3; read, as
    many pieces as the staging buffer holds at a time (one, for pieces of 40,000 bytes)."""
    stride, first_row, rows = segment + 13, 3, count + 5
    src = bytes((k * 7 + k // 251) % 256 for k in range(count * stride))
    pieces = [src[k * stride : k * stride + segment] for k in range(count)]
    expected = _in_bands(pieces, first_row, rows, chunk, rows * segment)
    copied = bytearray(rows * segment)
    compiled_kernel.copy_pieces(src, copied, count, segment, stride, first_row, rows, chunk)
    assert bytes(copied) == expected
    path = tmp_path / "src"
    path.write_bytes(src)
    fd = os.open(path, os.O_RDONLY)
    try:
        read = bytearray(rows * segment)
        assert (
            compiled_kernel.pread_pieces(fd, read, count, segment, 0, stride, first_row, rows, chunk) == count * segment
        )
        assert bytes(read) == expected
    finally:
        os.close(fd)


@pytest.mark.parametrize("segment", [96, 40_000, 70_000])  # many to the staging buffer, one, part of one
def test_pieces_read_into_bands_stop_where_the_file_ends(
    compiled_kernel: Library, tmp_path: Path, segment: int
) -> None:
    """The bytes read up to the end of the file, whole pieces and the part of one, however many the staging
    buffer holds at once: the caller refuses a short count (the source changed)."""
    stride, count = segment + 8, 20
    path = tmp_path / "src"
    path.write_bytes(bytes(k % 253 for k in range(11 * stride + segment // 2)))  # ends halfway through piece 11
    fd = os.open(path, os.O_RDONLY)
    try:
        read = bytearray(count * segment)
        assert (
            compiled_kernel.pread_pieces(fd, read, count, segment, 0, stride, 0, count, 16)
            == 11 * segment + segment // 2
        )
    finally:
        os.close(fd)


def test_pieces_longer_than_the_staging_buffer_land_in_bands(compiled_kernel: Library, tmp_path: Path) -> None:
    """A piece placed in bands is read through 64 KiB of staging at a time: one of 70,000 bytes in two reads."""
    segment, chunk, stride = 70_000, 4_000, 80_000
    src = np.random.default_rng(5).integers(0, 256, 2 * stride, dtype=np.uint8).tobytes()
    path = tmp_path / "src"
    path.write_bytes(src)
    pieces = [src[k * stride : k * stride + segment] for k in range(2)]
    fd = os.open(path, os.O_RDONLY)
    try:
        read = bytearray(2 * segment)
        assert compiled_kernel.pread_pieces(fd, read, 2, segment, 0, stride, 0, 2, chunk) == 2 * segment
    finally:
        os.close(fd)
    assert bytes(read) == _in_bands(pieces, 0, 2, chunk, 2 * segment)


@pytest.mark.parametrize("chunk", [8, 16, 24, 48])
def test_pieces_summed_band_by_band_as_placed_give_the_sums_of_the_pieces(compiled_kernel: Library, chunk: int) -> None:
    """The converted side of the two reads of a tensor taken by columns sums each band of a group as placed,
    its words counted from the band's first (first_word) and added (add): the total is each whole piece's sum,
    which a piece placed in the wrong band or row changes."""
    rows, segment = 5, 48
    pieces = [np.random.default_rng(k).integers(0, 256, segment, dtype=np.uint8).tobytes() for k in range(rows)]
    expected = np.zeros(rows, np.uint64)
    piece_sums_numpy(b"".join(pieces), rows, segment, segment, segment, 11, expected, 1)

    def banded_sums(block: bytes) -> list[int]:
        sums = np.zeros(rows, np.uint64)
        for at in range(0, segment, chunk):
            n = min(chunk, segment - at)
            band = block[at * rows : at * rows + rows * n]
            compiled_kernel.piece_sums(band, rows, n, n, n, 11, sums, 1, first_word=at // 4, add=True)
        return sums.tolist()

    block = _in_bands(pieces, 0, rows, chunk, rows * segment)
    assert banded_sums(block) == expected.tolist()
    misplaced = _in_bands([pieces[1], pieces[0], *pieces[2:]], 0, rows, chunk, rows * segment)  # two rows swapped
    assert banded_sums(misplaced)[:2] != expected.tolist()[:2]
    with pytest.raises(ValueError):
        compiled_kernel.piece_sums(block, rows, 8, 8, 8, 11, np.zeros(rows, np.uint64), 1, first_word=-1)


@pytest.mark.parametrize(("rows", "row_bytes", "piece_bytes"), [(1, 8, 8), (5, 64, 24), (3, 4096, 1000), (7, 800, 800)])
def test_the_checksum_is_its_definition_and_sees_a_changed_word_and_words_that_trade_places(
    compiled_kernel: Library, rows: int, row_bytes: int, piece_bytes: int
) -> None:
    pieces = -(-row_bytes // piece_bytes)
    stride = row_bytes + 16  # rows apart, with bytes between them that no checksum may read

    def sums(data: np.ndarray, seed: int = 99) -> list[int]:
        results = []
        for checksum in (piece_sums_numpy, compiled_kernel.piece_sums):
            out = np.zeros(rows * pieces, np.uint64)
            checksum(data.tobytes(), rows, stride, row_bytes, piece_bytes, seed, out, pieces)
            results.append(out.tolist())
        assert results[0] == results[1]
        return results[0]

    data = np.random.default_rng(row_bytes).integers(0, 2**32, rows * stride // 4, dtype=np.uint32)
    base = sums(data)
    gap = data.copy()
    gap[row_bytes // 4 : stride // 4] ^= 1  # between the rows: not covered
    assert sums(gap) == base
    assert sums(data, seed=100) != base  # a fresh seed gives other sums
    changed = data.copy()
    changed[(rows - 1) * stride // 4 + row_bytes // 4 - 1] ^= 1 << 31  # the last word of the last piece, sign bit
    assert sums(changed)[-1] != base[-1] and sums(changed)[:-1] == base[:-1]
    swapped = data.copy()
    swapped[[0, 1]] = swapped[[1, 0]]  # two words of the first piece trade places
    assert swapped[0] != swapped[1] and sums(swapped)[0] != base[0]
    signs = data.copy()
    signs[0], signs[1] = 1 << 31, 0  # they differ only in the sign bit, then trade places
    swapped_signs = signs.copy()
    swapped_signs[[0, 1]] = swapped_signs[[1, 0]]
    assert sums(signs)[0] != sums(swapped_signs)[0]
    with pytest.raises(ValueError):
        odd = row_bytes + 4  # rows of whole 8-byte words only
        compiled_kernel.piece_sums(data.tobytes(), rows, stride, odd, piece_bytes, 1, np.zeros(64, np.uint64), 8)
