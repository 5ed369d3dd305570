"""The tensor table both formats read into and write from: names, dtypes, shapes, where the bytes are."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from syncd.records import cheap_init

Buffer = bytes | bytearray | memoryview


@cheap_init
@dataclass(frozen=True)
class TensorInfo:
    """One tensor as stored in a source file; `offset` is absolute within that file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    param_id: int | None = None
    # the dtype exactly as the file spelled it (QFloat scheme, Bool spelling), for byte-exact re-emission
    raw_dtype: Any = None


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
