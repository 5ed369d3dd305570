"""What a checkpoint's surroundings say about its modules: gathered here, handed to the pure adapters.

The adapters do no I/O (README, "How it is built"); the convert layer reads the `config.json` a Hugging Face
`save_pretrained` writes beside the weights, and passes its parsed contents with the file's own metadata and
syncd record as one `FileContext` (the order of the evidence is applied in `syncd.adapters`), with the module
types of the model that config names, where `transformers` can build its class (definition.py).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from syncd.adapters import FileContext, ModelDefinition, ModuleMap
from syncd.errors import SyncdError
from syncd.formats import format_for_path
from syncd.formats.shards import is_index_name

CONFIG_NAME = "config.json"
MAX_CONFIG_BYTES = 1 << 20  # a model config is a few KiB; anything larger is not one


def gather_context(
    source: str,
    metadata: dict[str, str],
    recorded_layout: str | None,
    recorded_kinds: dict[str, str],
    map_states_every_module: bool = False,
    tensor_count: int | None = None,
    gamma_beta: frozenset[str] = frozenset(),
    container: str | None = None,
) -> FileContext:
    """`map_states_every_module`: the user's module map has a rule for every module of the checkpoint, so the
    model's definition, the evidence after the map, could decide nothing: it is not built (building it imports
    torch and transformers, 6-7 s of a one-shot conversion's start-up)."""
    config, note = read_config_beside(Path(source))
    definition: ModelDefinition | None = None
    definition_note: str | None = None
    if config is not None and map_states_every_module:
        definition_note = "model definition not built: the module map states every module"
    elif config is not None:
        from syncd.engine.definition import definition_for  # its builder's machinery: only beside a config

        definition, definition_note = definition_for(config, tensor_count)
    return FileContext(
        metadata=dict(metadata),
        recorded_layout=recorded_layout,
        recorded_kinds=dict(recorded_kinds),
        config=config,
        notes=tuple(n for n in (note, definition_note) if n),
        definition=definition,
        gamma_beta=gamma_beta,
        container=container,
    )


def states_every_module(module_map: ModuleMap | None, names: Iterable[str]) -> bool:
    """True when `module_map` has a rule for the module of every tensor named (`a.b.weight`'s is `a.b`)."""
    if module_map is None:
        return False
    return all(module_map.lookup(path) is not None for path in {name.rpartition(".")[0] for name in names})


def definition_of(config_path: Path) -> ModelDefinition:
    """The definition of the model a config.json (or the directory holding one) describes, for `syncd modules`;
    SyncdError naming the file when it cannot be had."""
    path = config_path / CONFIG_NAME if config_path.is_dir() else config_path
    if format_for_path(path) is not None or is_index_name(path):  # a checkpoint: the config saved beside it
        if not (path.parent / CONFIG_NAME).exists():  # named as the user typed it, not a file they never did
            raise SyncdError(
                f"no {CONFIG_NAME} beside it: name a save_pretrained directory or its config.json", str(path)
            )
        path = path.parent / CONFIG_NAME
    if not path.exists():
        raise SyncdError("not found: name a save_pretrained directory or its config.json", str(path))
    config, note = _read_config(path)
    if config is None:
        raise SyncdError(note or "not a model's config: it names no model_type", str(path))
    from syncd.engine.definition import definition_for

    definition, note = definition_for(config)
    if definition is None:
        raise SyncdError(note or "no model definition", str(path))
    return definition


def read_config_beside(source: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(the parsed config.json in the source's directory, or None; a note when one is there but unusable).

    A config that cannot be used never stops a conversion: the names and shapes still decide, and the note
    says why it was passed over.
    """
    config, why = _read_config(source.parent / CONFIG_NAME)
    return config, None if why is None else f"{CONFIG_NAME} beside it not used: {why}"


def _read_config(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(the parsed config at `path`, or None; why, when one is there but unusable). Opened without following
    a symlink and never blocking (a FIFO named config.json is not read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, exc.strerror or str(exc)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None, "not a regular file"
        if info.st_size > MAX_CONFIG_BYTES:
            return None, f"larger than {MAX_CONFIG_BYTES} bytes"
        data = os.read(fd, MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        return None, exc.strerror or str(exc)
    finally:
        os.close(fd)
    return _parse_config(data)


def _parse_config(data: bytes) -> tuple[dict[str, Any] | None, str | None]:
    try:
        config = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        return None, f"not JSON ({' '.join(str(exc).split())[:120]})"
    if not isinstance(config, dict):
        return None, "not a JSON object"
    if "model_type" not in config and "architectures" not in config:
        return None, None  # some other tool's config: says nothing about the model
    return config, None
