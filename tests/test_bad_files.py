"""Hand-made bad checkpoints: each gives its own FormatError naming the file (and the tensor, where
there is one), quickly and without allocating what the file claims.

Every file is built here from a recipe (nothing is stored) and opened with `open_checkpoint` in a forked child
whose address space may grow by only 512 MiB; the child reports the error, the time taken and how much its peak
RSS grew. A reader that trusted a claimed size would die of MemoryError (reported as such, not as FormatError)
or show the growth; one that hung is killed and reported.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

import cbor2
import pytest
from conftest import MNIST_BPK
from formatgen import bpk_bytes, bpk_data_start, cbor_head, cbor_text, descriptor, run_isolated, st_bytes, st_entry

from syncd.errors import FormatError
from syncd.formats import open_checkpoint
from syncd.formats.burnpack import MAX_TENSOR_COUNT

TIME_LIMIT = 60.0  # seconds per read: catches a hang, not slowness (these take milliseconds; CI may be loaded)
RSS_LIMIT = 200 << 20  # peak-RSS growth per read (the 100001-tensor file legitimately parses ~4 MB of CBOR)
U64_MAX = (1 << 64) - 1
F32_ONE = b"\x00\x00\x80\x3f"


def bpk_one(desc: dict, data: bytes = b"", name: str = "w") -> bytes:
    return bpk_bytes({name: desc}, data)


def raw_doc(tensors_map: bytes, n_tensors: int = 1) -> bytes:
    """CBOR {"tensors": <map of n entries whose bytes are given>} with the map head written by hand."""
    return cbor_head(5, 1) + cbor_text("tensors") + cbor_head(5, n_tensors) + tensors_map


def f32_desc_cbor(offsets: bytes = b"\x82\x00\x04", param_id: bytes | None = None) -> bytes:
    """The CBOR of an F32 [1] descriptor, with the data_offsets (and param_id) bytes given raw."""
    out = cbor_head(5, 3 if param_id is None else 4)
    out += cbor_text("dtype") + cbor_text("F32") + cbor_text("shape") + b"\x81\x01"
    out += cbor_text("data_offsets") + offsets
    if param_id is not None:
        out += cbor_text("param_id") + param_id
    return out


def truncated_by(cut: int) -> bytes:
    """A valid one-tensor file (512 data bytes) with its last `cut` bytes gone; `cut` must not equal the
    padding, or the file would be a valid packed (Burn 0.19) file."""
    blob = bpk_one(descriptor("F32", [128], 0, 512), bytes(range(256)) * 2)
    padding = bpk_data_start(blob) - (10 + struct.unpack_from("<I", blob, 6)[0])
    assert cut != padding
    return blob[:-cut]


def many_tensors(count: int) -> bytes:
    entry = {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}
    return bpk_bytes({f"t{i:06d}": entry for i in range(count)})


def deep(depth: int) -> bytes:
    return cbor_head(5, 1) + cbor_text("tensors") + b"\x81" * depth + b"\x80"


def with_tag(tagged: bytes) -> bytes:
    """A one-tensor file whose param_id is the given raw CBOR."""
    return bpk_bytes(meta_raw=raw_doc(cbor_text("w") + f32_desc_cbor(param_id=tagged)), data=F32_ONE)


# name, file name, recipe, distinctive fragment of the message, tensor the error must name (or None)
Case = tuple[str, str, Callable[[], bytes], str, str | None]

BURNPACK_CASES: list[Case] = [
    ("wrong magic", "m.bpk", lambda: b"BURN" + bpk_bytes()[4:], "Invalid magic number", None),
    ("future version", "m.bpk", lambda: bpk_bytes(version=2), "Unsupported version 2", None),
    ("truncated header", "m.bpk", lambda: bpk_bytes()[:7], "insufficient bytes (7 of 10)", None),
    ("truncated metadata", "m.bpk", lambda: bpk_bytes({"w": descriptor("F32", [1], 0, 4)})[:40],
     "metadata needs", None),
    ("metadata size claims 100 MB", "m.bpk", lambda: bpk_bytes(meta_size=100_000_000), "metadata needs 100000000 bytes",
     None),
    ("metadata size field 4 GB", "m.bpk", lambda: bpk_bytes(meta_size=0xFFFFFFFF),
     "Metadata size 4294967295 exceeds maximum allowed size of 104857600 bytes", None),
    ("truncated data by < 256", "m.bpk", lambda: truncated_by(10), "File truncated", "w"),
    ("truncated data by > 256", "m.bpk", lambda: truncated_by(300), "File truncated", "w"),
    ("packed file truncated", "m.bpk", lambda: bpk_bytes({"w": descriptor("U8", [3], 0, 3)}, b"ab", aligned=False),
     "File truncated", "w"),
    ("CBOR garbage", "m.bpk", lambda: bpk_bytes(meta_raw=b"\xff\xfe\xfd\xfc" * 8), "Metadata deserialization error",
     None),
    ("CBOR cut short", "m.bpk", lambda: bpk_bytes(meta_raw=cbor2.dumps({"tensors": {"w": 1}})[:-3]),
     "Metadata deserialization error", None),
    ("deep CBOR nesting", "m.bpk", lambda: bpk_bytes(meta_raw=deep(10_000)), "depth", None),
    ("top level not a map", "m.bpk", lambda: bpk_bytes(meta_raw=cbor2.dumps([1, 2])), "top level is not a map", None),
    ("no tensors key", "m.bpk", lambda: bpk_bytes(meta_raw=cbor2.dumps({"metadata": {}})), "missing field `tensors`",
     None),
    ("offsets past the end", "m.bpk", lambda: bpk_one(descriptor("F32", [1], 256, 260), F32_ONE),
     "File truncated: expected at least", "w"),
    ("offset near 2^64", "m.bpk", lambda: bpk_one(descriptor("F32", [1], U64_MAX - 7, U64_MAX - 3), F32_ONE),
     "File truncated: expected at least", "w"),
    ("overlapping ranges", "m.bpk", lambda: bpk_bytes(
        {"a": descriptor("F32", [2], 0, 8), "b": descriptor("F32", [2], 4, 12)}, bytes(12)),
     "data range 4..12 overlaps tensor 'a' (0..8)", "b"),
    ("reversed range", "m.bpk", lambda: bpk_one(descriptor("F32", [1], 8, 4), bytes(8)), "end 4 < start 8", "w"),
    ("wrong byte length", "m.bpk", lambda: bpk_one(descriptor("F32", [2], 0, 4), F32_ONE),
     "declares 4 bytes but its shape [2] and dtype F32 need 8", "w"),
    ("shape with 2^40 elements", "m.bpk", lambda: bpk_one(descriptor("F32", [1 << 20, 1 << 20], 0, 4), F32_ONE),
     "need 4398046511104", "w"),
    ("2^40 elements, matching offsets", "m.bpk", lambda: bpk_one(descriptor("F32", [1 << 20, 1 << 20], 0, 1 << 42)),
     "size 4398046511104 exceeds maximum allowed size of 10737418240 bytes", "w"),
    ("shape of 50000 huge dims", "m.bpk", lambda: bpk_one(descriptor("F32", [U64_MAX] * 50_000, 0, 4), F32_ONE),
     "but its shape", "w"),
    ("tensors map claims 10^9 entries", "m.bpk",
     lambda: bpk_bytes(meta_raw=raw_doc(cbor_text("w") + f32_desc_cbor(), 10**9)), "Metadata deserialization error",
     None),
    ("shape claims 2^64-1 dims", "m.bpk",
     lambda: bpk_bytes(meta_raw=raw_doc(cbor_text("w") + cbor_head(5, 1) + cbor_text("shape") + cbor_head(4, U64_MAX))),
     "Metadata deserialization error", None),
    ("name claims 4 GB", "m.bpk", lambda: bpk_bytes(meta_raw=raw_doc(cbor_head(3, 0xFFFFFFFF) + b"w")),
     "Metadata deserialization error", None),
    ("non-UTF-8 name", "m.bpk", lambda: bpk_bytes(meta_raw=raw_doc(cbor_text(b"w\xff\xfe") + f32_desc_cbor())),
     "Metadata deserialization error", None),
    ("empty name segment", "m.bpk", lambda: bpk_one(descriptor("U8", [1], 0, 1), b"x", name="a..b"),
     "tensor name 'a..b' has an empty path segment", None),
    ("trailing dot", "m.bpk", lambda: bpk_one(descriptor("U8", [1], 0, 1), b"x", name="a."),
     "tensor name 'a.' has an empty path segment", None),
    ("empty name", "m.bpk", lambda: bpk_one(descriptor("U8", [1], 0, 1), b"x", name=""),
     "tensor name '' has an empty path segment", None),
    ("unknown dtype", "m.bpk", lambda: bpk_one(descriptor("F8", [1], 0, 1), b"x"), "unknown dtype 'F8'", "w"),
    ("unknown bool store", "m.bpk", lambda: bpk_one(descriptor({"Bool": "U16"}, [1], 0, 2), b"xx"),
     "unknown dtype {'Bool': 'U16'}", "w"),
    ("unknown quant value", "m.bpk", lambda: bpk_one(descriptor({"QFloat": {"value": "Q9"}}, [1], 0, 1), b"x"),
     "unknown dtype {'QFloat'", "w"),
    ("descriptor lacks shape", "m.bpk", lambda: bpk_one({"dtype": "U8", "data_offsets": [0, 1]}, b"x"),
     "descriptor lacks `shape`", "w"),
    ("negative dim", "m.bpk", lambda: bpk_one(descriptor("U8", [-1], 0, 1), b"x"), "corrupted shape data", "w"),
    ("three offsets", "m.bpk", lambda: bpk_one({"dtype": "U8", "shape": [1], "data_offsets": [0, 1, 2]}, b"x"),
     "corrupted offset data", "w"),
    ("negative param_id", "m.bpk", lambda: bpk_one(descriptor("U8", [1], 0, 1, param_id=-5), b"x"),
     "param_id must be an unsigned 64-bit integer", "w"),
    ("duplicate tensor names", "m.bpk",
     lambda: bpk_bytes(meta_raw=raw_doc(cbor_text("w") + f32_desc_cbor() + cbor_text("w") + f32_desc_cbor(), 2)),
     "Duplicate map key", None),
    ("duplicate top-level key", "m.bpk",
     lambda: bpk_bytes(meta_raw=cbor_head(5, 2) + (cbor_text("tensors") + cbor_head(5, 0)) * 2), "Duplicate map key",
     None),
    ("bignum param_id (fits u64)", "m.bpk", lambda: with_tag(b"\xc2\x41\x01"), "tag 2", None),
    ("bignum param_id (2^64)", "m.bpk", lambda: with_tag(b"\xc2\x49\x01" + bytes(8)), "tag 2", None),
    ("datetime tag in metadata", "m.bpk",
     lambda: bpk_bytes(meta_raw=cbor_head(5, 2) + cbor_text("tensors") + cbor_head(5, 0) + cbor_text("metadata")
                       + cbor_head(5, 1) + cbor_text("k") + b"\xc0" + cbor_text("2013-03-21T20:04:00Z")),
     "tag 0", None),
    ("unknown tag", "m.bpk", lambda: with_tag(b"\xd8\x2a\x01"), "tag 42", None),
    ("metadata value not text", "m.bpk",
     lambda: bpk_bytes(meta_raw=cbor2.dumps({"tensors": {}, "metadata": {"k": 1}})),
     "`metadata` is not a map of text to text", None),
    ("bad scalar", "m.bpk",
     lambda: bpk_bytes(meta_raw=cbor2.dumps({"tensors": {}, "scalars": {"lr": {"Int": 1 << 63}}})),
     "scalar 'lr' is not a valid Scalar", None),
    ("more than 100000 tensors", "m.bpk", lambda: many_tensors(MAX_TENSOR_COUNT + 1),
     "File contains 100001 tensors, exceeding maximum of 100000", None),
]  # fmt: skip


def st_one(entry: dict, data: bytes = b"", name: str = "w") -> bytes:
    return st_bytes({name: entry}, data)


def deep_json(depth: int) -> bytes:
    return b'{"w":' + b"[" * depth + b"]" * depth + b"}"


SAFETENSORS_CASES: list[Case] = [
    ("too small", "m.safetensors", lambda: b"\x08\x00\x00", "header too small", None),
    ("header length past EOF", "m.safetensors", lambda: st_bytes({}, header_len=1000),
     "header length 1000 runs past the end of the file", None),
    ("huge header length", "m.safetensors", lambda: st_bytes({}, header_len=U64_MAX),
     "exceeds the limit of 100000000 bytes", None),
    ("random bytes", "m.safetensors", lambda: bytes(range(7, 255)) * 16,
     "not a safetensors file (its first 8 bytes give a header length of", None),
    ("a header length past EOF and no JSON after it", "m.safetensors", lambda: (10**6).to_bytes(8, "little") + b"[]",
     "not a safetensors file", None),
    ("invalid JSON", "m.safetensors", lambda: st_bytes(b'{"w": [1, 2}'), "header is not valid JSON", None),
    ("non-UTF-8 header", "m.safetensors", lambda: st_bytes(b'{"w\xff": 1}'), "header is not valid UTF-8", None),
    ("header not an object", "m.safetensors", lambda: st_bytes(b"[1, 2]"), "header is not a JSON object", None),
    ("gap in data_offsets", "m.safetensors",
     lambda: st_bytes({"a": st_entry("U8", [1], 0, 1), "b": st_entry("U8", [1], 2, 3)}, b"xyz"),
     "data range 2..3 leaves a gap before it (at 1)", "b"),
    ("overlap in data_offsets", "m.safetensors",
     lambda: st_bytes({"a": st_entry("U8", [2], 0, 2), "b": st_entry("U8", [2], 1, 3)}, b"xyz"),
     "data range 1..3 overlaps the previous tensor", "b"),
    ("reversed offsets", "m.safetensors", lambda: st_one(st_entry("U8", [1], 4, 0), bytes(4)), "end 0 < start 4", "w"),
    ("length mismatch", "m.safetensors", lambda: st_one(st_entry("F32", [2], 0, 4), F32_ONE),
     "declares 4 bytes but its shape [2] and dtype F32 need 8", "w"),
    ("data shorter than offsets", "m.safetensors", lambda: st_one(st_entry("U8", [4], 0, 4), b"xy"),
     "tensor data covers 4 bytes but the file holds 2", None),
    ("trailing bytes", "m.safetensors", lambda: st_one(st_entry("U8", [1], 0, 1), b"xyz"),
     "tensor data covers 1 bytes but the file holds 3", None),
    ("shape with 2^40 elements", "m.safetensors", lambda: st_one(st_entry("F32", [1 << 20, 1 << 20], 0, 4), F32_ONE),
     "need 4398046511104", "w"),
    ("shape of 50000 huge dims", "m.safetensors", lambda: st_one(st_entry("F32", [U64_MAX] * 50_000, 0, 4), F32_ONE),
     "but its shape", "w"),
    ("unknown dtype", "m.safetensors", lambda: st_one(st_entry("F7", [1], 0, 1), b"x"), "unknown dtype 'F7'", "w"),
    ("dtype not a string", "m.safetensors", lambda: st_one({"dtype": 5, "shape": [1], "data_offsets": [0, 1]}, b"x"),
     "unknown dtype 5", "w"),
    ("missing data_offsets", "m.safetensors", lambda: st_one({"dtype": "U8", "shape": [1]}, b"x"),
     "entry must have dtype, shape and data_offsets", "w"),
    ("unknown field", "m.safetensors", lambda: st_one({**st_entry("U8", [1], 0, 1), "extra": 1}, b"x"),
     "unknown fields ['extra']", "w"),
    ("offset is a float", "m.safetensors",
     lambda: st_one({"dtype": "U8", "shape": [1], "data_offsets": [0, 1.0]}, b"x"),
     "data_offsets must be two unsigned integers", "w"),
    ("offset of 5000 digits", "m.safetensors",
     lambda: st_bytes(b'{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,' + b"9" * 5000 + b"]}}", b"x"),
     "header is not valid JSON", None),
    ("non-string metadata value", "m.safetensors", lambda: st_bytes({"__metadata__": {"k": 1}}),
     "__metadata__ must map text to text", None),
    ("metadata not a map", "m.safetensors", lambda: st_bytes({"__metadata__": ["k"]}),
     "__metadata__ must map text to text", None),
    ("duplicate keys", "m.safetensors",
     lambda: st_bytes(b'{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                      b'"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"x"), "duplicate key 'w'", None),
    ("deep JSON nesting", "m.safetensors", lambda: st_bytes(deep_json(100_000)), "nested too deeply", None),
]  # fmt: skip

CASES = BURNPACK_CASES + SAFETENSORS_CASES


def test_case_names_are_unique() -> None:
    names = [(case[0], case[1][-4:]) for case in CASES]
    assert len(names) == len(set(names))


def open_and_close(path: Path) -> Callable[[], str]:
    def run() -> str:
        with open_checkpoint(path) as reader:
            return f"opened without error: {[t.name for t in reader.tensors][:5]}"

    return run


@pytest.mark.parametrize(
    ("case", "filename", "recipe", "fragment", "tensor"), CASES, ids=[f"{c[1].split('.')[1]}: {c[0]}" for c in CASES]
)
def test_bad_file(
    case: str, filename: str, recipe: Callable[[], bytes], fragment: str, tensor: str | None, tmp_path: Path
) -> None:
    path = tmp_path / filename
    path.write_bytes(recipe())
    report = run_isolated(open_and_close(path))
    assert not report.get("hung"), f"{case}: reading did not finish"
    # a FormatError; one the file's own sizes show cut short is its subclass IncompleteFileError
    assert report.get("error_type") in ("FormatError", "IncompleteFileError"), report.get("traceback") or report.get(
        "result"
    )
    error = report["error"]
    assert fragment in error["str"], error["str"]
    assert error["path"] == str(path) and error["str"].startswith(f"{path}: ")
    if tensor is not None:
        assert error["tensor"] == tensor
        assert f"tensor '{tensor}'" in error["str"]
    assert report["elapsed"] < TIME_LIMIT
    assert report["rss_growth"] < RSS_LIMIT, f"{case}: peak RSS grew by {report['rss_growth'] >> 20} MiB"


def test_a_good_file_passes_the_same_harness(tmp_path: Path) -> None:
    """The harness itself can tell a good file from a bad one."""
    path = tmp_path / "good.bpk"
    path.write_bytes(bpk_one(descriptor("F32", [1], 0, 4), F32_ONE))
    report = run_isolated(open_and_close(path))
    assert report["result"] == "opened without error: ['w']"


def test_harness_catches_allocation() -> None:
    assert run_isolated(lambda: len(bytearray(1 << 30)))["error_type"] == "MemoryError"  # beyond the headroom
    assert run_isolated(lambda: len(bytearray(RSS_LIMIT + (16 << 20))))["rss_growth"] > RSS_LIMIT  # within it


@pytest.mark.parametrize("name", ["t.bpk", "t.safetensors"])
def test_file_truncated_after_open(name: str, tmp_path: Path) -> None:
    """A training job may cut the file while we read it: pread reports it, no SIGBUS, no short tensor."""
    path = tmp_path / name
    if name.endswith(".bpk"):
        path.write_bytes(bpk_one(descriptor("U8", [1000], 0, 1000), bytes(1000)))
    else:
        path.write_bytes(st_one(st_entry("U8", [1000], 0, 1000), bytes(1000)))
    with open_checkpoint(path) as reader:
        os.truncate(path, reader.tensor("w").offset + 10)
        with pytest.raises(FormatError, match="file truncated while reading tensor 'w'") as info:
            reader.read("w")
        assert info.value.path == str(path)
        with pytest.raises(FormatError, match="file truncated while reading tensor 'w'"):
            list(reader.iter_chunks("w", 64))


def test_file_over_burns_size_limit(tmp_path: Path) -> None:
    path = tmp_path / "huge.bpk"
    path.write_bytes(bpk_bytes())
    os.truncate(path, 107_374_182_400 + 1)  # sparse: no disk is used
    report = run_isolated(open_and_close(path))
    assert report.get("error_type") == "FormatError", report
    assert "File size 107374182401 bytes exceeds maximum allowed size of 107374182400 bytes" in report["error"]["str"]


@pytest.mark.parametrize("name", ["x.safetensors", "x.bpk"])
def test_fifo_does_not_block(name: str, tmp_path: Path) -> None:
    path = tmp_path / name
    os.mkfifo(path)
    report = run_isolated(open_and_close(path), timeout=10)
    assert not report.get("hung"), "open_checkpoint blocked on a FIFO"
    assert report.get("error_type") == "FormatError", report
    assert report["error"]["str"] == f"{path}: not a regular file"
    assert report["elapsed"] < TIME_LIMIT


def test_a_loop_of_symlinks_is_called_one(tmp_path: Path) -> None:
    """Followed (the command line follows a symlink), a loop is no file; it was said to be a symlink not
    followed, which is what a watched tree's symlink gets."""
    os.symlink(tmp_path / "b.bpk", tmp_path / "a.bpk")
    os.symlink(tmp_path / "a.bpk", tmp_path / "b.bpk")
    with pytest.raises(FormatError, match="a.bpk: is a loop of symlinks$"):
        open_checkpoint(tmp_path / "a.bpk")
    os.symlink(MNIST_BPK, tmp_path / "c.bpk")
    with pytest.raises(FormatError, match="c.bpk: is a symlink; not following it$"):
        open_checkpoint(tmp_path / "c.bpk", within=tmp_path)


def test_directory_and_missing_file(tmp_path: Path) -> None:
    (tmp_path / "d.bpk").mkdir()
    start = time.monotonic()
    with pytest.raises(FormatError, match="not a regular file") as info:
        open_checkpoint(tmp_path / "d.bpk")
    assert info.value.path == str(tmp_path / "d.bpk")
    with pytest.raises(FormatError, match="no such file"):
        open_checkpoint(tmp_path / "missing.safetensors")
    assert time.monotonic() - start < TIME_LIMIT


@pytest.mark.slow
def test_recipes_only_break_what_they_say(tmp_path: Path) -> None:
    """The building blocks make valid files when nothing is broken, so each case fails for its own reason."""
    (tmp_path / "a.bpk").write_bytes(with_tag(b"\x01"))
    (tmp_path / "b.bpk").write_bytes(truncated_by(10) + bytes(10))
    (tmp_path / "c.bpk").write_bytes(many_tensors(MAX_TENSOR_COUNT))
    (tmp_path / "d.safetensors").write_bytes(st_one(st_entry("U8", [4], 0, 4), b"wxyz"))
    (tmp_path / "e.bpk").write_bytes(bpk_bytes(meta_raw=deep(100)))  # within Burn's depth limit of 128
    for path in sorted(tmp_path.iterdir()):
        if path.name == "e.bpk":
            with pytest.raises(FormatError, match="`tensors` is not a map of names"):
                open_checkpoint(path)
            continue
        with open_checkpoint(path) as reader:
            assert reader.tensors


@pytest.mark.slow
def test_a_large_legitimate_tensor_table_is_still_decoded(tmp_path: Path) -> None:
    """The pricing that refuses hostile metadata (tests/test_fuzz.py) must let a real 100,000-tensor table through."""
    import cbor2

    from syncd.formats.burnpack import decoded_cost
    from syncd.formats.fileio import DECODE_BUDGET, DECODE_SCAN_ABOVE

    tensors = {
        f"layers.{i}.attention.weight": {
            "dtype": "F32",
            "shape": [0, 4096],
            "data_offsets": [0, 0],
            "param_id": 2**63 + i,
        }
        for i in range(100_000)
    }
    raw = cbor2.dumps({"tensors": tensors})
    assert len(raw) > DECODE_SCAN_ABOVE and decoded_cost(raw) < DECODE_BUDGET


@pytest.mark.parametrize("suffix", [".safetensors", ".bpk"])
def test_text_made_four_times_larger_by_one_wide_character_is_priced_at_that_width(tmp_path: Path, suffix: str) -> None:
    """CPython keeps a whole str at its widest character's width: 40 MiB of ASCII metadata after one emoji
    (written as it is, or as JSON's escape) decodes to 160 MiB of text, and again as the value taken out of
    it (a 99 MB header took 1.2 GB, past the service's MemoryMax, so it was killed at every restart).
    Refused before decoding; the same bytes without the emoji are decoded."""
    from syncd.formats.burnpack import decoded_cost as bpk_cost
    from syncd.formats.safetensors import decoded_cost as st_cost

    for emoji in ("", "\N{GRINNING FACE}"):
        metadata = {"note": emoji + "x" * (40 << 20)}
        raw = bpk_bytes({}, metadata=metadata) if suffix == ".bpk" else st_bytes({"__metadata__": metadata})
        path = tmp_path / f"m{len(emoji)}{suffix}"
        path.write_bytes(raw)
        if not emoji:
            with open_checkpoint(path) as reader:
                assert reader.header.metadata == metadata
            continue
        header = raw[8 : 8 + int.from_bytes(raw[:8], "little")] if suffix == ".safetensors" else raw[10:]
        assert (st_cost if suffix == ".safetensors" else bpk_cost)(header) > 4 * (40 << 20)
        with pytest.raises(FormatError, match=r"could need \d+ MiB to decode"):
            open_checkpoint(path)


def test_read_metadata_takes_the_metadata_alone_and_refuses_what_comes_before_the_table(tmp_path: Path) -> None:
    """The daemon asks a file what it says of itself (`syncd.source`) before converting it: the metadata, read
    without going through a table its reader refuses here, but with every check that comes before the table."""
    from syncd.formats import read_metadata

    said = {"syncd.source": "model.safetensors", "epoch": "3"}
    past_the_end = {
        "a.bpk": bpk_bytes({"w": descriptor("F32", [16], 0, 64)}, metadata=said),
        "a.safetensors": st_bytes({"__metadata__": said, "w": st_entry("F32", [16], 0, 64)}),
    }
    for name, blob in past_the_end.items():
        (tmp_path / name).write_bytes(blob)
        with pytest.raises(FormatError):
            open_checkpoint(tmp_path / name)
        assert read_metadata(tmp_path / name) == said
    good = tmp_path / "good.safetensors"
    good.write_bytes(st_bytes({"__metadata__": said, "w": st_entry("F32", [1], 0, 4)}, F32_ONE))
    with open_checkpoint(good) as reader:
        assert read_metadata(good) == reader.header.metadata == said
    refused = {
        "short.bpk": bpk_bytes({}, metadata=said)[:12],
        "lying.bpk": bpk_bytes({}, metadata=said, meta_size=1 << 20),
        "tagged.bpk": with_tag(b"\xc2\x41\x01"),  # a bignum: CBOR tags are refused while decoding
        "no-tensors.bpk": bpk_bytes(meta_raw=cbor2.dumps({"metadata": said})),
        "long.safetensors": st_bytes({"__metadata__": said}, header_len=1 << 20),
        "not-text.safetensors": st_bytes({"__metadata__": {"epoch": 3}}),
        "not-json.safetensors": st_bytes(b"{not json"),
    }
    for name, blob in refused.items():
        (tmp_path / name).write_bytes(blob)
        with pytest.raises(FormatError):
            read_metadata(tmp_path / name)
    pickled = tmp_path / "model.pt"
    pickled.write_bytes(b"PK\x03\x04" + bytes(60))  # a zip under a PyTorch name: no metadata, never unpickled
    assert read_metadata(pickled) == {}
