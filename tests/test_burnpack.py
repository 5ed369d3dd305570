"""Burnpack reader and writer: Burn's own files, exact round trips, Burn's CBOR bytes, writer refusals."""

from __future__ import annotations

import math
import os
import struct
import tempfile
from pathlib import Path
from typing import Any

import cbor2
import pytest
from conftest import ASTERINAS_BPK as ASTERINAS
from conftest import CORPUS as _CORPUS_DIR
from conftest import MNIST_BPK as MNIST
from formatgen import bpk_bytes, bpk_data_start, bytes_spec, cbor_text, descriptor, specs_from_reader, write_bpk
from hypothesis import given, settings
from hypothesis import strategies as st

from syncd.errors import FormatError, IncompleteFileError
from syncd.formats import open_checkpoint
from syncd.formats.burnpack import (
    LAYOUT_ALIGNED,
    LAYOUT_PACKED,
    MAX_TENSOR_COUNT,
    BurnpackReader,
    Scalar,
)
from syncd.formats.dtypes import ITEMSIZE
from syncd.formats.table import TensorSpec

CORPUS = sorted((_CORPUS_DIR / "bpk").glob("*.bpk"))

# ------------------------------------------------------------------------------------------- Burn's files

MNIST_ORDER = [
    ("conv1.conv.weight", (64, 1, 3, 3), 0),
    ("conv1.conv.bias", (64,), 2304),
    ("conv1.norm.gamma", (64,), 2560),
    ("conv1.norm.beta", (64,), 2816),
    ("conv1.norm.running_mean", (64,), 3072),
    ("conv1.norm.running_var", (64,), 3328),
    ("conv2.conv.weight", (64, 64, 3, 3), 3584),
    ("conv2.conv.bias", (64,), 151040),
    ("conv2.norm.gamma", (64,), 151296),
    ("conv2.norm.beta", (64,), 151552),
    ("conv2.norm.running_mean", (64,), 151808),
    ("conv2.norm.running_var", (64,), 152064),
    ("fc1.weight", (1600, 128), 152320),
    ("fc1.bias", (128,), 971520),
    ("fc2.weight", (128, 128), 972032),
    ("fc2.bias", (128,), 1037568),
    ("fc3.weight", (128, 10), 1038080),
    ("fc3.bias", (10,), 1043200),
]


def test_mnist_fixture_table() -> None:
    with BurnpackReader(MNIST) as reader:
        facts = reader.header.facts
        assert (facts["version"], facts["metadata_size"], facts["data_start"]) == (1, 1398, 1536)
        assert facts["layout"] == LAYOUT_ALIGNED
        assert facts["top_level_keys"] == ["tensors"]  # the record path writes no metadata map
        assert reader.header.metadata == {} and reader.header.scalars == {}
        assert facts["tensor_key_order"] == sorted(name for name, _, _ in MNIST_ORDER)
        assert [(t.name, t.shape, t.offset - 1536) for t in reader.tensors] == MNIST_ORDER
        assert {t.dtype for t in reader.tensors} == {"F32"} and {t.raw_dtype for t in reader.tensors} == {"F32"}
        assert all(t.nbytes == 4 * math.prod(t.shape) for t in reader.tensors)
        ids = {t.name: t.param_id for t in reader.tensors}
        assert ids["conv1.conv.bias"] == 9505838338724798577
        assert ids["conv1.conv.weight"] == 10777079075451239370
        assert ids["fc1.weight"] == 1730029982897944783
        assert ids["conv2.norm.running_var"] == 17310467163264002046
        assert ids["fc3.bias"] == 7846584638995852899
        assert sum(pid >= 1 << 63 for pid in ids.values()) >= 9
        assert reader.header.file_size == 1_044_776 == reader.tensors[-1].offset + reader.tensors[-1].nbytes
        # the bytes are the file's bytes
        raw = Path(MNIST).read_bytes()
        bias = reader.tensor("conv1.conv.bias")
        assert reader.read("conv1.conv.bias") == raw[bias.offset : bias.offset + bias.nbytes]


def test_asterinas_has_metadata_and_aligned_gaps() -> None:
    with open_checkpoint(ASTERINAS) as reader:
        assert isinstance(reader, BurnpackReader)
        assert reader.header.metadata == {"format": "burnpack", "producer": "burn", "version": "0.20.1"}
        assert reader.header.facts["top_level_keys"] == ["tensors", "metadata"]
        starts = [t.offset for t in reader.tensors]
        assert all(s % 256 == 0 for s in starts)
        gaps = [b.offset - (a.offset + a.nbytes) for a, b in zip(reader.tensors, reader.tensors[1:], strict=False)]
        assert any(g > 0 for g in gaps) and min(gaps) >= 0


@pytest.mark.parametrize("source", [MNIST, *CORPUS], ids=os.path.basename)
def test_rewrite_reproduces_burn_file(source: str, tmp_path: Path) -> None:
    original = Path(source).read_bytes()
    with BurnpackReader(source) as reader:
        out = write_bpk(
            tmp_path / "copy.bpk",
            specs_from_reader(reader),
            metadata=reader.header.metadata,
            scalars=reader.header.scalars,
            layout=reader.header.facts["layout"],
        )
    assert len(out) == len(original)
    assert out == original


# ------------------------------------------------------------------------------------------- round trips

U64 = 1 << 64
I64 = 1 << 63
QUANT_VALUES = ["Q8F", "E5M2", "E4M3", "Q4F", "E2M1", "Q2F", "Q8S", "Q4S", "Q2S"]
BOOL_FORMS = {
    "Bool": "Bool",
    "Bool(Native)": {"Bool": "Native"},
    "Bool(U8)": {"Bool": "U8"},
    "Bool(U32)": {"Bool": "U32"},
}
NUMERIC = ["F64", "F32", "Flex32", "F16", "BF16", "I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8"]
ALL_DTYPES = [*NUMERIC, *BOOL_FORMS, "QFloat"]

segment = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="."), min_size=1, max_size=5)
names = st.lists(segment, min_size=1, max_size=3).map(".".join)
shapes = st.lists(st.integers(0, 4), max_size=3).map(tuple)
block = st.fixed_dictionaries(
    {
        "size": st.fixed_dictionaries(
            {"storage": st.lists(st.integers(1, 64), min_size=5, max_size=5), "len": st.just(1)}
        ),
        "dtype": st.sampled_from(["F32", "F16", "BF16", "UE8M0", "UE4M3"]),
    }
)
schemes = st.fixed_dictionaries(
    {
        "value": st.sampled_from(QUANT_VALUES),
        "store": st.sampled_from(["Native", {"PackedU32": 0}]),
        "mode": st.sampled_from(["Symmetric", "Lookup"]),
        "tensor": st.none() | st.just("F32"),
        "block": st.none() | block,
    }
).map(lambda scheme: {"QFloat": scheme})
param_ids = st.none() | st.integers(0, U64 - 1) | st.sampled_from([0, 23, 24, 255, 256, 65536, I64, U64 - 1])
text_maps = st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=4)
scalar_values = st.one_of(
    st.builds(Scalar, st.just("Int"), st.integers(-I64, I64 - 1) | st.sampled_from([-I64, I64 - 1, -1, -24, -25])),
    st.builds(Scalar, st.just("UInt"), st.integers(0, U64 - 1) | st.sampled_from([U64 - 1, 0])),
    st.builds(Scalar, st.just("Float"), st.floats() | st.sampled_from([0.5, 0.1, math.inf, -math.inf, -0.0])),
    st.builds(Scalar, st.just("Bool"), st.booleans()),
)


@st.composite
def tensors(draw: st.DrawFn, name: str) -> dict[str, Any]:
    dtype = draw(st.sampled_from(ALL_DTYPES))
    shape = draw(shapes)
    count = math.prod(shape)
    if dtype == "QFloat":  # opaque payload: any length, the scheme travels verbatim
        data, raw = draw(st.binary(max_size=40)), draw(schemes)
    elif dtype in BOOL_FORMS:
        bits = draw(st.lists(st.integers(0, 1), min_size=count, max_size=count))
        data, raw = b"".join(b.to_bytes(ITEMSIZE[dtype], "little") for b in bits), BOOL_FORMS[dtype]
    else:
        data, raw = draw(st.binary(min_size=count * ITEMSIZE[dtype], max_size=count * ITEMSIZE[dtype])), dtype
    return {"name": name, "dtype": dtype, "shape": shape, "data": data, "raw": raw, "param_id": draw(param_ids)}


@st.composite
def models(draw: st.DrawFn) -> list[dict[str, Any]]:
    return [draw(tensors(name)) for name in draw(st.lists(names, unique=True, max_size=6))]


def to_specs(model: list[dict[str, Any]]) -> list[TensorSpec]:
    return [
        bytes_spec(
            t["name"], t["dtype"], t["shape"], t["data"], t["param_id"], t["raw"] if t["dtype"] == "QFloat" else None
        )
        for t in model
    ]


def same(a: Any, b: Any) -> bool:
    """Equality in which floats compare by their bits (nan == nan, 0.0 != -0.0)."""
    if isinstance(a, float) or isinstance(b, float):
        return type(a) is type(b) and struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and a == b


def expected_layout(model: list[dict[str, Any]], layout: str) -> list[int]:
    """Relative starts as Burn's writer assigns them: input order, 256-aligned unless packed (0.19)."""
    starts, cursor = [], 0
    for t in model:
        start = -(-cursor // 256) * 256 if layout == LAYOUT_ALIGNED else cursor
        starts.append(start)
        cursor = start + len(t["data"])
    return starts


def expected_document(model, starts, metadata, scalars) -> dict[str, Any]:
    tensors_doc = {}
    for i in sorted(range(len(model)), key=lambda i: model[i]["name"].encode()):
        t = model[i]
        tensors_doc[t["name"]] = descriptor(t["raw"], t["shape"], starts[i], starts[i] + len(t["data"]), t["param_id"])
    doc: dict[str, Any] = {"tensors": tensors_doc}
    if metadata:
        doc["metadata"] = {k: metadata[k] for k in sorted(metadata)}
    if scalars:
        doc["scalars"] = {k: {scalars[k].kind: scalars[k].value} for k in sorted(scalars)}
    return doc


def roundtrip(model, metadata, scalars, layout) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        first = write_bpk(Path(tmp, "a.bpk"), to_specs(model), metadata=metadata, scalars=scalars, layout=layout)
        again = write_bpk(Path(tmp, "b.bpk"), to_specs(model), metadata=metadata, scalars=scalars, layout=layout)
        assert again == first, "writing the same tensors twice gave different bytes"

        # the header and CBOR, checked independently of syncd's encoder
        magic, version, size = struct.unpack_from("<IHI", first)
        assert (magic, version) == (0x4255524E, 1)
        meta_end = 10 + size
        data_start = -(-meta_end // 256) * 256 if layout == LAYOUT_ALIGNED else meta_end
        starts = expected_layout(model, layout)
        expected = expected_document(model, starts, metadata, scalars)
        assert same(cbor2.loads(first[10:meta_end]), expected)
        if not any(s.kind == "Float" for s in scalars.values()):  # cbor2 writes every float as f64; Burn does not
            assert first[10:meta_end] == cbor2.dumps(expected)
        assert len(first) == data_start + max(
            (s + len(t["data"]) for s, t in zip(starts, model, strict=True)), default=0
        )
        for start, t in zip(starts, model, strict=True):
            assert first[data_start + start : data_start + start + len(t["data"])] == t["data"]
        covered = bytearray(len(first))
        covered[:meta_end] = b"\x01" * meta_end
        for start, t in zip(starts, model, strict=True):
            covered[data_start + start : data_start + start + len(t["data"])] = b"\x01" * len(t["data"])
        assert all(first[i] == 0 for i, c in enumerate(covered) if not c), "padding must be zero bytes"

        with BurnpackReader(Path(tmp, "a.bpk")) as reader:
            unaligned = any(s % 256 for s in starts) or meta_end % 256
            assert reader.header.facts["layout"] == (
                LAYOUT_PACKED if layout == LAYOUT_PACKED and unaligned else LAYOUT_ALIGNED
            )
            assert reader.header.facts["data_start"] == data_start
            assert reader.header.metadata == metadata
            assert list(reader.header.scalars) == sorted(scalars)
            for key, scalar in scalars.items():
                assert reader.header.scalars[key].kind == scalar.kind
                assert same(reader.header.scalars[key].value, scalar.value)
            assert sorted(t.name for t in reader.tensors) == sorted(t["name"] for t in model)
            for t in model:
                info = reader.tensor(t["name"])
                assert (info.dtype, info.shape, info.param_id, info.nbytes) == (
                    t["dtype"],
                    t["shape"],
                    t["param_id"],
                    len(t["data"]),
                )
                assert same(info.raw_dtype, t["raw"])
                assert reader.read(t["name"]) == t["data"]
                assert b"".join(bytes(p) for p in reader.iter_chunks(t["name"], 3)) == t["data"]
            copy = write_bpk(
                Path(tmp, "c.bpk"),
                specs_from_reader(reader),
                metadata=reader.header.metadata,
                scalars=reader.header.scalars,
                layout=reader.header.facts["layout"],
            )
        assert copy == first, "re-writing what was read changed the bytes"


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(
    model=models(),
    metadata=text_maps,
    scalars=st.dictionaries(st.text(max_size=6), scalar_values, max_size=4),
    layout=st.sampled_from([LAYOUT_ALIGNED, LAYOUT_PACKED]),
)
def test_roundtrip_property(model, metadata, scalars, layout) -> None:
    roundtrip(model, metadata, scalars, layout)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("layout", [LAYOUT_ALIGNED, LAYOUT_PACKED])
def test_roundtrip_every_dtype(dtype: str, layout: str) -> None:
    """Every dtype, with a 0-d tensor, a zero-size one and an odd-sized one, in both layouts."""
    scheme = {"QFloat": {"value": "Q8S", "store": "Native", "mode": "Symmetric", "tensor": None, "block": None}}
    size = ITEMSIZE.get(dtype, 1)
    raw = scheme if dtype == "QFloat" else BOOL_FORMS.get(dtype, dtype)
    model = []
    for name, shape, count in [("a.scalar", (), 1), ("a.empty", (3, 0), 0), ("b.ünï.7", (3, 1), 3)]:
        data = (
            b"".join((i % 2).to_bytes(size, "little") for i in range(count))
            if dtype in BOOL_FORMS
            else bytes((7 * i + 1) % 256 for i in range(count * size + (5 if dtype == "QFloat" else 0)))
        )
        model.append({"name": name, "dtype": dtype, "shape": shape, "data": data, "raw": raw, "param_id": 2**64 - 1})
    model[1]["param_id"] = None
    roundtrip(model, {"format": "burnpack"}, {}, layout)


def test_packed_file_is_detected_as_packed(tmp_path: Path) -> None:
    specs = [bytes_spec("a", "U8", (3,), b"abc"), bytes_spec("b", "F32", (1,), b"\x00\x00\x80\x3f")]
    blob = write_bpk(tmp_path / "old.bpk", specs, layout=LAYOUT_PACKED)
    size = struct.unpack_from("<I", blob, 6)[0]
    assert len(blob) == 10 + size + 7  # no padding anywhere
    with BurnpackReader(tmp_path / "old.bpk") as reader:
        assert reader.header.facts["layout"] == LAYOUT_PACKED
        assert reader.read("b") == b"\x00\x00\x80\x3f"
        assert reader.tensor("b").offset == 10 + size + 3


@pytest.mark.parametrize("extra", [1, 133, 4096])
def test_a_packed_file_with_bytes_after_its_last_tensor_is_still_packed(tmp_path: Path, extra: int) -> None:
    """Burn 0.19's reader takes bytes after the last tensor. Enough of them made the file fit the aligned
    layout, and every tensor was read from the wrong place, exit 0 (one byte: "File truncated"). A tensor
    starting off the alignment is 0.19's whatever the size."""
    specs = [bytes_spec("a", "U8", (3,), b"abc"), bytes_spec("b", "F32", (1,), b"\x00\x00\x80\x3f")]
    blob = write_bpk(tmp_path / "old.bpk", specs, layout=LAYOUT_PACKED)
    (tmp_path / "longer.bpk").write_bytes(blob + b"\xff" * extra)
    with BurnpackReader(tmp_path / "longer.bpk") as reader:
        assert reader.header.facts["layout"] == LAYOUT_PACKED
        assert (reader.read("a"), reader.read("b")) == (b"abc", b"\x00\x00\x80\x3f")
    (tmp_path / "short.bpk").write_bytes(blob[:-1])
    with pytest.raises(IncompleteFileError, match="File truncated"):
        BurnpackReader(tmp_path / "short.bpk")


def test_aligned_file_cut_short_by_its_metadata_padding_is_truncated_not_packed(tmp_path: Path) -> None:
    """Such a file ends exactly where a packed (0.19) file of the same table would; read as packed, every
    tensor came from the wrong bytes. Its gap before the second, 256-aligned tensor says it is not packed."""
    specs = [bytes_spec("a", "F32", (2,), b"\x00" * 4 + b"\x80\x3f" * 2), bytes_spec("b", "U8", (2,), b"de")]
    blob = write_bpk(tmp_path / "new.bpk", specs, layout=LAYOUT_ALIGNED)
    padding = bpk_data_start(blob) - 10 - struct.unpack_from("<I", blob, 6)[0]
    assert padding > 0
    (tmp_path / "cut.bpk").write_bytes(blob[:-padding])
    with pytest.raises(IncompleteFileError, match="File truncated"):
        BurnpackReader(tmp_path / "cut.bpk")


def test_packed_file_with_aligned_metadata_end_is_detected_as_packed(tmp_path: Path) -> None:
    """When 10+N happens to be a multiple of 256 the data section starts at the same place in both layouts;
    the unaligned tensor starts still show a Burn 0.19 file, and re-writing must keep them."""
    for pad in range(300):
        specs = [bytes_spec("a", "U8", (3,), b"abc"), bytes_spec("b", "U8", (2,), b"de")]
        blob = write_bpk(tmp_path / "old.bpk", specs, metadata={"k": "v" * pad}, layout=LAYOUT_PACKED)
        if (10 + struct.unpack_from("<I", blob, 6)[0]) % 256 == 0:
            break
    else:
        pytest.fail("no metadata padding put the data section on a 256-byte boundary")
    with BurnpackReader(tmp_path / "old.bpk") as reader:
        assert reader.header.facts["layout"] == LAYOUT_PACKED
        assert reader.read("b") == b"de"
        again = write_bpk(
            tmp_path / "again.bpk",
            specs_from_reader(reader),
            metadata=reader.header.metadata,
            layout=reader.header.facts["layout"],
        )
    assert again == blob


# ------------------------------------------------------------------------------------------- CBOR bytes


def scalar_bytes(tmp_path: Path, value: Scalar) -> bytes:
    """The CBOR of the `scalars` map holding just {"s": value}."""
    blob = write_bpk(tmp_path / "s.bpk", [], scalars={"s": value})
    meta = blob[10 : 10 + struct.unpack_from("<I", blob, 6)[0]]
    prefix = bytes.fromhex("a2 67") + b"tensors" + bytes.fromhex("a0 67") + b"scalars" + bytes.fromhex("a1 61") + b"s"
    assert meta.startswith(prefix)
    return meta[len(prefix) :]


@pytest.mark.parametrize(
    ("scalar", "cbor_hex"),
    [
        (Scalar("Float", 0.5), "a1 65 466c6f6174 f9 3800"),
        (Scalar("Float", 0.1), "a1 65 466c6f6174 fb 3fb999999999999a"),
        (Scalar("Float", math.inf), "a1 65 466c6f6174 f9 7c00"),
        (Scalar("Float", -math.inf), "a1 65 466c6f6174 f9 fc00"),
        (Scalar("Float", math.nan), "a1 65 466c6f6174 f9 7e00"),
        (Scalar("Float", -0.0), "a1 65 466c6f6174 f9 8000"),
        (Scalar("Float", 65504.0), "a1 65 466c6f6174 f9 7bff"),
        (Scalar("Float", 2.0**-24), "a1 65 466c6f6174 f9 0001"),
        (Scalar("Float", 65520.0), "a1 65 466c6f6174 fa 477ff000"),
        (Scalar("Float", 1e300), "a1 65 466c6f6174 fb 7e37e43c8800759c"),
        (Scalar("Int", -1), "a1 63 496e74 20"),
        (Scalar("Int", -(2**63)), "a1 63 496e74 3b 7fffffffffffffff"),
        (Scalar("Int", 2**63 - 1), "a1 63 496e74 1b 7fffffffffffffff"),
        (Scalar("UInt", 2**64 - 1), "a1 64 55496e74 1b ffffffffffffffff"),
        (Scalar("UInt", 24), "a1 64 55496e74 18 18"),
        (Scalar("Bool", True), "a1 64 426f6f6c f5"),
    ],
    ids=lambda v: repr(v.value) if isinstance(v, Scalar) else None,
)
def test_scalar_encoding_is_ciboriums(scalar: Scalar, cbor_hex: str, tmp_path: Path) -> None:
    assert scalar_bytes(tmp_path, scalar) == bytes.fromhex(cbor_hex)


def test_descriptor_bytes_match_burns(tmp_path: Path) -> None:
    """Key order dtype, shape, data_offsets, param_id; Bool(Native) as a one-entry map; no null param_id."""
    blob = write_bpk(
        tmp_path / "d.bpk",
        [
            bytes_spec("b", "Bool(Native)", (1,), b"\x01", param_id=None),
            bytes_spec("a", "F32", (), b"\0\0\0\0", 2**64 - 1),
        ],
    )
    meta = blob[10 : 10 + struct.unpack_from("<I", blob, 6)[0]]
    h, text = bytes.fromhex, cbor_text
    expected = b"".join([
        h("a1"), text("tensors"), h("a2"),
        text("a"), h("a4"), text("dtype"), text("F32"), text("shape"), h("80"),
        text("data_offsets"), h("82 19 0100 19 0104"), text("param_id"), h("1b ffffffffffffffff"),
        text("b"), h("a3"), text("dtype"), h("a1 64 426f6f6c 66 4e6174697665"), text("shape"), h("81 01"),
        text("data_offsets"), h("82 00 01"),
    ])  # fmt: skip
    assert meta == expected
    # "b" (written first) at 0, "a" at the next 256-byte boundary; no padding after the last tensor
    assert len(blob) == 256 + 260 and blob[256:257] == b"\x01" and blob[257:512] == bytes(255)


# ------------------------------------------------------------------------------------------- refusals


def fill_with(*pieces: bytes, positional: bool = False) -> Any:
    def fill(sink: Any) -> None:
        offset = 0
        for piece in pieces:
            if positional:
                sink.pwrite(piece, offset)
            else:
                sink.write(piece)
            offset += len(piece)

    return fill


REFUSALS = {
    "duplicate name": (
        [bytes_spec("a.b", "U8", (1,), b"x"), bytes_spec("a.b", "U8", (1,), b"y")],
        "Duplicate tensor name 'a.b'",
        None,
    ),
    "length mismatch": (
        [bytes_spec("w", "F32", (2,), b"\0" * 4)],
        "declares 4 bytes but its shape [2] and dtype F32 need 8",
        "w",
    ),
    "bool 0xFF": ([bytes_spec("m", "Bool(Native)", (2,), b"\x01\xff")], "other than 0 or 1", "m"),
    "legacy bool 0xFF": ([bytes_spec("m", "Bool", (1,), b"\xff")], "other than 0 or 1", "m"),
    "Bool(U8) 2": ([bytes_spec("m", "Bool(U8)", (1,), b"\x02")], "other than 0 or 1", "m"),
    "Bool(U32) 256": ([bytes_spec("m", "Bool(U32)", (1,), (256).to_bytes(4, "little"))], "other than 0 or 1", "m"),
    "param_id 2^64": ([bytes_spec("p", "U8", (1,), b"x", param_id=2**64)], "param_id 18446744073709551616", "p"),
    "negative param_id": ([bytes_spec("p", "U8", (1,), b"x", param_id=-1)], "param_id -1", "p"),
    "empty segment": ([bytes_spec("a..b", "U8", (1,), b"x")], "empty path segment", None),
    "QFloat without scheme": ([bytes_spec("q", "QFloat", (1,), b"x")], "no quantization scheme", None),
    "too few bytes": ([TensorSpec("f", "U8", (4,), 4, fill_with(b"ab"))], "expected 4, got 2", "f"),
    "too many bytes": (
        [TensorSpec("f", "U8", (4,), 4, fill_with(b"abc", b"de"))],
        "expected 4, got a write reaching 5",
        "f",
    ),
    "too many bytes by position": (
        [TensorSpec("f", "U8", (2,), 2, fill_with(b"ab", b"c", positional=True))],
        "expected 2",
        "f",
    ),
    "too few bytes by position": (
        [TensorSpec("f", "U8", (2,), 2, fill_with(b"a", positional=True))],
        "expected 2, got 1",
        "f",
    ),
}


@pytest.mark.parametrize(("specs", "fragment", "tensor"), REFUSALS.values(), ids=REFUSALS.keys())
def test_writer_refuses(specs: list[TensorSpec], fragment: str, tensor: str | None, tmp_path: Path) -> None:
    with pytest.raises(FormatError) as info:
        write_bpk(tmp_path / "out.bpk", specs)
    assert fragment in str(info.value)
    assert info.value.tensor == tensor
    if tensor is not None:
        assert f"tensor '{tensor}'" in str(info.value)


@pytest.mark.parametrize(
    ("scalars", "fragment"),
    [
        ({"s": Scalar("Int", 2**63)}, "does not fit"),
        ({"s": Scalar("UInt", -1)}, "does not fit"),
        ({"s": Scalar("Str", 1)}, "unknown scalar"),
    ],
)
def test_writer_refuses_bad_scalars(scalars: dict[str, Scalar], fragment: str, tmp_path: Path) -> None:
    with pytest.raises(FormatError, match=fragment):
        write_bpk(tmp_path / "out.bpk", [], scalars=scalars)


@pytest.mark.slow
def test_writer_refuses_more_than_max_tensors(tmp_path: Path) -> None:
    filled = []

    def fill(sink: Any) -> None:
        filled.append(1)

    specs = [TensorSpec(f"t{i}", "U8", (0,), 0, fill) for i in range(MAX_TENSOR_COUNT + 1)]
    with pytest.raises(FormatError, match="100001 tensors exceed Burn's maximum of 100000"):
        write_bpk(tmp_path / "out.bpk", specs)
    assert not filled  # refused before any tensor was written
    write_bpk(tmp_path / "ok.bpk", specs[:MAX_TENSOR_COUNT])  # the limit itself is allowed
    with BurnpackReader(tmp_path / "ok.bpk") as reader:
        assert len(reader.tensors) == MAX_TENSOR_COUNT


def test_reader_accepts_unknown_keys_any_int_width_and_version_0(tmp_path: Path) -> None:
    """Burn reads with serde: unknown keys are ignored, integer widths are free, version 0 is accepted."""
    h, text = bytes.fromhex, cbor_text
    meta = b"".join([
        h("a2"), text("tensors"), h("a1"), text("w"),
        h("a4"), text("dtype"), text("F32"), text("shape"), h("81 01"),
        text("data_offsets"), h("82 00 1b 0000000000000004"),  # 4 as a 64-bit integer
        text("extra"), h("f6"),  # unknown descriptor key
        text("later"), h("80"),  # unknown top-level key
    ])  # fmt: skip
    path = tmp_path / "v0.bpk"
    path.write_bytes(bpk_bytes(meta_raw=meta, version=0, data=b"\x00\x00\x80\x3f"))
    with BurnpackReader(path) as reader:
        assert reader.read("w") == b"\x00\x00\x80\x3f"
        assert reader.header.facts["unknown_keys"] == ["later"]
