"""Casting tensor bytes between F32 and F16/BF16 (the precision option; syncd/adapters/precision.py decides
which tensors). Round to nearest even, as the `half` crate Burn uses (docs/burn-adapters.md#half-precision) and numpy
for F16; a finite value too large for the target is refused, naming the tensor, never turned into inf.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from syncd.errors import UnsupportedError, VerificationError

ITEM = {"F32": 4, "F16": 2, "BF16": 2}


def cast_chunk(data: memoryview | bytes, from_dtype: str, to_dtype: str, name: str, path: str | None = None) -> bytes:
    """Cast whole little-endian elements; UnsupportedError naming the tensor if a finite value overflows."""
    if from_dtype == "F32":
        values = np.frombuffer(data, dtype="<f4")
        out = _f32_to_f16(values) if to_dtype == "F16" else _f32_to_bf16(values)
        _refuse_overflow(values, out, to_dtype, name, path)
        return out.tobytes()
    if to_dtype != "F32" or from_dtype not in ("F16", "BF16"):
        raise UnsupportedError(f"no cast from {from_dtype} to {to_dtype} (tensor '{name}')", path)
    if from_dtype == "F16":
        return _f16_to_f32(np.frombuffer(data, dtype="<f2")).tobytes()
    wide = np.frombuffer(data, dtype="<u2").astype("<u4") << 16
    return wide.tobytes()


def _f32_to_f16(values: np.ndarray) -> np.ndarray:
    """numpy rounds as `half` does, but keeps a signaling NaN signaling (0x7f800001 -> 0x7c01): a NaN gets the
    quiet bit and the top of its payload, as `half` and torch give it (0x7e00)."""
    with np.errstate(over="ignore", invalid="ignore"):
        out = values.astype("<f2")
    bits = values.view("<u4")
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():
        wide = bits[nan]
        sign, payload = (wide >> np.uint32(16)) & np.uint32(0x8000), (wide & np.uint32(0x7FFFFF)) >> np.uint32(13)
        out.view("<u2")[nan] = (sign | np.uint32(0x7E00) | payload).astype("<u2")
    return out


def _f16_to_f32(values: np.ndarray) -> np.ndarray:
    """Exact for every value; a NaN gets the quiet bit as `half` gives it (numpy kept a signaling one so)."""
    out = values.astype("<f4")
    bits = values.view("<u2")
    nan = (bits & np.uint16(0x7FFF)) > np.uint16(0x7C00)
    if nan.any():
        narrow = bits[nan].astype("<u4")
        sign, payload = (narrow & np.uint32(0x8000)) << np.uint32(16), (narrow & np.uint32(0x3FF)) << np.uint32(13)
        out.view("<u4")[nan] = sign | np.uint32(0x7FC00000) | payload
    return out


def _f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """Round to nearest even on the bit pattern; NaNs stay NaN (quiet), infinities stay infinite."""
    bits = values.view("<u4")
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype("<u2")
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():
        rounded[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype("<u2")
    return rounded


def _refuse_overflow(values: np.ndarray, out: np.ndarray, to_dtype: str, name: str, path: str | None) -> None:
    became_inf = _is_inf(out, to_dtype) & np.isfinite(values)
    if became_inf.any():
        worst = float(np.max(np.abs(values[became_inf])))
        limit = "65504" if to_dtype == "F16" else "3.39e38"
        raise UnsupportedError(
            f"tensor '{name}' holds {worst:g}, beyond {to_dtype}'s largest value {limit}: not casting it", path
        )


def _is_inf(out: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "F16":
        return np.isinf(out)
    return (out.view("<u2") & np.uint16(0x7FFF)) == np.uint16(0x7F80)


def cast_nbytes(nbytes: int, from_dtype: str, to_dtype: str) -> int:
    return nbytes // ITEM[from_dtype] * ITEM[to_dtype]


CHUNK_BYTES = 16 << 20  # source bytes per step: memory stays bounded whatever the tensor
_UINT = {2: np.uint16, 4: np.uint32}


class CastCopy:
    """One tensor cast into the output (and transposed, for a Linear weight going between layouts), strip by
    strip; `verify` re-reads what was written and compares it with the cast done again from the source."""

    def __init__(
        self,
        reader: Any,
        name: str,
        from_dtype: str,
        to_dtype: str,
        transpose: bool,
        rows: tuple[int, int] | None = None,
        at: int = 0,
    ) -> None:
        self.reader = reader
        self.name = name
        self.from_dtype = from_dtype
        self.to_dtype = to_dtype
        self.transpose = transpose
        # a piece of a PyTorch packed tensor: only rows r0:r1 of the source, written `at` bytes into the output
        # tensor (a join lays several end to end)
        self.rows = rows
        self.at = at

    def _window(self) -> tuple[int, tuple[int, ...]]:
        """(byte offset within the source tensor, shape) of what this copy casts."""
        info = self.reader.tensor(self.name)
        if self.rows is None:
            return 0, info.shape
        r0, r1 = self.rows
        row_bytes = info.nbytes // info.shape[0] if info.shape and info.shape[0] else 0
        return r0 * row_bytes, (r1 - r0, *info.shape[1:])

    def _cast(self, data: memoryview) -> bytes:
        return cast_chunk(data, self.from_dtype, self.to_dtype, self.name, self.reader.path)

    def _strips(self) -> Iterator[tuple[int, int, bytes]]:
        """(first source row, rows, cast bytes of those rows), in order; rows = elements when not transposed."""
        start, shape = self._window()
        item = ITEM[self.from_dtype]
        nbytes = item * _count(shape)
        row = shape[1] * item if self.transpose and len(shape) == 2 else item
        rows = nbytes // row if row else 0
        step = max(1, CHUNK_BYTES // max(row, 1))
        buf = memoryview(bytearray(min(step * row, nbytes)))
        for r0 in range(0, rows, step):
            n = min(step, rows - r0)
            piece = buf[: n * row]
            self.reader.readinto(self.name, start + r0 * row, piece)
            yield r0, n, self._cast(piece)

    def fill(self, sink: Any) -> None:
        _, shape = self._window()
        out_item = ITEM[self.to_dtype]
        if not self.transpose or _count(shape) == 0:
            for r0, _, data in self._strips():
                sink.pwrite(data, self.at + r0 * out_item)
            return
        rows, cols = shape
        for r0, n, data in self._strips():
            block = np.frombuffer(data, dtype=_UINT[out_item]).reshape(n, cols).T.copy()  # [cols, n]
            for c in range(cols):
                sink.pwrite(block[c], self.at + (c * rows + r0) * out_item)

    def verify(self, output: Any, target: str) -> None:
        _, shape = self._window()
        out_item = ITEM[self.to_dtype]
        rows, cols = shape if self.transpose and len(shape) == 2 else (0, 0)
        for r0, n, data in self._strips():
            if not self.transpose or _count(shape) == 0:
                written = bytearray(len(data))
                output.readinto(target, self.at + r0 * out_item, memoryview(written))
                same = written == data
            else:
                expected = np.frombuffer(data, dtype=_UINT[out_item]).reshape(n, cols).T
                written_t = np.empty((cols, n), dtype=_UINT[out_item])
                view = written_t.data.cast("B")
                for c in range(cols):
                    at = self.at + (c * rows + r0) * out_item
                    output.readinto(target, at, view[c * n * out_item : (c + 1) * n * out_item])
                same = np.array_equal(written_t, expected)
            if not same:
                raise VerificationError(f"tensor '{target}' reads back different from its cast source", output.path)


class JoinedCast:
    """A PyTorch packed tensor joined from Burn's cast pieces: each piece's CastCopy writes at its own offset
    within the output tensor (docs/burn-adapters.md#half-precision: the HalfPrecisionAdapter casts the Linears a packed
    module is split into)."""

    def __init__(self, pieces: list[CastCopy]) -> None:
        self.pieces = pieces
        self.from_dtype = pieces[0].from_dtype
        self.to_dtype = pieces[0].to_dtype

    def fill(self, sink: Any) -> None:
        for piece in self.pieces:
            piece.fill(sink)

    def verify(self, output: Any, target: str) -> None:
        for piece in self.pieces:
            piece.verify(output, target)


def _count(shape: tuple[int, ...]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total
