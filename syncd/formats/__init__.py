"""Byte-exact readers and writers for burnpack (.bpk) and safetensors. Nothing here knows of modules.

What each format is (name, extension, reader, dtypes) is described once, in registry.py; how formats are
converted is the engine's (engine/targets.py, engine/directions.py).
"""

from __future__ import annotations

import os

from syncd.errors import FormatError
from syncd.formats.burnpack import NAME as BURNPACK
from syncd.formats.fileio import TensorFileReader, open_regular_file, pread_exact
from syncd.formats.registry import BY_NAME, FORMATS, Format, format_for_path
from syncd.formats.safetensors import NAME as SAFETENSORS

__all__ = ["BURNPACK", "FORMATS", "SAFETENSORS", "Format", "format_for_path", "open_checkpoint", "sniff_format"]


SNIFF_BYTES = 512
# Leading bytes of files that land beside checkpoints (and are handed to syncd by mistake), by what they are.
_SIGNATURES = (
    (b"PK\x03\x04", "a zip archive, e.g. a torch.save .pt/.pth file"),
    (b"\x89HDF\r\n\x1a\n", "an HDF5 file, e.g. a Keras .h5"),
    (b"\x93NUMPY", "a NumPy .npy array"),
    (b"GGUF", "a GGUF model"),
    (b"\x1f\x8b", "a gzip-compressed file"),
    (b"\x28\xb5\x2f\xfd", "a zstd-compressed file"),
    (b"\x7fELF", "an ELF executable"),
)


def looks_like(head: bytes, size: int) -> str | None:
    """What a file that is not a plausible safetensors file looks like, from its first bytes, or None when
    it could be one (a damaged one: the reader's own error then says what is wrong) or is unrecognizable.
    A safetensors file starts with a little-endian u64 header length that fits the file, then `{`."""
    if len(head) >= 9:
        length = int.from_bytes(head[:8], "little")
        if length <= size - 8 and head[8:9] == b"{":
            return None
    for signature, what in _SIGNATURES:
        if head.startswith(signature):
            return what
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "a Python pickle, e.g. a torch.save .pt/.bin file"
    text = head.lstrip(b" \t\r\n").removeprefix(b"\xef\xbb\xbf")
    try:
        decoded: str | None = text.decode("utf-8")
    except UnicodeDecodeError as exc:  # the sample may end inside a multi-byte character
        decoded = text[: exc.start].decode("utf-8") if exc.start >= len(text) - 3 else None
    if decoded and all(ch.isprintable() or ch in "\t\r\n" for ch in decoded):
        return "JSON text" if decoded[:1] in "{[" else "text"
    return None


def sniff_format(path: str | os.PathLike[str], within: str | os.PathLike[str] | None = None) -> str:
    """Decide by content: a format's magic, else the format without one; the name only breaks ties."""
    fd, size = open_regular_file(path, within)
    try:
        longest = max(len(fmt.magic or b"") for fmt in FORMATS)
        head = pread_exact(fd, min(size, max(longest, SNIFF_BYTES)), 0, os.fspath(path), "header")
    finally:
        os.close(fd)
    for fmt in FORMATS:
        if fmt.magic is not None and head.startswith(fmt.magic):
            return fmt.name
    lookalike = looks_like(head, size)
    if lookalike is not None:
        kinds = " or ".join(fmt.name for fmt in reversed(FORMATS))
        raise FormatError(f"not a {kinds} file (looks like {lookalike})", os.fspath(path))
    named = format_for_path(path)
    if named is not None and named.magic is not None:
        raise FormatError(f"Invalid magic number: not a {named.name} file", os.fspath(path))
    return next(fmt.name for fmt in FORMATS if fmt.magic is None)


def open_checkpoint(path: str | os.PathLike[str], within: str | os.PathLike[str] | None = None) -> TensorFileReader:
    """Open and validate a checkpoint of any format; `within` confines it to a directory tree."""
    return BY_NAME[sniff_format(path, within)].reader(path, within)
