"""Can the service's user do its job on the watched trees? `syncd check-config FILE [--user NAME]` warns
when that user cannot list a tree, read a checkpoint in it, or write where the outputs go.

As root, `--user` checks as that user (a child process takes the user's uid, gid and groups, so the
kernel's own answer counts: modes, groups and ACLs alike); without it, the checks run as whoever runs the
command (`sudo -u syncd syncd check-config ...` is the same). The service's sandbox (ReadWritePaths=,
ProtectHome=) is not seen from here: a warning-free check still needs the trees listed in the unit.
"""

from __future__ import annotations

import json
import os
import pwd
import stat
from dataclasses import dataclass, field
from pathlib import Path

from syncd.daemon.config import Config, Watch
from syncd.daemon.names import is_candidate
from syncd.errors import UsageError

MAX_ENTRIES = 20_000  # a check, not a scan: enough to find the pattern in a large tree
MAX_DEPTH = 64


@dataclass
class _Findings:
    unreadable: list[str] = field(default_factory=list)  # checkpoints the user cannot read
    unlistable: list[str] = field(default_factory=list)  # directories the user cannot enter and list
    unwritable: list[str] = field(default_factory=list)  # output directories the user cannot write


def access_warnings(config: Config, user: str | None = None) -> list[str]:
    """One line per problem the user would have with the daemon's own files and the watched trees; empty
    when none."""
    name = user or pwd.getpwuid(os.geteuid()).pw_name
    if user is not None and uid_of(user) != os.geteuid():
        own, results = _as_user(user, config)
    else:
        own, results = _check_own_files(config), [_check_watch(watch) for watch in config.watches]
    lines = [f"warning: {config.path}: user {name} {problem}" for problem in own]
    for watch, found in zip(config.watches, results, strict=True):
        lines += _describe(config.path, watch, name, found)
    return lines


def _check_own_files(config: Config) -> list[str]:
    """What the daemon itself needs: to read its configuration, to write its state directory and its sync
    log (a `syncd@USER` config copied from the service's, state_dir left at /var/lib/syncd)."""
    problems = []
    if not os.access(config.path, os.R_OK):
        problems.append("cannot read the configuration itself")
    for what, directory in (("state_dir", config.state_dir), ("the sync log's directory", config.log.path.parent)):
        existing = _nearest_existing(directory)
        if not os.access(existing, os.W_OK | os.X_OK):
            made = "" if existing == directory else f" (nor create it in {existing})"
            problems.append(f"cannot write {what} {directory}{made}")
    if os.path.lexists(config.log.path) and not os.access(config.log.path, os.W_OK):
        problems.append(f"cannot write the sync log {config.log.path}")
    return problems


def _nearest_existing(directory: Path) -> Path:
    """`directory`, or the nearest directory above it that exists (where the daemon would create it)."""
    for candidate in (directory, *directory.parents):
        if os.path.lexists(candidate):
            return candidate
    return directory


def uid_of(user: str) -> int:
    """The uid of `user` (a `--user` argument); a usage error when there is no such user."""
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        raise UsageError(f"--user: no such user {user!r}") from None


def _describe(config_path: Path, watch: Watch, user: str, found: _Findings) -> list[str]:
    where = f"warning: {config_path}: watch {watch.path}: user {user}"
    lines = []
    if found.unlistable:
        lines.append(f"{where} cannot list {len(found.unlistable)} director(ies), e.g. {found.unlistable[0]}")
    if found.unreadable:
        example = found.unreadable[0]
        lines.append(
            f"{where} cannot read {len(found.unreadable)} checkpoint(s), e.g. {example}{_owner_and_mode(example)}; "
            "for files only their writer may read, run syncd@WRITER.service "
            "(docs/install.md#checkpoints-only-their-writer-may-read)"
        )
    if found.unwritable:
        lines.append(f"{where} cannot write {len(found.unwritable)} output director(ies), e.g. {found.unwritable[0]}")
    return lines


def _owner_and_mode(path: str) -> str:
    try:
        info = os.lstat(path)
    except OSError:
        return ""
    try:
        owner = pwd.getpwuid(info.st_uid).pw_name
    except KeyError:
        owner = str(info.st_uid)
    return f" (owner {owner}, mode {stat.S_IMODE(info.st_mode):04o})"


def _check_watch(watch: Watch) -> _Findings:
    found = _Findings()
    if watch.mirror is not None and not os.access(watch.mirror, os.W_OK | os.X_OK):
        found.unwritable.append(os.fsdecode(watch.mirror))
    seen = 0
    stack = [(watch.path, 0)]
    while stack and seen < MAX_ENTRIES:
        directory, depth = stack.pop()
        if not os.access(directory, os.R_OK | os.X_OK):
            found.unlistable.append(os.fsdecode(directory))
            continue
        if watch.mirror is None and not os.access(directory, os.W_OK | os.X_OK):
            found.unwritable.append(os.fsdecode(directory))
        try:
            entries = list(os.scandir(directory))
        except OSError:
            found.unlistable.append(os.fsdecode(directory))
            continue
        for entry in entries:
            seen += 1
            path = Path(entry.path)
            if entry.is_dir(follow_symlinks=False):
                if watch.recursive and depth < MAX_DEPTH:
                    stack.append((path, depth + 1))
            elif entry.is_file(follow_symlinks=False) and is_candidate(watch, path) and not os.access(path, os.R_OK):
                found.unreadable.append(os.fsdecode(path))
    return found


def _as_user(user: str, config: Config) -> tuple[list[str], list[_Findings]]:
    """Run the checks in a child process that has become `user` (root only)."""
    if os.geteuid() != 0:
        raise UsageError(f"--user {user}: checking as another user needs root (or run it as {user})")
    entry = pwd.getpwnam(user)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: become the user, check, report as JSON, exit without cleanup handlers
        code = 1
        try:
            os.close(read_end)
            os.setgroups(os.getgrouplist(entry.pw_name, entry.pw_gid))
            os.setgid(entry.pw_gid)
            os.setuid(entry.pw_uid)
            report = {"own": _check_own_files(config), "watches": [_check_watch(w).__dict__ for w in config.watches]}
            with os.fdopen(write_end, "w") as pipe:
                json.dump(report, pipe)
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0 or not data:
        raise UsageError(f"--user {user}: the access check as that user failed")
    report = json.loads(data)
    return report["own"], [_Findings(**item) for item in report["watches"]]
