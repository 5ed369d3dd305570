"""Tensors that are not one window of their source file (a PyTorch view: transposed, strided, or sharing
its bytes with a tensor before it, as tied weights do): written contiguous, outside the one pass.

The one pass moves each source byte once, in file order (onepass.py); such a tensor's bytes are elsewhere
(gathered by strides) or already taken by another tensor. Its reader's `readinto` gives its elements in C
order, so it is copied here, strip by strip, and transposed in memory where the plan says so, as a cast
tensor is (cast.py). `verify` reads back what was written and compares it with the source read again.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from syncd.errors import VerificationError
from syncd.formats.dtypes import ITEMSIZE
from syncd.formats.fileio import TensorFileReader

STRIP_BYTES = 16 << 20  # source bytes per step: memory stays bounded whatever the tensor


@dataclass(frozen=True)
class ViewPiece:
    """A source tensor (or rows r0:r1 of it), transposed or not, landing `at` bytes into the output tensor."""

    reader: TensorFileReader
    name: str
    transpose: bool = False
    rows: tuple[int, int] | None = None
    at: int = 0

    def _window(self) -> tuple[int, tuple[int, ...], int]:
        """(byte offset within the source tensor, shape, item size) of what this piece copies."""
        info = self.reader.tensor(self.name)
        item = ITEMSIZE[info.dtype]
        if self.rows is None:
            return 0, info.shape, item
        r0, r1 = self.rows
        row_bytes = info.nbytes // info.shape[0] if info.shape and info.shape[0] else 0
        return r0 * row_bytes, (r1 - r0, *info.shape[1:]), item

    def strips(self) -> Iterator[tuple[int, int, bytearray]]:
        """(first row, rows, bytes of those rows) in order; a row is one element when not transposed."""
        start, shape, item = self._window()
        count = 1
        for dim in shape:
            count *= dim
        row = shape[1] * item if self.transpose and len(shape) == 2 else item
        rows = count * item // row if row else 0
        step = max(1, STRIP_BYTES // max(row, 1))
        for r0 in range(0, rows, step):
            n = min(step, rows - r0)
            data = bytearray(n * row)
            self.reader.readinto(self.name, start + r0 * row, memoryview(data))
            yield r0, n, data

    def fill(self, sink: Any) -> None:
        _, shape, item = self._window()
        if not self.transpose:
            for r0, _, data in self.strips():
                sink.pwrite(data, self.at + r0 * item)
            return
        import numpy as np

        rows, cols = shape
        for r0, n, data in self.strips():
            block = np.frombuffer(data, dtype=f"<u{item}").reshape(n, cols).T.copy()  # [cols, n]
            for c in range(cols):
                sink.pwrite(block[c], self.at + (c * rows + r0) * item)

    def verify(self, output: TensorFileReader, target: str) -> None:
        _, shape, item = self._window()
        for r0, n, data in self.strips():
            if not self.transpose:
                written = bytearray(len(data))
                output.readinto(target, self.at + r0 * item, memoryview(written))
                same = written == data
            else:
                import numpy as np

                rows, cols = shape
                expected = np.frombuffer(data, dtype=f"<u{item}").reshape(n, cols).T
                got = bytearray(cols * n * item)
                view = memoryview(got)
                for c in range(cols):
                    at = self.at + (c * rows + r0) * item
                    output.readinto(target, at, view[c * n * item : (c + 1) * n * item])
                same = bool(np.array_equal(np.frombuffer(got, dtype=f"<u{item}").reshape(cols, n), expected))
            if not same:
                raise VerificationError(f"tensor '{target}' differs from its source '{self.name}'", output.path)


@dataclass(frozen=True)
class ViewCopy:
    """A TensorSpec fill: the output tensor from its pieces, each copied through its reader's `readinto`."""

    pieces: tuple[ViewPiece, ...]

    def __call__(self, sink: Any) -> None:
        for piece in self.pieces:
            piece.fill(sink)

    def verify(self, output: TensorFileReader, target: str) -> None:
        for piece in self.pieces:
            piece.verify(output, target)
