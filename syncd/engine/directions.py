"""Which way a checkpoint is converted: the format a file of each format is converted to when no other is
asked for, and the daemon's `direction:` choices.

Conversion policy lives here, above the formats (which say only what a format is) and the adapters (which say
only what a layout is); the tensor layout each target format is written in is its target type's (targets.py).
"""

from __future__ import annotations

from syncd.formats import BURNPACK, FORMATS, PYTORCH, SAFETENSORS, Format
from syncd.formats.registry import BY_NAME, READ_ONLY

# The format a file of each format is converted to by default: the other one; PyTorch's own checkpoints (read,
# never written) to Burn's.
CONVERTS_TO: dict[str, str] = {BURNPACK: SAFETENSORS, SAFETENSORS: BURNPACK, PYTORCH: BURNPACK}


def converts_to(fmt: Format) -> Format:
    """The format a file of `fmt` is converted to by default."""
    return BY_NAME[CONVERTS_TO[fmt.name]]


# The daemon's `direction:` choices: each format to the one it converts to, or all of them.
DIRECTIONS: dict[str, frozenset[str]] = {
    **{f"{fmt.short}->{converts_to(fmt).short}": frozenset([fmt.name]) for fmt in (*FORMATS, *READ_ONLY)},
    "both": frozenset(BY_NAME),
}
