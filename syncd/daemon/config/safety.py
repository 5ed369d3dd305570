"""Checks that keep a valid-looking configuration from doing harm.

- Whoever can write the config decides what the daemon reads and overwrites: a config (or module-map file)
  writable by group or others is refused.
- A watch on `/` is refused; two watches may not claim the same files (same directory, or one inside another
  watch that is recursive), since their settings could disagree.
- Two watches' mirror directories may not overlap: their outputs would take the same names.
- A mirror directory may not overlap any watched tree (in either direction): the daemon would see its own
  outputs as new sources and convert them back.
- With `output: beside` and `direction: both`, outputs land in the watched tree by design; the watcher tells
  its own outputs apart through the state database, not through the config.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from collections.abc import Mapping
from pathlib import Path

from syncd.daemon.config.schema import Config, Watch
from syncd.daemon.config.yamlfile import Problem, YamlFile


def check_file_mode(file: YamlFile, runs_as: int | None = None) -> None:
    """Record a problem on `file` when someone other than the user syncd runs as (or root) may edit it.

    `runs_as` is the uid of the user syncd runs as: the caller's (None) for the daemon, the `--user` of
    `syncd check-config --user NAME` when root checks a config for a service that runs as NAME.

    Whoever can edit the config decides what the daemon reads and overwrites with its rights. Its editors are
    the owner, the members of its group when it is group-writable, everyone when others may write. The rule:
    every editor must be the user syncd runs as, or root. So a config written under umask 002 (mode 0664) is
    accepted when its group is the owner's private group (no other member), as on Debian, Ubuntu and Fedora,
    and the owner runs syncd; it is refused when the group has other members, when others may write, or when
    the service runs as a user other than the file's owner.
    """
    try:
        info = os.stat(file.path)
    except OSError as exc:
        file.problem(None, None, f"cannot stat: {exc.strerror}")
        return
    problem = _editable_by_others(info, file.name, os.geteuid() if runs_as is None else runs_as)
    if problem is not None:
        file.problem(None, None, problem)


def _editable_by_others(info: os.stat_result, name: str, me: int) -> str | None:
    """Why a file with `info` may be edited by someone other than `me` (the user syncd runs as) or root."""
    mode = stat.S_IMODE(info.st_mode)
    why = f"whoever can edit it decides what syncd reads and overwrites as {_user_name(me)}"
    if mode & 0o002:
        return f"refusing a config writable by others (mode {mode:04o}): {why}; run: chmod go-w {name}"
    if info.st_uid not in (me, 0):
        owner = _user_name(info.st_uid)
        if me == 0:
            return (
                f"refusing a config owned by {owner}, not by root (syncd runs as root): {why}; run: chown root {name}"
            )
        return (
            f"refusing a config owned by {owner}, not by {_user_name(me)} (the user syncd runs as) or root: {why}; "
            f"run: chown {_user_name(me)} {name} (or make root its owner)"
        )
    if mode & 0o020:
        others = sorted(_group_members(info.st_gid) - {_user_name(me), "root"})
        if others:
            return (
                f"refusing a config writable by group {_group_name(info.st_gid)} (mode {mode:04o}), whose members "
                f"include {', '.join(others)}: {why}; run: chmod g-w {name} (a group-writable config is accepted "
                f"only when its group holds no one else, as a user's private group under umask 002)"
            )
    return None


def _group_members(gid: int) -> set[str]:
    """Every user in group `gid`: its listed members and the users whose primary group it is."""
    try:
        members = set(grp.getgrgid(gid).gr_mem)
    except KeyError:
        return {f"gid {gid} (unknown group)"}
    return members | {user.pw_name for user in pwd.getpwall() if user.pw_gid == gid}


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return f"gid {gid}"


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
    mirrored = [watch for watch in watches if watch.mirror is not None]
    for position, watch in enumerate(mirrored):
        for other in mirrored[:position]:
            assert watch.mirror is not None and other.mirror is not None
            if _inside(watch.mirror, other.mirror) or _inside(other.mirror, watch.mirror):
                # two trees' outputs in one place: a.safetensors of each is one a.bpk, replaced by turns
                message = (
                    f"{watch.mirror} overlaps the mirror of watches[{other.index}] ({other.mirror}); two trees' "
                    "outputs would take the same names"
                )
                line = mirror_lines.get(watch.index, watch.line)
                problems.append(Problem(file, line, f"watches[{watch.index}].output.mirror", message))
    return problems


def _inside(path: Path, tree: Path) -> bool:
    return path == tree or tree in path.parents


def _claims_same_files(inner: Watch, outer: Watch) -> bool:
    """True if a file under `inner` is also seen by `outer`: same directory, or inside a recursive one."""
    return inner.path == outer.path or (outer.recursive and outer.path in inner.path.parents)
