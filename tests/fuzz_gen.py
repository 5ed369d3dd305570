"""Input generators and checks for the fuzz tests: hostile-but-structured checkpoints, byte-level
mutations of real files, and the one property every input must satisfy.

Files are built as raw bytes with encoders written here (a small CBOR and JSON emitter over a syntax tree
that can say what no well-behaved encoder would: duplicate keys, non-UTF-8 text, lone surrogates, lying
length heads, tags, non-minimal ints, absurd nesting), never with syncd's own writers, so the readers are
not checked against the code that shares their assumptions.

The property (`check_reader`, `check_convert`, `check_cli`): every input ends in success or in a `SyncdError`
whose text is one line, within TIME_LIMIT seconds and MEMORY_LIMIT bytes of address space beyond the
baseline; never another exception type, a hang or a crash; and a failed conversion publishes nothing and
leaves no scratch file behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import re
import resource
import signal
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from conftest import (
    ASTERINAS_BPK,
    CORPUS,
    FIXTURES,
    MULTI_LAYER_ST,
    REGRESSIONS,
    REPO,
)
from hypothesis import strategies as st

from syncd.errors import SyncdError, VerificationError

CORPUS_DIR = REGRESSIONS

TIME_LIMIT = 20.0  # seconds per input: catches a hang or a blow-up, not slowness on a loaded machine
MEMORY_LIMIT = 256 << 20  # address space an input may add to the process's baseline
MAGIC = 0x4255524E
U64 = 1 << 64

# ================================================================================================ CBOR


@dataclass(frozen=True)
class Raw:
    """Bytes emitted verbatim (a lying head, a break byte, a deep nest...)."""

    data: bytes


@dataclass(frozen=True)
class Text:
    """A CBOR text string (or JSON string body) holding exactly these bytes, valid UTF-8 or not."""

    data: bytes


@dataclass(frozen=True)
class Pairs:
    """A map written pair by pair: keys may repeat or be of any type."""

    items: tuple[tuple[Any, Any], ...]


@dataclass(frozen=True)
class Tag:
    tag: int
    value: Any


@dataclass(frozen=True)
class Wide:
    """An unsigned integer in a wider head than needed (Burn reads any width)."""

    value: int
    width: int  # 1, 2, 4 or 8 bytes


def _head(major: int, arg: int, width: int | None = None) -> bytes:
    if width is None:
        if arg < 24:
            return bytes([major << 5 | arg])
        width = next(w for w in (1, 2, 4, 8) if arg < 1 << (8 * w))
    code = {1: 24, 2: 25, 4: 26, 8: 27}[width]
    return bytes([major << 5 | code]) + arg.to_bytes(width, "big")


def cbor(value: Any) -> bytes:
    """Encode a syntax tree of Python values and the markers above as CBOR."""
    if isinstance(value, Raw):
        return value.data
    if isinstance(value, Text):
        return _head(3, len(value.data)) + value.data
    if isinstance(value, Wide):
        return _head(0, value.value, value.width)
    if isinstance(value, Tag):
        return _head(6, value.tag) + cbor(value.value)
    if isinstance(value, Pairs):
        return _head(5, len(value.items)) + b"".join(cbor(k) + cbor(v) for k, v in value.items)
    if value is None:
        return b"\xf6"
    if isinstance(value, bool):
        return b"\xf5" if value else b"\xf4"
    if isinstance(value, int):
        if 0 <= value < U64:
            return _head(0, value)
        if -U64 <= value < 0:
            return _head(1, -1 - value)
        magnitude = value if value >= 0 else -1 - value
        return _head(6, 2 if value >= 0 else 3) + cbor(magnitude.to_bytes((magnitude.bit_length() + 7) // 8, "big"))
    if isinstance(value, float):
        for code, fmt in ((0xF9, ">e"), (0xFA, ">f")):
            with contextlib.suppress(OverflowError):
                narrow = struct.pack(fmt, value)
                if struct.pack(">d", struct.unpack(fmt, narrow)[0]) == struct.pack(">d", value):
                    return bytes([code]) + narrow
        return b"\xfb" + struct.pack(">d", value)
    if isinstance(value, str):
        data = value.encode("utf-8", "surrogatepass")
        return _head(3, len(data)) + data
    if isinstance(value, bytes):
        return _head(2, len(value)) + value
    if isinstance(value, list | tuple):
        return _head(4, len(value)) + b"".join(cbor(v) for v in value)
    if isinstance(value, dict):
        return _head(5, len(value)) + b"".join(cbor(k) + cbor(v) for k, v in value.items())
    raise TypeError(f"cannot encode {type(value).__name__}")


# ================================================================================================ JSON


def jsonb(value: Any) -> bytes:
    """Encode a syntax tree as JSON bytes; Text bodies go between quotes as they are (escapes included)."""
    if isinstance(value, Raw):
        return value.data
    if isinstance(value, Text):
        return b'"' + value.data + b'"'
    if isinstance(value, Pairs):
        return (
            b"{"
            + b",".join(
                jsonb(k if not isinstance(k, str) else Text(_jstr(k))) + b":" + jsonb(v) for k, v in value.items
            )
            + b"}"
        )
    if isinstance(value, dict):
        return jsonb(Pairs(tuple(value.items())))
    if isinstance(value, list | tuple):
        return b"[" + b",".join(jsonb(v) for v in value) + b"]"
    if isinstance(value, str):
        return b'"' + _jstr(value) + b'"'
    if isinstance(value, bool) or value is None:
        return {True: b"true", False: b"false", None: b"null"}[value]
    if isinstance(value, int):
        return str(value).encode()
    if isinstance(value, float):
        return json.dumps(value).encode()  # NaN / Infinity as Python spells them: not JSON, readers must refuse
    raise TypeError(f"cannot encode {type(value).__name__}")


def _jstr(text: str) -> bytes:
    return json.dumps(text, ensure_ascii=False).encode("utf-8", "surrogatepass")[1:-1]


# ================================================================================================ drawing
# Strategies are built once and cached: constructing them per draw costs more than the file it makes.

_INDEX: dict[int, st.SearchStrategy[int]] = {}
_RANGE: dict[tuple[int, int], st.SearchStrategy[int]] = {}
PERCENT = st.integers(0, 99)


def pick(draw: Any, options: list[Any] | tuple[Any, ...]) -> Any:
    """One of `options` (which may be computed per call); shrinks towards the first."""
    n = len(options)
    if n not in _INDEX:
        _INDEX[n] = st.integers(0, n - 1)
    return options[draw(_INDEX[n])]


def ints(draw: Any, lo: int, hi: int) -> int:
    key = (lo, hi)
    strategy = _RANGE.get(key)
    if strategy is None:
        strategy = st.integers(lo, hi)
        if len(_RANGE) < 10_000:
            _RANGE[key] = strategy
    return draw(strategy)


def chance(draw: Any, percent: int) -> bool:
    return percent > 0 and (percent >= 100 or draw(PERCENT) < percent)


# ================================================================================================ pools

HOSTILE_INTS = [
    0,
    1,
    2,
    3,
    7,
    8,
    24,
    255,
    256,
    257,
    65535,
    65536,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**53 + 1,
    10_737_418_240,
    10_737_418_241,
    104_857_601,
    2**62,
    2**63 - 1,
    2**63,
    2**64 - 256,
    2**64 - 2,
    2**64 - 1,
    -1,
    -2,
    -(2**31),
    -(2**63),
    -(2**63) - 1,
    -(2**64),
    2**64,
    2**65,
    10**30,
    -(2**64) - 1,  # bignums (CBOR tags 2/3)
]
HOSTILE_INT = st.one_of(st.sampled_from(HOSTILE_INTS), st.integers(0, 70), st.integers(-(2**64), 2**64 + 5))
SELF_REFERENCE = Raw(b"\xd8\x1c\x82\x00\xd8\x1d\x00")  # shareable [0, <itself>]: a cycle
# anything that is not what a field wants: wrong types, tags, specials, lying heads, nests
HOSTILE_VALUES = [
    None,
    True,
    False,
    0.5,
    float("nan"),
    float("inf"),
    -0.0,
    1e300,
    "",
    "3",
    "F32",
    b"\x01",
    [],
    {},
    [[1]],
    {"a": 1},
    Raw(b"\xf7"),
    Raw(b"\xf0"),
    Raw(b"\xf8\xff"),
    Tag(2, b"\x01" * 9),
    Tag(0, "2024-01-01T00:00:00Z"),
    Tag(1, 2**62),
    Tag(1, 1e300),
    Tag(258, [1, 2]),
    Tag(35, "(a+)+$"),
    Tag(30, [1, 0]),
    Tag(1000, 1),
    Tag(37, b"x"),
    Tag(260, b"\x01\x02"),
    Tag(36, "x"),
    Tag(4, [1, 2]),
    Tag(25, 0),
    Tag(256, ["a"]),
    SELF_REFERENCE,
    Raw(b"\x81" * 129 + b"\x00"),
    Raw(b"\x9f" * 130 + b"\xff" * 130),
    Raw(b"\x9b" + b"\xff" * 8),
    Raw(b"\x7a\xff\xff\xff\xff"),
    Raw(b"\x5b\x7f" + b"\xff" * 7),
    Raw(b"\xff"),
    Raw(b"\x1c"),
    Text(b"\xff\xfe"),
    Text(b"\xed\xa0\x80"),
    Wide(1, 8),
    -1,
    2**64 - 1,
    2**64,
]
HOSTILE_VALUE = st.sampled_from(HOSTILE_VALUES)
DEEP = [127, 128, 129, 400, 5000]
SEGMENTS = [
    "weight",
    "bias",
    "gamma",
    "beta",
    "running_mean",
    "running_var",
    "num_batches_tracked",
    "alpha",
    "fc",
    "fc1",
    "linear",
    "conv",
    "norm",
    "bn",
    "ln",
    "0",
    "1",
    "layers",
    "embed",
    "encoder",
    "attn",
    "proj",
]
UNIT_DTYPES = ["F64", "F32", "Flex32", "F16", "BF16", "I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "Bool"]
BPK_KINDS = UNIT_DTYPES + ["Bool(Native)", "Bool(U8)", "Bool(U32)", "QFloat"]
ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "Flex32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "Bool": 1,
    "Native": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "C64": 8,
}
BOOL_STORES = {"Native": 1, "U8": 1, "U32": 4}
ST_DTYPES = [
    "F64",
    "F32",
    "F16",
    "BF16",
    "I64",
    "I32",
    "I16",
    "I8",
    "U64",
    "U32",
    "U16",
    "U8",
    "BOOL",
    "F8_E4M3",
    "F8_E5M2",
    "F8_E8M0",
    "F4",
    "F6_E2M3",
    "F6_E3M2",
    "C64",
]
SUBBYTE = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
QUANT_VALUES = ["Q8F", "E5M2", "E4M3", "Q4F", "E2M1", "Q2F", "Q8S", "Q4S", "Q2S"]
CARRIED_KEYS = [
    "syncd.layout",
    "syncd.param_ids",
    "syncd.dtypes",
    "syncd.data_order",
    "syncd.burnpack_metadata",
    "syncd.burnpack_layout",
    "syncd.scalars",
    "syncd.dropped",
    "syncd.safetensors_metadata",
    "syncd.source",
    "syncd.source_sha256",
    "syncd.source_xxh3_128",
    "format",
]
META_KEYS = CARRIED_KEYS + ["version", "producer", "note"]
LAYOUT_VALUES = ["pytorch", "burn", "keep", "packed", "aligned", "", "x" * 300]

JSON_LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(),
    st.text(max_size=8),
    st.sampled_from(
        [
            "0x1p99999",
            "0x1.8p1",
            "inf",
            "nan",
            "F32",
            "Flex32",
            "Bool(U32)",
            "true",
            "AAE=",
            "!!",
            "Float",
            "Int",
            "UInt",
            "Bool",
            "packed",
            "aligned",
            "I64",
            "w",
            "fc.weight",
        ]
    ),
)
JSON_VALUE = st.recursive(
    JSON_LEAF,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
HOSTILE_JSON = [
    "[" * 100_000 + "]" * 100_000,
    "{" * 2000,
    '"\\ud800"',
    "1" * 5000,
    "1e99999",
    "NaN",
    "",
    "{",
    "[1,",
    '{"a":1,"a":2}',
    '{"w":["Float","0x1p99999"]}',
    '{"w":["Float","-0x1p-99999"]}',
    '{"w":["Int","1e3"]}',
    '{"w":["UInt","-1"]}',
    '{"w":["Int","99999999999999999999999"]}',
    '{"w":["Bool","yes"]}',
    '{"w":[1,2,3]}',
    '{"w":{"dtype":"I64","shape":[-1,-1],"data":"AA=="}}',
    '{"w":{"dtype":"I64","shape":[],"data":"!!"}}',
    '{"w":{"dtype":"QFloat","shape":[],"data":""}}',
    '{"w":{"dtype":"I64","shape":[1e3],"data":""}}',
    '{"w":{"dtype":"Bool(U32)","shape":[1],"data":"AgAAAA=="}}',
    '{"w":"18446744073709551616"}',
    '{"w":"-1"}',
    '{"w":"0x10"}',
    '{"w":1.5}',
    '{"w":"Flex32"}',
    '{"w":"QFloat"}',
    '["w","w"]',
    "[1]",
    '{"__metadata__":{"dtype":"I64","shape":[],"data":"AAAAAAAAAAA="}}',
    '{"w":["Float",1]}',
    '{"w":{"dtype":"I64","shape":[],"data":"AAAAAAAAAAA="}}',
    '{"fc.weight":"F32"}',
    '{"w":"Bool(U32)"}',
    '{"w":{"dtype":"U8","shape":[2,-2],"data":"AAAA"}}',
    '{"w\\ud800":"1"}',
    '["\\udfff"]',
]


def json_text(draw: Any, hostility: int) -> str:
    """A JSON document as text: random, or one of the hostile ones."""
    if chance(draw, 100 - hostility):
        return json.dumps(draw(JSON_VALUE))
    return pick(draw, HOSTILE_JSON)


CARRIED_NAMES = [
    "fc.weight",
    "fc.bias",
    "norm.num_batches_tracked",
    "bn.running_mean",
    "w",
    "",
    "a..b",
    "\ud800",
    "__metadata__",
    "q.weight",
]
CARRIED_DTYPES: list[Any] = ["Flex32", "Bool", "Bool(U8)", "Bool(U32)", "F32", "QFloat", "I64", "", 1, None, ["Flex32"]]
SCALAR_TEXTS: list[Any] = [
    "0x1p99999",
    "-0x1p-99999",
    "0x1.8p1",
    "inf",
    "-inf",
    "nan",
    "1e3",
    "true",
    "false",
    "yes",
    "-1",
    "18446744073709551616",
    "9223372036854775808",
    "-9223372036854775809",
    "1" * 5000,
    "0",
    "",
    1,
    1.5,
    None,
    ["x"],
]
DROPPED_DATA: list[Any] = ["", "AA==", "AAAAAAAAAAA=", "AQAAAA==", "!!", "AAE", "A" * 100_000, 1, None, "AgAAAA=="]
DROPPED_SHAPES: list[Any] = [[], [1], [2], [-1, -1], [2**64], [1e3], ["1"], None, "1", [[1]], [True], [0, 2**70]]


def carried_text(draw: Any, key: str, hostility: int) -> str:
    """A value for one carried `syncd.*` key, shaped like what syncd writes there, with hostile parts; or a
    hostile JSON document; or random JSON."""
    how = ints(draw, 0, 9)
    if how == 0:
        return pick(draw, HOSTILE_JSON)
    if how == 1:
        return json_text(draw, hostility)
    names = [pick(draw, CARRIED_NAMES) for _ in range(ints(draw, 0, 3))]
    if key == "syncd.param_ids":
        value: Any = {
            n: pick(
                draw,
                [
                    "0",
                    "18446744073709551615",
                    "18446744073709551616",
                    "-1",
                    "1.5",
                    "x",
                    7,
                    None,
                    [1],
                    "0x10",
                    "1" * 5000,
                ],
            )
            for n in names
        }
    elif key == "syncd.dtypes":
        value = {n: pick(draw, CARRIED_DTYPES) for n in names}
    elif key == "syncd.data_order":
        value = names if chance(draw, 80) else [draw(HOSTILE_INT) for _ in names]
    elif key == "syncd.scalars":
        value = {
            n: [pick(draw, ["Float", "Int", "UInt", "Bool", "Str", ""]), pick(draw, SCALAR_TEXTS)]
            + ([1] if chance(draw, 10) else [])
            for n in names
        }
    elif key == "syncd.dropped":
        value = {
            n: {
                "dtype": pick(draw, CARRIED_DTYPES + ["I64", "U8", "F64", "C64", "F4", "BF16"]),
                "shape": pick(draw, DROPPED_SHAPES),
                "data": pick(draw, DROPPED_DATA),
            }
            for n in names
        }
        if chance(draw, 20) and value:
            next(iter(value.values())).pop(pick(draw, ["dtype", "shape", "data"]))
    else:  # the carried metadata maps
        value = {n: pick(draw, ["v", "", 1, None, ["v"], "\ud800"]) for n in names}
    if chance(draw, 10):
        value = [value] if chance(draw, 50) else json.dumps(value)
    return json.dumps(value)


HOSTILE_NAMES: list[Any] = [
    "",
    ".",
    "..",
    "a..b",
    ".a",
    "a.",
    "__metadata__",
    "a\nb",
    "a\x00b",
    " ",
    "w\u202e",
    "\ud800",
    "a.\udfff",
    "😀.weight",
    "fc.weight\r",
    Text(b"\xff"),
    Text(b"a.\xc3"),
    Text(b"\xed\xa0\x80"),
    Text(b"\xc0\xae"),
    Text(b""),
]
ANY_TEXT = st.text(max_size=12)


def tensor_name(draw: Any, hostility: int) -> Any:
    if not chance(draw, hostility):
        return ".".join(pick(draw, SEGMENTS) for _ in range(ints(draw, 1, 4)))
    how = ints(draw, 0, 4)
    if how == 0:
        return pick(draw, HOSTILE_NAMES)
    if how == 1:
        return "a" * pick(draw, [200, 4096, 70_000])
    if how == 2:
        return ".".join(["x"] * pick(draw, [2, 300, 3000]))
    return draw(ANY_TEXT)


# ================================================================================================ burnpack


@dataclass
class _Planned:
    key: Any
    doc: Any  # the descriptor map (data_offsets filled in later), or a hostile non-map
    nbytes: int | None  # None: no consistent length (hostile shape/dtype)
    bools: int  # element width of a bool dtype (its bytes must be 0/1), else 0
    offsets: Any = None  # hostile data_offsets, or None to assign consistent ones


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


HOSTILE_SHAPES = [
    [2**63, 0],
    [0, 2**64 - 1],
    [2**64 - 1, 2**64 - 1],
    [1] * 300,
    [2**32, 2**32],
    [10_737_418_240],
    [3, -1],
    [2**64],
    [0] * 5000,
]
DIMS = [0, 1, 1, 2, 3, 4, 5, 8, 16]
ZERO_SIZED = [[2**40, 0], [0, 2**40], [2**63, 0], [0, 2**64 - 1], [0], [0, 0], [0, 3], [3, 0], [0, 2**32, 2**32]]


def shape_of(draw: Any, hostility: int) -> list[Any]:
    if chance(draw, hostility):
        if chance(draw, 50):
            return list(pick(draw, HOSTILE_SHAPES))
        return [draw(HOSTILE_INT) for _ in range(ints(draw, 0, 6))]
    if chance(draw, 3):
        return list(pick(draw, ZERO_SIZED))
    return [pick(draw, DIMS) for _ in range(ints(draw, 0, 4))]


MODULE_PREFIXES = ["fc", "linear", "layers.0", "encoder.proj", "norm", "bn", "conv", "embed", "ln", "head"]
MODULE_KINDS = ["linear", "linear_burn", "batch_norm", "burn_norm", "conv", "embedding", "layer_norm"]
SMALL = [1, 2, 3, 4, 5, 8]
HUGE = [2**40, 2**63, 2**64 - 1]


def module_group(draw: Any) -> list[tuple[str, list[int], str]]:
    """(name, shape, dtype) of the tensors of one module as PyTorch or Burn would save it; sometimes
    zero-sized with a huge other dimension, which a reader accepts (0 bytes) and a transpose must not loop over."""
    prefix, kind = pick(draw, MODULE_PREFIXES), pick(draw, MODULE_KINDS)
    a, b = pick(draw, SMALL), pick(draw, SMALL)
    if kind in ("linear", "linear_burn") and chance(draw, 15):  # [H, 0] / [0, H], bias [0]
        out_dim, huge = 0, pick(draw, HUGE)
        w = [out_dim, huge] if kind == "linear" else [huge, out_dim]
        return [(f"{prefix}.weight", w, "F32"), (f"{prefix}.bias", [0], "F32")]
    dtype = "F32" if chance(draw, 85) else pick(draw, ["F16", "BF16", "F64"])
    if kind == "linear":
        group = [(f"{prefix}.weight", [a, b], dtype), (f"{prefix}.bias", [a], dtype)]
    elif kind == "linear_burn":
        group = [(f"{prefix}.weight", [b, a], dtype), (f"{prefix}.bias", [a], dtype)]
    elif kind == "batch_norm":
        group = [(f"{prefix}.{leaf}", [a], dtype) for leaf in ("weight", "bias", "running_mean", "running_var")]
        group.append((f"{prefix}.num_batches_tracked", [], "I64"))
    elif kind == "burn_norm":
        group = [(f"{prefix}.{leaf}", [a], dtype) for leaf in ("gamma", "beta", "running_mean", "running_var")]
    elif kind == "conv":
        group = [(f"{prefix}.weight", [a, b, 3, 3], dtype), (f"{prefix}.bias", [a], dtype)]
    elif kind == "embedding":
        group = [(f"{prefix}.weight", [a, b], dtype)]
    else:
        group = [(f"{prefix}.weight", [a], dtype), (f"{prefix}.bias", [a], dtype)]
    if chance(draw, 20):
        group.pop(ints(draw, 0, len(group) - 1))
    return group


def tensor_plan(draw: Any, hostility: int) -> list[tuple[str, list[int], str] | None]:
    """What tensors a structured file holds: whole modules (so the adapters have something to decide), or
    free-form ones (None: the generator makes everything up)."""
    if chance(draw, 50):
        plan: list[tuple[str, list[int], str] | None] = []
        for _ in range(ints(draw, 1, 3)):
            plan.extend(module_group(draw))
        return plan[:8] + [None] * (ints(draw, 0, 2) if chance(draw, hostility) else 0)
    return [None] * ints(draw, 0, 6)


HOSTILE_DTYPES: list[tuple[Any, str | None]] = [
    ("f32", None),
    ("Bool(U8)", None),
    ("QFloat", None),
    ("", None),
    ("F32 ", None),
    ({"Bool": "U16"}, None),
    ({"Bool": 1}, None),
    ({"Bool": "U8", "x": 1}, None),
    ({"QFloat": None}, None),
    ({"QFloat": []}, None),
    ({"QFloat": {}}, None),
    ({"QFloat": {"value": [1]}}, None),
    ({"QFloat": {"value": {"a": 1}}}, None),
    ({"QFloat": {"value": Tag(258, [1])}}, None),
    ({"Float": "F32"}, None),
    ({"Bool": Text(b"\xff")}, None),
    ({"QFloat": {"value": "Q8S", "store": SELF_REFERENCE}}, "QFloat"),
    ({"QFloat": {"value": "Q4F", "nest": Raw(b"\x81" * 120 + b"\x00")}}, "QFloat"),
    ({"QFloat": {"value": "Q8F", "odd": b"\x00\x01"}}, "QFloat"),
    ({"QFloat": {"value": "Q8F", "big": Raw(b"\xc2\x49" + b"\x01" * 9)}}, "QFloat"),
    ({"QFloat": {"value": "Q8F", "undef": Raw(b"\xf7")}}, "QFloat"),
    ({"QFloat": {"value": "E2M1", "x": Tag(1, 1.5)}}, "QFloat"),
    ({"QFloat": {"value": "E2M1", "x": Tag(258, [1, 2])}}, "QFloat"),
    ({"QFloat": {"value": "E2M1", "x": Raw(b"\xf8\x20")}}, "QFloat"),
    ({"QFloat": Pairs((("value", "Q8F"), (1, 2)))}, "QFloat"),
    ({"QFloat": Pairs((("value", "Q8F"), ((1, 2), 2)))}, "QFloat"),
    ({"QFloat": {"value": "Q8F", "f": 0.1, "g": float("nan"), "h": -(2**64)}}, "QFloat"),
    ({"QFloat": {"value": "Q2S", "block": {"size": {"storage": [0, 0, 0, 0, 0], "len": 2**64 - 1}}}}, "QFloat"),
]
BLOCK = {"storage": [32, 1, 1, 1, 1], "len": 1}


def quant_scheme(draw: Any) -> Any:
    value = pick(draw, QUANT_VALUES)
    return pick(
        draw,
        [
            {"value": value, "store": "Native", "mode": "Symmetric", "tensor": "F32", "block": None},
            {
                "value": value,
                "store": {"PackedU32": 0},
                "mode": "Lookup",
                "tensor": None,
                "block": {"size": BLOCK, "dtype": "F16"},
            },
            {"value": value, "param": "F32", "store": "Native", "level": "Tensor", "mode": "Symmetric"},
            {
                "value": value,
                "param": "F32",
                "store": {"PackedNative": 2},
                "level": {"Block": BLOCK},
                "mode": "Symmetric",
            },
            {
                "value": value,
                "param": "F32",
                "store": "U32",
                "level": {"BlockTensor": {"block": BLOCK, "global": "UE8M0"}},
                "mode": "Symmetric",
            },
            {"value": value},
            {"value": value, "store": [1, 2, [3, [4, [5]]]], "x": {"y": {"z": None}}, "f": 0.5, "n": -7, "t": True},
        ],
    )


def bpk_dtype(draw: Any, hostility: int) -> tuple[Any, str | None]:
    """(the CBOR DType, the element kind for sizing: a unit name, a Bool store, "QFloat", or None)."""
    if chance(draw, hostility):
        return pick(draw, HOSTILE_DTYPES) if chance(draw, 70) else (draw(HOSTILE_VALUE), None)
    kind = pick(draw, BPK_KINDS)
    if kind.startswith("Bool("):
        store = kind[5:-1]
        return {"Bool": store}, store
    if kind == "QFloat":
        return {"QFloat": quant_scheme(draw)}, "QFloat"
    return kind, kind


HOSTILE_OFFSETS: list[Any] = [
    [2**64 - 1, 2**64 - 1],
    [2**64 - 256, 2**64],
    [0, 2**64 - 1],
    [256, 0],
    [0],
    [0, 0, 0],
    [],
    [-1, 3],
    [0.0, 4.0],
    "0..4",
    None,
    [True, False],
    [Wide(0, 8), Wide(4, 8)],
    [2**63, 2**63 + 4],
    [0, 10_737_418_241],
]
NON_KEYS: list[Any] = [1, -1, b"w", None, True, 0.5, [1], Raw(b"\xf7"), Tag(258, ["a"]), Tag(1000, "w")]
NON_MAPS: list[Any] = [[], "desc", None, 0, Raw(b"\xbf\xff"), Tag(55799, {})]
DESC_KEYS = ["extra", "dtype", "shape", "param_id", "data_offsets"]


BPK_SPELLING: dict[str, tuple[Any, str]] = {
    "F32": ("F32", "F32"),
    "F16": ("F16", "F16"),
    "BF16": ("BF16", "BF16"),
    "F64": ("F64", "F64"),
    "I64": ("I64", "I64"),
}


def descriptor(draw: Any, hostility: int, fixed: tuple[str, list[int], str] | None = None) -> _Planned:
    key = tensor_name(draw, hostility if chance(draw, 40) else 0) if fixed is None else fixed[0]
    if chance(draw, hostility // 3):
        key = pick(draw, NON_KEYS)
    dtype, kind = bpk_dtype(draw, hostility)
    shape = shape_of(draw, hostility)
    if fixed is not None:
        if not chance(draw, hostility):
            dtype, kind = BPK_SPELLING[fixed[2]]
        if not chance(draw, hostility):
            shape = list(fixed[1])
    doc: dict[str, Any] = {"dtype": dtype, "shape": shape}
    if chance(draw, hostility):
        doc["shape"] = draw(HOSTILE_VALUE) if chance(draw, 50) else [draw(HOSTILE_VALUE)]
    if chance(draw, 30):
        doc["param_id"] = draw(HOSTILE_INT) if chance(draw, hostility) else ints(draw, 0, 2**64 - 1)
    if chance(draw, hostility // 2):
        doc[pick(draw, DESC_KEYS)] = draw(HOSTILE_VALUE)  # unknown key, or a second value for a known one
    if chance(draw, hostility // 2):
        doc.pop(pick(draw, ["dtype", "shape"]), None)
    nbytes: int | None = None
    bools = 0
    shape = doc.get("shape")
    valid_shape = isinstance(shape, list) and all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d < U64 for d in shape
    )
    if kind == "QFloat":
        nbytes = ints(draw, 0, 64)
    elif kind is not None and valid_shape:
        size = BOOL_STORES.get(kind) or ITEMSIZE[kind]
        nbytes = _numel(shape) * size
        bools = size if kind in BOOL_STORES or kind == "Bool" else 0
        if chance(draw, hostility // 2):
            nbytes += pick(draw, [-1, 1, size, -size]) if nbytes else 1
    offsets = None
    if chance(draw, hostility):
        offsets = pick(draw, HOSTILE_OFFSETS) if chance(draw, 50) else [draw(HOSTILE_INT), draw(HOSTILE_INT)]
    planned = _Planned(key, doc, nbytes, bools, offsets)
    if chance(draw, hostility // 3):
        planned.doc = pick(draw, NON_MAPS)
    return planned


def _filler(seed: int, size: int, bools: int) -> bytes:
    rng = random.Random(seed)
    if bools:
        data = bytearray(size)
        for i in range(0, size, bools):
            data[i] = rng.random() < 0.5
        if size and rng.random() < 0.05:
            data[rng.randrange(size)] = rng.choice([2, 0xFF])
        return bytes(data)
    return rng.randbytes(size)


MAX_DATA = 1 << 16  # bytes of tensor data a generated file really holds


def meta_map(draw: Any, hostility: int) -> Any:
    entries: dict[Any, Any] = {}
    for _ in range(ints(draw, 0, 4)):
        key = pick(draw, META_KEYS)
        if key in ("syncd.layout", "syncd.burnpack_layout"):
            entries[key] = pick(draw, LAYOUT_VALUES)
        elif key.startswith("syncd."):
            entries[key] = carried_text(draw, key, hostility)
        else:
            entries[key] = draw(ANY_TEXT)
    if chance(draw, hostility):
        entries[pick(draw, ["k", 1, Text(b"\xff"), Raw(b"\xf6"), "syncd.param_ids"])] = (
            draw(HOSTILE_VALUE) if chance(draw, 70) else "\ud800"
        )
    return entries


BAD_SCALARS: list[Any] = [{"Int": 1, "UInt": 2}, [], "Int", None, {}, Tag(1000, 1), {"Float": SELF_REFERENCE}]


def scalars_map(draw: Any, hostility: int) -> Any:
    out: dict[Any, Any] = {}
    for i in range(ints(draw, 0, 3)):
        kind = pick(draw, ["Int", "UInt", "Float", "Bool"])
        if kind == "Int":
            value: Any = ints(draw, -(2**63), 2**63 - 1)
        elif kind == "UInt":
            value = ints(draw, 0, 2**64 - 1)
        elif kind == "Float":
            value = draw(st.floats())
        else:
            value = chance(draw, 50)
        if chance(draw, hostility):
            kind = pick(draw, ["Int", "UInt", "Float", "Bool", "Str", "", "int"])
            value = draw(HOSTILE_INT) if chance(draw, 50) else draw(HOSTILE_VALUE)
        out[f"s{i}"] = {kind: value} if not chance(draw, hostility // 2) else pick(draw, BAD_SCALARS)
    return out


TOP_EXTRAS: list[Any] = (
    [
        ("tensors", {}),
        ("extra", SELF_REFERENCE),
        (Tag(55799, "x"), 1),
        (1, 2),
        ("metadata", None),
        ("scalars", []),
        ("metadata", []),
        ("extra", Raw(b"\xa0")),
        ("extra", Tag(35, "(a*)*b")),
        ("extra", Tag(2, b"\xff" * 4000)),
    ]
    + [("extra", Raw(b"\x81" * d + b"\x00")) for d in DEEP]
    + [("extra", Raw(b"\x9f" * d + b"\xff" * d)) for d in DEEP]
)
TOP_REPLACEMENTS: list[Any] = [("tensors", []), ("tensors", None), ("tensors", "x"), ("tensorz", {})]
DOC_REPLACEMENTS: list[Any] = [
    [],
    "tensors",
    None,
    Tag(55799, {"tensors": {}}),
    Raw(b"\xbf\xff"),
    Raw(b"\xa1\x67tensors\xbf\xff"),
    Raw(b""),
    Raw(b"\xa1\x67tensors\xa0" * 2),
]
HOSTILITY = [0, 0, 2, 5, 15, 40, 100]
GENTLE = [0, 1, 2, 3, 5, 10]  # for the conversion tests: most files must get past the reader


@st.composite
def burnpack_files(draw: Any, levels: list[int] = HOSTILITY) -> bytes:
    """A burnpack file: a valid skeleton whose fields are replaced by hostile values at a per-file rate (in
    percent, one of `levels`)."""
    hostility = pick(draw, levels)
    planned = [descriptor(draw, hostility, fixed) for fixed in tensor_plan(draw, hostility)]
    packed = chance(draw, 20)
    seed = ints(draw, 0, 2**32)
    # consistent offsets in a data order of our choosing; hostile ones where a descriptor asked for them
    cursor, data_len, datas = 0, 0, []
    order = list(range(len(planned)))
    if chance(draw, 50):
        order.reverse()
    for i in order:
        p = planned[i]
        if not isinstance(p.doc, dict):
            continue
        size = p.nbytes if p.nbytes is not None and p.nbytes >= 0 else ints(draw, 0, 16)
        start = cursor if packed else -(-cursor // 256) * 256
        p.doc["data_offsets"] = [start, start + size] if p.offsets is None else p.offsets
        if p.offsets is None:
            if start + size <= MAX_DATA:
                datas.append((start, _filler(seed + i, size, p.bools)))
                data_len = max(data_len, start + size)
            cursor = start + size  # past MAX_DATA: claims more than the file holds (truncated)
        if chance(draw, 80):  # Burn's key order; else data_offsets last
            p.doc = {k: p.doc[k] for k in DESC_KEYS[1:] + DESC_KEYS[:1] if k in p.doc}
    pairs: list[tuple[Any, Any]] = [(p.key, p.doc) for p in planned]
    if chance(draw, hostility // 2) and pairs:  # a duplicate tensor name
        pairs.append((pairs[0][0], pairs[-1][1]))
    top: list[tuple[Any, Any]] = [("tensors", Pairs(tuple(pairs)))]
    if chance(draw, 40):
        top.append(("metadata", meta_map(draw, hostility)))
    if chance(draw, 25):
        top.append(("scalars", scalars_map(draw, hostility)))
    if chance(draw, hostility):
        top.append(pick(draw, TOP_EXTRAS))
    if chance(draw, hostility // 4):
        top = [pick(draw, TOP_REPLACEMENTS)]
    if chance(draw, 20):
        top.reverse()
    document: Any = Pairs(tuple(top))
    if chance(draw, hostility // 4):
        document = pick(draw, DOC_REPLACEMENTS)
    meta = cbor(document)
    if chance(draw, hostility // 3):
        meta += pick(draw, [b"\x00", b"\xff", b"\x00" * 100])  # trailing bytes after the document
    size_field = len(meta)
    if chance(draw, hostility // 2):
        size_field = pick(
            draw, [0, 1, len(meta) - 1, len(meta) + 1, len(meta) + 256, 2**32 - 1, 2**31, 104_857_600, 104_857_601]
        )
        size_field = max(0, min(size_field, 2**32 - 1))
    magic = MAGIC if not chance(draw, hostility // 4) else pick(draw, [0, MAGIC ^ 1, 0x4E525542])
    version = 1 if not chance(draw, hostility // 2) else pick(draw, [0, 2, 0xFFFF])
    head = struct.pack("<IHI", magic, version, size_field) + meta
    data_start = len(head) if packed else -(-len(head) // 256) * 256
    body = bytearray(data_len)
    for start, data in datas:
        body[start : start + len(data)] = data
    blob = head + bytes(data_start - len(head)) + bytes(body)
    if chance(draw, hostility // 2):
        cut = ints(draw, 0, len(blob))
        blob = blob[:cut] if chance(draw, 70) else blob + bytes(ints(draw, 1, 300))
    return blob


# ================================================================================================ safetensors

HOSTILE_ST_DTYPES: list[Any] = [
    "f32",
    "F32 ",
    "",
    "Bool",
    "QFloat",
    "Flex32",
    "F8",
    4,
    None,
    ["F32"],
    {"F32": 1},
    Text(b"\\ud800"),
    Text(b"\xff"),
    "bool",
    "U1",
]
HOSTILE_ST_SHAPES: list[Any] = [
    None,
    "3",
    [1.0],
    [True],
    [[2]],
    [-0.0],
    {},
    Raw(b"[1e999]"),
    Raw(b"[1" + b"0" * 5000 + b"]"),
    Raw(b"[18446744073709551616]"),
    Raw(b"[-0]"),
    Raw(b"[1E2]"),
    Raw(b"[01]"),
    Raw(b"[" * 3000 + b"]" * 3000),
]
ST_ENTRY_KEYS = ["extra", "dtype", "shape", "data_offsets", "__metadata__"]
ST_NON_ENTRIES: list[Any] = [[], "entry", None, 0, Raw(b"[" * 3000 + b"]" * 3000), Raw(b"{}")]


def st_entry(draw: Any, hostility: int, fixed: tuple[str, list[int], str] | None = None) -> tuple[Any, Any, int | None]:
    """(name, entry tree, consistent byte length or None)."""
    name = tensor_name(draw, hostility if chance(draw, 40) else 0) if fixed is None else fixed[0]
    dtype: Any = pick(draw, ST_DTYPES)
    shape: Any = shape_of(draw, hostility)
    if fixed is not None:
        if not chance(draw, hostility):
            dtype = fixed[2]
        if not chance(draw, hostility):
            shape = list(fixed[1])
    nbytes: int | None = None
    if isinstance(shape, list) and all(isinstance(d, int) and 0 <= d < U64 for d in shape):
        if dtype in SUBBYTE:
            bits = _numel(shape) * SUBBYTE[dtype]
            nbytes = bits // 8 if bits % 8 == 0 else None
        else:
            nbytes = _numel(shape) * ITEMSIZE[dtype]
    if chance(draw, hostility):
        dtype = pick(draw, HOSTILE_ST_DTYPES)
        nbytes = None
    entry: Any = {"dtype": dtype, "shape": shape}
    if chance(draw, hostility):
        entry["shape"] = pick(draw, HOSTILE_ST_SHAPES)
        nbytes = None
    if chance(draw, hostility // 2):
        entry[pick(draw, ST_ENTRY_KEYS)] = 1
    if chance(draw, hostility // 2):
        entry.pop(pick(draw, ["dtype", "shape"]), None)
    if chance(draw, hostility // 3):
        entry = pick(draw, ST_NON_ENTRIES)
    return name, entry, nbytes


HOSTILE_ST_OFFSETS: list[Any] = [
    [],
    [0],
    [0, 0, 0],
    [4, 0],
    [0.0, 4.0],
    "0,4",
    None,
    [True, True],
    Raw(b"[0,18446744073709551616]"),
    Raw(b"[-0,0]"),
    [2**64 - 1, 2**64 - 1],
]
HOSTILE_ST_META: list[Any] = [
    [],
    "m",
    None,
    1,
    {"k": 1},
    {"k": None},
    {"k": ["v"]},
    {"k": Text(b"\\ud800")},
    {"k": Text(b"\xff")},
    {Text(b"\\udfff"): "v"},
    {"k": Text(b"\\u0000")},
    {"syncd.param_ids": Text(b"\\ud800")},
]
BAD_NAMES = [
    Text(b"\\ud800"),
    Text(b"a\\udc00b"),
    Text(b"\xff"),
    Text(b"\\u0000"),
    Text(b"\\ud800\\udc00"),
    Text(b"a\\n"),
]
ST_TEXT_REPLACEMENTS = [
    b"",
    b"[]",
    b"null",
    b" {}",
    b"\xef\xbb\xbf{}",
    b"{" * 100_000,
    b"[" * 100_000,
    b'{"a":' * 3000 + b"1" + b"}" * 3000,
    b"{}" + b"\x00" * 5,
    b'{"__metadata__":{}}',
    b'{"a":{"dtype":"U8","shape":[],"data_offsets":[0,1]}}',
    b"{}}",
    b"{,}",
    b'{"a":1}',
]
ST_PADS = [b"", b"\x00" * 8, b"\n\t  ", b" " * 4096, b"\r\n", b"  \x00"]


@st.composite
def safetensors_files(draw: Any, levels: list[int] = HOSTILITY) -> bytes:
    """A safetensors file: a valid skeleton whose fields are replaced by hostile values at a per-file rate."""
    hostility = pick(draw, levels)
    entries = [st_entry(draw, hostility, fixed) for fixed in tensor_plan(draw, hostility)]
    seed = ints(draw, 0, 2**32)
    cursor, chunks = 0, []
    pairs: list[tuple[Any, Any]] = []
    for i, (name, entry, nbytes) in enumerate(entries):
        size = nbytes if nbytes is not None else ints(draw, 0, 16)
        if isinstance(entry, dict):
            offsets: Any = [cursor, cursor + size]
            if chance(draw, hostility):
                offsets = pick(draw, HOSTILE_ST_OFFSETS + [[cursor, cursor + size + 1], [cursor + 1, cursor + size]])
                if chance(draw, 50):
                    offsets = [draw(HOSTILE_INT), draw(HOSTILE_INT)]
            entry["data_offsets"] = offsets
            if chance(draw, 30):  # key order varies
                entry = dict(reversed(list(entry.items())))
        if cursor + size <= MAX_DATA:
            chunks.append(_filler(seed + i, size, 1 if isinstance(entry, dict) and entry.get("dtype") == "BOOL" else 0))
        cursor += size
        pairs.append((name if not isinstance(name, str) else Text(_jstr(name)), entry))
    if chance(draw, 40):
        meta: Any = {}
        for _ in range(ints(draw, 0, 4)):
            key = pick(draw, META_KEYS)
            if key in ("syncd.layout", "syncd.burnpack_layout"):
                meta[key] = pick(draw, LAYOUT_VALUES)
            else:
                meta[key] = carried_text(draw, key, hostility) if key.startswith("syncd.") else draw(ANY_TEXT)
        if chance(draw, hostility):
            meta = pick(draw, HOSTILE_ST_META)
        position = ints(draw, 0, len(pairs)) if chance(draw, 30) else 0
        pairs.insert(position, (Text(b"__metadata__"), meta))
    if chance(draw, hostility // 2) and pairs:
        pairs.append(pairs[0])  # duplicate key
    if chance(draw, hostility // 3):
        pairs.append((pick(draw, BAD_NAMES), {"dtype": "U8", "shape": [0], "data_offsets": [cursor, cursor]}))
    text = jsonb(Pairs(tuple(pairs)))
    if chance(draw, hostility // 3):
        text = pick(
            draw,
            ST_TEXT_REPLACEMENTS
            + [text + b"}", text[:-1], text + b"x", text.replace(b":", b"=", 1), b" " + text, b"\n" + text],
        )
    pad = b" " * (-len(text) % 8)
    if chance(draw, hostility // 2):
        pad = pick(draw, ST_PADS)
    text += pad
    length = len(text)
    if chance(draw, hostility // 2):
        length = pick(
            draw, [0, 1, 2, 7, length - 1, length + 1, length + 8, 2**32, 2**63, 2**64 - 1, 100_000_000, 100_000_001]
        )
        length = max(0, min(length, 2**64 - 1))
    blob = struct.pack("<Q", length) + text + b"".join(chunks)
    if chance(draw, hostility // 2):
        cut = ints(draw, 0, len(blob))
        blob = blob[:cut] if chance(draw, 70) else blob + bytes(ints(draw, 1, 64))
    return blob


# ================================================================================================ PyTorch

# A torch.save zip built here (its own zip writer and pickle emitter, not torch's nor syncd's): tensors as
# `_rebuild_tensor_v2/_v3` calls over persistent storage ids, with hostile offsets, sizes, strides and storage
# sizes; other globals, stray opcodes, cut streams; zip headers that lie (sizes, methods, CRCs, names).

PT_STORAGES = {
    "FloatStorage": 4,
    "DoubleStorage": 8,
    "HalfStorage": 2,
    "BFloat16Storage": 2,
    "LongStorage": 8,
    "IntStorage": 4,
    "ShortStorage": 2,
    "CharStorage": 1,
    "ByteStorage": 1,
    "BoolStorage": 1,
    "ComplexFloatStorage": 8,
    "ComplexDoubleStorage": 16,
    "QInt8Storage": 1,
}
PT_V3_DTYPES = {
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float32": 4,
    "complex32": 4,
}
PT_OTHER_GLOBALS = [
    ("posix", "system"),
    ("builtins", "eval"),
    ("__builtin__", "getattr"),
    ("torch", "load"),
    ("torch._utils", "_rebuild_qtensor"),
    ("numpy.core.multiarray", "scalar"),
    ("torch", "Size"),
    ("collections", "defaultdict"),
    ("torch.nn.parameter", "Parameter"),
    ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch._utils", "_rebuild_parameter"),
    ("", ""),
]
PT_STRAY_OPS = [
    b"(",
    b")",
    b"0",
    b"1",
    b"2",
    b"N",
    b"R",
    b"b",
    b"s",
    b"u",
    b"a",
    b"e",
    b"t",
    b"\x85",
    b"\x93",
    b"Q",
    b"\x81",
    b"i",
    b"o",
    b"\x82",
    b"V",
    b"S",
    b"\x94",
    b"j\xff\xff\xff\xff",
    b"r\xff\xff\xff\xff",
    b"h\x00",
    b"\x8a\xff",
    b"X\xff\xff\xff\x7f",
    b"\x8d" + b"\xff" * 8,
    b"c\n\n",
    b".",
]


def _p_int(n: int) -> bytes:
    if 0 <= n < 256:
        return b"K" + bytes([n])
    if 0 <= n < 65536:
        return b"M" + n.to_bytes(2, "little")
    if -(2**31) <= n < 2**31:
        return b"J" + n.to_bytes(4, "little", signed=True)
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def _p_str(text: str | bytes) -> bytes:
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    return b"X" + len(raw).to_bytes(4, "little") + raw


def _p_global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _p_tuple(items: list[bytes]) -> bytes:
    return b"(" + b"".join(items) + b"t"


@dataclass
class _PtPlan:
    pickle: bytes
    storages: dict[str, int]  # key -> bytes its entry holds


def _pt_tensor(draw: Any, hostility: int, storages: dict[str, int]) -> bytes:
    v3 = chance(draw, 20)
    kind, item = pick(draw, sorted(PT_V3_DTYPES.items()) if v3 else sorted(PT_STORAGES.items()))
    if not chance(draw, hostility):
        kind, item = ("float32", 4) if v3 else ("FloatStorage", 4)
    rank = ints(draw, 0, 3)
    shape = [ints(draw, 0, 5) for _ in range(rank)]
    strides, step = [], 1
    for dim in reversed(shape):
        strides.insert(0, step)
        step *= max(dim, 1)
    if chance(draw, 30):  # a view: permuted or strided strides over a larger storage
        strides = [s * ints(draw, 1, 3) for s in strides]
        if chance(draw, 50):
            strides.reverse()
    offset = ints(draw, 0, 4) if chance(draw, 30) else 0
    numel = offset + sum((d - 1) * s for d, s in zip(shape, strides, strict=True) if d) + 1
    if chance(draw, hostility):
        which = ints(draw, 0, 3)
        value = draw(HOSTILE_INT)
        if which == 0:
            offset = value
        elif which == 1 and shape:
            shape[ints(draw, 0, len(shape) - 1)] = value
        elif which == 2 and strides:
            strides[ints(draw, 0, len(strides) - 1)] = value
        else:
            numel = value
    key = str(len(storages)) if not storages or chance(draw, 80) else pick(draw, sorted(storages))
    if key not in storages:
        size = max(0, numel) * (1 if v3 else item) * (item if v3 else 1)
        if chance(draw, hostility):
            size = pick(draw, [0, 1, size - 1, size + 1, size * 2]) if size < 1 << 20 else 0
        storages[key] = max(0, min(size, MAX_DATA))
    storage_type = _p_global("torch.storage", "UntypedStorage") if v3 else _p_global("torch", kind)
    pid = _p_tuple([_p_str("storage"), storage_type, _p_str(key), _p_str("cpu"), _p_int(numel)])
    args = [pid + b"Q", _p_int(offset), _p_tuple([_p_int(d) for d in shape]), _p_tuple([_p_int(s) for s in strides])]
    args += [b"\x89", _p_global("collections", "OrderedDict") + b")R"]
    if v3:
        args.append(_p_global("torch", kind))
    name = "_rebuild_tensor_v3" if v3 else "_rebuild_tensor_v2"
    call = _p_global("torch._utils", name) + _p_tuple(args) + b"R"
    if chance(draw, 15):
        call = _p_global("torch._utils", "_rebuild_parameter") + _p_tuple([call, b"\x88", b"}"]) + b"R"
    return call


def _pt_value(draw: Any, hostility: int, storages: dict[str, int], depth: int) -> bytes:
    roll = ints(draw, 0, 99)
    if roll < 55 or depth > 3:
        return _pt_tensor(draw, hostility, storages)
    if roll < 70:
        return _pt_dict(draw, hostility, storages, depth + 1)
    if roll < 75:
        return b"]" + b"(" + b"".join(_pt_value(draw, hostility, storages, depth + 1) for _ in range(2)) + b"e"
    if roll < 80 and chance(draw, hostility):
        module, name = pick(draw, PT_OTHER_GLOBALS)
        return _p_global(module, name) + _p_tuple([_p_str("x")]) + b"R"
    return pick(draw, [b"N", b"\x88", _p_int(3), b"G" + struct.pack(">d", 0.5), _p_str("text"), b"C\x02ab", b")"])


def _pt_dict(draw: Any, hostility: int, storages: dict[str, int], depth: int) -> bytes:
    ordered = chance(draw, 50)
    out = _p_global("collections", "OrderedDict") + b")R" if ordered else b"}"
    out += b"("
    for i in range(ints(draw, 1, 5)):
        key = (
            pick(draw, [f"layer{i}.weight", f"m.{i}", "", "a.b", "\n", "\udc80", 7, -1])
            if chance(draw, hostility)
            else f"t{depth}_{i}.weight"
        )
        out += (_p_int(key) if isinstance(key, int) else _p_str(key)) + _pt_value(draw, hostility, storages, depth)
    out += b"u"
    if ordered and chance(draw, 30):  # a state dict's `_metadata` attribute
        out += b"}" + _p_str("_metadata") + b"}" + b"s" + b"b"
    return out


def _pt_pickle(draw: Any, hostility: int) -> _PtPlan:
    storages: dict[str, int] = {}
    body = _pt_dict(draw, hostility, storages, 0)
    if chance(draw, 25):
        body = b"}" + _p_str(pick(draw, ["state_dict", "model_state_dict", "model"])) + body + b"s"
    data = b"\x80\x02" + body + b"."
    if chance(draw, hostility):
        pos = ints(draw, 0, len(data))
        stray = pick(draw, PT_STRAY_OPS) if chance(draw, 50) else None  # an opcode in the wrong place, or a cut
        data = data[:pos] + stray + data[pos:] if stray is not None else data[:pos]
    return _PtPlan(data, storages)


def zip_stored(entries: list[tuple[str, bytes]], draw: Any = None, hostility: int = 0) -> bytes:
    """A zip of stored entries, as torch writes them; with `draw`, some headers may lie."""
    out, central = bytearray(), bytearray()
    for name, data in entries:
        raw = name.encode("utf-8", "surrogatepass")
        method, crc, size, local_size = 0, zlib.crc32(data), len(data), len(data)
        if draw is not None and chance(draw, hostility // 4):
            which = ints(draw, 0, 3)
            method = 8 if which == 0 else 0
            crc = crc ^ 1 if which == 1 else crc
            size = pick(draw, [0, size + 1, size - 1, 2**32 - 1]) if which == 2 else size
            local_size = size + 7 if which == 3 else local_size
        at = len(out)
        out += (
            struct.pack(
                "<IHHHHHIIIHH",
                0x04034B50,
                20,
                0,
                method,
                0,
                0,
                crc,
                local_size & 0xFFFFFFFF,
                local_size & 0xFFFFFFFF,
                len(raw),
                0,
            )
            + raw
            + data
        )
        central += (
            struct.pack(
                "<IHHHHHHIIIHHHHHII",
                0x02014B50,
                20,
                20,
                0,
                method,
                0,
                0,
                crc,
                size & 0xFFFFFFFF,
                size & 0xFFFFFFFF,
                len(raw),
                0,
                0,
                0,
                0,
                0,
                at,
            )
            + raw
        )
    count = len(entries)
    return bytes(out + central + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, len(central), len(out), 0))


@st.composite
def pytorch_files(draw: Any, levels: list[int] = HOSTILITY) -> bytes:
    """A torch.save zip: a pickle of (nested) dicts of tensors, its storages, byteorder and version."""
    hostility = pick(draw, levels)
    plan = _pt_pickle(draw, hostility)
    entries = [("archive/data.pkl", plan.pickle)]
    if not chance(draw, hostility // 2):
        entries.append(("archive/byteorder", b"little" if not chance(draw, hostility) else pick(draw, [b"big", b""])))
    entries += [(f"archive/data/{key}", _filler(ints(draw, 0, 2**16), size, 0)) for key, size in plan.storages.items()]
    entries.append(("archive/version", b"3\n"))
    if chance(draw, hostility):
        pick(draw, [lambda: entries.reverse(), lambda: entries.append(entries[0]), lambda: entries.pop()])()
    return zip_stored(entries, draw, hostility)


def _pt_entries(blob: bytes) -> list[tuple[str, bytes]] | None:
    import zipfile

    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as archive:
            return [(info.filename, archive.read(info)) for info in archive.infolist()]
    except Exception:
        return None


@st.composite
def pytorch_mutations(draw: Any) -> tuple[str, bytes]:
    """A torch-written seed with edits: inside its pickle (the zip rebuilt around it, so the CRC holds and the
    interpreter sees the edit), or byte-level anywhere in the file."""
    name, blob = pick(draw, pytorch_seeds())
    entries = _pt_entries(blob)
    if entries is None or chance(draw, 30):
        data = bytearray(blob)
        for _ in range(ints(draw, 1, 4)):
            pos = ints(draw, 0, max(0, len(data) - 1))
            op = pick(draw, ["flip", "byte", "truncate", "delete", "insert"])
            if op == "flip" and data:
                data[pos] ^= 1 << ints(draw, 0, 7)
            elif op == "byte" and data:
                data[pos] = pick(draw, BYTES)
            elif op == "truncate":
                del data[pos:]
            elif op == "delete":
                del data[pos : pos + ints(draw, 1, 32)]
            else:
                data[pos:pos] = draw(SMALL_BINARY)
        return name, bytes(data)
    index = next(i for i, (n, _) in enumerate(entries) if n.endswith("data.pkl"))
    pkl = bytearray(entries[index][1])
    for _ in range(ints(draw, 1, 3)):
        pos = ints(draw, 2, max(2, len(pkl) - 1))
        op = pick(draw, ["flip", "byte", "stray", "int", "delete", "truncate"])
        if op in ("flip", "byte") and pos >= len(pkl):  # an earlier edit cut the pickle short
            op = "stray"
        if op == "flip":
            pkl[pos] ^= 1 << ints(draw, 0, 7)
        elif op == "byte":
            pkl[pos] = pick(draw, BYTES + [ord("K"), ord("R"), ord("c"), ord("Q"), ord("h"), ord("q")])
        elif op == "stray":
            pkl[pos:pos] = pick(draw, PT_STRAY_OPS)
        elif op == "int":
            pkl[pos:pos] = _p_int(draw(HOSTILE_INT))
        elif op == "delete":
            del pkl[pos : pos + ints(draw, 1, 8)]
        else:
            del pkl[pos:]
    entries[index] = (entries[index][0], bytes(pkl))
    if chance(draw, 20) and len(entries) > index + 1:  # a storage shortened or lengthened
        j = ints(draw, 0, len(entries) - 1)
        entries[j] = (entries[j][0], entries[j][1][: ints(draw, 0, len(entries[j][1]))] + bytes(ints(draw, 0, 16)))
    return name, zip_stored(entries)


_PT_SEEDS: list[tuple[str, bytes]] = []


def pytorch_seeds() -> list[tuple[str, bytes]]:
    """Files torch.save wrote: a state dict, views over shared storages, a training checkpoint, new dtypes."""
    if _PT_SEEDS:
        return _PT_SEEDS
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 2))
    base = torch.arange(24.0).reshape(4, 6)
    optimizer = torch.optim.SGD(model.parameters(), momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    objects = {
        "state.pt": model.state_dict(),
        "views.pt": {"base": base, "t": base.t(), "rows": base[1:3], "strided": base[:, ::2], "tied": base},
        "ckpt.pt": {"epoch": 1, "model_state_dict": model.state_dict(), "optimizer": optimizer.state_dict()},
        "dtypes.pt": {
            "u16": torch.arange(4).to(torch.uint16),
            "f8": torch.zeros(3, dtype=torch.float8_e4m3fn),
            "b": torch.tensor([True, False]),
            "bf": torch.ones(2, dtype=torch.bfloat16),
        },
    }
    for name, obj in objects.items():
        buf = io.BytesIO()
        torch.save(obj, buf)
        _PT_SEEDS.append((name, buf.getvalue()))
    return _PT_SEEDS


# ================================================================================================ mutations


def header_end(blob: bytes | bytearray) -> int:
    """Where the header (length field + metadata) of either format ends, clamped to the blob."""
    if len(blob) >= 10 and int.from_bytes(blob[:4], "little") == MAGIC:
        return min(len(blob), 10 + int.from_bytes(blob[6:10], "little"))
    if len(blob) >= 8:
        return min(len(blob), 8 + int.from_bytes(blob[:8], "little"))
    return len(blob)


INTERESTING_CBOR = [
    b"\x9b\xff\xff\xff\xff\xff\xff\xff\xff",
    b"\xbb\x00\x00\x00\x00\xff\xff\xff\xff",
    b"\x7b" + b"\xff" * 8,
    b"\x5a\xff\xff\xff\xff",
    b"\xd8\x1c",
    b"\xd8\x1d\x00",
    b"\xc2",
    b"\xd9\x01\x02",
    b"\xff",
    b"\x9f",
    b"\xbf",
    b"\xf7",
    b"\xf8\x20",
    b"\x1b" + b"\xff" * 8,
    b"\x3b" + b"\xff" * 8,
    b"\x1c",
    b"\x81" * 200,
    b"\xfb\x7f\xf8\x00\x00\x00\x00\x00\x00",
    b"\x62\xed\xa0",
    b"\x60",
    b"\xc1\x1b\x7f" + b"\xff" * 7,
    b"\xd8\x23",
]
INTERESTING_JSON = [
    b"18446744073709551616",
    b"-1",
    b"1e999",
    b"NaN",
    b"1.5",
    b"0",
    b"\\ud800",
    b"\xff",
    b'"',
    b"\\",
    b"[",
    b"{",
    b"]",
    b"}",
    b",",
    b":",
    b"null",
    b"99999999999999999999",
    b"[" * 2000,
    b'"__metadata__"',
    b"BOOL",
    b"F4",
    b"F6_E2M3",
    b"C64",
    b"\x00",
    b" " * 9,
    b"\\udfff",
    b"\\u0000",
    b'"syncd.dropped":"[1]",',
]
NUMBERS_JSON = INTERESTING_JSON[:6] + [b"4", b"1" + b"0" * 30, b"-0", b"0.0", b"1e2", b"9223372036854775808"]
OPS = ["flip", "flip", "byte", "truncate", "insert", "delete", "length", "length", "token", "token", "number", "dup"]
BYTES = [0, 1, 0x7F, 0x80, 0xFF, 0x20, 0x22, 0x5C, 0x9F, 0xBF, 0xF6]
SMALL_BINARY = st.binary(min_size=1, max_size=16)


@st.composite
def mutations(draw: Any, pool: str) -> tuple[str, bytes]:
    """A seed file (of `seeds(pool)`) with 1-4 byte-level edits, mostly in its header."""
    name, blob = pick(draw, seeds(pool))
    data = bytearray(blob)
    burnpack = name.endswith(".bpk")
    base = 10 if burnpack else 8
    for _ in range(ints(draw, 1, 4)):
        end = max(1, header_end(data))
        span = min(end + 16, len(data)) if chance(draw, 85) else len(data)
        pos = ints(draw, 0, max(0, span - 1))
        op = pick(draw, OPS)
        if op == "flip" and data:
            data[pos] ^= 1 << ints(draw, 0, 7)
        elif op == "byte" and data:
            data[pos] = pick(draw, BYTES)
        elif op == "truncate":
            cut = pick(
                draw,
                [0, 1, 4, 7, 8, 9, 10, pos, end - 1, end, end + 1, len(data) - 1, len(data) - 255, len(data) - 256],
            )
            del data[max(0, cut) :]
        elif op == "insert":
            extra = (
                draw(SMALL_BINARY)
                if chance(draw, 40)
                else pick(draw, INTERESTING_CBOR if burnpack else INTERESTING_JSON)
            )
            data[pos:pos] = extra
        elif op == "delete":
            del data[pos : pos + ints(draw, 1, 32)]
        elif op == "length" and len(data) >= base:
            _rewrite_length(draw, data, burnpack)
        elif op == "token" and len(data) > base:
            inside = ints(draw, base, max(base, end - 1))
            chunk = pick(draw, INTERESTING_CBOR if burnpack else INTERESTING_JSON)
            if chance(draw, 50):
                data[inside : inside + len(chunk)] = chunk  # overwrite in place
            else:
                data[inside:inside] = chunk
                _fix_length(data, burnpack, len(chunk))
        elif op == "number" and not burnpack:
            spans = [m.span() for m in re.finditer(rb"-?\d+", bytes(data[8:end]))]
            if spans:
                a, b = pick(draw, spans)
                new = pick(draw, NUMBERS_JSON)
                data[8 + a : 8 + b] = new
                _fix_length(data, burnpack, len(new) - (b - a))
        elif op == "number" and burnpack:
            heads = [m.start() for m in re.finditer(rb"[\x18-\x1b]", bytes(data[10:end]))]
            if heads:
                data[10 + pick(draw, heads)] = pick(draw, [0x1B, 0x3B, 0x1C, 0xC2, 0x19, 0x5B, 0x9B])
        elif op == "dup" and data:  # a slice of the header copied to another place in it
            a = ints(draw, 0, max(0, end - 1))
            piece = bytes(data[a : a + ints(draw, 1, 64)])
            data[pos:pos] = piece
            if pos < end:
                _fix_length(data, burnpack, len(piece))
    return name, bytes(data)


def _rewrite_length(draw: Any, data: bytearray, burnpack: bool) -> None:
    if burnpack and chance(draw, 85):
        real = int.from_bytes(data[6:10], "little")
        value = pick(
            draw,
            [
                0,
                1,
                real - 1,
                real + 1,
                real + 246,
                real - 256,
                2**32 - 1,
                2**31,
                104_857_600,
                104_857_601,
                len(data),
                len(data) - 10,
            ],
        )
        data[6:10] = (value % 2**32).to_bytes(4, "little")
    elif burnpack:
        data[4:6] = pick(draw, [0, 2, 0xFFFF]).to_bytes(2, "little")  # the version field
    else:
        real = int.from_bytes(data[:8], "little")
        value = pick(
            draw,
            [
                0,
                1,
                2,
                7,
                8,
                real - 1,
                real + 1,
                real - 8,
                real + 8,
                len(data) - 8,
                len(data),
                2**32,
                2**63,
                2**64 - 1,
                100_000_000,
                100_000_001,
            ],
        )
        data[:8] = (value % U64).to_bytes(8, "little")


def _fix_length(data: bytearray, burnpack: bool, delta: int) -> None:
    """After growing or shrinking the header, keep its length field honest (else every edit is a lie)."""
    if burnpack and len(data) >= 10:
        size = int.from_bytes(data[6:10], "little") + delta
        data[6:10] = (size % 2**32).to_bytes(4, "little")
    elif not burnpack and len(data) >= 8:
        size = int.from_bytes(data[:8], "little") + delta
        data[:8] = (size % U64).to_bytes(8, "little")


# ------------------------------------------------------------------------------------------------ tree edits
# Decode a real file's header, replace, drop, duplicate or rename one node of it (also inside the JSON documents
# that syncd carries as metadata strings), encode it again around the same data: deep paths through a file the
# readers accept, where byte edits mostly stop at the first parse error.

TREE_EDITS = ["replace", "replace", "int", "drop", "rename", "duplicate", "inner", "inner", "inner"]
EDIT_INTS = [-1, 1, 255, 256, -256, 2**32, 2**63, 2**64, -(2**64)]


def _split(blob: bytes, burnpack: bool) -> tuple[Any, bytes, bool] | None:
    """(decoded header, data section, packed) of a seed, or None if it does not decode."""
    import cbor2

    if burnpack:
        size = int.from_bytes(blob[6:10], "little")
        doc = cbor2.loads(blob[10 : 10 + size])
        ends = [d["data_offsets"][1] for d in doc.get("tensors", {}).values()]
        aligned = -(-(10 + size) // 256) * 256
        packed = aligned + max(ends, default=0) > len(blob)
        return doc, blob[(10 + size) if packed else aligned :], packed
    size = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8 : 8 + size]), blob[8 + size :], False


def _join(doc: Any, data: bytes, burnpack: bool, packed: bool) -> bytes:
    if burnpack:
        meta = cbor(doc)
        head = struct.pack("<IHI", MAGIC, 1, len(meta)) + meta
        return head + bytes(0 if packed else -len(head) % 256) + data
    text = jsonb(doc)
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def _edit(draw: Any, node: Any, burnpack: bool, depth: int = 0) -> Any:
    """`node` with one edit somewhere inside it (containers are copied, never changed in place)."""
    children = list(node.items()) if isinstance(node, dict) else list(enumerate(node)) if isinstance(node, list) else []
    if children and (depth == 0 or chance(draw, 75)):
        key, child = pick(draw, children)
        op = pick(draw, TREE_EDITS) if chance(draw, 40) else "descend"
        if isinstance(node, dict):
            if op == "drop":
                return {k: v for k, v in node.items() if k != key}
            if op == "rename":
                return {(tensor_name(draw, 100) if k == key else k): v for k, v in node.items()}
            if op == "duplicate":
                return Pairs((*node.items(), (key, _edit(draw, child, burnpack, depth + 1))))
            return {k: (_edit(draw, v, burnpack, depth + 1) if k == key else v) for k, v in node.items()}
        copy = list(node)
        if op == "drop":
            del copy[key]
        elif op == "duplicate":
            copy.insert(key, child)
        else:
            copy[key] = _edit(draw, child, burnpack, depth + 1)
        return copy
    op = pick(draw, TREE_EDITS)
    if op == "inner" and isinstance(node, str) and node[:1] in ("{", "["):
        with contextlib.suppress(ValueError, RecursionError):
            inner = _edit(draw, json.loads(node), False, 0)
            return jsonb(inner).decode("utf-8", "surrogatepass")  # a carried JSON document, edited
    if op == "int" and isinstance(node, int) and not isinstance(node, bool):
        return node + pick(draw, EDIT_INTS)
    if burnpack:
        return draw(HOSTILE_VALUE) if chance(draw, 70) else draw(HOSTILE_INT)
    return pick(draw, HOSTILE_JSON_VALUES) if chance(draw, 70) else draw(HOSTILE_INT)


HOSTILE_JSON_VALUES: list[Any] = [
    None,
    True,
    0.5,
    "",
    "3",
    "F32",
    "BOOL",
    "F4",
    [],
    {},
    [[1]],
    {"a": 1},
    -1,
    2**64,
    float("nan"),
    float("inf"),
    Raw(b"1e999"),
    Raw(b"-0"),
    Raw(b"1" * 5000),
    Raw(b"[" * 3000 + b"]" * 3000),
    Text(b"\\ud800"),
    Text(b"\xff"),
    Text(b"\\u0000"),
    "0x1p99999",
    "Bool(U32)",
    "Flex32",
    "pytorch",
    "burn",
    "packed",
    "a\nb",
]


GENTLE_LEAVES: list[Any] = [
    0,
    1,
    2,
    3,
    -1,
    2**64 - 1,
    2**64,
    "",
    "x",
    "F32",
    "Flex32",
    "Bool(U32)",
    "I64",
    "fc.weight",
    "fc.bias",
    "pytorch",
    "burn",
    True,
    None,
    0.5,
    [],
    {},
    "\ud800",
    "a\nb",
]


def _carried_edit(draw: Any, doc: Any, burnpack: bool) -> Any:
    """Edit the metadata map: a carried `syncd.*` JSON document changed inside, replaced, or added."""
    key = "metadata" if burnpack else "__metadata__"
    if not isinstance(doc, dict):
        return doc
    meta = dict(doc.get(key) or {}) if isinstance(doc.get(key) or {}, dict) else {}
    carried = [k for k, v in meta.items() if isinstance(v, str) and v[:1] in ("{", "[")]
    if carried and chance(draw, 60):
        target = pick(draw, carried)
        with contextlib.suppress(ValueError, RecursionError):
            inner = _edit_gently(draw, json.loads(meta[target]))
            meta[target] = jsonb(inner).decode("utf-8", "surrogatepass")
    else:
        target = pick(draw, CARRIED_KEYS)
        meta[target] = pick(draw, LAYOUT_VALUES) if target.endswith("layout") else carried_text(draw, target, 20)
    out = dict(doc)
    out[key] = meta
    return out


def _edit_gently(draw: Any, node: Any) -> Any:
    """One leaf of a JSON tree replaced by a plausible-but-wrong value, or a key dropped or renamed."""
    if isinstance(node, dict) and node and chance(draw, 85):
        key = pick(draw, list(node))
        how = ints(draw, 0, 9)
        if how == 0:
            return {k: v for k, v in node.items() if k != key}
        if how == 1:
            return {(pick(draw, CARRIED_NAMES) if k == key else k): v for k, v in node.items()}
        return {k: (_edit_gently(draw, v) if k == key else v) for k, v in node.items()}
    if isinstance(node, list) and node and chance(draw, 85):
        i = ints(draw, 0, len(node) - 1)
        return [*node[:i], _edit_gently(draw, node[i]), *node[i + 1 :]]
    if isinstance(node, str) and chance(draw, 30):
        return pick(draw, SCALAR_TEXTS + DROPPED_DATA)
    return pick(draw, GENTLE_LEAVES)


@st.composite
def tree_mutations(draw: Any, pool: str) -> tuple[str, bytes]:
    """A seed (of `seeds(pool)`) whose decoded header gets 1-3 edits (often in its carried metadata), encoded
    again around the same data."""
    name, blob = pick(draw, seeds(pool))
    burnpack = name.endswith(".bpk")
    doc, data, packed = _split(blob, burnpack)
    for _ in range(ints(draw, 1, 3)):
        doc = _carried_edit(draw, doc, burnpack) if chance(draw, 50) else _edit(draw, doc, burnpack)
        if isinstance(doc, Pairs):  # a duplicated top-level key: no further edits through it
            break
    return name, _join(doc, data, burnpack, packed)


# ================================================================================================ seeds


def _small_shared_files() -> list[Path]:
    files = sorted(FIXTURES.glob("*/*")) + sorted(CORPUS.glob("*/*"))
    return [p for p in files if p.suffix in (".bpk", ".safetensors") and p.stat().st_size <= 20_000]


def _large_shared_files() -> list[Path]:
    files = sorted(FIXTURES.glob("*/*")) + sorted(CORPUS.glob("*/*"))
    return [p for p in files if p.suffix in (".bpk", ".safetensors") and p.stat().st_size > 20_000]


_SEEDS: dict[str, list[tuple[str, bytes]]] = {}


def seeds(pool: str) -> list[tuple[str, bytes]]:
    """Seed files for mutation; `pool` is "burnpack" or "safetensors", "+large" adds the 1 MB fixtures.
    Burn's and PyTorch's files from tests/data, plus files syncd made from them (carried `syncd.*`
    metadata, every dtype, QFloat, scalars, the packed layout)."""
    if pool not in _SEEDS:
        kind, _, large = pool.partition("+")
        ext = ".bpk" if kind == "burnpack" else ".safetensors"
        files = _small_shared_files() + (_large_shared_files() if large else [])
        found = [(p.name, p.read_bytes()) for p in files if p.suffix == ext]
        found += [(n, b) for n, b in _made_seeds() if n.endswith(ext)]
        _SEEDS[pool] = found
    return _SEEDS[pool]


_MADE: list[tuple[str, bytes]] = []


def _made_seeds() -> list[tuple[str, bytes]]:
    if _MADE:
        return _MADE
    from formatgen import bytes_spec

    from syncd.engine.convert import ConvertRequest, convert
    from syncd.formats.burnpack import LAYOUT_PACKED, Scalar, write_burnpack
    from syncd.formats.safetensors import write_safetensors

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        multi = MULTI_LAYER_ST
        bpk = work / "multi.bpk"
        convert(ConvertRequest(source=multi, dest=bpk))  # carries num_batches_tracked, format=pt
        back = work / "multi_back.safetensors"
        convert(ConvertRequest(source=bpk, dest=back))  # carries param ids? (none), data order, layout
        aster = ASTERINAS_BPK
        aster_st = work / "aster.safetensors"
        convert(ConvertRequest(source=aster, dest=aster_st))  # carries burnpack metadata, param ids, data order
        specs = [
            bytes_spec("a.f64", "F64", [2], bytes(16), param_id=2**64 - 1),
            bytes_spec("a.flex", "Flex32", [1, 2], bytes(8), param_id=5),
            bytes_spec("b.bool", "Bool(U32)", [2], b"\x01\x00\x00\x00\x00\x00\x00\x00"),
            bytes_spec("b.bool8", "Bool(U8)", [3], b"\x01\x00\x01"),
            bytes_spec("b.native", "Bool(Native)", [1], b"\x01"),
            bytes_spec("c.legacy", "Bool", [2], b"\x00\x01"),
            bytes_spec(
                "q.weight",
                "QFloat",
                [4],
                bytes(8),
                raw_dtype={
                    "QFloat": {"value": "Q8S", "store": "Native", "mode": "Symmetric", "tensor": "F32", "block": None}
                },
            ),
            bytes_spec("u.u16", "U16", [3], bytes(6)),
            bytes_spec("fc.weight", "F32", [2, 3], bytes(range(24))),
            bytes_spec("fc.bias", "F32", [3], bytes(12)),
        ]
        scalars = {
            "lr": Scalar("Float", 0.1),
            "step": Scalar("UInt", 7),
            "neg": Scalar("Int", -3),
            "flag": Scalar("Bool", True),
        }
        made = [
            ("made_all_dtypes.bpk", specs, {"producer": "fuzz"}, scalars, "aligned"),
            ("made_packed.bpk", specs[-3:], None, None, LAYOUT_PACKED),
        ]
        for name, sp, md, sc, layout in made:
            fd = os.open(work / name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                write_burnpack(fd, sp, md, sc, layout)
            finally:
                os.close(fd)
        st_specs = [
            bytes_spec(f"t.{d.lower()}", d, [4], bytes(4 * ITEMSIZE.get(d, 1) if d not in SUBBYTE else SUBBYTE[d] // 2))
            for d in ["F32", "I64", "BF16"]
        ]
        st_specs += [
            bytes_spec("t.f4", "F4", [4], bytes(2)),
            bytes_spec("t.f6", "F6_E2M3", [4], bytes(3)),
            bytes_spec("t.c64", "C64", [1], bytes(8)),
            bytes_spec("t.e8", "F8_E8M0", [2], bytes(2)),
            bytes_spec("t.bool", "Bool(Native)", [2], b"\x01\x00"),
        ]
        fd = os.open(work / "made_all.safetensors", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            write_safetensors(fd, st_specs, {"syncd.layout": "burn", "note": "x"})
        finally:
            os.close(fd)
        noq = [spec for spec in specs if spec.dtype != "QFloat"]
        carriers = [("made_carry.bpk", noq, "aligned"), ("made_carry_packed.bpk", noq[-3:], LAYOUT_PACKED)]
        for name, sp, layout in carriers:
            fd = os.open(work / name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                write_burnpack(fd, sp, {"producer": "fuzz"}, scalars, layout)
            finally:
                os.close(fd)
            out = work / name.replace(".bpk", ".safetensors")
            try:
                convert(ConvertRequest(source=work / name, dest=out))
            except SyncdError:
                convert(ConvertRequest(source=work / name, dest=out, layout="keep"))
            (work / name).unlink()
        for path in sorted(work.iterdir()):
            _MADE.append((path.name, path.read_bytes()))
    return _MADE


# ================================================================================================ budgets


class BudgetExceeded(BaseException):
    """Raised from SIGALRM when one input takes longer than its budget (BaseException: no handler eats it)."""


def _vm_size() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize")


@contextlib.contextmanager
def budget(seconds: float = TIME_LIMIT, memory: int = MEMORY_LIMIT) -> Iterator[None]:
    """Cap one input's work in this process: SIGALRM after `seconds` raises BudgetExceeded (to break a hang),
    and an address-space limit of the current size plus `memory` (so an allocation the input provokes beyond
    that raises MemoryError). An alarm that lands where Python swallows exceptions (a gc callback) is still
    caught: the elapsed time is checked on the way out."""

    def expire(signum: int, frame: Any) -> None:
        raise BudgetExceeded(f"input took more than {seconds} s")

    old_limit = resource.getrlimit(resource.RLIMIT_AS)
    old_handler = signal.signal(signal.SIGALRM, expire)
    resource.setrlimit(resource.RLIMIT_AS, (_vm_size() + memory, old_limit[1]))
    started = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        resource.setrlimit(resource.RLIMIT_AS, old_limit)
        elapsed = time.monotonic() - started
        if elapsed > seconds:  # also when the input ended in an error: a slow error is over budget too
            raise BudgetExceeded(f"input took {elapsed:.2f} s, more than {seconds} s")


# ================================================================================================ checks


class FuzzFailure(AssertionError):
    pass


def save_failure(blob: bytes, ext: str) -> Path:
    """Keep a failing input: in $SYNCD_FUZZ_SAVE (fuzz_long.py sets tests/data/regressions/incoming), else a
    temp dir."""
    directory = Path(os.environ.get("SYNCD_FUZZ_SAVE") or Path(tempfile.gettempdir()) / "syncd-fuzz-failures")
    directory.mkdir(parents=True, exist_ok=True)
    prefix = {".bpk": "bpk", ".pt": "pt"}.get(ext, "st")
    path = directory / f"{prefix}-{hashlib.sha256(blob).hexdigest()[:8]}{ext}"
    path.write_bytes(blob)
    return path


def _fail(blob: bytes, ext: str, what: str) -> FuzzFailure:
    return FuzzFailure(f"{what} (input saved as {save_failure(blob, ext)})")


def _one_line(exc: SyncdError) -> bool:
    text = str(exc)
    return bool(text) and "\n" not in text and "\r" not in text


def read_everything(path: Path) -> int:
    """open_checkpoint, read every tensor through both access paths, describe it as `inspect` does."""
    from syncd.engine.inspect import _describe, print_json, print_table
    from syncd.formats import open_checkpoint

    with open_checkpoint(path) as reader:
        total = 0
        for info in reader.tensors:
            for piece in reader.iter_chunks(info.name, 1 << 16):
                total += len(piece)
            if info.nbytes <= 1 << 20:
                assert len(reader.read(info.name)) == info.nbytes
        doc = _describe(reader, with_hash=False)
        print_json(doc, io.StringIO())
        print_table(doc, io.StringIO())
        return total


def check_reader(blob: bytes, ext: str, workdir: Path, memory: int = MEMORY_LIMIT) -> str:
    """The reader-level property; returns "ok" or the SyncdError class name."""
    path = workdir / f"input{ext}"
    path.write_bytes(blob)
    try:
        with budget(memory=memory):
            read_everything(path)
    except SyncdError as exc:
        if not _one_line(exc):
            raise _fail(blob, ext, f"{type(exc).__name__} is not one line: {str(exc)[:300]!r}") from None
        return type(exc).__name__
    except BudgetExceeded as exc:
        raise _fail(blob, ext, f"reader over budget: {exc}") from None
    except Exception as exc:
        raise _fail(blob, ext, f"reader raised {type(exc).__name__}: {str(exc)[:300]}") from exc
    return "ok"


def _scratch_files(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith(".") and ".syncd-" in n and n.endswith(".tmp"))


def check_convert(blob: bytes, ext: str, workdir: Path, to_format: str | None = None, layout: str = "auto") -> str:
    """The conversion property: success and a re-readable output, or a one-line SyncdError and nothing
    published (no output, no scratch file). Returns "ok" or the error class name."""
    from syncd.engine.convert import ConvertRequest, convert
    from syncd.engine.directions import converts_to
    from syncd.formats.registry import BY_EXTENSION, BY_NAME

    source = workdir / f"source{ext}"
    source.write_bytes(blob)
    out_dir = workdir / "out"
    out_dir.mkdir(exist_ok=True)
    for leftover in out_dir.iterdir():
        leftover.unlink()
    target = BY_NAME[to_format] if to_format else converts_to(BY_EXTENSION[ext])
    dest = out_dir / f"dest{target.extension}"
    outcome = "ok"
    try:
        with budget():
            convert(ConvertRequest(source=source, dest=dest, to_format=to_format, layout=layout))
    except VerificationError as exc:  # the pass's own output failed its checks: a bug, whatever the input
        raise _fail(blob, ext, f"conversion ({to_format}, {layout}) failed its verification: {exc}") from None
    except SyncdError as exc:
        if not _one_line(exc):
            raise _fail(blob, ext, f"{type(exc).__name__} is not one line: {str(exc)[:300]!r}") from None
        outcome = type(exc).__name__
    except BudgetExceeded as exc:
        raise _fail(blob, ext, f"conversion over budget ({to_format}, {layout}): {exc}") from None
    except Exception as exc:
        what = f"conversion ({to_format}, {layout}) raised {type(exc).__name__}: {str(exc)[:300]}"
        raise _fail(blob, ext, what) from exc
    scratch = _scratch_files(out_dir)
    if scratch:
        raise _fail(blob, ext, f"scratch files left behind ({to_format}, {layout}): {scratch}")
    if source.read_bytes() != blob:
        raise _fail(blob, ext, "the conversion changed its source")
    if outcome != "ok":
        if dest.exists():
            raise _fail(blob, ext, f"failed conversion ({outcome}) published {dest.name}")
        return outcome
    if not dest.exists():
        raise _fail(blob, ext, "conversion reported success but published nothing")
    try:
        with budget():
            read_everything(dest)
    except (SyncdError, Exception) as exc:
        raise _fail(
            blob,
            ext,
            f"published output ({to_format}, {layout}) does not re-read: {type(exc).__name__}: {str(exc)[:300]}",
        ) from exc
    return outcome


# ------------------------------------------------------------------------------------------------ CLI

_CLI_BASELINE: dict[str, float] = {}


def cli_baseline() -> dict[str, float]:
    """Address space and start-up time of a `syncd` process that has imported everything `convert` uses,
    measured once: the CLI runs get this plus MEMORY_LIMIT, and this plus TIME_LIMIT."""
    if not _CLI_BASELINE:
        code = (
            "import time; t=time.monotonic();"
            "import syncd.cli, syncd.engine.convert, syncd.engine.inspect, syncd.adapters;"
            "print(time.monotonic()-t);"
            "print([l for l in open('/proc/self/status') if l.startswith('VmPeak')][0].split()[1])"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
        seconds, peak_kb = out.stdout.split()
        _CLI_BASELINE["vm_peak"] = int(peak_kb) * 1024
        _CLI_BASELINE["import_seconds"] = float(seconds)
    return _CLI_BASELINE


def _limit_child(limit: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def syncd_command() -> list[str]:
    script = Path(sys.executable).with_name("syncd")
    return [str(script)] if script.exists() else [sys.executable, "-m", "syncd"]


def _module_map_or_nothing(lines: list[str]) -> bool:
    """What may follow the error line: nothing, or (for a refused layout) the module map that settles it."""
    if not lines:
        return True
    if not lines[0].startswith("# module map"):
        return False
    try:
        doc = yaml.safe_load("\n".join(lines))
    except yaml.YAMLError:
        return False
    return isinstance(doc, dict) and (isinstance(doc.get("modules"), dict) or doc.get("layout") in ("pytorch", "burn"))


def check_cli(blob: bytes, ext: str, workdir: Path, extra: list[str] | None = None) -> int:
    """Run the real `syncd convert` in a child limited to baseline + MEMORY_LIMIT of address space and
    TIME_LIMIT (plus interpreter start-up); exit 0-3, one stderr line on failure, no traceback, nothing
    published on failure."""
    base = cli_baseline()
    source = workdir / f"cli-source{ext}"
    source.write_bytes(blob)
    out_dir = workdir / "cli-out"
    out_dir.mkdir(exist_ok=True)
    for leftover in out_dir.iterdir():
        leftover.unlink()
    dest = out_dir / ("dest.safetensors" if ext == ".bpk" else "dest.bpk")
    limit = int(base["vm_peak"]) + MEMORY_LIMIT
    env = {k: v for k, v in os.environ.items() if k != "SYNCD_DEBUG"}
    try:
        proc = subprocess.run(
            [*syncd_command(), "convert", str(source), "-o", str(dest), *(extra or [])],
            capture_output=True,
            text=True,
            errors="replace",
            env=env,
            cwd=workdir,
            timeout=TIME_LIMIT + max(1.0, 2 * base["import_seconds"]),
            preexec_fn=lambda: _limit_child(limit),
        )
    except subprocess.TimeoutExpired:
        raise _fail(blob, ext, "syncd convert timed out") from None
    err = proc.stderr
    if proc.returncode not in (0, 1, 2, 3):
        raise _fail(blob, ext, f"syncd convert exited {proc.returncode}: {err[-500:]}")
    if "Traceback" in err or "internal error" in err:
        raise _fail(blob, ext, f"syncd convert printed a traceback or internal error: {err[-500:]}")
    if proc.returncode != 0:
        lines = err.splitlines()
        if not lines or not lines[0].startswith("syncd: ") or not _module_map_or_nothing(lines[1:]):
            raise _fail(blob, ext, f"syncd convert failed without exactly one error line: {err[-500:]!r}")
        if dest.exists():
            raise _fail(blob, ext, "failed CLI conversion published its output")
    if _scratch_files(out_dir):
        raise _fail(blob, ext, "CLI conversion left scratch files")
    return proc.returncode
