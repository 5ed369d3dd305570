"""Byte-exact readers and writers for burnpack (.bpk) and safetensors. Nothing here knows of modules."""

from __future__ import annotations

import os

from syncd.errors import FormatError
from syncd.formats.burnpack import MAGIC, BurnpackReader
from syncd.formats.fileio import TensorFileReader, open_regular_file, pread_exact
from syncd.formats.safetensors import SafetensorsReader

BURNPACK = "burnpack"
SAFETENSORS = "safetensors"
EXTENSIONS = {".bpk": BURNPACK, ".safetensors": SAFETENSORS}


def format_for_path(path: str | os.PathLike[str]) -> str | None:
    """The format a file name announces, or None."""
    return EXTENSIONS.get(os.path.splitext(os.fspath(path))[1].lower())


def sniff_format(path: str | os.PathLike[str], within: str | os.PathLike[str] | None = None) -> str:
    """Decide by content: the burnpack magic, else a safetensors header; the name only breaks ties."""
    fd, size = open_regular_file(path, within)
    try:
        head = pread_exact(fd, min(size, 4), 0, os.fspath(path), "header")
    finally:
        os.close(fd)
    if len(head) == 4 and int.from_bytes(head, "little") == MAGIC:
        return BURNPACK
    named = format_for_path(path)
    if named == BURNPACK:
        raise FormatError("Invalid magic number: not a burnpack file", os.fspath(path))
    return SAFETENSORS


def open_checkpoint(path: str | os.PathLike[str], within: str | os.PathLike[str] | None = None) -> TensorFileReader:
    """Open and validate a checkpoint of either format; `within` confines it to a directory tree."""
    kind = sniff_format(path, within)
    reader = BurnpackReader if kind == BURNPACK else SafetensorsReader
    return reader(path, within)
