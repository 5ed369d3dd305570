"""Safetensors reader and writer: byte-identical to the `safetensors` library, readable by PyTorch."""

from __future__ import annotations

import json
import math
import os
import re
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
import safetensors
import safetensors.numpy
import safetensors.torch
import torch
from conftest import FIXTURES as _FIXTURES_DIR
from formatgen import bpk_bytes, bytes_spec, descriptor, specs_from_reader, write_st
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import TensorSpec as LibSpec
from safetensors import safe_open

from syncd.errors import FormatError
from syncd.formats import BURNPACK, SAFETENSORS, open_checkpoint, sniff_format
from syncd.formats.dtypes import ITEMSIZE, SAFETENSORS_TO_DTYPE, SUBBYTE_BITS
from syncd.formats.safetensors import SafetensorsReader
from syncd.formats.table import TensorSpec

pytestmark = pytest.mark.torch

FIXTURES = sorted((_FIXTURES_DIR / "pytorch").glob("*.safetensors"))

# safetensors dtype -> the name the library's TensorSpec takes (torch's spelling)
LIB_DTYPE = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "F4": "float4_e2m1fn_x2",
    "C64": "complex64",
}
TORCH_DTYPE = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "F4": torch.float4_e2m1fn_x2,
    "C64": torch.complex64,
}
NUMPY_DTYPE = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U64": np.uint64,
    "U32": np.uint32,
    "U16": np.uint16,
    "U8": np.uint8,
    "BOOL": np.bool_,
    "C64": np.complex64,
}
WHOLE_BYTE = [name for name in SAFETENSORS_TO_DTYPE if SAFETENSORS_TO_DTYPE[name] in ITEMSIZE]


def test_dtype_tables_cover_the_library() -> None:
    assert set(WHOLE_BYTE) | {"F4"} == set(LIB_DTYPE)  # every whole-byte dtype (and F4) is compared below
    assert set(SAFETENSORS_TO_DTYPE) == set(LIB_DTYPE) | {"F6_E2M3", "F6_E3M2"}


def nbytes_of(st_dtype: str, shape: tuple[int, ...]) -> int:
    count = math.prod(shape)
    if st_dtype in SUBBYTE_BITS:
        return count * SUBBYTE_BITS[st_dtype] // 8
    return count * ITEMSIZE[SAFETENSORS_TO_DTYPE[st_dtype]]


def valid_bytes(st_dtype: str, count: int, seed: int) -> bytes:
    """Bytes every reader accepts for this dtype (bools are 0/1)."""
    if st_dtype == "BOOL":
        return bytes((seed + i) % 2 for i in range(count))
    return bytes((seed * 31 + 7 * i + 3) % 256 for i in range(count))


def library_bytes(tensors: list[tuple[str, str, tuple[int, ...], bytes]], metadata: dict[str, str] | None) -> bytes:
    """What `safetensors.serialize` writes for these (name, dtype, shape, data)."""
    keep = []
    specs = {}
    for name, st_dtype, shape, data in tensors:
        array = np.frombuffer(bytearray(data) or bytearray(1), dtype=np.uint8)
        keep.append(array)
        lib_shape = list(shape)
        if st_dtype == "F4":  # the library takes the storage shape (two values per byte) and doubles it
            lib_shape[-1] //= 2
        specs[name] = LibSpec(
            dtype=LIB_DTYPE[st_dtype], shape=lib_shape, data_ptr=array.ctypes.data, data_len=len(data)
        )
    return bytes(safetensors.serialize(specs, metadata=metadata))


def our_specs(tensors: list[tuple[str, str, tuple[int, ...], bytes]]) -> list[TensorSpec]:
    return [bytes_spec(name, SAFETENSORS_TO_DTYPE[dt], shape, data) for name, dt, shape, data in tensors]


def torch_bytes(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def check_torch_reads(path: Path, tensors: list[tuple[str, str, tuple[int, ...], bytes]]) -> None:
    loaded = safetensors.torch.load_file(path)
    assert set(loaded) == {t[0] for t in tensors}
    for name, st_dtype, shape, data in tensors:
        tensor = loaded[name]
        assert tensor.dtype == TORCH_DTYPE[st_dtype]
        storage_shape = (*shape[:-1], shape[-1] // 2) if st_dtype == "F4" else shape
        assert tuple(tensor.shape) == storage_shape
        expected = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        assert torch.equal(tensor.contiguous().reshape(-1).view(torch.uint8), expected)


def check_reader(path: Path, tensors: list[tuple[str, str, tuple[int, ...], bytes]], metadata: dict | None) -> None:
    with SafetensorsReader(path) as reader:
        assert reader.header.metadata == (metadata or {})
        assert {t.name for t in reader.tensors} == {t[0] for t in tensors}
        for name, st_dtype, shape, data in tensors:
            info = reader.tensor(name)
            assert (info.dtype, info.raw_dtype, info.shape, info.nbytes) == (
                SAFETENSORS_TO_DTYPE[st_dtype],
                st_dtype,
                shape,
                len(data),
            )
            assert reader.read(name) == data


# ------------------------------------------------------------------------------------------- every dtype


def dtype_case(st_dtype: str) -> list[tuple[str, str, tuple[int, ...], bytes]]:
    if st_dtype in SUBBYTE_BITS:  # sub-byte types need whole bytes: F4 pairs, F6 quadruples
        shapes = [("x.pair", (2, 4)), ("x.none", (0, 4)), ("y", (8,))]
    else:
        shapes = [("x.scalar", ()), ("x.none", (2, 0)), ("y.ü", (2, 3))]
    return [
        (name, st_dtype, shape, valid_bytes(st_dtype, nbytes_of(st_dtype, shape), i))
        for i, (name, shape) in enumerate(shapes)
    ]


@pytest.mark.parametrize("st_dtype", [*WHOLE_BYTE, "F4"])
def test_writer_matches_library_and_torch_reads_it(st_dtype: str, tmp_path: Path) -> None:
    tensors = dtype_case(st_dtype)
    others = [("other", "F32", (1,), b"\x00\x00\x80\x3f"), ("z.last", "U8", (3,), b"abc")]
    for metadata in (None, {"format": "pt"}):
        ours = write_st(tmp_path / "ours.safetensors", our_specs(tensors + others), metadata)
        assert ours == library_bytes(tensors + others, metadata)
        check_torch_reads(tmp_path / "ours.safetensors", tensors + others)
        check_reader(tmp_path / "ours.safetensors", tensors + others, metadata)


@pytest.mark.parametrize("st_dtype", sorted(NUMPY_DTYPE))
def test_writer_matches_numpy_save(st_dtype: str, tmp_path: Path) -> None:
    tensors = dtype_case(st_dtype)
    arrays = {
        name: np.frombuffer(bytearray(data), dtype=np.dtype(NUMPY_DTYPE[st_dtype]).newbyteorder("<")).reshape(shape)
        for name, _, shape, data in tensors
    }
    ours = write_st(tmp_path / "ours.safetensors", our_specs(tensors), {"k": "v"})
    assert ours == safetensors.numpy.save(arrays, metadata={"k": "v"})
    loaded = safetensors.numpy.load_file(tmp_path / "ours.safetensors")
    for name in arrays:
        assert loaded[name].dtype == arrays[name].dtype and loaded[name].shape == arrays[name].shape
        assert loaded[name].tobytes() == arrays[name].tobytes()


@pytest.mark.parametrize("st_dtype", sorted(SUBBYTE_BITS))
def test_subbyte_roundtrip(st_dtype: str, tmp_path: Path) -> None:
    tensors = dtype_case(st_dtype)
    blob = write_st(tmp_path / "s.safetensors", our_specs(tensors))
    (size,) = struct.unpack_from("<Q", blob)
    header = json.loads(blob[8 : 8 + size])
    assert header["x.pair"] == {"dtype": st_dtype, "shape": [2, 4], "data_offsets": header["x.pair"]["data_offsets"]}
    check_reader(tmp_path / "s.safetensors", tensors, None)


# ------------------------------------------------------------------------------------------- property

LIB_DTYPES = sorted(LIB_DTYPE)
tensor_names = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=8).filter(
    lambda n: n != "__metadata__"
)
shapes = st.lists(st.integers(0, 4), max_size=3).map(tuple)
meta_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=6)


@st.composite
def models(draw: st.DrawFn) -> list[tuple[str, str, tuple[int, ...], bytes]]:
    out = []
    for name in draw(st.lists(tensor_names, unique=True, max_size=6)):
        st_dtype = draw(st.sampled_from(LIB_DTYPES))
        shape = draw(shapes)
        if st_dtype == "F4":
            shape = (*shape, 2 * draw(st.integers(0, 2)))
        size = nbytes_of(st_dtype, shape)
        if st_dtype == "BOOL":
            data = bytes(draw(st.lists(st.integers(0, 1), min_size=size, max_size=size)))
        else:
            data = draw(st.binary(min_size=size, max_size=size))
        out.append((name, st_dtype, shape, data))
    return out


@settings(max_examples=150, deadline=None)
@given(tensors=models(), metadata=st.none() | st.dictionaries(meta_text, meta_text, min_size=1, max_size=1))
def test_writer_matches_library_property(tensors, metadata) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "p.safetensors")
        ours = write_st(path, our_specs(tensors), metadata)
        assert ours == library_bytes(tensors, metadata)
        assert write_st(Path(tmp, "again.safetensors"), our_specs(tensors), metadata) == ours
        check_reader(path, tensors, metadata)
        with SafetensorsReader(path) as reader:
            assert write_st(Path(tmp, "copy.safetensors"), specs_from_reader(reader), reader.header.metadata) == ours


@settings(max_examples=50, deadline=None)
@given(tensors=models(), metadata=st.dictionaries(meta_text, meta_text, min_size=2, max_size=5))
def test_many_metadata_keys_property(tensors, metadata) -> None:
    """The library writes `__metadata__` in hash order; ours is sorted, the rest of the file identical."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "m.safetensors")
        ours = write_st(path, our_specs(tensors), metadata)
        theirs = library_bytes(tensors, metadata)
        assert len(ours) == len(theirs)
        (size,) = struct.unpack_from("<Q", ours)
        assert ours[8 + size :] == theirs[8 + size :]
        header = json.loads(ours[8 : 8 + size])
        assert header == json.loads(theirs[8 : 8 + size])
        assert list(header)[0] == "__metadata__" and list(header["__metadata__"]) == sorted(metadata)
        check_reader(path, tensors, metadata)


# ------------------------------------------------------------------------------------------- PyTorch's files


@pytest.mark.parametrize("source", FIXTURES, ids=os.path.basename)
def test_pytorch_fixtures(source: str, tmp_path: Path) -> None:
    with SafetensorsReader(source) as reader, safe_open(source, framework="pt") as lib:
        names = lib.keys()
        assert sorted(t.name for t in reader.tensors) == sorted(names)
        assert reader.header.metadata == (lib.metadata() or {})
        for name in names:
            info = reader.tensor(name)
            view = lib.get_slice(name)
            assert info.raw_dtype == view.get_dtype()
            assert info.dtype == SAFETENSORS_TO_DTYPE[view.get_dtype()]
            assert list(info.shape) == view.get_shape()
            assert reader.read(name) == torch_bytes(lib.get_tensor(name))
        copy = write_st(tmp_path / "copy.safetensors", specs_from_reader(reader), reader.header.metadata)
    assert copy == Path(source).read_bytes()


def test_mnist_fixture_details() -> None:
    with open_checkpoint(FIXTURES[0]) as reader:
        assert isinstance(reader, SafetensorsReader)
        assert reader.tensor("norm1.num_batches_tracked").dtype == "I64"
        assert reader.tensor("norm1.num_batches_tracked").shape == ()
        assert reader.tensor("fc1.weight").shape == (32, 11616)
        assert reader.tensors[0].name == "norm1.num_batches_tracked"  # I64 sorts first in the library's order
        assert reader.header.facts["data_start"] == 1528


# ------------------------------------------------------------------------------------------- writer refusals

REFUSALS = {
    "duplicate name": (
        [bytes_spec("a", "U8", (1,), b"x"), bytes_spec("a", "U8", (1,), b"y")],
        "Duplicate tensor name 'a'",
        None,
    ),
    "length mismatch": (
        [bytes_spec("w", "F32", (2,), b"\0" * 4)],
        "declares 4 bytes but its shape [2] and dtype F32 need 8",
        "w",
    ),
    "__metadata__ name": ([bytes_spec("__metadata__", "U8", (1,), b"x")], "cannot be named __metadata__", None),
    "QFloat": ([bytes_spec("q", "QFloat", (1,), b"x", raw_dtype={"QFloat": {"value": "Q8S"}})], "need None", "q"),
    "odd F6": ([bytes_spec("f", "F6_E2M3", (3,), b"\0\0")], "need -1", "f"),
    "bool 0xFF": ([bytes_spec("m", "Bool(Native)", (2,), b"\x01\xff")], "other than 0 or 1", "m"),
    "too few bytes": ([TensorSpec("f", "U8", (4,), 4, lambda sink: sink.write(b"ab"))], "expected 4, got 2", "f"),
    "too many bytes": ([TensorSpec("f", "U8", (1,), 1, lambda sink: sink.write(b"ab"))], "expected 1", "f"),
}


@pytest.mark.parametrize(("specs", "fragment", "tensor"), REFUSALS.values(), ids=REFUSALS.keys())
def test_writer_refuses(specs: list[TensorSpec], fragment: str, tensor: str | None, tmp_path: Path) -> None:
    with pytest.raises(FormatError) as info:
        write_st(tmp_path / "out.safetensors", specs)
    assert fragment in str(info.value)
    assert info.value.tensor == tensor


def test_writer_refuses_non_text_metadata(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match="text to text"):
        write_st(tmp_path / "out.safetensors", [], {"k": 1})  # type: ignore[dict-item]


# ------------------------------------------------------------------------------------------- sniffing


def test_sniffing_goes_by_content(tmp_path: Path) -> None:
    st_file = tmp_path / "weights.bin"
    write_st(st_file, [bytes_spec("a", "U8", (1,), b"x")])
    bpk_file = tmp_path / "weights.safetensors"
    bpk_file.write_bytes(bpk_bytes({"a": descriptor("U8", [1], 0, 1)}, b"x"))
    assert sniff_format(st_file) == SAFETENSORS
    assert sniff_format(bpk_file) == BURNPACK
    with open_checkpoint(bpk_file) as reader:
        assert reader.read("a") == b"x"
    fake = tmp_path / "fake.bpk"
    fake.write_bytes((st_file).read_bytes())
    with pytest.raises(FormatError, match="Invalid magic number") as info:
        open_checkpoint(fake)
    assert info.value.path == str(fake)


@pytest.mark.parametrize("shape", [[2**40, 2**40, 0], [2**31, 2**31, 2**31, 0], [0, 2**40, 2**40], [2**32, 2**31, 0]])
def test_a_zero_size_shape_is_refused_exactly_where_the_library_refuses_it(tmp_path: Path, shape: list[int]) -> None:
    """The library multiplies a shape's dimensions in order in 64 bits and refuses an overflow on the way, even
    where a 0 comes later: syncd reads what it reads, and never writes a file it refuses (a .bpk tensor
    [2^40, 2^40, 0], which Burn takes, made a .safetensors the library would not open, exit 0)."""
    path = tmp_path / "z.safetensors"
    header = json.dumps({"z": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    try:
        safetensors.safe_open(str(path), "np").keys()
        library_reads = True
    except Exception:
        library_reads = False
    if library_reads:
        with open_checkpoint(path) as reader:
            assert reader.tensor("z").shape == tuple(shape)
    else:
        with pytest.raises(FormatError, match="passes 2\\^64"):
            open_checkpoint(path)
    spec = TensorSpec("z", "F32", tuple(shape), 0, lambda sink: None)
    if library_reads:
        write_st(tmp_path / "w.safetensors", [spec])
        safetensors.safe_open(str(tmp_path / "w.safetensors"), "np").keys()
    else:
        with pytest.raises(FormatError, match="cannot be held in safetensors"):
            write_st(tmp_path / "w.safetensors", [spec])


def test_a_zero_size_dimension_torch_cannot_load_is_never_written(tmp_path: Path) -> None:
    """[2^64 - 1, 1, 0]: the library reads it, torch does not (a shape is signed 64-bit there), and torch is
    the client a .safetensors is written for."""
    spec = TensorSpec("z", "F32", (2**64 - 1, 1, 0), 0, lambda sink: None)
    with pytest.raises(FormatError, match="2\\^63 or more, which PyTorch cannot load"):
        write_st(tmp_path / "w.safetensors", [spec])
    write_st(tmp_path / "ok.safetensors", [TensorSpec("z", "F32", (2**62, 1, 0), 0, lambda sink: None)])
    assert safetensors.torch.load_file(tmp_path / "ok.safetensors")["z"].shape == (2**62, 1, 0)


@pytest.mark.parametrize(
    ("entry", "error"),
    [
        ('{"dtype":"F32","shape":[-0],"data_offsets":[0,0]}', "-0 is not an unsigned integer"),
        ('{"dtype":"F32","shape":[1],"data_offsets":[-0,4]}', "-0 is not an unsigned integer"),
        ('{"dtype":"F32","shape":[1' + "0" * 5000 + '],"data_offsets":[0,4]}', "an integer of more than 4300 digits"),
        ('{"dtype":"F32","shape":[1],"data_offsets":[0,4]}', None),
    ],
    ids=["shape", "offset", "digits", "valid"],
)
def test_numbers_the_library_refuses_are_refused_in_words_a_person_can_act_on(
    tmp_path: Path, entry: str, error: str | None
) -> None:
    """`-0` is the integer 0 to Python and no unsigned integer to the library; an integer past Python's limit on
    digits said to call sys.set_int_max_str_digits(). A name holding "-0" is a name."""
    path = tmp_path / "n.safetensors"
    header = ('{"layer-0.w":' + entry + "}").encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
    try:
        safetensors.safe_open(str(path), "np").keys()
        library_reads = True
    except Exception:
        library_reads = False
    assert library_reads == (error is None)
    if error is None:
        with open_checkpoint(path) as reader:
            assert reader.tensor("layer-0.w").shape == (1,)
    else:
        with pytest.raises(FormatError, match=re.escape(f"header is not valid JSON: {error}")):
            open_checkpoint(path)
