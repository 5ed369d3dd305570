"""The safetensors container: a reader and a streaming writer with the same interface as burnpack's.

Layout (docs/burn-format.md#safetensors-for-comparison): u64 LE header length, JSON header (`__metadata__` first, padded
with spaces to a multiple of 8), then the tensors back to back with no alignment. We parse the header ourselves, with
the checks of the `safetensors` library (whose output our writer reproduces byte for byte), because the converter needs
each tensor's offsets and must move raw bytes: BF16 and the F8 types have no numpy dtype, and a streaming writer cannot
hand the library a whole model in memory.
"""

from __future__ import annotations

import json
import os
import re
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring
from operator import attrgetter
from typing import Any

from syncd.errors import FormatError, IncompleteFileError
from syncd.formats.dtypes import (
    DTYPE_TO_SAFETENSORS,
    ITEMSIZE,
    PLAIN_DIM,
    PLAIN_RANK,
    SAFETENSORS_DTYPE_RANK,
    SAFETENSORS_TO_DTYPE,
    byte_length,
    plain_byte_length,
)
from syncd.formats.fileio import (
    TensorFileReader,
    pread_exact,
    pwrite_all,
    refuse_costly_decode,
    text_width,
    write_tensors,
)
from syncd.formats.table import CheckpointHeader, TensorInfo, TensorSpec, tensor_info

# the safetensors library's limit on the JSON header
NAME = "safetensors"  # described in registry.py
MAX_HEADER_SIZE = 100_000_000
U64_LIMIT = 1 << 64


class SafetensorsReader(TensorFileReader):
    """Parses and validates a safetensors header; tensor bytes are read only when asked for."""

    def _parse(self) -> None:
        document, size = read_document(self.fd, self.file_size, self.path)
        metadata = parse_metadata(document.pop("__metadata__", None), self.path)
        data_start = 8 + size
        self._index(parse_entries(document, data_start, self.path))
        check_coverage(self.tensors, self.file_size - data_start, data_start, self.path)
        self.header = CheckpointHeader(
            format=NAME,
            path=self.path,
            file_size=self.file_size,
            metadata=metadata,
            facts={"header_size": size, "data_start": data_start, "key_order": list(document)},
        )


def read_document(fd: int, file_size: int, path: str) -> tuple[dict[str, Any], int]:
    """(the decoded JSON header, its length) of a safetensors file: the length checked against the file and
    the library's limit, the text decoded as the library does; its entries are not checked yet."""
    if file_size < 8:
        raise IncompleteFileError(f"header too small (truncated): file has {file_size} bytes, needs at least 8", path)
    (size,) = struct.unpack("<Q", pread_exact(fd, 8, 0, path, "header length"))
    if (
        (size > MAX_HEADER_SIZE or 8 + size > file_size)
        and file_size > 8
        and pread_exact(fd, 1, 8, path, "header") != b"{"
    ):
        # the header is a JSON object, its text starting with `{` (the format's rule): a length that does not
        # fit and no `{` where the header starts is another kind of file, not a truncated safetensors
        raise FormatError(f"not a safetensors file (its first 8 bytes give a header length of {size})", path)
    if size > MAX_HEADER_SIZE:
        raise FormatError(f"header length {size} exceeds the limit of {MAX_HEADER_SIZE} bytes", path)
    if 8 + size > file_size:
        raise IncompleteFileError(
            f"header length {size} runs past the end of the file ({file_size} bytes): truncated?", path
        )
    return parse_header_json(pread_exact(fd, size, 8, path, "header"), path), size


def read_metadata(fd: int, file_size: int, path: str) -> dict[str, str]:
    """The file's `__metadata__`, its tensor entries left unchecked (see formats.read_metadata)."""
    document, _ = read_document(fd, file_size, path)
    return parse_metadata(document.get("__metadata__"), path)


def unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A json.loads object hook that refuses a key given twice (JSON allows it; a header must not). Called for
    every object of a header (one per tensor): the dict is built at C speed, and only one that came out
    shorter than its pairs is gone through to name the key given twice."""
    result = dict(pairs)
    if len(result) == len(pairs):
        return result
    return _refuse_duplicate_key(pairs)


def _refuse_duplicate_key(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def decoded_cost(raw: bytes) -> int:
    """An upper estimate of what json.loads needs for `raw`, from its structural characters; text wider than
    Latin-1 is charged at its width twice, the decoded header and the strings taken out of it."""
    containers = raw.count(b"[") + raw.count(b"{")
    strings = raw.count(b'"') // 2
    wide = 2 * (max(text_width(raw), _escaped_width(raw)) - 1) * len(raw)
    return 64 * containers + 8 * raw.count(b",") + 56 * strings + 100 * raw.count(b":") + len(raw) + wide


# JSON escapes of a surrogate (half of a character past U+FFFF) and of any character past U+00FF
_ESCAPED_FOUR = re.compile(rb"\\u[dD][89abAB]")
_ESCAPED_TWO = re.compile(rb"\\u(?!00)")


def _escaped_width(raw: bytes) -> int:
    """text_width for what `\\u` escapes in JSON text decode to."""
    if b"\\u" not in raw:  # a memchr-speed look before two regex scans
        return 1
    if _ESCAPED_FOUR.search(raw) is not None:
        return 4
    return 2 if _ESCAPED_TWO.search(raw) is not None else 1


def parse_header_json(raw: bytes, path: str) -> dict[str, Any]:
    refuse_costly_decode(raw, decoded_cost, "header", path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise FormatError("header is not valid UTF-8", path) from None
    if not text.startswith("{"):
        raise FormatError("header is not a JSON object", path)
    try:
        document = loads_json(text)
    except RecursionError:
        raise FormatError("header JSON is nested too deeply", path) from None
    except MemoryError:  # e.g. 100 MB of "[]," builds millions of lists: refuse it as burnpack's decode does
        raise FormatError(f"header JSON ({len(raw)} bytes) is too large to decode in memory", path) from None
    except ValueError as exc:
        raise FormatError(f"header is not valid JSON: {json_error_text(exc)}", path) from None
    if not isinstance(document, dict):
        raise FormatError("header is not a JSON object", path)
    if "\\u" in text and _lone_surrogate(document):  # only an escape can make one; the library refuses them too
        raise FormatError("header holds a \\u escape of a lone surrogate, which is not Unicode text", path)
    return document


def loads_json(text: str) -> Any:
    """JSON as the safetensors library reads a header: duplicate keys refused (unique_pairs), and `-0`, which
    Python reads as the integer 0, refused as serde refuses it for an unsigned integer. (Looked for only where
    the text holds "-0" at all: a hook per number costs a tenth of the decode.)"""
    if "-0" not in text:
        return json.loads(text, object_pairs_hook=unique_pairs)
    return json.loads(text, object_pairs_hook=unique_pairs, parse_int=_no_negative_zero)


def _no_negative_zero(digits: str) -> int:
    if digits.startswith("-") and digits.lstrip("-0") == "":
        raise ValueError(f"{digits} is not an unsigned integer")
    return int(digits)


def json_error_text(exc: ValueError) -> str:
    """What a JSON decode error says, for a person: Python's limit on integer digits names a function to call."""
    text = str(exc).splitlines()[0]
    if "integer string conversion" in text:
        return f"an integer of more than {sys.get_int_max_str_digits()} digits"
    return text


def _lone_surrogate(document: Any) -> bool:
    """Whether any key or text in the decoded header is not encodable (a lone surrogate from a \\u escape)."""
    stack = [document]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
    return False


def parse_metadata(raw: Any, path: str) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
        raise FormatError("__metadata__ must map text to text", path)
    return dict(raw)


def _is_uint(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < U64_LIMIT


_ENTRY_FIELDS = frozenset({"dtype", "shape", "data_offsets"})
# safetensors dtype -> (our dtype, element size), for the dtypes of a whole element size
_PLAIN_DTYPES = {raw: (dtype, ITEMSIZE[dtype]) for raw, dtype in SAFETENSORS_TO_DTYPE.items() if dtype in ITEMSIZE}


def parse_entries(document: dict[str, Any], data_start: int, path: str) -> list[TensorInfo]:
    """Every tensor entry of a header (`__metadata__` taken out), in order. `_plain_entry`'s tests, inline:
    this loop runs once per tensor (twice per conversion: the source, then the output re-read), and the calls
    were a sixth of its cost. What the tests do not accept goes through `parse_entry`, which names what is
    wrong."""
    dtypes, rank, dim_limit, info = _PLAIN_DTYPES, PLAIN_RANK, PLAIN_DIM, tensor_info
    tensors: list[TensorInfo] = []
    append = tensors.append
    for name, entry in document.items():
        if type(entry) is dict and len(entry) == 3:  # three fields, these three: `entry.keys() == fields`, in less
            try:
                raw, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
            except KeyError:  # another field: parse_entry names it
                raw = None
            known = dtypes.get(raw) if type(raw) is str else None
            if known is not None and type(shape) is list and len(shape) <= rank and type(offsets) is list:
                size = known[1]
                for dim in shape:
                    if type(dim) is not int or not 0 <= dim < dim_limit:
                        size = -1
                        break
                    size *= dim
                start, end = offsets if len(offsets) == 2 else (None, None)
                if (
                    type(start) is int
                    and type(end) is int
                    and 0 <= start <= end < U64_LIMIT
                    and size == end - start
                    and (size or not _overflows(shape))  # (only a shape holding a 0 can overflow on the way)
                ):
                    append(info((name, known[0], tuple(shape), data_start + start, size, None, raw)))
                    continue
        append(parse_entry(name, entry, data_start, path))
    return tensors


def parse_entry(name: str, entry: Any, data_start: int, path: str) -> TensorInfo:
    """One tensor's entry, validated as the library does. A header holds one per tensor (tens of thousands in
    some checkpoints): the well-formed case is checked in a few cheap tests, anything else goes through
    every check, which names what is wrong."""
    return _plain_entry(name, entry, data_start) or _checked_entry(name, entry, data_start, path)


def _plain_entry(name: str, entry: Any, data_start: int) -> TensorInfo | None:
    """The entry when it is plainly well formed (the three fields, a known dtype, plain ints whose sizes
    agree), else None; accepts nothing `_checked_entry` refuses and builds the same TensorInfo."""
    if type(entry) is not dict or entry.keys() != _ENTRY_FIELDS:
        return None
    raw, offsets = entry["dtype"], entry["data_offsets"]
    if type(raw) is not str or type(offsets) is not list or len(offsets) != 2:
        return None
    dtype = SAFETENSORS_TO_DTYPE.get(raw)
    start, end = offsets
    if dtype is None or type(start) is not int or type(end) is not int or not 0 <= start <= end < U64_LIMIT:
        return None
    if plain_byte_length(dtype, entry["shape"]) != end - start or (end == start and _overflows(entry["shape"])):
        return None
    return TensorInfo(name, dtype, tuple(entry["shape"]), data_start + start, end - start, None, raw)


def _checked_entry(name: str, entry: Any, data_start: int, path: str) -> TensorInfo:
    def fail(message: str) -> FormatError:
        return FormatError(message, path, name)

    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise fail("entry must have dtype, shape and data_offsets")
    if set(entry) - {"dtype", "shape", "data_offsets"}:
        raise fail(f"unknown fields {sorted(set(entry) - {'dtype', 'shape', 'data_offsets'})}")
    dtype = SAFETENSORS_TO_DTYPE.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    if dtype is None:
        raise fail(f"unknown dtype {entry['dtype']!r:.40}")
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        raise fail("shape must be a list of unsigned integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_uint(o) for o in offsets)):
        raise fail("data_offsets must be two unsigned integers")
    start, end = offsets
    if end < start:
        raise fail(f"data_offsets end {end} < start {start}")
    if end == start and _overflows(shape):  # (a size other than 0 is checked against the shape below)
        shown = shape if len(shape) <= 8 else [*shape[:8], "..."]
        raise fail(f"shape {shown}: {_OVERFLOW}")
    expected = byte_length(dtype, tuple(shape))
    if expected != end - start:
        raise fail(f"declares {end - start} bytes but its shape {shape} and dtype {entry['dtype']} need {expected}")
    return TensorInfo(name, dtype, tuple(shape), data_start + start, end - start, None, entry["dtype"])


TORCH_DIM_LIMIT = 1 << 63  # torch reads a shape as signed 64-bit integers
_OVERFLOW = "the product of its dimensions passes 2^64 on the way, which the safetensors library refuses"


def _overflows(shape: Sequence[int]) -> bool:
    """The library multiplies the dimensions in order in 64 bits and refuses an overflow, even where a later
    0 makes the product 0 (`[2^40, 2^40, 0]`): the one way a zero-size tensor's shape is refused."""
    numel = 1
    for dim in shape:
        numel *= dim
        if numel >= U64_LIMIT:
            return True
    return False


def check_coverage(placed: list[TensorInfo], buffer_len: int, data_start: int, path: str) -> None:
    """As the library requires: the tensors tile the data buffer exactly, without gaps or overlaps. `placed`:
    the tensors in file order, by offset then size (the reader's `tensors`, sorted once for both)."""
    cursor = data_start  # (offsets are absolute: compared as they are, once per tensor)
    for name, _, _, offset, nbytes, _, _ in placed:
        if offset != cursor:
            start, at = offset - data_start, cursor - data_start
            what = "overlaps the previous tensor" if start < at else f"leaves a gap before it (at {at})"
            raise FormatError(f"data range {start}..{start + nbytes} {what}", path, name)
        cursor = offset + nbytes
    covered = cursor - data_start
    if covered > buffer_len:
        raise IncompleteFileError(
            f"tensor data covers {covered} bytes but the file holds {buffer_len} after the header: truncated", path
        )
    if covered != buffer_len:
        raise FormatError(f"tensor data covers {covered} bytes but the file holds {buffer_len} after the header", path)


# ---------------------------------------------------------------------------------------------- writing


@dataclass
class SafetensorsPlan:
    header: bytes
    order: list[int]  # indexes into specs, in data order
    starts: list[int]  # absolute offsets, one per spec (by spec index)
    file_size: int


def safetensors_dtype(dtype: str, name: str) -> str:
    try:
        return DTYPE_TO_SAFETENSORS[dtype]
    except KeyError:
        raise FormatError(f"dtype {dtype} has no safetensors form", tensor=name) from None


def plan_safetensors(specs: Sequence[TensorSpec], metadata: dict[str, str] | None = None) -> SafetensorsPlan:
    """Lay tensors out as the library does (dtype descending, then name) so our files match its own."""
    seen: set[str] = set()
    plain = True  # every shape a list or tuple of plain ints (what _plain_header_json takes)
    for spec in specs:
        if spec.name in seen:
            raise FormatError(f"Duplicate tensor name '{spec.name}'")
        if spec.name == "__metadata__":
            raise FormatError("a tensor cannot be named __metadata__")
        seen.add(spec.name)
        if plain_byte_length(spec.dtype, spec.shape) == spec.nbytes and (spec.nbytes or not _overflows(spec.shape)):
            continue  # the common case, in a few cheap tests
        plain = False
        if _overflows(spec.shape):
            raise FormatError(
                f"its shape {list(spec.shape)} cannot be held in safetensors: {_OVERFLOW}", tensor=spec.name
            )
        if any(dim >= TORCH_DIM_LIMIT for dim in spec.shape):  # (only a zero-size tensor gets this far)
            raise FormatError(
                f"its shape {list(spec.shape)} has a dimension of 2^63 or more, which PyTorch cannot load",
                tensor=spec.name,
            )
        expected = byte_length(spec.dtype, tuple(spec.shape))
        if expected != spec.nbytes:
            raise FormatError(
                f"declares {spec.nbytes} bytes but its shape {list(spec.shape)} and dtype {spec.dtype} need {expected}",
                tensor=spec.name,
            )
    st_dtypes = [DTYPE_TO_SAFETENSORS.get(spec.dtype) or safetensors_dtype(spec.dtype, spec.name) for spec in specs]
    keys = [(-SAFETENSORS_DTYPE_RANK[st_dtype], spec.name) for st_dtype, spec in zip(st_dtypes, specs, strict=True)]
    order = sorted(range(len(specs)), key=keys.__getitem__)
    sorted_metadata: dict[str, str] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise FormatError("safetensors metadata must map text to text")
        sorted_metadata = {k: metadata[k] for k in sorted(metadata)}
    rel_starts = [0] * len(specs)
    cursor = 0
    for i in order:
        rel_starts[i] = cursor
        cursor = cursor + specs[i].nbytes  # (as the entry's end was computed: a size of no number fails the same way)
    # (a name or size of another type, which json.dumps writes its own way or refuses, takes json.dumps)
    plain = plain and {*map(type, seen)} <= {str} and {*map(type, map(_NBYTES, specs))} <= {int, bool}
    header_json = _plain_header_json if plain else _header_json
    text = header_json(specs, st_dtypes, order, rel_starts, sorted_metadata).encode("utf-8")
    text += b" " * (-len(text) % 8)
    if len(text) > MAX_HEADER_SIZE:  # refused before writing: no reader (this one included) would take it
        raise FormatError(
            f"its safetensors header would take {len(text)} bytes, more than the {MAX_HEADER_SIZE} a reader accepts"
        )
    header = struct.pack("<Q", len(text)) + text
    starts = [len(header) + s for s in rel_starts]
    return SafetensorsPlan(header, order, starts, len(header) + cursor)


_NBYTES = attrgetter("nbytes")


def _header_json(
    specs: Sequence[TensorSpec], st_dtypes: list[str], order: list[int], starts: list[int], metadata: dict[str, str]
) -> str:
    """The JSON header as the library writes it: `__metadata__` first (if any), then each tensor in data order."""
    document: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    for i in order:
        document[specs[i].name] = {
            "dtype": st_dtypes[i],
            "shape": list(specs[i].shape),
            "data_offsets": [starts[i], starts[i] + specs[i].nbytes],
        }
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False)


def _plain_header_json(
    specs: Sequence[TensorSpec], st_dtypes: list[str], order: list[int], starts: list[int], metadata: dict[str, str]
) -> str:
    """`_header_json`'s text, for tensors whose names are text, sizes ints and shapes plain ints: one f-string per
    tensor, its name quoted by json's own encoder, where json.dumps walks a dict and two lists per tensor
    (for 10,000 tensors, 7,000 instructions a tensor less). The dtypes are safetensors' names, which need no
    escaping; an int's text is its repr, as json.dumps writes it."""
    quote = encode_basestring
    parts = [_header_json(specs, st_dtypes, [], starts, metadata)[1:-1]] if metadata else []
    append = parts.append
    for i in order:
        spec, start = specs[i], starts[i]
        shape, end = ",".join(map(str, spec.shape)), start + spec.nbytes
        append(f'{quote(spec.name)}:{{"dtype":"{st_dtypes[i]}","shape":[{shape}],"data_offsets":[{start},{end}]}}')
    return "{" + ",".join(parts) + "}"


def write_safetensors(fd: int, specs: Sequence[TensorSpec], metadata: dict[str, str] | None = None) -> SafetensorsPlan:
    """Write a whole safetensors file to `fd`, filling tensors in data order, one at a time."""
    plan = plan_safetensors(specs, metadata)
    os.ftruncate(fd, plan.file_size)  # sized first: a producer may fill its window through a mapping
    pwrite_all(fd, plan.header, 0)
    write_tensors(fd, ((specs[i], plan.starts[i]) for i in plan.order))
    return plan
