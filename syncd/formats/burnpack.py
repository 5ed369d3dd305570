"""Burn's burnpack (`.bpk`) container: a byte-exact reader and writer. Knows nothing of modules.

Layout (docs/burn-format.md#container): 10-byte header (magic u32 LE, version u16 LE, metadata size u32 LE), CBOR
metadata, zero padding up to the data section, then each tensor's raw little-endian bytes at
`data_start + data_offsets[0]`. Burn >= 0.20 aligns the data section and every tensor to 256 bytes;
Burn 0.19 packs tensors right after the metadata with the same version number (docs/burn-format.md#alignment).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from operator import attrgetter
from typing import Any, NamedTuple

import cbor2

from syncd.errors import FormatError, IncompleteFileError
from syncd.formats.dtypes import ITEMSIZE, PLAIN_DIM, PLAIN_RANK, byte_length, plain_byte_length
from syncd.formats.fileio import (
    DECODE_BUDGET,
    TensorFileReader,
    pread_exact,
    pwrite_all,
    refuse_costly_decode,
    text_width,
    write_tensors,
    write_zeros,
)
from syncd.formats.table import CheckpointHeader, TensorInfo, TensorSpec, tensor_info

NAME = "burnpack"  # described in registry.py
MAGIC = 0x4255524E
FORMAT_VERSION = 1
HEADER_SIZE = 10
TENSOR_ALIGNMENT = 256
# Burn's reader limits (docs/burn-format.md#reader-limits); our writer enforces them too (#writer-checks).
MAX_METADATA_SIZE = 104_857_600
MAX_TENSOR_SIZE = 10_737_418_240
MAX_TENSOR_COUNT = 100_000
MAX_CBOR_DEPTH = 128
MAX_FILE_SIZE = 107_374_182_400
U64_LIMIT = 1 << 64
I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1

UNIT_DTYPES = frozenset(
    ["F64", "F32", "Flex32", "F16", "BF16", "I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "Bool"]
)
BOOL_STORES = {"Native": "Bool(Native)", "U8": "Bool(U8)", "U32": "Bool(U32)"}
QUANT_VALUES = frozenset(["Q8F", "E5M2", "E4M3", "Q4F", "E2M1", "Q2F", "Q8S", "Q4S", "Q2S"])
SCALAR_KINDS = ("Int", "UInt", "Float", "Bool")

LAYOUT_ALIGNED = "aligned"  # Burn >= 0.20
LAYOUT_PACKED = "packed"  # Burn 0.19


@dataclass(frozen=True)
class Scalar:
    """A burnpack scalar (docs/burn-format.md#scalars): kind is Int, UInt, Float or Bool."""

    kind: str
    value: int | float | bool


NAN_PREFIX = "nan:"  # then the IEEE 754 binary64 bits, big-endian hex


def nan_text(value: float) -> str:
    """A NaN scalar with its sign and payload: `nan:` and its binary64 bits (`str` and `float.hex` say "nan")."""
    return NAN_PREFIX + struct.pack(">d", value).hex()


def align_up(value: int, alignment: int = TENSOR_ALIGNMENT) -> int:
    return (value + alignment - 1) // alignment * alignment


# ---------------------------------------------------------------------------------------------- reading


class BurnpackReader(TensorFileReader):
    """Parses and validates a burnpack file's header; tensor bytes are read only when asked for."""

    def _fail(self, message: str, tensor: str | None = None) -> FormatError:
        return FormatError(message, self.path, tensor)

    def _short(self, message: str, tensor: str | None = None) -> FormatError:
        """The file ends before its header says it does: truncated, or still being written."""
        return IncompleteFileError(message, self.path, tensor)

    def _parse(self) -> None:
        document, version, meta_size = read_document(self.fd, self.file_size, self.path)
        tensors_doc, metadata, scalars, extra_keys = split_document(document, self.path)
        if len(tensors_doc) > MAX_TENSOR_COUNT:
            raise self._fail(f"File contains {len(tensors_doc)} tensors, exceeding maximum of {MAX_TENSOR_COUNT}")
        # each tensor is placed first where an aligned data section (Burn >= 0.20, most files) puts it: one
        # record per tensor, moved afterwards only in a packed (Burn 0.19) file
        placed_at = align_up(HEADER_SIZE + meta_size)
        tensors = parse_descriptors(tensors_doc, placed_at, self.path)
        self._index(tensors)
        placement = _placement(self.tensors)
        layout, data_start = self._detect_layout(meta_size, tensors, placement)
        if data_start != placed_at:
            tensors = [t._replace(offset=t.offset - placed_at + data_start) for t in tensors]
            self._index(tensors)
        if placement.overlap:  # (then check_ranges finds it, in the order that names the tensors it always named)
            check_ranges(tensors, data_start, self.path)
        top_keys = [k for k in document if isinstance(k, str)]
        self.header = CheckpointHeader(
            format=NAME,
            path=self.path,
            file_size=self.file_size,
            metadata=metadata,
            scalars=scalars,
            facts={
                "version": version,
                "metadata_size": meta_size,
                "data_start": data_start,
                "layout": layout,
                "top_level_keys": top_keys,
                "unknown_keys": extra_keys,
                "tensor_key_order": list(tensors_doc),  # (the tensors' names, in the order parsed)
            },
        )

    def _detect_layout(self, meta_size: int, tensors: list[TensorInfo], placement: _Placement) -> tuple[str, int]:
        """Aligned (Burn >= 0.20) or packed (Burn 0.19) data section, told apart by file size
        (docs/burn-format.md#alignment). `tensors` are placed after an aligned data section's start."""
        unaligned = HEADER_SIZE + meta_size
        aligned = align_up(unaligned)
        max_end = placement.end - aligned if tensors else 0
        if placement.misaligned:
            # Burn >= 0.20 starts every tensor at a multiple of the alignment: a start that is not is Burn
            # 0.19's, whatever the file's size says (bytes after the last tensor, which its reader takes, made it
            # fit the aligned layout: every tensor read from the wrong place, exit 0)
            if unaligned + max_end <= self.file_size:
                return LAYOUT_PACKED, unaligned
            runs_past = max(tensors, key=_end).name
            raise self._short(
                f"File truncated: expected at least {unaligned + max_end} bytes, got {self.file_size} bytes", runs_past
            )
        if aligned + max_end <= self.file_size:
            # when 10+N is itself aligned the data section starts at the same place in both layouts; only the
            # tensors' starts then tell a 0.19 file, and re-writing it must keep them unaligned
            if unaligned == aligned and any(t.offset % TENSOR_ALIGNMENT for t in tensors):
                return LAYOUT_PACKED, unaligned
            return LAYOUT_ALIGNED, aligned
        if unaligned != aligned and unaligned + max_end == self.file_size and _back_to_back(tensors, aligned):
            return LAYOUT_PACKED, unaligned
        last = max(tensors, key=_end).name if tensors else None  # the tensor that runs past
        raise self._short(
            f"File truncated: expected at least {aligned + max_end} bytes, got {self.file_size} bytes", last
        )


def _end(info: TensorInfo) -> int:
    return info.offset + info.nbytes


class _Placement(NamedTuple):
    """What the layout and range checks need of a table, gathered in one pass over it in file order."""

    end: int  # the largest end of any tensor, empty ones too (0 for no tensor)
    misaligned: bool  # a tensor holding bytes starts off the 256-byte grid
    overlap: bool  # two tensors holding bytes share some


def _placement(placed: list[TensorInfo]) -> _Placement:
    """`placed`: tensors sorted by offset then size, at offsets that are a multiple of the alignment apart from
    their starts. One loop over them instead of a pass (with a generator) for each check: it runs per tensor.
    In that order two tensors holding bytes overlap only if one overlaps the one before it that holds bytes."""
    data_end = filled_to = 0
    misaligned = overlap = False
    for _, _, _, offset, nbytes, _, _ in placed:
        end = offset + nbytes
        if end > data_end:
            data_end = end
        if nbytes:
            if offset < filled_to:
                overlap = True
            if offset % TENSOR_ALIGNMENT:
                misaligned = True
            filled_to = end
    return _Placement(data_end, misaligned, overlap)


def _back_to_back(tensors: list[TensorInfo], data_start: int) -> bool:
    """Whether the tensors lie end to end from `data_start`, as Burn 0.19 packs them: the only layout a packed file can
    have. An aligned file cut short by exactly its metadata padding also ends where a packed one would, but
    its gaps before 256-aligned starts give it away (read as packed, every tensor would be the wrong bytes)."""
    cursor = data_start  # (`tensors` lie at offsets from data_start)
    for start, end in sorted((t.offset, t.offset + t.nbytes) for t in tensors if t.nbytes):
        if start != cursor:
            return False
        cursor = end
    return True


def read_document(fd: int, file_size: int, path: str) -> tuple[Any, int, int]:
    """(the decoded CBOR document, format version, metadata size) of a burnpack file: its fixed header and
    sizes checked, the document decoded with Burn's limits; what is in it is not checked yet."""
    if file_size > MAX_FILE_SIZE:
        raise FormatError(f"File size {file_size} bytes exceeds maximum allowed size of {MAX_FILE_SIZE} bytes", path)
    if file_size < HEADER_SIZE:
        raise IncompleteFileError(f"Invalid header: insufficient bytes ({file_size} of {HEADER_SIZE})", path)
    magic, version, meta_size = struct.unpack("<IHI", pread_exact(fd, HEADER_SIZE, 0, path, "header"))
    if magic != MAGIC:
        raise FormatError(f"Invalid magic number 0x{magic:08x}: not a burnpack file", path)
    if version > FORMAT_VERSION:
        raise FormatError(f"Unsupported version {version} (this reader knows version {FORMAT_VERSION})", path)
    if meta_size > MAX_METADATA_SIZE:
        raise FormatError(f"Metadata size {meta_size} exceeds maximum allowed size of {MAX_METADATA_SIZE} bytes", path)
    if file_size < HEADER_SIZE + meta_size:
        raise IncompleteFileError(
            f"Invalid header: metadata needs {meta_size} bytes but the file has "
            f"{file_size - HEADER_SIZE} after the header (truncated)",
            path,
        )
    raw = pread_exact(fd, meta_size, HEADER_SIZE, path, "metadata")
    return decode_cbor(raw, path), version, meta_size


def read_metadata(fd: int, file_size: int, path: str) -> dict[str, str]:
    """The file's metadata (text to text), its tensor table left unchecked (see formats.read_metadata)."""
    document, _, _ = read_document(fd, file_size, path)
    return split_document(document, path)[1]


class _Descriptor(NamedTuple):
    """One descriptor as read, before the data section's start is known (then a TensorInfo). A tuple, made
    through `_descriptor` (tuple.__new__, no Python frame): one per tensor, at a third of a dataclass's cost."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int
    param_id: int | None
    raw_dtype: Any


_descriptor = partial(tuple.__new__, _Descriptor)


class _RejectEveryTag(Mapping):
    """cbor2 decodes the tags it knows (bignums 2/3, dates 0/1, ...) itself, never asking `tag_hook`; as its
    `semantic_decoders` this mapping overrides every tag number with a decoder that refuses it."""

    def __getitem__(self, tag: int) -> Callable[..., Any]:
        def reject(*_: Any) -> Any:
            raise ValueError(f"CBOR tag {tag} is not allowed in burnpack metadata")

        return reject

    def __iter__(self) -> Iterator[int]:
        return iter(())

    def __len__(self) -> int:
        return 0


_HEAD_EXTRA = {24: 1, 25: 2, 26: 4, 27: 8}


def decoded_cost(raw: bytes, budget: int = DECODE_BUDGET) -> int:
    """An upper estimate of the memory cbor2 needs for `raw`, stopping once it passes `budget`.

    One pass without building anything: containers and their slots, text and byte strings, integers beyond
    CPython's small-int cache and floats are charged what CPython objects of them take. An item whose argument
    is in its head byte (most of a tensor table's) costs one table lookup: a 20,000-tensor table (1.6 MB) is
    priced in 72 ms, not 128.
    """
    cost, i, end = 0, 0, len(raw)
    costs, skips = _HEAD_COST, _HEAD_SKIP
    while i < end and cost <= budget:
        head = raw[i]
        add = costs[head]
        if add >= 0:
            cost += add
            i += skips[head] + 1
            continue
        width = _HEAD_EXTRA[head & 0x1F]
        arg = int.from_bytes(raw[i + 1 : i + 1 + width], "big")
        i += 1 + width
        major = head >> 5
        cost += _item_cost(major, arg, end)
        if major == 3:  # a long text, which decodes at the width of its widest character
            cost += (text_width(raw, i, i + arg) - 1) * arg
        if major in (2, 3):
            i += arg
    return cost


def _item_cost(major: int, arg: int, end: int) -> int:
    """What cbor2 builds for one item: a container's slots are capped by the bytes there are to fill them."""
    if major in (0, 1):
        return 32 if arg > 255 else 8
    if major in (2, 3):
        return 56 + arg
    if major == 4:
        return 64 + 8 * min(arg, end)
    if major == 5:
        return 232 + 16 * min(arg, end)
    if major == 7:
        return 24 + 8
    return 64  # tags, which the decoder refuses


def _head_table() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(cost, bytes of payload after the head) of each head byte whose argument it holds itself (info 0-23;
    their slot counts are not capped: never less than `_item_cost` of a longer header says); cost -1 where the
    argument follows in 1-8 bytes (info 24-27). Indefinite lengths, simple values and breaks (28-31): small,
    charged as a container."""
    costs, skips = [], []
    for head in range(256):
        major, info = head >> 5, head & 0x1F
        if info in _HEAD_EXTRA:
            costs.append(-1)
            skips.append(0)
        elif info > 27:
            costs.append(64)
            skips.append(0)
        else:
            costs.append(_item_cost(major, info, info))
            skips.append(info if major in (2, 3) else 0)
    return tuple(costs), tuple(skips)


_HEAD_COST, _HEAD_SKIP = _head_table()


def decode_cbor(raw: bytes, path: str) -> Any:
    """Decode burnpack metadata with Burn's depth limit, refusing tags (bignums) and duplicate keys."""
    refuse_costly_decode(raw, decoded_cost, "Metadata", path)
    try:
        return cbor2.loads(
            raw,
            max_depth=MAX_CBOR_DEPTH,
            semantic_decoders=_RejectEveryTag(),
            allow_duplicate_keys=False,
            str_errors="strict",
        )
    except (cbor2.CBORDecodeError, ValueError, TypeError, RecursionError, MemoryError, OverflowError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if isinstance(exc.__cause__, ValueError):  # e.g. a refused tag: say why
            message += f" ({exc.__cause__})"
        raise FormatError(f"Metadata deserialization error: {message}", path) from None


def split_document(document: Any, path: str) -> tuple[dict, dict[str, str], dict[str, Scalar], list[str]]:
    if not isinstance(document, dict):
        raise FormatError("Metadata deserialization error: top level is not a map", path)
    if "tensors" not in document:
        raise FormatError("Metadata deserialization error: missing field `tensors`", path)
    tensors = document["tensors"]
    if not isinstance(tensors, dict) or not all(isinstance(k, str) for k in tensors):
        raise FormatError("Metadata deserialization error: `tensors` is not a map of names", path)
    metadata = document.get("metadata", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise FormatError("Metadata deserialization error: `metadata` is not a map of text to text", path)
    scalars = {name: parse_scalar(name, value, path) for name, value in _scalar_map(document, path).items()}
    extra = [str(k) for k in document if k not in ("tensors", "metadata", "scalars")]
    return tensors, dict(metadata), scalars, extra


def _scalar_map(document: dict, path: str) -> dict:
    scalars = document.get("scalars", {})
    if not isinstance(scalars, dict) or not all(isinstance(k, str) for k in scalars):
        raise FormatError("Metadata deserialization error: `scalars` is not a map of names", path)
    return scalars


def parse_scalar(name: str, value: Any, path: str) -> Scalar:
    if isinstance(value, dict) and len(value) == 1:
        kind, inner = next(iter(value.items()))
        if kind == "Bool" and isinstance(inner, bool):
            return Scalar(kind, inner)
        if kind == "Float" and isinstance(inner, float | int) and not isinstance(inner, bool):
            return Scalar(kind, float(inner))
        if kind == "Int" and _is_int(inner) and I64_MIN <= inner <= I64_MAX:
            return Scalar(kind, inner)
        if kind == "UInt" and _is_int(inner) and 0 <= inner < U64_LIMIT:
            return Scalar(kind, inner)
    raise FormatError(f"Metadata deserialization error: scalar '{name}' is not a valid Scalar: {value!r:.80}", path)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_dtype(raw: Any) -> str | None:
    """Map a CBOR DType (docs/burn-format.md#dtypes) to our dtype name, or None if it is not one Burn defines."""
    if isinstance(raw, str):
        return raw if raw in UNIT_DTYPES else None
    if isinstance(raw, dict) and len(raw) == 1:
        variant, inner = next(iter(raw.items()))
        if variant == "Bool" and isinstance(inner, str):
            return BOOL_STORES.get(inner)
        if variant == "QFloat" and isinstance(inner, dict):
            value = inner.get("value")  # any CBOR value, a list or a map too: test the type before the set
            return "QFloat" if isinstance(value, str) and value in QUANT_VALUES else None
    return None


_DESCRIPTOR_FIELDS = frozenset({"dtype", "shape", "data_offsets"})
_DESCRIPTOR_FIELDS_WITH_ID = _DESCRIPTOR_FIELDS | {"param_id"}


_UNIT_ITEMSIZE = {dtype: ITEMSIZE[dtype] for dtype in UNIT_DTYPES}


def parse_descriptors(tensors_doc: dict[str, Any], data_start: int, path: str) -> list[TensorInfo]:
    """Every descriptor of the `tensors` map, in order, as a tensor whose data section starts at `data_start`.
    `_plain_descriptor`'s tests, inline: this loop runs once per tensor (twice per conversion: the source, then
    the output re-read), and the calls were a sixth of its cost. What the tests do not accept goes through
    `parse_descriptor`, which names what is wrong."""
    itemsizes, rank, dim_limit = _UNIT_ITEMSIZE, PLAIN_RANK, PLAIN_DIM
    info = tensor_info
    tensors: list[TensorInfo] = []
    append = tensors.append
    for name, desc in tensors_doc.items():
        # the three fields, or four with param_id: `desc.keys() in (fields, with_id)`, in less
        if type(desc) is dict and (len(desc) == 3 or len(desc) == 4 and "param_id" in desc):
            try:
                raw, shape, offsets = desc["dtype"], desc["shape"], desc["data_offsets"]
            except KeyError:  # another field: parse_descriptor names what is wrong
                raw = None
            param_id = desc["param_id"] if len(desc) == 4 else None
            size = itemsizes.get(raw, -1) if type(raw) is str else -1
            if size >= 0 and type(shape) is list and len(shape) <= rank and type(offsets) is list and len(offsets) == 2:
                for dim in shape:
                    if type(dim) is not int or not 0 <= dim < dim_limit:
                        size = -1
                        break
                    size *= dim
                start, end = offsets
                if (
                    type(start) is int
                    and type(end) is int
                    and 0 <= start <= end < U64_LIMIT
                    and size == end - start <= MAX_TENSOR_SIZE
                    and (param_id is None or type(param_id) is int and 0 <= param_id < U64_LIMIT)
                    and name  # has_module_path's tests, inline (a call costs more than the tests)
                    and name[0] != "."
                    and name[-1] != "."
                    and ".." not in name
                ):
                    append(info((name, raw, tuple(shape), data_start + start, size, param_id, raw)))
                    continue
        d = parse_descriptor(name, desc, path)
        append(info((name, d.dtype, d.shape, data_start + d.start, d.end - d.start, d.param_id, d.raw_dtype)))
    return tensors


def parse_descriptor(name: str, desc: Any, path: str) -> _Descriptor:
    """One tensor's descriptor, validated as Burn's reader does. A file holds one per tensor (up to
    MAX_TENSOR_COUNT): the well-formed case is checked in a few cheap tests, anything else goes through every
    check, which names what is wrong."""
    return _plain_descriptor(name, desc) or _checked_descriptor(name, desc, path)


def _plain_descriptor(name: str, desc: Any) -> _Descriptor | None:
    """The descriptor when it is plainly well formed (a unit dtype, plain ints whose sizes agree, a name with
    no empty segment), else None; accepts nothing `_checked_descriptor` refuses and builds the same one."""
    if type(desc) is not dict or (desc.keys() != _DESCRIPTOR_FIELDS and desc.keys() != _DESCRIPTOR_FIELDS_WITH_ID):
        return None
    raw, offsets, param_id = desc["dtype"], desc["data_offsets"], desc.get("param_id")
    if type(raw) is not str or raw not in UNIT_DTYPES or type(offsets) is not list or len(offsets) != 2:
        return None
    start, end = offsets
    if type(start) is not int or type(end) is not int or not 0 <= start <= end < U64_LIMIT:
        return None
    if end - start > MAX_TENSOR_SIZE or not (param_id is None or type(param_id) is int and 0 <= param_id < U64_LIMIT):
        return None
    if plain_byte_length(raw, desc["shape"]) != end - start or not has_module_path(name):
        return None
    return _descriptor((name, raw, tuple(desc["shape"]), start, end, param_id, raw))


def _checked_descriptor(name: str, desc: Any, path: str) -> _Descriptor:
    def fail(message: str) -> FormatError:
        return FormatError(message, path, name)

    check_name(name, path)
    if not isinstance(desc, dict):
        raise fail("descriptor is not a map")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in desc:
            raise fail(f"descriptor lacks `{key}`")
    dtype = parse_dtype(desc["dtype"])
    if dtype is None:
        raise fail(f"unknown dtype {desc['dtype']!r:.80}")
    shape = desc["shape"]
    if not isinstance(shape, list) or not all(_is_int(d) and 0 <= d < U64_LIMIT for d in shape):
        raise fail("has corrupted shape data: shape must be a list of unsigned integers")
    offsets = desc["data_offsets"]
    if not (
        isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) and 0 <= o < U64_LIMIT for o in offsets)
    ):
        raise fail("has corrupted offset data: data_offsets must be two unsigned integers")
    start, end = offsets
    if end < start:
        raise fail(f"has corrupted offset data: end {end} < start {start}")
    if end - start > MAX_TENSOR_SIZE:
        raise fail(f"size {end - start} exceeds maximum allowed size of {MAX_TENSOR_SIZE} bytes")
    param_id = desc.get("param_id")
    if param_id is not None and not (_is_int(param_id) and 0 <= param_id < U64_LIMIT):
        raise fail("param_id must be an unsigned 64-bit integer")
    shape_t = tuple(shape)
    expected = byte_length(dtype, shape_t)
    if expected is not None and expected != end - start:
        raise fail(f"declares {end - start} bytes but its shape {list(shape_t)} and dtype {dtype} need {expected}")
    return _descriptor((name, dtype, shape_t, start, end, param_id, desc["dtype"]))


def check_name(name: str, path: str | None) -> None:
    """Burn splits names on '.' into path segments (docs/burn-format.md#metadata): an empty name or segment has no
    module path."""
    if not has_module_path(name):
        raise FormatError(f"tensor name {name!r} has an empty path segment", path)


def has_module_path(name: str) -> bool:
    """No empty segment: `name.split(".")` holds no "" (tested without splitting: it runs once per tensor; the
    loops of parse_descriptors and _plain_specs test it inline)."""
    return bool(name) and name[0] != "." and name[-1] != "." and ".." not in name


def check_ranges(tensors: Sequence[TensorInfo], data_start: int, path: str) -> None:
    """Refuse overlapping data ranges; Burn does not check this (docs/burn-format.md#reader-limits), but two tensors
    sharing bytes are never what a writer meant."""
    ordered = sorted((t for t in tensors if t.nbytes), key=attrgetter("offset"))
    for before, after in zip(ordered, ordered[1:], strict=False):
        if after.offset < before.offset + before.nbytes:
            start, before_start = after.offset - data_start, before.offset - data_start
            raise FormatError(
                f"data range {start}..{start + after.nbytes} overlaps tensor '{before.name}' "
                f"({before_start}..{before_start + before.nbytes})",
                path,
                after.name,
            )


# ---------------------------------------------------------------------------------------------- writing


def encode_dtype(dtype: str, raw_dtype: Any = None) -> Any:
    """Our dtype name -> Burn's CBOR DType; QFloat needs its original scheme."""
    if dtype == "QFloat":
        if not (isinstance(raw_dtype, dict) and "QFloat" in raw_dtype):
            raise FormatError("QFloat tensor has no quantization scheme to write")
        return raw_dtype
    if dtype in UNIT_DTYPES:
        return dtype
    for store, name in BOOL_STORES.items():
        if name == dtype:
            return {"Bool": store}
    raise FormatError(f"dtype {dtype} has no burnpack form")


class _ShortestFloat:
    """A Scalar::Float on its way into CBOR: cbor2 always widens floats to f64, ciborium writes the
    shortest width that round-trips (docs/burn-format.md#cbor-encoding), so these are encoded by `_encode_special`."""

    __slots__ = ("value",)

    def __init__(self, value: float) -> None:
        self.value = value


def _encode_special(encoder: Any, value: Any) -> None:
    if not isinstance(value, _ShortestFloat):
        raise FormatError(f"cannot encode {type(value).__name__} in burnpack metadata")
    encoder.write(_shortest_float(value.value))


def cbor_encode(document: Any) -> bytes:
    """CBOR as ciborium writes it (docs/burn-format.md#cbor-encoding): definite lengths, minimal ints, dicts in
    insertion order (cbor2's non-canonical mode does all that), and floats wrapped in _ShortestFloat at their shortest
    exact width."""
    try:
        return cbor2.dumps(document, default=_encode_special)
    except (OverflowError, ValueError, cbor2.CBOREncodeError) as exc:
        raise FormatError(f"cannot encode burnpack metadata: {exc}") from None


def _shortest_float(value: float) -> bytes:
    wide = struct.pack(">d", value)
    for code, fmt in ((0xF9, ">e"), (0xFA, ">f")):
        try:
            narrow = struct.pack(fmt, value)
        except OverflowError:
            continue
        if struct.pack(">d", struct.unpack(fmt, narrow)[0]) == wide:
            return bytes([code]) + narrow
    return b"\xfb" + wide


def encode_scalar(scalar: Scalar) -> dict:
    if scalar.kind not in SCALAR_KINDS:
        raise FormatError(f"unknown scalar kind {scalar.kind}")
    if scalar.kind == "Float":
        return {"Float": _ShortestFloat(float(scalar.value))}
    if scalar.kind == "Int" and not I64_MIN <= int(scalar.value) <= I64_MAX:
        raise FormatError(f"Int scalar {scalar.value} does not fit in 64 bits")
    if scalar.kind == "UInt" and not 0 <= int(scalar.value) < U64_LIMIT:
        raise FormatError(f"UInt scalar {scalar.value} does not fit in 64 bits")
    return {scalar.kind: scalar.value}


@dataclass
class BurnpackPlan:
    """Everything about the output decided before a byte is written (docs/burn-adapters.md#publishing, step 1)."""

    header: bytes
    data_start: int
    starts: list[int]  # relative to data_start, one per spec in write order
    file_size: int


def plan_burnpack(
    specs: Sequence[TensorSpec],
    metadata: dict[str, str] | None = None,
    scalars: dict[str, Scalar] | None = None,
    layout: str = LAYOUT_ALIGNED,
) -> BurnpackPlan:
    """Assign offsets in the given (data) order and encode the metadata as Burn does (docs/burn-format.md#container)."""
    plain = validate_specs(specs)
    starts, cursor = [], 0
    alignment = TENSOR_ALIGNMENT if layout == LAYOUT_ALIGNED else 1
    for spec in specs:
        start = -(-cursor // alignment) * alignment  # align_up, inline: once per tensor
        starts.append(start)
        cursor = start + spec.nbytes  # ends never decrease: the last one is the data's end
    encoded = [spec.name.encode("utf-8") for spec in specs]
    order = sorted(range(len(specs)), key=encoded.__getitem__)
    rest: dict[str, Any] = {}  # the document after its `tensors`
    if metadata:
        _check_text_map(metadata)
        rest["metadata"] = {k: metadata[k] for k in sorted(metadata, key=lambda k: k.encode("utf-8"))}
    if scalars:
        rest["scalars"] = {k: encode_scalar(scalars[k]) for k in sorted(scalars, key=lambda k: k.encode("utf-8"))}
    if plain and {*map(type, map(_DTYPE, specs))} <= {str} and {*map(type, map(_NBYTES, specs))} <= {int, bool}:
        body = _plain_document_cbor(specs, encoded, order, starts, rest)
    else:  # (a dtype of another type, a float size: cbor2 writes them its own way, or refuses them)
        tensors = {specs[i].name: _descriptor_doc(specs[i], starts[i]) for i in order}
        body = cbor_encode({"tensors": tensors, **rest})
    if len(body) > MAX_METADATA_SIZE:
        raise FormatError(f"Metadata size {len(body)} exceeds maximum allowed size of {MAX_METADATA_SIZE} bytes")
    unaligned = HEADER_SIZE + len(body)
    data_start = align_up(unaligned) if layout == LAYOUT_ALIGNED else unaligned
    file_size = data_start + cursor
    if file_size > MAX_FILE_SIZE:
        raise FormatError(f"File size {file_size} bytes exceeds maximum allowed size of {MAX_FILE_SIZE} bytes")
    header = struct.pack("<IHI", MAGIC, FORMAT_VERSION, len(body)) + body
    return BurnpackPlan(header, data_start, starts, file_size)


_DTYPE, _NBYTES = attrgetter("dtype"), attrgetter("nbytes")
_BYTES = [bytes((value,)) for value in range(256)]
_HEAD_1, _HEAD_2, _HEAD_4, _HEAD_8 = (struct.Struct(f">B{code}").pack for code in "BHIQ")


def _cbor_head(major: int, value: int) -> bytes:
    """A CBOR item's head (RFC 8949 section 3), its argument at the shortest width, as cbor2 and ciborium write
    it; `value` < 2^64."""
    initial = major << 5
    if value < 24:
        return _BYTES[initial | value]
    if value < 0x100:
        return _HEAD_1(initial | 24, value)
    if value < 0x10000:
        return _HEAD_2(initial | 25, value)
    if value < 0x100000000:
        return _HEAD_4(initial | 26, value)
    return _HEAD_8(initial | 27, value)


def _plain_document_cbor(
    specs: Sequence[TensorSpec], names: list[bytes], order: list[int], starts: list[int], rest: dict[str, Any]
) -> bytes:
    """cbor_encode({"tensors": {name: _descriptor_doc(...)}, **rest}), byte for byte, for specs `_plain_specs`
    accepts whose dtypes are text and sizes ints: the tensors map is written here, where cbor2 took a dict and
    two lists per tensor (for 10,000 tensors, 5,000 instructions a tensor less). What comes before a tensor's
    offsets depends only on its dtype and shape (plain ints), written once for each distinct pair."""
    head = _cbor_head
    before_offsets: dict[tuple[str, tuple[int, ...]], bytes] = {}
    parts = [head(5, 1 + len(rest)), b"\x67tensors", head(5, len(order))]
    for i in order:
        spec, name, start = specs[i], names[i], starts[i]
        key = (spec.dtype, tuple(spec.shape))
        prefix = before_offsets.get(key)
        if prefix is None:
            prefix = before_offsets[key] = _descriptor_prefix(*key)
        param_id = spec.param_id
        fields = b"\xa3" if param_id is None else b"\xa4"  # a map of 3 fields, or 4 with param_id
        # (the pieces joined once, at the end: no intermediate bytes per tensor)
        parts += (head(3, len(name)), name, fields, prefix, head(0, start), head(0, start + spec.nbytes))
        if param_id is not None:
            parts += (b"\x68param_id", head(0, param_id))
    parts.append(cbor_encode(rest)[1:])  # (its entries: a map of at most 2 has a one-byte head)
    return b"".join(parts)


def _descriptor_prefix(dtype: str, shape: tuple[int, ...]) -> bytes:
    """A descriptor's CBOR up to its two offsets: its dtype (a unit dtype is its name), shape and the head of
    `data_offsets`."""
    text = dtype.encode("utf-8")
    shape_cbor = _cbor_head(4, len(shape)) + b"".join(_cbor_head(0, dim) for dim in shape)
    return b"\x65dtype" + _cbor_head(3, len(text)) + text + b"\x65shape" + shape_cbor + b"\x6cdata_offsets\x82"


def _descriptor_doc(spec: TensorSpec, start: int) -> dict[str, Any]:
    dtype = spec.dtype
    doc: dict[str, Any] = {
        "dtype": dtype if dtype in UNIT_DTYPES else encode_dtype(dtype, spec.raw_dtype),  # (a unit dtype is its name)
        "shape": list(spec.shape),
        "data_offsets": [start, start + spec.nbytes],
    }
    if spec.param_id is not None:
        doc["param_id"] = spec.param_id
    return doc


def _check_text_map(metadata: dict[str, str]) -> None:
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise FormatError(f"metadata entry {key!r} is not text to text")


def validate_specs(specs: Sequence[TensorSpec]) -> bool:
    """Refuse anything Burn's reader would refuse (docs/burn-format.md#reader-limits). True when every spec is
    plainly well formed (`_plain_specs`)."""
    if len(specs) > MAX_TENSOR_COUNT:
        raise FormatError(f"{len(specs)} tensors exceed Burn's maximum of {MAX_TENSOR_COUNT}")
    if _plain_specs(specs):
        return True
    seen: set[str] = set()
    for spec in specs:
        check_name(spec.name, None)
        if spec.name in seen:
            raise FormatError(f"Duplicate tensor name '{spec.name}'")
        seen.add(spec.name)
        encode_dtype(spec.dtype, spec.raw_dtype)
        if plain_byte_length(spec.dtype, spec.shape) == spec.nbytes <= MAX_TENSOR_SIZE and _plain_param_id(spec):
            continue  # a well-formed spec (most of them): the checks below are for the rest
        if not all(isinstance(d, int) and 0 <= d < U64_LIMIT for d in spec.shape):
            raise FormatError(f"shape {list(spec.shape)} is not a list of unsigned integers", tensor=spec.name)
        expected = byte_length(spec.dtype, tuple(spec.shape))
        if expected is not None and expected != spec.nbytes:
            raise FormatError(
                f"declares {spec.nbytes} bytes but its shape {list(spec.shape)} and dtype {spec.dtype} need {expected}",
                tensor=spec.name,
            )
        if spec.nbytes > MAX_TENSOR_SIZE:
            raise FormatError(
                f"size {spec.nbytes} exceeds maximum allowed size of {MAX_TENSOR_SIZE} bytes", tensor=spec.name
            )
        if spec.param_id is not None and not (isinstance(spec.param_id, int) and 0 <= spec.param_id < U64_LIMIT):
            raise FormatError(f"param_id {spec.param_id} is not an unsigned 64-bit integer", tensor=spec.name)
    return False


def _plain_specs(specs: Sequence[TensorSpec]) -> bool:
    """Whether every spec is plainly well formed, in one loop without a call per spec (it runs once per
    tensor): a name with a module path, given once, a unit dtype, a size its plain shape agrees with, within
    Burn's limit, a plain param_id. Else validate_specs checks them one by one, naming what is wrong."""
    names = {spec.name for spec in specs}
    if len(names) != len(specs):
        return False
    itemsizes, rank, dim_limit = _UNIT_ITEMSIZE, PLAIN_RANK, PLAIN_DIM
    for spec in specs:
        size, shape, param_id = itemsizes.get(spec.dtype, -1), spec.shape, spec.param_id
        if size < 0 or type(shape) not in (tuple, list) or len(shape) > rank:
            return False
        for dim in shape:
            if type(dim) is not int or not 0 <= dim < dim_limit:
                return False
            size *= dim
        if size != spec.nbytes or size > MAX_TENSOR_SIZE:
            return False
        name = spec.name  # has_module_path's tests, inline (a call costs more than the tests)
        if not name or name[0] == "." or name[-1] == "." or ".." in name:
            return False
        if param_id is not None and not (type(param_id) is int and 0 <= param_id < U64_LIMIT):
            return False
    return True


def _plain_param_id(spec: TensorSpec) -> bool:
    return spec.param_id is None or type(spec.param_id) is int and 0 <= spec.param_id < U64_LIMIT


def write_burnpack(
    fd: int,
    specs: Sequence[TensorSpec],
    metadata: dict[str, str] | None = None,
    scalars: dict[str, Scalar] | None = None,
    layout: str = LAYOUT_ALIGNED,
) -> BurnpackPlan:
    """Write a whole burnpack file to `fd` (from offset 0), one tensor at a time, in `specs` order."""
    plan = plan_burnpack(specs, metadata, scalars, layout)
    os.ftruncate(fd, plan.file_size)  # sized first: a producer may fill its window through a mapping
    pwrite_all(fd, plan.header, 0)
    write_zeros(fd, len(plan.header), plan.data_start - len(plan.header))
    write_tensors(fd, ((spec, plan.data_start + start) for spec, start in zip(specs, plan.starts, strict=True)))
    return plan
