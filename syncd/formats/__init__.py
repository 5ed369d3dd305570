"""Byte-exact readers and writers for burnpack (.bpk) and safetensors, and a reader of PyTorch's own
`torch.save` checkpoints (.pt, .pth, .bin, .ckpt, .pth.tar). Nothing here knows of modules.

What each format is (name, extension, reader, dtypes) is described once, in registry.py; how formats are
converted is the engine's (engine/targets.py, engine/directions.py).
"""

from __future__ import annotations

import os

from syncd.errors import FormatError, IncompleteFileError
from syncd.formats.burnpack import NAME as BURNPACK
from syncd.formats.fileio import TensorFileReader, open_regular_file, pread_exact
from syncd.formats.pytorch_facts import NAME as PYTORCH
from syncd.formats.registry import BY_NAME, FORMATS, Format, format_for_path, read_pytorch
from syncd.formats.safetensors import NAME as SAFETENSORS

__all__ = [
    "BURNPACK",
    "FORMATS",
    "PYTORCH",
    "SAFETENSORS",
    "Format",
    "format_for_path",
    "open_checkpoint",
    "read_metadata",
    "sniff_format",
]


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


def _could_be_safetensors(head: bytes, size: int) -> bool:
    """A safetensors file starts with a little-endian u64 header length that fits the file, then `{`."""
    return len(head) >= 9 and int.from_bytes(head[:8], "little") <= size - 8 and head[8:9] == b"{"


def looks_like(head: bytes, size: int) -> str | None:
    """What a file that is not a plausible safetensors file looks like, from its first bytes, or None when
    it could be one (a damaged one: the reader's own error then says what is wrong) or is unrecognizable."""
    if _could_be_safetensors(head, size):
        return None
    for signature, what in _SIGNATURES:
        if head.startswith(signature):
            return what
    if head[257:262] == b"ustar":  # POSIX tar's magic sits in its first block's header, not at its start
        return "a tar archive, e.g. a file of torch.save's oldest format"
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
    """Decide by content: a format's magic, else the format without one; the name only breaks ties. A zip is
    read as a torch.save checkpoint only under a PyTorch name (.pt, .pth, .bin, .ckpt, .tar): under a
    checkpoint's name of the other formats it is named for what it is, not converted."""
    fd, size = open_regular_file(path, within)
    try:
        longest = max(len(fmt.magic or b"") for fmt in FORMATS)
        head = pread_exact(fd, min(size, max(longest, SNIFF_BYTES)), 0, os.fspath(path), "header")
    finally:
        os.close(fd)
    for fmt in FORMATS:
        if fmt.magic is not None and head.startswith(fmt.magic):
            return fmt.name
    named = format_for_path(path)
    if named is not None and named.name == PYTORCH:
        if head.startswith(BY_NAME[PYTORCH].magic or b"?"):
            return PYTORCH
        if (BY_NAME[PYTORCH].magic or b"").startswith(head):  # empty, or the first bytes of a zip only
            raise IncompleteFileError(
                f"{size} bytes: too short for a torch.save zip (still being written?)", os.fspath(path)
            )
        if head[:1] == b"\x80":  # a pickle: torch.save before PyTorch 1.6, or with the zip format turned off
            from syncd.formats.pytorch import legacy_error

            raise legacy_error(os.fspath(path))
        if not _could_be_safetensors(head, size):  # (a safetensors file under a PyTorch name is read as one)
            lookalike = looks_like(head, size)
            seen = f" (looks like {lookalike})" if lookalike else ""
            raise FormatError(f"not a torch.save checkpoint, which is a zip{seen}", os.fspath(path))
    lookalike = looks_like(head, size)
    if lookalike is not None:
        kinds = " or ".join(fmt.name for fmt in reversed(FORMATS))
        raise FormatError(f"not a {kinds} file (looks like {lookalike})", os.fspath(path))
    if named is not None and named.magic is not None and named.name != PYTORCH:
        raise FormatError(f"Invalid magic number: not a {named.name} file", os.fspath(path))
    return next(fmt.name for fmt in FORMATS if fmt.magic is None)


def open_checkpoint(
    path: str | os.PathLike[str], within: str | os.PathLike[str] | None = None, top_level_key: str | None = None
) -> TensorFileReader:
    """Open and validate a checkpoint of any format; `within` confines it to a directory tree. `top_level_key`:
    where a PyTorch checkpoint keeps its tensors (the other formats have no such nesting: it does not apply)."""
    name = sniff_format(path, within)
    if name == PYTORCH:
        return read_pytorch(path, within, top_level_key)
    return BY_NAME[name].reader(path, within)


def read_metadata(path: str | os.PathLike[str], within: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """A checkpoint's metadata, its header decoded with every limit of its reader but its tensor table not
    gone through: what a file says of itself (`syncd.source`...), asked before deciding whether to convert
    it. A table of 10,000 tensors takes the reader tens of milliseconds, and the conversion reads it anyway;
    a decision resting on the metadata is one whose outcome no broken table could make wrong, or one
    confirmed by opening the file. PyTorch's pickles hold no metadata: {} without reading them."""
    fmt = BY_NAME[sniff_format(path, within)]
    if fmt.metadata is None:
        return {}
    fd, size = open_regular_file(path, within)
    try:
        return fmt.metadata(fd, size, os.fspath(path))
    finally:
        os.close(fd)
