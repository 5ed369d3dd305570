"""The one description of each checkpoint format: every other module reads format facts from here.

A third format is one more `Format` entry (plus its reader and writer, and its conversion target in
syncd/engine/targets.py). Layout names are defined here too, as each format's native layout; the adapters use the
same constants (they decide layouts, this layer only names them).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from syncd.formats import burnpack, pytorch, safetensors
from syncd.formats.dtypes import BURNPACK_DTYPES, DTYPE_TO_SAFETENSORS
from syncd.formats.fileio import TensorFileReader

# Tensor layouts (which side of a Linear weight is [out], norm parameter names...): the adapters decide them.
PYTORCH_LAYOUT = "pytorch"
BURN_LAYOUT = "burn"


@dataclass(frozen=True)
class Format:
    name: str  # the reader's header.format
    extension: str  # with its dot; also the name `syncd convert --to` and the config's directions use
    native_layout: str  # the layout a file of this format is converted into
    converts_to: str  # the format a file of this one is converted to by default
    reader: type[TensorFileReader]
    dtypes: frozenset[str]  # our dtype names this format can store
    magic: bytes | None  # leading bytes that identify a file; None: the format tried when no magic matches
    aliases: tuple[str, ...] = ()  # other extensions of the same format

    @property
    def short(self) -> str:
        """The extension without its dot: `--to bpk`, `direction: bpk->safetensors`."""
        return self.extension[1:]


FORMATS: tuple[Format, ...] = (
    Format(
        name=burnpack.NAME,
        extension=".bpk",
        native_layout=BURN_LAYOUT,
        converts_to=safetensors.NAME,
        reader=burnpack.BurnpackReader,
        dtypes=BURNPACK_DTYPES,
        magic=burnpack.MAGIC.to_bytes(4, "little"),
    ),
    Format(
        name=safetensors.NAME,
        extension=".safetensors",
        native_layout=PYTORCH_LAYOUT,
        converts_to=burnpack.NAME,
        reader=safetensors.SafetensorsReader,
        dtypes=frozenset(DTYPE_TO_SAFETENSORS),
        magic=None,
    ),
)
# Formats syncd reads but does not write: PyTorch's own pickled checkpoints (syncd writes no pickles). They are
# sources only: not a `--to`, not in a watch's default `include`, taken by a watch whose `include:` or
# `direction:` names them.
PYTORCH_FORMAT = Format(
    name=pytorch.NAME,
    extension=".pt",
    native_layout=PYTORCH_LAYOUT,
    converts_to=burnpack.NAME,
    reader=pytorch.PytorchReader,
    dtypes=frozenset(),
    magic=pytorch.ZIP_MAGIC,
    aliases=pytorch.EXTENSIONS[1:],
)
READ_ONLY: tuple[Format, ...] = (PYTORCH_FORMAT,)
BY_NAME = {fmt.name: fmt for fmt in (*FORMATS, *READ_ONLY)}
BY_SHORT = {fmt.short: fmt for fmt in FORMATS}
BY_EXTENSION = {ext: fmt for fmt in (*FORMATS, *READ_ONLY) for ext in (fmt.extension, *fmt.aliases)}
# The daemon's `direction:` choices: each format to the one it converts to, or all of them.
DIRECTIONS: dict[str, frozenset[str]] = {
    **{f"{fmt.short}->{BY_NAME[fmt.converts_to].short}": frozenset([fmt.name]) for fmt in (*FORMATS, *READ_ONLY)},
    "both": frozenset(BY_NAME),
}


def format_for_path(path: str | os.PathLike[str]) -> Format | None:
    """The format a file name announces, or None."""
    return BY_EXTENSION.get(os.path.splitext(os.fspath(path))[1].lower())
