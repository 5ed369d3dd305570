"""The one description of each checkpoint format: every other module reads format facts from here.

What a format is: its name, extension, reader, dtypes and magic. How a format is converted (the tensor layout
it is written in, the format it converts to) is conversion policy, in the engine (engine/targets.py,
engine/directions.py). A third format is one more `Format` entry (plus its reader and writer), and its
conversion target in syncd/engine/targets.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from syncd.formats import burnpack, pytorch_facts, safetensors
from syncd.formats.dtypes import BURNPACK_DTYPES, DTYPE_TO_SAFETENSORS
from syncd.formats.fileio import TensorFileReader

OpenReader = Callable[..., TensorFileReader]
# (fd, file size, path) -> the file's metadata, its tensor table left unchecked
ReadMetadata = Callable[[int, int, str], dict[str, str]]


@dataclass(frozen=True)
class Format:
    name: str  # the reader's header.format
    extension: str  # with its dot; also the name `syncd convert --to` and the config's directions use
    reader: OpenReader  # (path, within=None) -> the file's validated reader
    dtypes: frozenset[str]  # our dtype names this format can store
    magic: bytes | None  # leading bytes that identify a file; None: the format tried when no magic matches
    aliases: tuple[str, ...] = ()  # other extensions of the same format
    metadata: ReadMetadata | None = None  # None: the format has no metadata (PyTorch's pickles)

    @property
    def short(self) -> str:
        """The extension without its dot: `--to bpk`, `direction: bpk->safetensors`."""
        return self.extension[1:]


FORMATS: tuple[Format, ...] = (
    Format(
        name=burnpack.NAME,
        extension=".bpk",
        reader=burnpack.BurnpackReader,
        dtypes=BURNPACK_DTYPES,
        magic=burnpack.MAGIC.to_bytes(4, "little"),
        metadata=burnpack.read_metadata,
    ),
    Format(
        name=safetensors.NAME,
        extension=".safetensors",
        reader=safetensors.SafetensorsReader,
        dtypes=frozenset(DTYPE_TO_SAFETENSORS),
        magic=None,
        metadata=safetensors.read_metadata,
    ),
)


# Formats syncd reads but does not write: PyTorch's own pickled checkpoints (syncd writes no pickles). They are
# sources only: not a `--to`, not in a watch's default `include`, taken by a watch whose `include:` or
# `direction:` names them.
def read_pytorch(
    path: str | os.PathLike[str], within: str | os.PathLike[str] | None = None, top_level_key: str | None = None
) -> TensorFileReader:
    """A torch.save checkpoint's reader, imported here, when one is read (see pytorch_facts.py)."""
    from syncd.formats.pytorch import PytorchReader

    return PytorchReader(path, within, top_level_key)


PYTORCH_FORMAT = Format(
    name=pytorch_facts.NAME,
    extension=".pt",
    reader=read_pytorch,
    dtypes=frozenset(),
    magic=pytorch_facts.ZIP_MAGIC,
    aliases=pytorch_facts.EXTENSIONS[1:],
)
READ_ONLY: tuple[Format, ...] = (PYTORCH_FORMAT,)
BY_NAME = {fmt.name: fmt for fmt in (*FORMATS, *READ_ONLY)}
BY_SHORT = {fmt.short: fmt for fmt in FORMATS}
BY_EXTENSION = {ext: fmt for fmt in (*FORMATS, *READ_ONLY) for ext in (fmt.extension, *fmt.aliases)}


def checkpoint_stem(path: str | os.PathLike[str]) -> str:
    """A checkpoint's name without its extension, both of `model_best.pth.tar`'s."""
    name = os.path.basename(os.fspath(path))
    for double in pytorch_facts.DOUBLE_EXTENSIONS:
        if name.lower().endswith(double) and len(name) > len(double):
            return name[: -len(double)]
    return os.path.splitext(name)[0]


def format_for_path(path: str | os.PathLike[str]) -> Format | None:
    """The format a file name announces, or None."""
    return BY_EXTENSION.get(os.path.splitext(os.fspath(path))[1].lower())
