"""What a conversion reads: one checkpoint file, or a sharded safetensors set read through its index, behind
one interface (formats/ reads the files; formats/shards.py checks that an index and its shards agree)."""

from __future__ import annotations

from pathlib import Path

from syncd.errors import FormatError
from syncd.formats import open_checkpoint
from syncd.formats.fileio import TensorFileReader
from syncd.formats.shards import ShardedReader, is_set_index
from syncd.formats.table import TensorInfo


class Source:
    """The tensors a conversion reads, behind one interface: one checkpoint file, or a sharded safetensors set
    read through its index (formats/shards.py checks the index and shards agree). `reader_of` says which file
    holds a tensor; the header (format, metadata, scalars) and the permission bits are the first file's; a
    set's `path` is its index, and its hash covers the index and then every shard (see source_digest)."""

    def __init__(self, readers: list[TensorFileReader], sharded: ShardedReader | None = None) -> None:
        self.readers = readers
        self.primary = readers[0]
        self.header = self.primary.header
        self.sharded = sharded
        self.path = sharded.path if sharded is not None else self.primary.path
        self.files = [self.path, *(r.path for r in readers)] if sharded is not None else [self.path]
        self.tensors = [info for reader in readers for info in reader.tensors]
        self._reader_of = {info.name: reader for reader in readers for info in reader.tensors}
        if len(self._reader_of) != len(self.tensors):
            raise FormatError("a tensor name occurs in more than one file of the checkpoint", self.path)
        self._info = {info.name: info for info in self.tensors}  # (looked up for every tensor, several times)

    def reader_of(self, name: str) -> TensorFileReader:
        return self._reader_of[name]

    def tensor(self, name: str) -> TensorInfo:
        return self._info[name]

    def read(self, name: str) -> bytes:
        return self._reader_of[name].read(name)

    def hash_prefix(self) -> bytes:
        """What the source hash takes before the files' bytes: a set's index, as it was read."""
        return self.sharded.index.raw if self.sharded is not None else b""

    def check_unchanged(self) -> None:
        """Every file read is the same, unchanged file it was when opened (a set: every shard and the index)."""
        for reader in self.readers:
            reader.check_unchanged()
        if self.sharded is not None:
            self.sharded.index.check_unchanged()

    def close(self) -> None:
        for reader in self.readers:
            reader.close()

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def open_source(path: Path, within: Path | None, top_level_key: str | None = None) -> Source:
    """The checkpoint at `path` (a set's index: the whole set); `top_level_key`: where a PyTorch checkpoint
    keeps its tensors."""
    if is_set_index(path):
        sharded = ShardedReader(path, within)
        return Source([shard.reader for shard in sharded.shards], sharded)
    return Source([open_checkpoint(path, within, top_level_key)])
