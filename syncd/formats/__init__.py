"""Byte-exact readers and writers for burnpack (.bpk) and safetensors. Nothing here knows of modules.

What each format is (extension, native layout, reader, dtypes) is described once, in registry.py.
"""

from __future__ import annotations

import os

from syncd.errors import FormatError
from syncd.formats.burnpack import NAME as BURNPACK
from syncd.formats.fileio import TensorFileReader, open_regular_file, pread_exact
from syncd.formats.registry import BY_NAME, FORMATS, Format, format_for_path
from syncd.formats.safetensors import NAME as SAFETENSORS

__all__ = ["BURNPACK", "FORMATS", "SAFETENSORS", "Format", "format_for_path", "open_checkpoint", "sniff_format"]


def sniff_format(path: str | os.PathLike[str], within: str | os.PathLike[str] | None = None) -> str:
    """Decide by content: a format's magic, else the format without one; the name only breaks ties."""
    fd, size = open_regular_file(path, within)
    try:
        longest = max(len(fmt.magic or b"") for fmt in FORMATS)
        head = pread_exact(fd, min(size, longest), 0, os.fspath(path), "header")
    finally:
        os.close(fd)
    for fmt in FORMATS:
        if fmt.magic is not None and head.startswith(fmt.magic):
            return fmt.name
    named = format_for_path(path)
    if named is not None and named.magic is not None:
        raise FormatError(f"Invalid magic number: not a {named.name} file", os.fspath(path))
    return next(fmt.name for fmt in FORMATS if fmt.magic is None)


def open_checkpoint(path: str | os.PathLike[str], within: str | os.PathLike[str] | None = None) -> TensorFileReader:
    """Open and validate a checkpoint of any format; `within` confines it to a directory tree."""
    return BY_NAME[sniff_format(path, within)].reader(path, within)
