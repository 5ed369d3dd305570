"""The tensor table both formats read into and write from: names, dtypes, shapes, where the bytes are."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

Buffer = bytes | bytearray | memoryview


class TensorInfo(NamedTuple):
    """One tensor as stored in a source file; `offset` is absolute within that file. A named tuple: a reader
    makes one per tensor, through `tensor_info` (tuple.__new__, no Python frame), at a sixth of a frozen
    dataclass's cost, and a conversion reads two tables (the source's, then the output's re-read)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    param_id: int | None = None
    # the dtype exactly as the file spelled it (QFloat scheme, Bool spelling), for byte-exact re-emission
    raw_dtype: Any = None


# tensor_info((name, dtype, shape, offset, nbytes, param_id, raw_dtype)): all seven, in the fields' order
tensor_info = partial(tuple.__new__, TensorInfo)


@dataclass
class TensorSpec:
    """One tensor to write. The writer calls `fill(sink)` when it reaches the tensor's place in the file;
    `fill` delivers exactly `nbytes` through `sink.write` (in order) or `sink.pwrite` (by position)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    fill: Callable[[Any], None]
    param_id: int | None = None
    raw_dtype: Any = None


@dataclass
class CheckpointHeader:
    """What a reader learned from a file's header, besides the tensors."""

    format: str  # "burnpack" | "safetensors"
    path: str
    file_size: int
    metadata: dict[str, str] = field(default_factory=dict)
    scalars: dict[str, Any] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)  # format-specific, for `syncd inspect`
