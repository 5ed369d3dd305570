"""Tensors that are not one window of their source file (a PyTorch view: transposed, strided, or sharing
its bytes with a tensor before it, as tied weights do): written contiguous, outside the one pass.

The one pass moves each source byte once, in file order (onepass.py); such a tensor's bytes are elsewhere
(gathered by strides) or already taken by another tensor. Its reader gathers it in the order the output wants
it (rows r0:r1 of it, or its transpose for a Linear weight going between layouts, are just other strides), so
it is copied here strip by strip, in bounded memory. `verify` reads back what was written and compares it with
the source gathered again.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, cast

from syncd.errors import VerificationError
from syncd.formats.dtypes import ITEMSIZE
from syncd.formats.fileio import TensorFileReader

STRIP_BYTES = 16 << 20  # bytes gathered per step: memory stays bounded whatever the tensor


class Gathers(Protocol):
    """A reader that gathers a tensor by strides (formats/pytorch.py's)."""

    def gather_into(
        self, name: str, offset: int, buf: memoryview, rows: tuple[int, int] | None = None, transpose: bool = False
    ) -> None: ...


@dataclass(frozen=True)
class ViewPiece:
    """A source tensor (or rows r0:r1 of it), transposed or not, landing `at` bytes into the output tensor."""

    reader: TensorFileReader
    name: str
    transpose: bool = False
    rows: tuple[int, int] | None = None
    at: int = 0

    def nbytes(self) -> int:
        info = self.reader.tensor(self.name)
        if self.rows is None:
            return info.nbytes
        count = self.rows[1] - self.rows[0]
        for dim in info.shape[1:]:
            count *= dim
        return count * ITEMSIZE[info.dtype]

    def strips(self) -> Iterator[tuple[int, bytearray]]:
        """(byte offset within this piece, its bytes in output order), strip by strip."""
        gather = cast(Gathers, self.reader)  # only a reader with tensors that are not windows makes a ViewPiece
        total = self.nbytes()
        item = ITEMSIZE[self.reader.tensor(self.name).dtype]
        step = max(item, STRIP_BYTES // item * item)
        for done in range(0, total, step):
            data = bytearray(min(step, total - done))
            gather.gather_into(self.name, done, memoryview(data), self.rows, self.transpose)
            yield done, data

    def fill(self, sink: Any) -> None:
        for done, data in self.strips():
            sink.pwrite(data, self.at + done)

    def verify(self, output: TensorFileReader, target: str) -> None:
        for done, data in self.strips():
            written = bytearray(len(data))
            output.readinto(target, self.at + done, memoryview(written))
            if written != data:
                raise VerificationError(f"tensor '{target}' differs from its source '{self.name}'", output.path)


@dataclass(frozen=True)
class ViewCopy:
    """A TensorSpec fill: the output tensor from its pieces, each gathered through its reader."""

    pieces: tuple[ViewPiece, ...]

    def __call__(self, sink: Any) -> None:
        for piece in self.pieces:
            piece.fill(sink)

    def verify(self, output: TensorFileReader, target: str) -> None:
        for piece in self.pieces:
            piece.verify(output, target)
