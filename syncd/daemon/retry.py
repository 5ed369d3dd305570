"""Another look at files that failed: their failures are marked in the state database, and the running daemon
(if any) is asked with SIGUSR1 to scan; without a daemon, its next start looks at them. After a lost state,
outputs naming their sources can be adopted as the daemon's own (`request_adoption`).

Both need the daemon's own rights: writing its state database and signalling its process. Anyone else (a
member of the service's group, who may read the status and the log) is told what to run instead.
"""

from __future__ import annotations

import os
import pwd
import signal
import stat
from dataclasses import dataclass, field
from pathlib import Path

from syncd.daemon import ownership
from syncd.daemon.config import Watch, load_config
from syncd.daemon.names import is_candidate
from syncd.daemon.state import DB_NAME, StateDB, lock_holder
from syncd.errors import SyncdError, one_line
from syncd.formats import sniff_format
from syncd.formats.fileio import FileStamp
from syncd.formats.registry import BY_NAME
from syncd.formats.shards import is_set_index, read_index, shards_named_after


@dataclass(frozen=True)
class RetryRequest:
    marked: list[str]  # the sources whose failures were marked
    daemon_pid: int | None  # the daemon asked to scan; None when none runs
    unknown: list[str] = field(default_factory=list)  # paths the state database has never seen
    not_failed: list[str] = field(default_factory=list)  # paths it knows that have not failed


def request_retry(config_path: Path, paths: list[Path] | None) -> RetryRequest:
    """Mark the failures of `paths` (None: every failed file) for another look and wake the daemon."""
    config = load_config(config_path, check_filesystem=False)
    _check_may_write(config.state_dir, config_path)
    sources = [os.path.abspath(p) for p in paths] if paths else None
    with StateDB(config.state_dir) as state:
        known = {source: state.get(source) for source in sources or ()}
        marked = state.retry_failures(sources)
    unknown = [source for source, row in known.items() if row is None]
    not_failed = [source for source, row in known.items() if row is not None and source not in marked]
    holder = lock_holder(config.state_dir)
    if holder is not None and (marked or sources is None):
        try:
            os.kill(holder, signal.SIGUSR1)
        except PermissionError:
            raise SyncdError(_needs_owner(config.state_dir, config_path, "signal the daemon")) from None
    return RetryRequest(marked, holder, unknown, not_failed)


def _check_may_write(state_dir: Path, config_path: Path) -> None:
    """SQLite needs to write the database and create its journal beside it."""
    database = state_dir / DB_NAME
    if not os.path.isdir(state_dir):
        raise SyncdError("no state database yet: the daemon has not run with this configuration", str(state_dir))
    writable = os.access(state_dir, os.W_OK | os.X_OK) and (not database.exists() or os.access(database, os.W_OK))
    if not writable:
        raise SyncdError(_needs_owner(state_dir, config_path, f"write the daemon's state database {database}"))


def _needs_owner(state_dir: Path, config_path: Path, what: str) -> str:
    """`retry needs to WHAT, which only OWNER (or root) may: run sudo -u OWNER syncd retry -c CONFIG ...`"""
    try:
        info = os.stat(state_dir)
        owner = pwd.getpwuid(info.st_uid).pw_name
        mode = f" (owner {owner}, mode {stat.S_IMODE(info.st_mode):04o})"
    except (OSError, KeyError):
        owner, mode = "the daemon's user", ""
    return (
        f"retry needs to {what}, which only {owner} (the daemon's user) or root may{mode}; "
        f"run: sudo -u {owner} syncd retry -c {config_path} ..."
    )


@dataclass(frozen=True)
class Adoption:
    adopted: list[tuple[str, str]]  # (source, its output) now recorded as the daemon's own
    refused: list[tuple[str, str]]  # (source, why its output is not taken)
    daemon_pid: int | None  # the daemon asked to scan; None when none runs


def request_adoption(config_path: Path, paths: list[Path] | None) -> Adoption:
    """After a lost state directory, the daemon cannot tell its own outputs of older versions of their
    sources from files someone edited keeping their metadata, and skips them as someone else's at every save
    (docs/daemon.md). The operator vouches for them: each source of `paths` (None: every one skipped so)
    whose output names it in `syncd.source` (a set, which names no source: the files its index lists and the
    shards named after it) gets
    that output recorded as the daemon's, as it is now, and is looked at again: its conversion replaces the
    output, unless it changes meanwhile."""
    config = load_config(config_path, check_filesystem=False)
    _check_may_write(config.state_dir, config_path)
    adopted, refused = [], []
    with StateDB(config.state_dir) as state:
        sources = [os.path.abspath(p) for p in paths] if paths else state.failed_with(ownership.DESTINATION_EXISTS)
        for source in sources:
            found = _adoptable_output(state, config.watches, Path(source))
            if isinstance(found, str):
                refused.append((source, found))
                continue
            dest, members = found
            if state.adopt_output(source, dest, members[dest], members if is_set_index(dest) else None):
                adopted.append((source, str(dest)))
            else:
                refused.append((source, "no longer skipped (the daemon looked at it meanwhile)"))
    holder = lock_holder(config.state_dir)
    if holder is not None and adopted:
        try:
            os.kill(holder, signal.SIGUSR1)
        except PermissionError:
            raise SyncdError(_needs_owner(config.state_dir, config_path, "signal the daemon")) from None
    return Adoption(adopted, refused, holder)


def _adoptable_output(
    state: StateDB, watches: tuple[Watch, ...], source: Path
) -> tuple[Path, dict[Path, FileStamp]] | str:
    """The output of `source` to adopt with each of its files as it is now (a set: its index, the shards it
    lists and those named after it), or why there is none."""
    row = state.get(source)
    if row is None:
        return "not known to the daemon (never seen: a typo, or not under a watch)"
    if row.status != "failed" or row.error != ownership.DESTINATION_EXISTS:
        return "its output was not skipped as someone else's file: nothing to adopt"
    covering = [watch for watch in watches if source.is_relative_to(watch.path) and is_candidate(watch, source)]
    if not covering:
        return "no watch of the configuration converts it"
    watch = max(covering, key=lambda w: len(w.path.parts))  # a nested watch's own settings win
    root = watch.mirror or watch.path
    try:
        dest = ownership.destination_for(watch, source, BY_NAME[sniff_format(source, watch.path)])
        # a set names no source: its files are those its index lists, and the shards of an earlier layout a
        # daemon killed before removing them left beside it (named after the set: what the daemon writes there)
        files = [dest]
        if is_set_index(dest):
            files += [dest.parent / name for name in read_index(dest, root).files] + shards_named_after(dest)
        members = {file: FileStamp.of(os.lstat(file)) for file in files if os.path.lexists(file)}
    except SyncdError as exc:
        return one_line(exc)
    except OSError as exc:  # a file of it gone or unreadable meanwhile
        return f"cannot look at its output: {exc.strerror or exc} ({exc.filename})"
    if not is_set_index(dest) and not ownership.names_source(dest, source, root):
        return f"its output {dest} does not name it in syncd.source: someone else's file, left alone"
    if dest not in members:
        return f"its output {dest} is not there: nothing to adopt"
    return dest, members
