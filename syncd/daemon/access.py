"""Can the service's user do its job? `syncd check-config FILE [--user NAME]` refuses the config (exit 2)
when that user cannot read it or write the state directory or the sync log (the daemon would exit at start),
and warns when it cannot list a watched tree, read a checkpoint in it, or write where the outputs go.

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
# where systemd makes a unit's StateDirectory= and LogsDirectory= (as root, for the unit's user) at its start,
# and their names in systemd/: syncd.service (User=syncd) has `syncd`, syncd@USER.service `syncd@USER`
UNIT_MADE = (Path("/var/lib"), Path("/var/log"))
SERVICE_USER = "syncd"


def unit_directories(user: str) -> list[Path]:
    """The directories a syncd unit running as `user` gets from systemd, made or given to it at every start."""
    names = [f"syncd@{user}", *(["syncd"] if user == SERVICE_USER else [])]
    return [base / name for base in UNIT_MADE for name in names]


@dataclass
class _Findings:
    unreadable: list[str] = field(default_factory=list)  # checkpoints the user cannot read
    unlistable: list[str] = field(default_factory=list)  # directories the user cannot enter and list
    unwritable: list[str] = field(default_factory=list)  # output directories the user cannot write


@dataclass
class AccessReport:
    """What `check-config` says about the user's access: `problems` keep the daemon from starting (exit 2),
    `warnings` cost it files or directories it will log as errors."""

    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def check_access(config: Config, user: str | None = None) -> AccessReport:
    """The problems and warnings of the user (default: the caller) with the daemon's own files and the
    watched trees; both empty when there are none."""
    name = user or pwd.getpwuid(os.geteuid()).pw_name
    if user is not None and uid_of(user) != os.geteuid():
        own, results = _as_user(user, config)
    else:
        own, results = _check_own_files(config), [_check_watch(watch) for watch in config.watches]
    report = AccessReport()
    report.problems += [f"{config.path}: user {name} {problem}" for problem in own["problems"]]
    report.warnings += [f"warning: {config.path}: user {name} {warning}" for warning in own["warnings"]]
    for watch, found in zip(config.watches, results, strict=True):
        if not os.path.lexists(watch.path):  # (not that the user cannot list it)
            report.warnings.append(
                f"warning: {config.path}: watch {watch.path} does not exist (yet): watched once it is made"
            )
            continue
        report.warnings += _describe(config.path, watch, name, found)
    return report


def _check_own_files(config: Config) -> dict[str, list[str]]:
    """What the daemon itself needs: to read its configuration, to write its state directory and its sync
    log (a `syncd@USER` config copied from the service's, state_dir left at /var/lib/syncd). One finding per
    setting: a sync log kept in the state directory is one."""
    own: dict[str, list[str]] = {"problems": [], "warnings": []}
    if not os.access(config.path, os.R_OK):
        own["problems"].append("cannot read the configuration itself, so the daemon cannot start")
    state = _directory_finding(config.state_dir, "state_dir")
    log_dir = config.log.path.parent
    log = None if state is not None and log_dir == config.state_dir else _directory_finding(log_dir, "log.path")
    if log is None and os.path.lexists(config.log.path) and not os.access(config.log.path, os.W_OK):
        log = True, f"cannot write the sync log {config.log.path} (log.path), so the daemon cannot start"
    for finding in (state, log):
        if finding is not None:
            own["problems" if finding[0] else "warnings"].append(finding[1])
    return own


def _directory_finding(directory: Path, setting: str) -> tuple[bool, str] | None:
    """(is it a problem, what is wrong) when the user cannot write `directory`, which `setting` names; None
    when it can. A problem keeps the daemon from starting. The unit's own StateDirectory= or LogsDirectory=
    (or a directory below it), missing or another user's, is a warning: systemd makes it, or gives it back to
    the unit's user, before the daemon starts (/var/lib/syncd does not exist at install, before the first
    start; a first run as root leaves it root's). Any other directory there is no unit's to give."""
    existing = _nearest_existing(directory)
    if os.access(existing, os.W_OK | os.X_OK):
        return None
    user = pwd.getpwuid(os.geteuid()).pw_name  # (this runs as the user checked, --user included)
    made_by_unit = any(directory.is_relative_to(own) for own in unit_directories(user))
    if existing == directory and made_by_unit:  # (a first run as root made it root's: the unit gives it back)
        return False, (
            f"cannot write {directory} ({setting}): the daemon starts only if systemd gives it to the user (the "
            "unit's StateDirectory= or LogsDirectory= does, at every start)"
        )
    if existing == directory:
        return True, f"cannot write {directory} ({setting}), so the daemon cannot start"
    if made_by_unit:
        return False, (
            f"cannot create {directory} ({setting}) in {existing}: the daemon starts only if systemd makes it "
            "(the unit's StateDirectory= or LogsDirectory=)"
        )
    return True, f"cannot create {directory} ({setting}) in {existing}, so the daemon cannot start"


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


def _as_user(user: str, config: Config) -> tuple[dict[str, list[str]], list[_Findings]]:
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
