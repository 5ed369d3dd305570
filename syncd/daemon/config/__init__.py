"""The daemon's YAML configuration: read, validated with line numbers, checked for safety.

`load_config` returns frozen dataclasses or raises one ConfigError; `validate` returns the Config (when valid)
and every problem (for `syncd check-config`). Problems name the file, the line and the key, e.g.
`syncd.yaml:12: watches[0].direction: expected one of bpk->safetensors, safetensors->bpk, both, got 'sideways'`.

Modules:
- `schema`: the settings, their types and defaults (`Config`, `Watch`, `LogSettings`);
- `yamlfile`: a YAML file read as nodes with line numbers, typed getters; nothing syncd-specific;
- `builder`: YAML nodes -> `Config`, every key read with its schema default;
- `safety`: the config file's mode, watches that overlap, mirrors inside watched trees.

Relative paths resolve against the directory of the file that names them; `~` is expanded. Watched
directories and mirror directories must exist: a typo should not silently watch nothing or create a new tree
somewhere.
"""

from __future__ import annotations

import os
from pathlib import Path

from syncd.daemon.config.builder import ConfigBuilder
from syncd.daemon.config.safety import check_file_mode, check_watch_safety
from syncd.daemon.config.schema import (
    DEFAULT_CONFIG_PATH,
    DEFAULT_IGNORE,
    DEFAULT_POLL_INTERVAL,
    DEFAULT_RESCAN_INTERVAL,
    RESTART_SETTINGS,
    ClusterSettings,
    Config,
    LogSettings,
    Watch,
)
from syncd.daemon.config.yamlfile import Problem, YamlFile, in_reading_order
from syncd.errors import ConfigError, one_line

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "DEFAULT_IGNORE",
    "DEFAULT_POLL_INTERVAL",
    "DEFAULT_RESCAN_INTERVAL",
    "RESTART_SETTINGS",
    "ClusterSettings",
    "Config",
    "LogSettings",
    "Problem",
    "Watch",
    "check_config",
    "load_config",
    "load_locations",
    "validate",
]


def load_config(path: str | os.PathLike[str], *, check_filesystem: bool = True) -> Config:
    """Read and validate `path`. Raises ConfigError naming the first problem (and how many more).

    `check_filesystem=False` skips the checks that need the watched trees to exist and the file mode to be
    safe; `syncd log` uses it to find the log of a config it will not act on.
    """
    config, problems = validate(path, check_filesystem=check_filesystem)
    if problems:
        error = problems[0].to_error()
        if len(problems) > 1:
            more = len(problems) - 1
            error = ConfigError(
                f"{error.message} (and {more} more problem{'s' if more > 1 else ''}; `syncd check-config` lists them)",
                error.path,
            )
        raise error
    assert config is not None
    return config


def load_locations(path: str | os.PathLike[str]) -> Config:
    """The config at `path` as `syncd status` and `syncd log` need it: where the state and the sync log are.
    A problem elsewhere in the file (a typo the running daemon refused at its last reload) does not hide what
    the daemon is doing; a problem in `state_dir` or `log` does, as does a file that does not read at all."""
    try:
        file = YamlFile(Path(path))
        root = file.load()
        config = None if root is None else ConfigBuilder(file, check_filesystem=False).build(root)
    except (RecursionError, ValueError, TypeError, OverflowError, MemoryError):
        config = None
    if config is None:
        return load_config(path, check_filesystem=False)  # says what is wrong
    if [p for p in file.problems if p.key is None or p.key.startswith(("state_dir", "log"))]:
        return load_config(path, check_filesystem=False)
    return config


def check_config(path: str | os.PathLike[str]) -> list[str]:
    """Every problem in the config at `path`, one line each; empty when it is valid."""
    _, problems = validate(path)
    return [str(problem) for problem in problems]


def validate(
    path: str | os.PathLike[str], *, check_filesystem: bool = True, runs_as: int | None = None
) -> tuple[Config | None, list[Problem]]:
    """The Config (None unless valid) and every problem, in reading order. What the YAML library or the OS
    refuses in ways of their own (nesting deeper than the parser's recursion, a NUL byte in a path) is a
    problem too: a reload must never die. `runs_as`: the uid of the user the daemon runs as, who (with root)
    alone may edit the file (default: the caller's)."""
    path = Path(path)
    try:
        return _validate(path, check_filesystem=check_filesystem, runs_as=runs_as)
    except RecursionError:
        return None, [Problem(str(path), None, None, "nested too deeply to read (is it generated?)")]
    except (ValueError, TypeError, OverflowError, MemoryError) as exc:
        return None, [Problem(str(path), None, None, f"invalid value: {one_line(exc)}")]


def _validate(path: Path, *, check_filesystem: bool, runs_as: int | None) -> tuple[Config | None, list[Problem]]:
    file = YamlFile(path)
    root = file.load()
    if root is None:
        return None, file.problems
    if check_filesystem:
        check_file_mode(file, runs_as)
    builder = ConfigBuilder(file, check_filesystem, runs_as)
    config = builder.build(root)
    problems = file.problems
    if config is not None:
        problems += check_watch_safety(config, str(path), builder.mirror_lines)
    return (config if not problems else None), in_reading_order(problems, str(path))
