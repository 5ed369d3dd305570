"""Checks that keep a valid-looking configuration from doing harm.

- Whoever can write the config decides what the daemon reads and overwrites: a config (or module-map file)
  writable by group or others is refused.
- A watch on `/` is refused; two watches may not claim the same files (same directory, or one inside another
  watch that is recursive), since their settings could disagree.
- A mirror directory may not overlap any watched tree (in either direction): the daemon would see its own
  outputs as new sources and convert them back.
- With `output: beside` and `direction: both`, outputs land in the watched tree by design; the watcher tells
  its own outputs apart through the state database, not through the config.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

from syncd.daemon.config.schema import Config, Watch
from syncd.daemon.config.yamlfile import Problem, YamlFile


def check_file_mode(file: YamlFile) -> None:
    """Record a problem on `file` when it is writable by group or others."""
    try:
        mode = os.stat(file.path).st_mode
    except OSError as exc:
        file.problem(None, None, f"cannot stat: {exc.strerror}")
        return
    if mode & 0o022:
        file.problem(
            None,
            None,
            f"refusing a config writable by group or others (mode {stat.S_IMODE(mode):04o}); "
            f"run: chmod go-w {file.name}",
        )


def check_watch_safety(config: Config, file: str, mirror_lines: Mapping[int, int]) -> list[Problem]:
    """Refuses watches on `/`, watches that claim the same files, and mirrors that overlap watched trees.

    `mirror_lines` maps a watch's index to the line of its `output:` value.
    """
    problems: list[Problem] = []
    watches = [watch for watch in config.watches if watch.path != Path(watch.path.anchor)]
    for watch in config.watches:
        if watch.path == Path(watch.path.anchor):
            key = f"watches[{watch.index}].path"
            problems.append(Problem(file, watch.line, key, "refusing to watch the root directory"))
    # the root is refused above; comparing the others against it would only repeat that
    for position, watch in enumerate(watches):
        key = f"watches[{watch.index}]"
        for other in watches[:position]:
            if _claims_same_files(watch, other) or _claims_same_files(other, watch):
                message = f"overlaps watches[{other.index}] ({other.path}); a file would be handled by two watches"
                problems.append(Problem(file, watch.line, f"{key}.path", message))
    for watch in watches:
        if watch.mirror is None:
            continue
        for other in watches:
            if _inside(watch.mirror, other.path) or _inside(other.path, watch.mirror):
                which = "its own watched tree" if other is watch else f"watches[{other.index}]"
                message = f"{watch.mirror} overlaps {which} ({other.path}); outputs would be picked up as new sources"
                line = mirror_lines.get(watch.index, watch.line)
                problems.append(Problem(file, line, f"watches[{watch.index}].output.mirror", message))
    return problems


def _inside(path: Path, tree: Path) -> bool:
    return path == tree or tree in path.parents


def _claims_same_files(inner: Watch, outer: Watch) -> bool:
    """True if a file under `inner` is also seen by `outer`: same directory, or inside a recursive one."""
    return inner.path == outer.path or (outer.recursive and outer.path in inner.path.parents)
