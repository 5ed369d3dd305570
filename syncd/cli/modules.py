"""`syncd modules DIR|CONFIG.json [-o MAP.yaml]`: the exact module map of a model, from its own definition.

Run it once where `transformers` is installed (where the training code runs); put the map in a watch's
`modules:` or pass it to `convert --modules`, and a daemon without `transformers` plans exactly as one with it.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from syncd.adapters.model import CONV_KINDS, EMBEDDING, LINEAR, LINEAR_IN_OUT, OTHER, ModelDefinition
from syncd.errors import AlreadyExistsError, SyncdError

WEIGHTED_KINDS = frozenset({LINEAR, LINEAR_IN_OUT, EMBEDDING, *CONV_KINDS})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", type=Path, metavar="DIR|CONFIG.json", help="a save_pretrained directory or its config")
    parser.add_argument("-o", "--output", type=Path, help="write the map to this file (default: print it)")
    parser.add_argument("--overwrite", action="store_true", help="replace the -o file if it exists")


def run(args: argparse.Namespace) -> int:
    from syncd.engine.context import definition_of

    definition = definition_of(args.path)
    kinds = written_kinds(definition)
    text = module_map_yaml(definition.source, kinds)
    if args.output is None:
        print(text, end="")
        return 0
    try:
        _write(args.output, text, args.overwrite)
    except FileExistsError:  # a map of one's own, edited by hand, perhaps: as `convert` keeps its destination
        raise AlreadyExistsError("file already exists; pass --overwrite to replace it", str(args.output)) from None
    except OSError as exc:
        raise SyncdError(f"cannot write the module map: {exc.strerror or exc}", str(args.output)) from None
    print(f"wrote {args.output}: {len(kinds)} modules ({definition.source})")
    return 0


def written_kinds(definition: ModelDefinition) -> list[tuple[str, str]]:
    """(module path, kind) for every module holding a tensor save_pretrained writes, in the file's order. A
    Linear, Embedding or convolution whose weight is not written (tied to another module, stored once there)
    keeps only its bias, which no layout changes: Other."""
    leaves: dict[str, set[str]] = {}
    for name in definition.written:
        module, _, leaf = name.rpartition(".")
        leaves.setdefault(module, set()).add(leaf)
    found = []
    for module, held in leaves.items():
        kind = definition.kinds.get(module)
        if kind is None:
            continue
        if kind in WEIGHTED_KINDS and "weight" not in held:
            kind = OTHER
        found.append((module, kind))
    return found


def module_map_yaml(source: str, kinds: list[tuple[str, str]]) -> str:
    """The map as YAML: a comment naming where it came from, then one exact path per module."""
    lines = [
        f"# module map of the {source}, written by `syncd modules`",
        "# the type of the module behind every tensor save_pretrained writes; use with `syncd convert --modules`",
        "# or in a watch's `modules:`",
        "modules:",
    ]
    # JSON string syntax is YAML: a module name with quotes or backslashes stays exact
    lines += [f"  {json.dumps(path, ensure_ascii=False)}: {kind}" for path, kind in kinds]
    return "\n".join(lines) + "\n"


def _write(path: Path, text: str, overwrite: bool) -> None:
    """Whole or not at all: written beside the destination, then renamed over it (`overwrite`) or linked
    where nothing is (FileExistsError otherwise, even for a file that appeared meanwhile)."""
    scratch = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        scratch.write_text(text, encoding="utf-8")
        if overwrite:
            os.replace(scratch, path)
        else:
            os.link(scratch, path)
    finally:
        scratch.unlink(missing_ok=True)
