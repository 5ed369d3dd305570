"""Sharded safetensors checkpoints: Hugging Face's `model.safetensors.index.json` and the shards it lists.

`save_pretrained(max_shard_size=...)` writes `model-00001-of-0000N.safetensors`... and an index whose
`weight_map` says which shard holds each tensor, with `metadata.total_size` (and, from transformers,
`total_parameters`). Reading: `ShardedReader` opens the index and every shard, checks that they agree, and
offers the same table and byte access as one file's reader (each tensor read from its own shard, shard after
shard). Writing: `split_greedy` is huggingface_hub's split rule, `shard_file_names` its naming and
`render_index` the exact bytes `save_pretrained` writes (`json.dumps(index, indent=2, sort_keys=True) + "\\n"`).
`ShardLayout` is a set's shape (which tensors in which file, the index's own metadata), carried from a set
into a single-file conversion and back so that the shards and index come out as they went in.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import Any

from syncd.errors import FormatError
from syncd.formats.fileio import (
    FileStamp,
    TensorFileReader,
    open_regular_file,
    pread_exact,
    refuse_costly_decode,
    source_changed,
)
from syncd.formats.registry import read_pytorch
from syncd.formats.safetensors import SafetensorsReader, decoded_cost, json_error_text, loads_json
from syncd.formats.table import CheckpointHeader, TensorInfo

INDEX_SUFFIX = ".safetensors.index.json"
# transformers' sets of torch.save shards (`pytorch_model-00001-of-00002.bin`), read as one checkpoint like a
# safetensors set; never written (syncd writes no pickles)
BIN_INDEX_SUFFIX = ".bin.index.json"
DEFAULT_INDEX_NAME = "model.safetensors.index.json"
MAX_INDEX_SIZE = 100_000_000  # as the safetensors header: an index is a table of names, never data
_SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}


def is_index_name(path: str | os.PathLike[str]) -> bool:
    return os.fspath(path).endswith(INDEX_SUFFIX)


def is_set_index(path: str | os.PathLike[str]) -> bool:
    """The index of a set syncd reads: a safetensors set's, or a set of torch.save `.bin` shards'."""
    return is_index_name(path) or os.fspath(path).endswith(BIN_INDEX_SUFFIX)


def shard_extension(index_path: str | os.PathLike[str]) -> str:
    """What the shards an index lists are: `.bin` for `*.bin.index.json`, else `.safetensors`."""
    return ".bin" if os.fspath(index_path).endswith(BIN_INDEX_SUFFIX) else ".safetensors"


def set_stem(index_path: str | os.PathLike[str]) -> str:
    """The name a set's outputs take: `model` of model.safetensors.index.json, `pytorch_model` of
    pytorch_model.bin.index.json."""
    name = os.path.basename(os.fspath(index_path))
    return name.removesuffix(INDEX_SUFFIX) if is_index_name(name) else name.removesuffix(BIN_INDEX_SUFFIX)


def find_index(directory: str | os.PathLike[str]) -> str:
    """The one `*.safetensors.index.json` in `directory`; refused when there is none or more than one."""
    names = sorted(n for n in os.listdir(directory) if n.endswith(INDEX_SUFFIX))
    if not names:  # a directory of torch.save shards only
        names = sorted(n for n in os.listdir(directory) if n.endswith(BIN_INDEX_SUFFIX))
    if len(names) != 1:
        found = "none" if not names else ", ".join(names)
        raise FormatError(f"expected one *{INDEX_SUFFIX} in the directory, found {found}", os.fspath(directory))
    return os.path.join(os.fspath(directory), names[0])


# ---------------------------------------------------------------------------------------------- the index


@dataclass
class ShardIndex:
    """A parsed index: `files` in shard order, each with its tensor names in the order the index lists them."""

    path: str
    raw: bytes
    metadata: dict[str, Any] | None  # the index's `metadata` object exactly as read (None: absent)
    weight_map: dict[str, str]
    files: list[str]
    extra: dict[str, Any] = field(default_factory=dict)  # other top-level keys, kept for the way back
    opened: FileStamp | None = None  # the file before it was read (a conversion checks it again)

    @property
    def total_size(self) -> int | None:
        value = (self.metadata or {}).get("total_size")
        return value if isinstance(value, int) else None

    def is_canonical(self) -> bool:
        """True when `save_pretrained`'s rendering of this index gives back exactly the bytes read."""
        return render_index(self.metadata, self.weight_map, self.extra) == self.raw

    def check_unchanged(self) -> None:
        """Raise SourceChangedError unless the index read whole when the set was opened (its bytes begin the
        set's hash) is still that file, unchanged, at its path."""
        try:
            now = FileStamp.of_path(self.path)
        except FileNotFoundError:
            raise source_changed(self.path, "was removed") from None
        if self.opened is not None:
            self.opened.check_unchanged(now, self.path)


def parse_index(raw: bytes, path: str) -> ShardIndex:
    """Parse and check an index's JSON (not the shards: `ShardedReader` opens those)."""
    refuse_costly_decode(raw, decoded_cost, "index", path)
    try:
        document = loads_json(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise FormatError("index is not valid UTF-8", path) from None
    except RecursionError:
        raise FormatError("index JSON is nested too deeply", path) from None
    except ValueError as exc:
        raise FormatError(f"index is not valid JSON: {json_error_text(exc)}", path) from None
    if not isinstance(document, dict) or not isinstance(document.get("weight_map"), dict):
        raise FormatError("index has no `weight_map` object", path)
    weight_map = document.pop("weight_map")
    metadata = document.pop("metadata", None)
    if metadata is not None and not isinstance(metadata, dict):
        raise FormatError("index `metadata` is not an object", path)
    total = (metadata or {}).get("total_size")
    if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total < 0):
        raise FormatError(f"index metadata.total_size is {total!r}, not a byte count", path)
    files: dict[str, None] = {}
    for name, file in weight_map.items():
        if not isinstance(file, str):
            raise FormatError(f"weight_map gives tensor '{name}' a shard that is not a file name", path)
        check_shard_name(file, path, shard_extension(path))
        files.setdefault(file)
    if not weight_map:
        raise FormatError("index lists no tensors", path)
    return ShardIndex(path, raw, metadata, weight_map, sorted(files), document)


def check_shard_name(name: str, index_path: str, extension: str = ".safetensors") -> None:
    """A shard is a `.safetensors` (or, for a `.bin` index, `.bin`) file inside the index's directory: a relative
    path with no `..`."""
    parts = PurePosixPath(name).parts
    bad = (
        not name
        or "\x00" in name
        or "\\" in name
        or name.startswith("/")
        or any(part in ("..", ".") for part in parts)
        or name != "/".join(parts)  # empty segments, trailing slash
        or not name.endswith(extension)
    )
    if bad:
        raise FormatError(
            f"index names shard {name!r}, which is not a {extension} file inside its directory", index_path
        )


def read_index(path: str | os.PathLike[str], within: str | os.PathLike[str] | None = None) -> ShardIndex:
    fd, size = open_regular_file(path, within)
    try:
        if size > MAX_INDEX_SIZE:
            raise FormatError(f"index of {size} bytes exceeds the limit of {MAX_INDEX_SIZE} bytes", os.fspath(path))
        opened = FileStamp.of_fd(fd)
        raw = pread_exact(fd, size, 0, os.fspath(path), "index")
    finally:
        os.close(fd)
    return replace(parse_index(raw, os.fspath(path)), opened=opened)


# ---------------------------------------------------------------------------------------------- reading


@dataclass
class Shard:
    file: str  # as the index names it, relative to the index's directory
    reader: TensorFileReader  # a SafetensorsReader, or a PytorchReader of a `.bin` set


class ShardedReader:
    """A sharded set read as one checkpoint: the tensors of every shard, shard after shard (each in its own
    data order), and per-tensor access that reads from the shard holding it. Only headers are held in memory.

    Shard names must be relative paths below the index's directory (no `..`, nothing absolute). `within`
    confines the index and every shard to a directory tree (the daemon's watch), checked on the opened files,
    with no symlink followed; without it (a user's own command) a shard may be a symlink, as in the Hugging
    Face cache, whose snapshot files link to its blob store.
    """

    def __init__(self, path: str | os.PathLike[str], within: str | os.PathLike[str] | None = None) -> None:
        self.path = os.fspath(path)
        self.directory = os.path.dirname(os.path.abspath(self.path))
        self.within = within
        self.index = read_index(self.path, within)
        self.shards: list[Shard] = []
        self._shard_of: dict[str, Shard] = {}
        try:
            self._open_shards()
        except BaseException:
            self.close()
            raise
        self.tensors: list[TensorInfo] = [t for shard in self.shards for t in shard.reader.tensors]
        self.file_size = sum(shard.reader.file_size for shard in self.shards)
        self.header = CheckpointHeader(
            format=self.shards[0].reader.header.format,
            path=self.path,
            file_size=self.file_size,
            metadata=dict(self.shards[0].reader.header.metadata),
            facts={"shards": list(self.index.files)},
        )

    def _open_shards(self) -> None:
        listed: dict[str, list[str]] = {file: [] for file in self.index.files}
        for name, file in self.index.weight_map.items():
            listed[file].append(name)
        for file in self.index.files:
            shard_path = os.path.join(self.directory, file)
            reader: TensorFileReader = (
                read_pytorch(shard_path, self.within)
                if shard_extension(self.path) == ".bin"
                else SafetensorsReader(shard_path, self.within)
            )
            self.shards.append(Shard(file, reader))
            held = {t.name for t in reader.tensors}
            for name in listed[file]:
                if name not in held:
                    raise FormatError(f"index puts tensor '{name}' in {file}, which does not hold it", self.path)
            for name in sorted(held - set(listed[file])):
                where = self.index.weight_map.get(name)
                said = f"puts it in {where}" if where else "does not list it"
                raise FormatError(f"shard {file} holds tensor '{name}' but the index {said}", self.path)
            for info in reader.tensors:
                self._shard_of[info.name] = self.shards[-1]

    def shard_metadata(self) -> dict[str, dict[str, str]]:
        return {shard.file: dict(shard.reader.header.metadata) for shard in self.shards}

    def reader_for(self, name: str) -> TensorFileReader:
        """The reader of the shard holding `name` (its offsets are within that shard's file)."""
        try:
            return self._shard_of[name].reader
        except KeyError:
            raise FormatError(f"Tensor not found: {name}", self.path) from None

    def tensor(self, name: str) -> TensorInfo:
        return self.reader_for(name).tensor(name)

    def read(self, name: str) -> bytes:
        return self.reader_for(name).read(name)

    def readinto(self, name: str, offset: int, buf: memoryview) -> None:
        self.reader_for(name).readinto(name, offset, buf)

    def iter_chunks(self, name: str, chunk_size: int = 8 << 20) -> Iterator[memoryview]:
        return self.reader_for(name).iter_chunks(name, chunk_size)

    def files(self) -> list[str]:
        """Every file of the set, index first, as paths."""
        return [self.path, *(shard.reader.path for shard in self.shards)]

    def close(self) -> None:
        for shard in self.shards:
            shard.reader.close()

    def __enter__(self) -> ShardedReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------- writing


def parse_shard_size(text: str) -> int:
    """`--shard-size`: bytes, or a number with KB/MB/GB/TB (powers of 1000, as huggingface_hub) or KiB/MiB/GiB."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if match is None or (unit and unit not in _SIZE_UNITS):
        raise ValueError(f"shard size {text!r} is not a size such as 500MB, 5GB or 2GiB")
    if not unit and "." in match.group(1):
        raise ValueError(f"shard size {text!r} is not a whole number of bytes (a unit: 500MB, 5GB, 2GiB)")
    size = int(float(match.group(1)) * _SIZE_UNITS.get(unit, 1))
    if size <= 0:
        raise ValueError(f"shard size {text!r} must be more than 0 bytes")
    return size


def split_greedy(sizes: Sequence[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """huggingface_hub's `split_state_dict_into_shards_factory` rule, over tensors in the order given: a
    tensor larger than the limit gets a shard of its own (appended at once, ahead of the shard being filled);
    otherwise the shard being filled is closed when the tensor would tip it over the limit."""
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for name, size in sizes:
        if size > max_shard_size:
            shards.append([name])
            continue
        if current_size + size > max_shard_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current:
        shards.append(current)
    return shards


def shard_file_names(count: int, weights_name: str = "model.safetensors") -> list[str]:
    """`model-00001-of-00003.safetensors`...; one shard keeps the plain name, as save_pretrained does."""
    if count == 1:
        return [weights_name]
    return [_numbered(weights_name, i + 1, count) for i in range(count)]


def _numbered(weights_name: str, number: int, count: int) -> str:
    return f"{weights_name.removesuffix('.safetensors')}-{number:05d}-of-{count:05d}.safetensors"


def render_index(
    metadata: dict[str, Any] | None, weight_map: dict[str, str], extra: dict[str, Any] | None = None
) -> bytes:
    """The index exactly as `save_pretrained` writes it (json.dumps, indent 2, sorted keys, ASCII, newline)."""
    document: dict[str, Any] = dict(extra or {})
    if metadata is not None:
        document["metadata"] = metadata
    document["weight_map"] = weight_map
    return (json.dumps(document, indent=2, sort_keys=True) + "\n").encode("utf-8")


@dataclass
class ShardLayout:
    """The shape of a sharded set: files in order with their tensors, the index's name and metadata, and the
    shards' own `__metadata__` when they differ from the first one's. Carried through a single-file conversion
    (as JSON, `to_json`/`from_json`) so the set can be written back as it was."""

    index_name: str
    files: list[tuple[str, list[str]]]
    index_metadata: dict[str, Any] | None = None
    index_extra: dict[str, Any] = field(default_factory=dict)
    index_text: str | None = None  # the index verbatim, when save_pretrained's rendering would differ
    shard_metadata: dict[str, dict[str, str]] = field(default_factory=dict)  # those differing from `common`
    with_index: bool = True  # False: one plain file, as save_pretrained writes a model that fits one shard
    common_metadata: dict[str, str] = field(default_factory=lambda: {"format": "pt"})  # every shard's, as a rule

    @classmethod
    def of(cls, reader: ShardedReader) -> ShardLayout:
        index = reader.index
        by_file = {shard.file: [t.name for t in shard.reader.tensors] for shard in reader.shards}
        first = reader.shards[0].reader.header.metadata
        differing = {f: md for f, md in reader.shard_metadata().items() if md != first}
        return cls(
            index_name=os.path.basename(reader.path),
            files=[(file, by_file[file]) for file in index.files],
            index_metadata=index.metadata,
            index_extra=dict(index.extra),
            index_text=None if index.is_canonical() else index.raw.decode("utf-8"),
            shard_metadata=differing,
            common_metadata=dict(first),
        )

    def metadata_of(self, file: str) -> dict[str, str]:
        """The `__metadata__` a shard is written with."""
        return self.shard_metadata.get(file, self.common_metadata)

    def weight_map(self) -> dict[str, str]:
        return {name: file for file, names in self.files for name in names}

    def index_bytes(self) -> bytes:
        if self.index_text is not None:
            return self.index_text.encode("utf-8")
        return render_index(self.index_metadata, self.weight_map(), self.index_extra)

    def restricted_to(self, names: set[str], sizes: dict[str, int]) -> ShardLayout:
        """The layout for only `names` (a filter left some out): emptied shards vanish, the files are
        renumbered and total_size (bytes, from `sizes`) recomputed, so the index stays true to what is written.
        transformers' total_parameters is dropped: it counts the model's parameters (`num_parameters()`), not
        its buffers (BatchNorm's running_mean...), which a file cannot tell apart, so a recount from the
        tensors kept could say more than the whole model had."""
        kept = [(file, [n for n in listed if n in names]) for file, listed in self.files]
        kept = [(file, listed) for file, listed in kept if listed]
        if kept == self.files:
            return self
        renamed = shard_file_names(len(kept), _weights_name(self.index_name))
        written = [n for _, listed in kept for n in listed]
        metadata = dict(self.index_metadata or {})
        metadata["total_size"] = sum(sizes[n] for n in written)
        metadata.pop("total_parameters", None)
        files = [(new, listed) for new, (_, listed) in zip(renamed, kept, strict=True)]
        return ShardLayout(
            self.index_name,
            files,
            metadata,
            dict(self.index_extra),
            with_index=len(files) > 1,
            common_metadata=dict(self.common_metadata),
        )

    def with_names(self, new_names: dict[str, str]) -> ShardLayout:
        """The layout with tensors renamed (old name -> new; names not in `new_names` kept), each in its shard."""
        if not new_names:
            return self
        return replace(self, files=[(file, [new_names.get(n, n) for n in names]) for file, names in self.files])

    def indexed(self) -> ShardLayout:
        """The layout written with its index even when it holds one shard (`model-00001-of-00001.safetensors`
        rather than `model.safetensors` alone): where the index's name was asked for."""
        if self.with_index:
            return self
        ((file, names),) = self.files
        return replace(self, files=[(_numbered(file, 1, 1), names)], with_index=True)

    def named_after(self, index_name: str) -> ShardLayout:
        """The layout written under the index `index_name` (`-o NAME.safetensors.index.json`), with its index
        even for one shard. An index of another stem than the carried set's gets shards named after it, as
        save_pretrained names them (`a-00001-of-00002.safetensors`): the carried names were kept, and a second
        set written beside it under another index replaced the first one's shards, its index left listing
        tensors its shards no longer held."""
        if _weights_name(index_name) == _weights_name(self.index_name):
            return replace(self, index_name=index_name).indexed()
        weights = _weights_name(index_name)
        count = len(self.files)
        renamed = {old: _numbered(weights, i + 1, count) for i, (old, _) in enumerate(self.files)}
        return replace(
            self,
            index_name=index_name,
            files=[(renamed[old], names) for old, names in self.files],
            index_text=None,  # the index as read names the old shards: rendered anew
            shard_metadata={renamed[old]: md for old, md in self.shard_metadata.items() if old in renamed},
            with_index=True,
        )

    def with_total_size(self, total: int) -> ShardLayout:
        """The layout with `metadata.total_size` set to `total` (the tensors' sizes changed, e.g. by a cast)."""
        metadata = dict(self.index_metadata or {})
        if metadata.get("total_size") == total:
            return self
        metadata["total_size"] = total
        return replace(self, index_metadata=metadata, index_text=None)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"index": self.index_name, "files": [[f, names] for f, names in self.files]}
        if self.index_metadata is not None:
            doc["index_metadata"] = self.index_metadata
        if self.index_extra:
            doc["index_extra"] = self.index_extra
        if self.index_text is not None:
            doc["index_text"] = self.index_text
        if self.shard_metadata:
            doc["shard_metadata"] = self.shard_metadata
        if not self.with_index:
            doc["with_index"] = False
        if self.common_metadata != {"format": "pt"}:
            doc["common_metadata"] = self.common_metadata
        return doc

    @classmethod
    def from_json(cls, doc: Any) -> ShardLayout:
        """Strict: raises ValueError on anything malformed (the caller names the file)."""
        if not isinstance(doc, dict) or not isinstance(doc.get("index"), str) or not is_index_name(doc["index"]):
            raise ValueError("shard layout has no index name")
        if "/" in doc["index"] or "\x00" in doc["index"]:  # a name beside the .bpk, as one was recorded
            raise ValueError("shard layout names its index outside the set's directory")
        files = doc.get("files")
        if not isinstance(files, list) or not files:
            raise ValueError("shard layout lists no files")
        parsed: list[tuple[str, list[str]]] = []
        for item in files:
            if not (
                isinstance(item, list)
                and len(item) == 2
                and isinstance(item[0], str)
                and isinstance(item[1], list)
                and all(isinstance(n, str) for n in item[1])
            ):
                raise ValueError("shard layout file entry is not [file, [names]]")
            check_shard_name(item[0], doc["index"])
            parsed.append((item[0], list(item[1])))
        if len({f for f, _ in parsed}) != len(parsed):
            raise ValueError("shard layout names a file twice")
        metadata, extra, text = doc.get("index_metadata"), doc.get("index_extra", {}), doc.get("index_text")
        shard_md = doc.get("shard_metadata", {})
        common = doc.get("common_metadata", {"format": "pt"})
        if metadata is not None and not isinstance(metadata, dict):
            raise ValueError("shard layout index_metadata is not an object")
        if not isinstance(extra, dict) or (text is not None and not isinstance(text, str)):
            raise ValueError("shard layout index_extra/index_text malformed")
        if not isinstance(shard_md, dict) or not all(_is_text_map(v) for v in (*shard_md.values(), common)):
            raise ValueError("shard layout shard_metadata is not a map of text maps")
        with_index = doc.get("with_index", True)
        if not isinstance(with_index, bool) or (not with_index and len(parsed) != 1):
            raise ValueError("shard layout with_index malformed")
        return cls(doc["index"], parsed, metadata, extra, text, shard_md, with_index, dict(common))


def _is_text_map(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(x, str) for x in (*value, *value.values()))


def layout_by_size(
    sizes: Sequence[tuple[str, int]],
    max_shard_size: int | None,
    index_name: str = DEFAULT_INDEX_NAME,
    *,
    always_index: bool = False,
) -> ShardLayout:
    """A fresh layout (for `--shard-size`): HF's greedy split over the tensors in the order given, its
    file names, and `metadata.total_size`; `max_shard_size` None puts everything in one file. One shard is
    one plain file without an index, as save_pretrained writes it, unless `always_index`: then it is
    `model-00001-of-00001.safetensors` and its index (a set whose name does not depend on its size)."""
    groups = [[name for name, _ in sizes]] if max_shard_size is None else split_greedy(sizes, max_shard_size)
    weights = _weights_name(index_name)
    names = (
        shard_file_names(len(groups), weights) if len(groups) > 1 or not always_index else [_numbered(weights, 1, 1)]
    )
    total = sum(size for _, size in sizes)
    files = list(zip(names, groups, strict=True))
    return ShardLayout(index_name, files, {"total_size": total}, with_index=len(files) > 1 or always_index)


def _weights_name(index_name: str) -> str:
    return index_name.removesuffix(".index.json")


# ---------------------------------------------------------------------------------------------- sets on disk

# the names save_pretrained gives shards; such a file is part of a set even before its index is written
# (the index comes last), so it is never converted on its own
_SHARD_NAME = re.compile(r".+-[0-9]{5}-of-[0-9]{5}\.(safetensors|bin)")


def looks_like_shard(name: str) -> bool:
    return _SHARD_NAME.fullmatch(name) is not None


def shards_named_after(index: Path) -> list[Path]:
    """The files beside `index` named as save_pretrained names its set's shards (`model-00002-of-00004.safetensors`
    for model.safetensors.index.json), whichever layout they are of."""
    pattern = re.compile(re.escape(set_stem(index)) + r"-[0-9]{5}-of-[0-9]{5}\.safetensors")
    try:
        names = os.listdir(index.parent)
    except OSError:
        return []
    return [index.parent / name for name in sorted(names) if pattern.fullmatch(name)]


class IndexFiles:
    """The shard names of each index, parsed once per version of the index (its identity, size, mtime and
    ctime), refused ones included (as listing nothing): a directory's `.safetensors` events each ask which
    index lists the file, and re-parsing a large index on every one of them costs seconds and hundreds of MB.
    Holds names only, for at most MAX_ENTRIES indexes (the least recently asked go first). Thread-safe."""

    MAX_ENTRIES = 256
    MAX_DIRECTORIES = 4096
    # a directory changed this recently may change again within its timestamp's granularity (a network
    # filesystem's can be a second or more) without its stamp showing it: listed again rather than trusted
    RECENT_NS = 2_000_000_000
    # but not more often than this: a directory written all along (each conversion publishes into it) was
    # listed for every file, N^2 again; an index that appears meanwhile is told by `forget` (its own event)
    RELIST_NS = 500_000_000

    def __init__(self) -> None:
        self._files: OrderedDict[str, tuple[tuple[int, ...], tuple[str, ...] | None]] = OrderedDict()
        self._indexes: OrderedDict[str, tuple[tuple[int, ...], tuple[str, ...], int]] = OrderedDict()
        self._lock = threading.Lock()

    def index_names(self, directory: str) -> tuple[str, ...] | None:
        """The names of the set indexes in `directory`, listed once per version of the directory (its
        identity, mtime and ctime), or None if it cannot be listed. Every file's event asks which index lists
        it: listing a directory of N checkpoints for each of them cost N^2 (minutes for a pass over 6,000)."""
        try:
            info = os.stat(directory)
        except OSError:
            return None
        version = (info.st_dev, info.st_ino, info.st_mtime_ns, info.st_ctime_ns)
        settled = time.time_ns() - max(info.st_mtime_ns, info.st_ctime_ns) > self.RECENT_NS  # (file times: wall)
        now = time.monotonic_ns()  # a listing's age: a wall clock set back would keep one for as long
        with self._lock:
            known = self._indexes.get(directory)
            if known is not None and (settled and known[0] == version or now - known[2] < self.RELIST_NS):
                self._indexes.move_to_end(directory)
                return known[1]
        try:
            names = tuple(sorted(n for n in os.listdir(directory) if is_set_index(n)))
        except OSError:
            return None
        with self._lock:
            self._indexes[directory] = (version, names, now)
            self._indexes.move_to_end(directory)
            while len(self._indexes) > self.MAX_DIRECTORIES:
                self._indexes.popitem(last=False)
        return names

    def forget(self, directory: str) -> None:
        """An index is known to be in `directory` now (its own event): its next listing is taken anew."""
        with self._lock:
            self._indexes.pop(directory, None)

    def files(self, index_path: str | os.PathLike[str]) -> tuple[str, ...] | None:
        """The names the index lists, or None if it does not read (gone, not an index, refused)."""
        path = os.path.abspath(os.fspath(index_path))
        try:
            info = os.stat(path)
        except OSError:
            return None
        version = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
        with self._lock:
            known = self._files.get(path)
            if known is not None and known[0] == version:
                self._files.move_to_end(path)
                return known[1]
        try:
            files: tuple[str, ...] | None = tuple(read_index(path).files)
        except FormatError:
            files = None
        with self._lock:
            self._files[path] = (version, files)
            self._files.move_to_end(path)
            while len(self._files) > self.MAX_ENTRIES:
                self._files.popitem(last=False)
        return files


def member_files(index_path: str | os.PathLike[str], known: IndexFiles | None = None) -> list[str]:
    """The shard paths an index lists (read from the index alone; the shards are not opened). With `known`,
    an index already parsed in this version is not parsed again; an index that does not read lists none."""
    directory = os.path.dirname(os.fspath(index_path))
    if known is not None:
        return [os.path.join(directory, file) for file in known.files(index_path) or ()]
    index = read_index(index_path)
    return [os.path.join(directory, file) for file in index.files]


def index_listing(path: str | os.PathLike[str], known: IndexFiles | None = None) -> str | None:
    """The index beside `path` that lists it as a shard, or None. An index that does not read is skipped:
    it is reported when it is converted, and a half-written one lists nothing yet. With `known`, each index
    is parsed once per version."""
    directory, name = os.path.split(os.path.abspath(path))
    if known is not None:
        candidates = known.index_names(directory)
        if candidates is None:
            return None
    else:
        try:
            candidates = tuple(sorted(n for n in os.listdir(directory) if is_set_index(n)))
        except OSError:
            return None
    for candidate in candidates:
        index_path = os.path.join(directory, candidate)
        if known is not None:
            files = known.files(index_path) or ()
        else:
            try:
                files = tuple(read_index(index_path).files)
            except FormatError:
                continue
        if name in files:
            return index_path
    return None
