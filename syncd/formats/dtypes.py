"""Element types of both formats and how they map onto each other.

Names follow Burn's DType spelling (docs/burn-format.md#dtypes). Bool has four spellings in burnpack: the legacy
unit variant `"Bool"` (Burn <= 0.20) and `Bool(Native|U8|U32)` (Burn >= 0.21). QFloat payloads are opaque.
Types only safetensors knows (F8_*, F4, F6_*, C64) keep their safetensors names.
"""

from __future__ import annotations

from typing import Any

# bytes per element; QFloat has none (its payload length comes from its scheme).
ITEMSIZE: dict[str, int] = {
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
    "Bool(Native)": 1,
    "Bool(U8)": 1,
    "Bool(U32)": 4,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "C64": 8,
}

# element bit widths of the sub-byte safetensors types
SUBBYTE_BITS: dict[str, int] = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}

BURNPACK_DTYPES = frozenset(
    [
        "F64",
        "F32",
        "Flex32",
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
        "Bool",
        "Bool(Native)",
        "Bool(U8)",
        "Bool(U32)",
        "QFloat",
    ]
)
BOOL_DTYPES = frozenset(["Bool", "Bool(Native)", "Bool(U8)", "Bool(U32)"])

# safetensors dtype name -> our name (BOOL is a native 1-byte bool)
SAFETENSORS_TO_DTYPE: dict[str, str] = {
    "F64": "F64",
    "F32": "F32",
    "F16": "F16",
    "BF16": "BF16",
    "I64": "I64",
    "I32": "I32",
    "I16": "I16",
    "I8": "I8",
    "U64": "U64",
    "U32": "U32",
    "U16": "U16",
    "U8": "U8",
    "BOOL": "Bool(Native)",
    "F8_E4M3": "F8_E4M3",
    "F8_E5M2": "F8_E5M2",
    "F8_E8M0": "F8_E8M0",
    "F4": "F4",
    "F6_E2M3": "F6_E2M3",
    "F6_E3M2": "F6_E3M2",
    "C64": "C64",
}

# our name -> the safetensors dtype that holds the same bytes (docs/burn-format.md#dtypes: Flex32 is stored as F32,
# Bool(U8)/Bool(U32) as U8/U32; the bool-ness is carried in syncd metadata by the converter).
DTYPE_TO_SAFETENSORS: dict[str, str] = {
    **{v: k for k, v in SAFETENSORS_TO_DTYPE.items()},
    "Flex32": "F32",
    "Bool": "BOOL",
    "Bool(Native)": "BOOL",
    "Bool(U8)": "U8",
    "Bool(U32)": "U32",
}

# The order the safetensors library lays tensors out in: dtype descending in this enum order, then name.
SAFETENSORS_DTYPE_RANK: dict[str, int] = {
    name: rank
    for rank, name in enumerate(
        [
            "BOOL",
            "F4",
            "F6_E2M3",
            "F6_E3M2",
            "U8",
            "I8",
            "F8_E5M2",
            "F8_E4M3",
            "F8_E8M0",
            "I16",
            "U16",
            "F16",
            "BF16",
            "I32",
            "U32",
            "F32",
            "C64",
            "F64",
            "I64",
            "U64",
        ]
    )
}


# No file can hold 2^64 elements; counting stops there so that a hostile shape of many huge dimensions costs
# neither quadratic big-integer time nor a number too long to print in an error message.
NUMEL_CAP = 1 << 64


def byte_length(dtype: str, shape: tuple[int, ...]) -> int | None:
    """Bytes a dense tensor of this dtype and shape needs; None for QFloat (no fixed size). Element counts
    beyond NUMEL_CAP are counted as NUMEL_CAP, which no real byte length can match."""
    numel = 0 if 0 in shape else 1
    for dim in shape:
        numel = min(numel * dim, NUMEL_CAP)
    if dtype in ITEMSIZE:
        return numel * ITEMSIZE[dtype]
    if dtype in SUBBYTE_BITS:
        bits = numel * SUBBYTE_BITS[dtype]
        return bits // 8 if bits % 8 == 0 else -1
    return None


# what `plain_byte_length` takes on: shapes of real models, whose product stays a small integer
PLAIN_RANK = 8
PLAIN_DIM = 1 << 32
_PLAIN_SEQUENCES = (list, tuple)


def plain_byte_length(dtype: str, shape: Any) -> int | None:
    """`byte_length` of the common case in a few cheap tests, for readers and writers checking thousands of table
    entries: a list or tuple of at most 8 plain ints, each in 0..2^32, of a dtype with a whole element size.
    None for anything else (a bool or a float among the dims, a huge or negative one, QFloat, a sub-byte
    dtype): the caller then takes its full checks, which say what is wrong."""
    size = ITEMSIZE.get(dtype)
    if size is None or type(shape) not in _PLAIN_SEQUENCES or len(shape) > PLAIN_RANK:
        return None
    for dim in shape:
        if type(dim) is not int or not 0 <= dim < PLAIN_DIM:
            return None
        size *= dim
    return size
