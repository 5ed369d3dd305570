"""Is a file ready to convert? Settled (quiet long enough), complete (nobody still writing it), whole (as
long as its header says).

A writer gives no signal that it is done other than closing the file, and a close is not always seen (a
poll, a rescan, a writer that keeps the file open). So readiness is decided from what can be observed: the
close or rename event, the time since the last change, and a read lease that the kernel refuses while any
process has the file open for writing (`open_for_writing`). Every answer is either "go on" or a number of
seconds after which the file is looked at again; nothing here logs a sync log line except a modification time
in the future, said once.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from syncd.errors import FormatError, IncompleteFileError, SyncdError, one_line
from syncd.formats.fileio import FileStamp

# A file that does not read, was not seen closed and changed less than this long ago may still be being
# written (when open_for_writing cannot tell): it is looked at again rather than refused.
INCOMPLETE_GRACE_SECONDS = 60.0
BUSY_RETRY_SECONDS = 1.0  # how soon a file still being written is looked at again (its close comes sooner)
# Without a lease (no CAP_LEASE and not the file's owner, or a file system without leases) a file whose close
# was not seen must be this long without any change before it is taken as complete, unless the configuration
# says otherwise (`unleased_settle_seconds`; docs/daemon.md#when-a-checkpoint-is-complete).
UNLEASED_SETTLE_SECONDS = 10.0
FUTURE_SLACK_SECONDS = 2.0  # clock skew tolerated before a modification time counts as "in the future"
CLOSED_SETTLE_SECONDS = 0.05  # the short check that suffices once a close or rename was seen
# A file shorter than its header says (a writer that closes after every chunk) is looked at again, quietly,
# with backoff from INCOMPLETE_FIRST_RETRY up to INCOMPLETE_MAX_RETRY seconds, while it changed less than
# INCOMPLETE_GRACE_SECONDS ago; one unchanged for longer is refused once, saying so.
INCOMPLETE_FIRST_RETRY = 0.25
INCOMPLETE_MAX_RETRY = 8.0
_MEMORY_LIMIT = 10_000  # entries in each per-path memory before it is forgotten wholesale


@dataclass(frozen=True)
class NotYet:
    """Not ready: look again after `retry_in` seconds (None: only when an event brings the file back)."""

    retry_in: float | None
    why: str  # for the journal (not the sync log: nothing failed)
    level: int = logging.DEBUG


# called with (watched tree, path, reason) for what a person should read (a modification time in the future)
Warn = Callable[[Path, Path, str], None]


class Readiness:
    """The readiness decisions, with the little they remember between looks at one path. Thread-safe enough
    for the workers: each path is handled by one worker at a time, and the memories are only hints."""

    def __init__(
        self, settle_seconds: float, warn: Warn, unleased_settle_seconds: float = UNLEASED_SETTLE_SECONDS
    ) -> None:
        self.settle_seconds = settle_seconds
        self.unleased_settle_seconds = unleased_settle_seconds
        self._warn = warn
        self._future: dict[tuple[Path, int], float] = {}  # (path, mtime_ns) in the future -> first seen
        self._incomplete: dict[Path, int] = {}  # path seen shorter than its header says -> looks so far

    @property
    def busy_retry(self) -> float:
        """How soon a file that was busy (being written, changed while read) is looked at again."""
        return max(self.settle_seconds, BUSY_RETRY_SECONDS)

    def settle_wait(self, watch_root: Path | None, path: Path, info: os.stat_result, closed: bool) -> float:
        """Seconds until the file has been quiet long enough. A close or rename says the writer is done,
        so a short check suffices; a bare create/modify must stay unchanged for the full settle time."""
        window = min(self.settle_seconds, CLOSED_SETTLE_SECONDS) if closed else self.settle_seconds
        return max(0.0, window - self.age(watch_root, path, info))

    def writer_wait(self, path: Path, info: os.stat_result, closed: bool) -> tuple[float, bool]:
        """(seconds until the file is looked at again, 0 to go on; whether the writer is known to be done).

        A file someone has open for writing waits for its close (which brings it back at once); without a
        lease and without a seen close, the longer unleased settle time applies."""
        writing = open_for_writing(path)
        if writing:
            return BUSY_RETRY_SECONDS, False  # a writer pausing longer than the settle time
        if writing is None and not closed:
            return self.unleased_wait(path, info), False
        return 0.0, True

    def set_wait(self, watch_root: Path, index: Path, stats: list[os.stat_result | None], closed: bool) -> float:
        """Seconds until a sharded set is complete: `stats` are the index's then each listed shard's (None for
        a shard missing). A missing shard is waited for while the index is recent; after that the conversion
        reports it. `closed` is about the index."""
        info = stats[0]
        assert info is not None
        present = [st for st in stats if st is not None]
        if len(present) < len(stats) and recently_changed(FileStamp.of(info)):
            return self.busy_retry
        return max(self.settle_wait(watch_root, index, st, closed and st is info) for st in present)

    def unleased_wait(self, path: Path, info: os.stat_result) -> float:
        """Without a lease nothing tells whether a writer still has the file open: a writer that sets the
        full size first and fills it in later, pausing, looks complete (and reads, half zeros). Such a file is
        taken only after `unleased_settle_seconds` (or `settle_seconds`, if longer) without any change (mtime or
        ctime), unless its close was seen."""
        changed = max(info.st_mtime_ns, info.st_ctime_ns) / 1e9
        age = time.time() - changed
        if age < -FUTURE_SLACK_SECONDS:
            age = self.age(None, path, info)
        return max(0.0, max(self.unleased_settle_seconds, self.settle_seconds) - age)

    def age(self, watch_root: Path | None, path: Path, info: os.stat_result) -> float:
        """How long the file has been quiet. A modification time in the future (a copy from a host whose clock
        runs ahead) is taken as the moment we first saw it, and said once (when `watch_root` is given)."""
        age = time.time() - info.st_mtime
        if age >= -FUTURE_SLACK_SECONDS:
            return age
        key = (path, info.st_mtime_ns)
        if key not in self._future:
            if len(self._future) > _MEMORY_LIMIT:
                self._future.clear()
            self._future[key] = time.monotonic()
            if watch_root is not None:
                self._warn(watch_root, path, f"modification time {-age:.0f} s in the future; treated as now")
        return time.monotonic() - self._future[key]

    def not_ready_after(
        self,
        path: Path,
        version: FileStamp,
        exc: BaseException,
        finished: bool,
        changed: Callable[[], bool] | None = None,
    ) -> NotYet | None:
        """A conversion failed: was the file simply not ready (changed while read, shorter than its header says
        while still growing, unreadable while a writer not known to be done may still be at it)? None: it
        was ready, the failure is to be reported. `changed`: whether the source is no longer `version` (a
        set's version is all its files'; by default, `path`'s own stamp)."""
        if not os.path.lexists(path):
            # removed while it was converted (a trainer rotating its checkpoints away, directory and all): the
            # failure that came of it (the output's directory gone too) is nobody's to fix, nothing to retry
            return NotYet(None, f"{path} was removed while it was converted: {one_line(exc)}", logging.INFO)
        if isinstance(exc, SyncdError) and exc.kind == "busy":
            # changed, replaced or removed while we read it: never published; looked at again once quiet
            return NotYet(self.busy_retry if os.path.lexists(path) else None, one_line(exc), logging.INFO)
        if isinstance(exc, IncompleteFileError):
            wait = self.incomplete_wait(path)
            if wait is not None:
                return NotYet(wait, f"{path} is not complete yet, looking again in {wait:.2f} s: {exc}")
        content_error = isinstance(exc, FormatError) and exc.kind == "input"
        if content_error and (changed() if changed is not None else changed_since(path, version)):
            # read while it was being saved again (a close seen is the previous save's): the error says
            # nothing about the version there now, which is looked at once it is quiet
            why = f"{path} changed while it was being read, looking again once it is quiet: {one_line(exc)}"
            return NotYet(self.busy_retry if os.path.lexists(path) else None, why, logging.INFO)
        if content_error and not finished and recently_changed(version):
            return NotYet(self.busy_retry, f"{path} does not read yet, looking again later: {exc}")
        return None

    def incomplete_wait(self, path: Path) -> float | None:
        """Seconds until a file shorter than its header says is looked at again, or None once it has been
        unchanged for INCOMPLETE_GRACE_SECONDS (nobody is still appending: it is refused). A writer that
        closes after every chunk is not done at its first close; each new chunk's close brings it back
        sooner than the backoff."""
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            self._incomplete.pop(path, None)
            return None
        quiet = self.age(None, path, info)
        if quiet >= INCOMPLETE_GRACE_SECONDS:
            self._incomplete.pop(path, None)
            return None
        if len(self._incomplete) > _MEMORY_LIMIT:
            self._incomplete.clear()
        looks = self._incomplete.get(path, 0)
        self._incomplete[path] = looks + 1
        backoff = min(INCOMPLETE_MAX_RETRY, INCOMPLETE_FIRST_RETRY * 2.0**looks)
        return min(backoff, INCOMPLETE_GRACE_SECONDS - quiet + 0.1)

    def converted(self, path: Path) -> None:
        """Forget what was remembered about `path` (it converted)."""
        self._incomplete.pop(path, None)


def open_for_writing(path: Path) -> bool | None:
    """True if some process has `path` open for writing, False if none has, None if we cannot tell.

    The kernel refuses a read lease (EAGAIN) while any descriptor has the file open for writing. Taking one
    needs the file's owner or CAP_LEASE and a local file system; without them the settle time has to do.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        # A writer opening the file while we hold the lease waits until we drop it (at once) and the kernel
        # signals us: SIGURG, which is ignored by default, instead of SIGIO, which would end the process.
        fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGURG)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
    except OSError as exc:
        return True if exc.errno == errno.EAGAIN else None
    else:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return False
    finally:
        os.close(fd)


def anyone_writing(paths: list[Path]) -> bool:
    """True if some process has any of `paths` (those that exist) open for writing."""
    return any(open_for_writing(p) for p in paths if os.path.lexists(p))


def changed_since(path: Path, version: FileStamp) -> bool:
    """`path` is no longer the file as stamped in `version` (written, replaced or removed since)."""
    try:
        return version.changed(FileStamp.of_path(path, follow_symlinks=False))
    except OSError:
        return True


def recently_changed(version: FileStamp) -> bool:
    return time.time() - version.mtime_ns / 1e9 < INCOMPLETE_GRACE_SECONDS


def set_version(stats: list[os.stat_result]) -> FileStamp:
    """One version for a whole set: the index's identity, the total size, the latest change of any file."""
    index = stats[0]
    size, mtime_ns = sum(st.st_size for st in stats), max(st.st_mtime_ns for st in stats)
    return FileStamp(index.st_dev, index.st_ino, size, mtime_ns, max(st.st_ctime_ns for st in stats))
