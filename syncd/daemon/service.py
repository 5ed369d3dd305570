"""`syncd run`: the daemon. Event -> queue -> convert -> publish -> log.

Start-up removes stale scratch files, starts the watchers, scans every watch for sources without an
up-to-date output, then tells systemd READY=1. The main thread only handles signals, watchdog pings,
status lines and rescans (after a directory appears, after lost events, and every `rescan_interval` as a
safety net); workers do the conversions. SIGHUP reloads a valid configuration (an invalid one
is reported and the old one kept); SIGTERM stops taking work, gives running conversions a moment, removes
the scratch files of any it abandons, and exits 0.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from syncd.daemon import claims, notify
from syncd.daemon.claims import is_claim_name
from syncd.daemon.config import Config, Watch, load_config
from syncd.daemon.fstype import shared_filesystem
from syncd.daemon.journal import JournalingSyncLog, configure_logging
from syncd.daemon.names import is_candidate
from syncd.daemon.queue import WorkQueue
from syncd.daemon.state import StateDB, lock_state_dir
from syncd.daemon.status import SHOWN_WAITING, Activity
from syncd.daemon.statuses import Status
from syncd.daemon.sync import Syncer
from syncd.daemon.treelock import TreeLocks
from syncd.daemon.watcher import Watcher, walk_files
from syncd.engine.progress import ProgressCallback
from syncd.engine.publish import (
    SCRATCH_GRACE_SECONDS,
    abandon_open_scratches,
    is_scratch_name,
    remove_if_stale,
    remove_stale_scratch,
)
from syncd.errors import TRANSIENT_ERRNOS, ConfigError, SyncdError, one_line
from syncd.formats.fileio import FileStamp

log = logging.getLogger("syncd")

STOP_GRACE_SECONDS = 3.0  # systemd's TimeoutStopSec is larger; tests expect an exit within 5 s
TICK_SECONDS = 1.0
# until READY=1, every tick asks systemd for this much more time to start (notify.beat)
START_EXTENSION_SECONDS = 30.0
# an empty scratch file younger than this may be between its creation and its lock: a scan leaves it alone


def _say_nothing(path: Path, reason: str) -> None:
    """An `on_limit` for a walk whose limits another walk reports."""


class Daemon:
    def __init__(self, config: Config) -> None:
        self.config = config
        # status file, STATUS=, `converting` lines and the metrics file
        self.activity = Activity(config.state_dir, config.path, config.metrics)
        self.synclog = JournalingSyncLog(
            config.log.path, config.log.max_bytes, config.log.backups, observers=(self.activity.record,)
        )
        self.state = StateDB(config.state_dir)
        self.syncer = Syncer(self.state, self.synclog, config.settle_seconds, config.hash_name)
        self.syncer.set_settle_times(config.settle_seconds, config.unleased_settle_seconds)
        self.syncer.progress_for = self._progress_for
        self.syncer.alive_for = self._alive_for
        self.syncer.config_path = config.path
        self.queue = WorkQueue(self._work, config.workers)
        self.watcher: Watcher | None = None
        self._trees = TreeLocks()  # one daemon per tree (not shared with other nodes)
        self.shared: dict[Path, str] = {}  # watches other nodes write to -> their filesystem's name
        self._wake = Wakeup()
        self._stop = False
        self._until_ready = True  # starting, or reloading: READY=1 not yet sent
        self._reload = False
        self._retry = False
        self._stuck_reported: set[tuple[str, Path]] = set()
        self._rescan: set[Path] = set()
        self._limited: set[Path] = set()  # trees whose new directories met the inotify watch limit
        self._rescan_lock = threading.Lock()
        self._next_safety_rescan: float | None = None
        self._config_stamp = _file_stamp(config.path)  # the config file as loaded: `syncd retry` compares
        self._roots: dict[Path, tuple[int, int] | None] = {}  # each tree's directory as last seen (_check_roots)
        self._unwatched: set[Path] = set()  # trees not watched now: gone, or taken by another daemon meanwhile
        self._awaited: set[Path] = set()  # trees that did not exist yet when the configuration was taken
        # a shared tree's directory held open (it has no tree lock, which does it for the others): a tree removed
        # and made again then never gets the removed one's inode back, which _check_roots would take for the same
        self._pinned: dict[Path, int] = {}

    # -- wiring

    def _work(self, watch: Watch, path: Path, closed: bool) -> float | None:
        with self.activity.working(path):
            outcome = self.syncer.process(watch, path, closed)
        return outcome.retry_in

    def _progress_for(self, source: Path) -> ProgressCallback | None:
        """The status line's progress of a conversion, which also tells the queue its worker is not stuck: a
        checkpoint that takes longer than `stuck_worker_seconds` to convert is no hang (withholding the
        watchdog pings got the daemon restarted, its conversion begun again, without end)."""
        shown = self.activity.progress_for(source)
        worker = threading.current_thread().name  # asked on the worker's thread; told from the pass's threads

        def progress(done: int, total: int) -> None:
            self.queue.progressed(worker)
            if shown is not None:
                shown(done, total)

        return progress

    def _alive_for(self) -> Callable[[], None]:
        """What a conversion tells where it moves on without writing (its checks after the pass)."""
        worker = threading.current_thread().name
        return lambda: self.queue.progressed(worker)

    # the watcher's listener (syncd.daemon.watcher.WatchListener), called from observer threads

    def on_file(self, watch: Watch, path: Path, closed: bool) -> None:
        delay = 0.0 if closed else self.config.settle_seconds
        if not self.queue.put(watch, path, closed, delay):
            self._request_rescan(watch.path)

    def on_directory(self, watch: Watch, directory: Path) -> None:
        self._request_rescan(directory)

    def on_overflow(self, watch: Watch) -> None:
        self.synclog.log(
            Status.ERROR, watch=str(watch.path), reason="inotify event queue overflowed (events were lost); rescanning"
        )
        self._request_rescan(watch.path)

    def on_fallback(self, watch: Watch, reason: str) -> None:
        self.synclog.log(Status.ERROR, watch=str(watch.path), reason=reason)

    def on_watch_limit(self, watch: Watch) -> None:
        with self._rescan_lock:
            self._limited.add(watch.path)
        self._wake.set()

    def _walk_limit(self, directory: Path, reason: str) -> None:
        self.synclog.log(Status.SKIPPED, source=str(directory), reason=reason)

    def _request_rescan(self, path: Path) -> None:
        with self._rescan_lock:
            self._rescan.add(path)
        self._wake.set()

    # -- life cycle

    def start(self) -> None:
        self._beat()  # (before READY=1: more time to start, first of all)
        self._clean_stale_scratch()
        self._start_watcher()
        self.queue.start()
        queued = self._scan_all()
        self.synclog.log(
            Status.STARTED,
            reason=f"watching {len(self.config.watches)} tree(s){self._how_watched()}; {queued} file(s) to check",
            config=str(self.config.path),
            host=claims.this_node(),  # (which node this log is of, where several share a tree; pids repeat in
            pid=os.getpid(),  # containers)
        )
        self._ready()

    def _start_watcher(self) -> None:
        """Watch every tree of the current configuration (at start-up and after a reload)."""
        self.shared = shared_watches(self.config)
        # trees gone, or made anew and another daemon's, stay so through a reload: _check_roots takes them
        # when they can be (holding them here would fail the reload, and the fallback to the running
        # configuration as well, which ended the daemon)
        missing = {watch.path for watch in self.config.watches if _identity(watch.path) is None}
        for path in sorted(missing - self._unwatched):
            self.synclog.log(
                Status.WARNING, watch=str(path), reason="the watched tree does not exist; it is watched once it is made"
            )
        # (a tree gone while watched and then reloaded is still "back" when it comes)
        self._awaited = (self._awaited | (missing - self._unwatched)) & {watch.path for watch in self.config.watches}
        left_out = ({watch.path for watch in self.config.watches} & self._unwatched) | missing
        self._trees.hold(
            watch.path for watch in self.config.watches if watch.path not in self.shared and watch.path not in left_out
        )
        self.syncer.shared = frozenset(self.shared)
        self.syncer.claim_retry_max = self.config.cluster.poll_interval
        self.watcher = Watcher(self.config, self, self.shared)
        self.watcher.start(skip=left_out)
        self._unpin()
        for path in self.shared:
            self._pin(path)
        self._roots = {
            watch.path: self._roots.get(watch.path) if watch.path in left_out else _identity(watch.path)
            for watch in self.config.watches
        }
        self._unwatched = left_out
        interval = self.config.rescan_interval
        self._next_safety_rescan = None if interval is None else time.monotonic() + interval

    def _how_watched(self) -> str:
        """For the `started` and `reloaded` lines: which watches are shared with other nodes, and how."""
        if not self.shared:
            return ""
        names = sorted(set(self.shared.values()))
        return (
            f"; {len(self.shared)} on a shared filesystem ({', '.join(names)}): inotify for this node's writes, "
            f"polled every {self.config.cluster.poll_interval:g} s for other nodes', outputs claimed before "
            "converting"
        )

    def _clean_stale_scratch(self) -> None:
        directories: set[Path] = set()
        for watch in self.config.watches:
            for root in filter(os.path.isdir, filter(None, (watch.path, watch.mirror))):
                # a directory of the tree it cannot list is said once, by the scan that follows
                quiet = _say_nothing if root == watch.path else None
                walk = self._beating(walk_files(root, watch.recursive, on_limit=quiet))
                directories.update(p.parent for p in walk if is_scratch_name(p.name))
        for directory in directories:
            for removed in remove_stale_scratch(directory):
                self.synclog.log(
                    Status.REMOVED, source=str(removed), reason="a stale scratch file of a syncd that died"
                )

    def _scan_all(self) -> int:
        """Queue every file of every tree watched now (not one gone, or another daemon's meanwhile)."""
        return sum(self._scan(watch, watch.path) for watch in self.config.watches if watch.path not in self._unwatched)

    def _scan(self, watch: Watch, root: Path) -> int:
        """Queue every file below `root` (the queue drops what is up to date quickly). A scan of a large tree
        takes the main thread for many seconds: it goes on with the loop's own duties meanwhile (the watchdog
        pings, the status) and stops for SIGTERM (a tree of 100,000 files blocked both for 13-40 s, past the
        unit's WatchdogSec)."""
        queued = 0
        if root != watch.path and not os.path.isdir(root):
            return queued  # a directory made and removed again before its scan (a trainer's rotation): nothing
        for path in self._beating(walk_files(root, watch.recursive, on_limit=self._walk_limit)):
            if not is_candidate(watch, path):
                self._remove_if_left_over(path)
                continue
            if not self.queue.put(watch, path, closed=False, delay=0.0):
                self.synclog.log(
                    Status.ERROR,
                    watch=str(watch.path),
                    reason=f"work queue full at {self.queue.capacity} files; the rest waits for a rescan",
                )
                self._request_rescan(root)
                break
            queued += 1
        return queued

    def _remove_if_left_over(self, path: Path) -> None:
        """A scratch file no living process holds, or a claim file whose output is gone: what a syncd that
        died (on this node or another) left behind, removed at the next scan rather than at its next start."""
        if is_scratch_name(path.name):
            if remove_if_stale(path, min_age=SCRATCH_GRACE_SECONDS):
                self.synclog.log(Status.REMOVED, source=str(path), reason="a stale scratch file of a syncd that died")
        elif is_claim_name(path.name):
            claims.remove_if_orphaned(path)

    def _clean_mirrors(self) -> None:
        """The outputs of a mirrored watch are not below it: the safety rescan looks there for leftovers."""
        for watch in self.config.watches:
            if watch.mirror is not None:
                for path in walk_files(watch.mirror, watch.recursive):
                    self._remove_if_left_over(path)

    def serve(self) -> None:
        interval = notify.watchdog_interval()
        tick = min(TICK_SECONDS, interval) if interval else TICK_SECONDS
        while not self._stop:
            self._wake.wait(tick)
            self._wake.clear()
            if self._reload:
                self._reload = False
                self.reload()
            if self._retry:
                self._retry = False
                self._look_again()
            self._check_roots()
            self._watch_limited()
            self._run_rescans()
            self._beat()

    def _beat(self) -> None:
        """What the main loop does every tick besides its work: the watchdog ping while the workers are well,
        and the status; before READY=1 (a start-up or reload scanning a large tree), more time to get there."""
        starting = START_EXTENSION_SECONDS if self._until_ready else None
        notify.beat(self._status(), alive=self._workers_healthy(), starting=starting)

    def _ready(self) -> None:
        self._until_ready = False
        notify.ready(self._status())

    def _beating(self, paths: Iterable[Path]) -> Iterator[Path]:
        """`paths` (a walk of a tree: many seconds on a large one), with the loop's own duties done at its start
        and every tick meanwhile (_beat); ends early for SIGTERM (the rest is for the next start's scan)."""
        beat = time.monotonic()
        for path in paths:
            if time.monotonic() >= beat:
                if self._stop:
                    return
                self._beat()
                beat = time.monotonic() + TICK_SECONDS
            yield path

    def _workers_healthy(self) -> bool:
        """False while a worker has been on one file for `stuck_worker_seconds` without progress: the watchdog
        pings stop, so systemd (WatchdogSec) restarts a daemon whose workers hang. Said once per stuck file."""
        stuck = self.queue.stuck(self.config.stuck_worker_seconds)
        for worker, seconds, path in stuck:
            if (worker, path) not in self._stuck_reported:
                self._stuck_reported.add((worker, path))
                self.synclog.log(
                    Status.ERROR,
                    source=str(path),
                    reason=f"{worker} on this file for {seconds:.0f} s without progress (stuck_worker_seconds: "
                    f"{self.config.stuck_worker_seconds:g}); watchdog pings withheld",
                )
        if not stuck:
            self._stuck_reported.clear()
        return not stuck

    def _check_roots(self) -> None:
        """A tree removed and made again (`rm -rf runs && mkdir runs`, a job cleaning its output) is a new
        directory, which the watch of the removed one never sees: its checkpoints waited for the safety rescan,
        every one of them. Each tree's directory is looked at every tick; a new one is locked, watched and
        scanned, the other trees' watches untouched."""
        for watch in self.config.watches:
            now = _identity(watch.path)
            was = self._roots.get(watch.path)
            if now == was and watch.path not in self._unwatched:
                continue
            if now is None:
                if was is not None:
                    self._roots[watch.path] = None
                    self._unwatch(watch, "the watched tree is gone; it is watched again as soon as it is back")
                continue
            self._rewatch(watch, now, announce=now != was)

    def _watch_limited(self) -> None:
        """Trees where a directory made since they were watched met the kernel's inotify watch limit: watched
        anew, which falls back to polling with its `error` line, and scanned for what was saved meanwhile."""
        with self._rescan_lock:
            limited, self._limited = self._limited, set()
        for watch in self.config.watches:
            if watch.path in limited and watch.path not in self._unwatched and self.watcher is not None:
                self.watcher.rewatch(watch)
                self._request_rescan(watch.path)

    def _unwatch(self, watch: Watch, reason: str, status: Status = Status.WARNING) -> None:
        if self.watcher is not None:
            self.watcher.unwatch(watch)
        self._unwatched.add(watch.path)
        self.synclog.log(status, watch=str(watch.path), reason=reason)

    def _rewatch(self, watch: Watch, now: tuple[int, int], announce: bool) -> None:
        """Watch a tree's new directory; while another daemon holds it (taken meanwhile), try again every tick,
        said once."""
        self._roots[watch.path] = now
        if self.config.cluster.shared == "auto" and watch.path not in self.shared:
            # a tree that was not there could not be told local or not: now it can (a late network mount)
            name = shared_filesystem(watch.path, watch.mirror)
            if name is not None:
                self.shared[watch.path] = name  # (the watcher reads this mapping too)
                self.syncer.shared = frozenset(self.shared)
        try:
            if watch.path in self.shared:
                self._pin(watch.path)
            else:
                self._trees.refresh(watch.path)
            if self.watcher is not None:
                self.watcher.rewatch(watch)
        except (SyncdError, OSError) as exc:
            if announce or watch.path not in self._unwatched:
                reason = f"the watched tree was made anew but cannot be watched: {one_line(exc)}"
                self._unwatch(watch, reason, Status.ERROR)
            return
        self._unwatched.discard(watch.path)
        made = watch.path in self._awaited
        self._awaited.discard(watch.path)
        reason = "was made" if made else "is back (made anew)"
        self.synclog.log(Status.WARNING, watch=str(watch.path), reason=f"the watched tree {reason}; watching it")
        self._request_rescan(watch.path)

    def _pin(self, path: Path) -> None:
        with contextlib.suppress(KeyError):
            os.close(self._pinned.pop(path))
        with contextlib.suppress(OSError):
            self._pinned[path] = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def _unpin(self) -> None:
        for fd in self._pinned.values():
            os.close(fd)
        self._pinned.clear()

    def _run_rescans(self) -> None:
        if self._next_safety_rescan is not None and time.monotonic() >= self._next_safety_rescan:
            # events can be lost without an overflow (a watch added a moment late, a filesystem that does not
            # report everything); a scan queues every candidate and the up-to-date ones are dropped quickly
            log.debug("safety rescan of every watch")
            self._next_safety_rescan = time.monotonic() + (self.config.rescan_interval or 0.0)
            for watch in self.config.watches:
                self._request_rescan(watch.path)
            self._clean_mirrors()
        if self.queue.overflowed and self.queue.pending() < self.queue.capacity // 2:
            self.queue.overflowed = False
            for watch in self.config.watches:
                self._request_rescan(watch.path)
        with self._rescan_lock:
            roots, self._rescan = self._rescan, set()
        for root in roots:
            for watch in self.config.watches:
                if watch.path in self._unwatched:
                    continue  # gone, or another daemon's now
                if root == watch.path or (watch.recursive and root.is_relative_to(watch.path)):
                    self._scan(watch, root)

    def _status(self, state: str = "running") -> str:
        queued, waiting = self.queue.queued(), self.queue.waiting(SHOWN_WAITING)
        line = self.activity.tick(queued, state=state, waiting=waiting)
        return f"watching {len(self.config.watches)} tree(s); {line}"

    def reload(self) -> None:
        """Apply a changed configuration. Nothing in it can end the daemon: any failure is one line and the
        running configuration stays. Settings only a restart applies are named in the `reloaded` line."""
        notify.reloading()
        self._until_ready = True
        self._config_stamp = _file_stamp(self.config.path)
        try:
            new = load_config(self.config.path)
        except Exception as exc:
            # the file and line at fault go where a record names its file (journal, `syncd log`, `syncd
            # status` show it first), the rest after the reason: the path was said twice
            where, what = (exc.path, exc.message) if isinstance(exc, SyncdError) and exc.path else (None, one_line(exc))
            self.synclog.log(
                Status.ERROR,
                config=where or str(self.config.path),
                reason=f"reload refused, keeping the running configuration: {what}",
            )
            self._ready()
            return
        pending = self.config.restart_settings_changed(new)
        new = new.keeping_restart_settings(self.config)
        running = self.config
        try:
            self._apply(new)
        except Exception as exc:
            if not isinstance(exc, SyncdError):  # a bug of ours: its traceback for the journal
                log.exception("reload failed")
            # watched again before the line is said, and scanned: a checkpoint finished while no watcher ran
            # (the running one is stopped before the new one fails) sent its event to none
            self._apply(running)
            self._scan_all()
            self.synclog.log(
                Status.ERROR,
                config=str(running.path),
                reason=f"reload failed, keeping the running configuration: {one_line(exc)}",
            )
            self._ready()
            return
        # refusals a setting decides (ambiguous layout, missing module map, on_exists) are looked at again
        self._retry_config_failures()
        queued = self._scan_all()
        reason = f"watching {len(new.watches)} tree(s){self._how_watched()}; {queued} file(s) to check"
        if pending:
            reason += f"; {', '.join(pending)} changed but take effect only after a restart"
        self.synclog.log(Status.RELOADED, reason=reason, config=str(new.path))
        self._ready()

    def _apply(self, new: Config) -> None:
        if self.watcher is not None:
            self.watcher.stop()
        self.config = new
        self.syncer.set_settle_times(new.settle_seconds, new.unleased_settle_seconds)
        self.syncer.hash_name = new.hash_name
        self.activity.metrics_path = new.metrics
        self._start_watcher()

    def _retry_config_failures(self) -> None:
        try:
            self.state.retry_failures(kind="config", recheck=True)
        except SyncdError as exc:
            self.synclog.log(Status.ERROR, reason=f"cannot mark refusals for another look: {one_line(exc)}")

    def _look_again(self) -> None:
        """What `syncd retry` asks for: the failures it marked are looked at again by a scan. A configuration
        file edited since it was loaded is applied first (as SIGHUP would): the fix a refusal needed is often
        a module map added to it, and looking again with the old one would only refuse again."""
        if _file_stamp(self.config.path) != self._config_stamp:
            self.reload()  # scans every watch itself
        else:
            self._scan_all()

    def request_retry(self, *_: object) -> None:
        """SIGUSR1 (sent by `syncd retry`): scan every watch; failures marked in the state are looked at again."""
        self._retry = True
        self._wake.set()

    def stop(self) -> None:
        notify.stopping()
        if self.watcher is not None:
            self.watcher.stop()
        finished = self.queue.stop(STOP_GRACE_SECONDS)
        abandoned = [] if finished else abandon_open_scratches()
        reason = "finished in-flight work" if finished else f"abandoned {len(abandoned)} conversion(s) in flight"
        self.synclog.log(Status.STOPPED, reason=reason)
        self._status(state="stopped")
        self.synclog.close()
        if finished:
            self.state.close()

    def request_stop(self, *_: object) -> None:
        self._stop = True
        self._wake.set()

    def request_reload(self, *_: object) -> None:
        self._reload = True
        self._wake.set()


class Wakeup:
    """Wakes the main loop, from worker threads and from signal handlers alike: a byte in a pipe.
    threading.Event would not do: a handler runs in the main thread between two of its bytecodes, and an
    Event's set() from inside the main thread's own clear() or wait() waits for the lock it already holds
    (a burst of SIGHUPs hung the daemon for good)."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def set(self) -> None:
        with contextlib.suppress(BlockingIOError):  # a full pipe: the loop is woken already
            os.write(self._write, b"\0")

    def wait(self, timeout: float) -> None:
        select.select([self._read], [], [], timeout)

    def clear(self) -> None:
        with contextlib.suppress(BlockingIOError):  # drained
            while os.read(self._read, 4096):
                pass


def _unusable_setting(config: Config, exc: OSError) -> SyncdError:
    """A directory the configuration names that the daemon cannot use, said with the setting that names it
    (`syncd@alice` left with service.yaml's state_dir: /var/lib/syncd said only `.../lock: Permission denied`).

    A permission, or a file where a directory should be, stays until someone changes the setting or the
    directory: a ConfigError (exit 2), which systemd's RestartPreventExitStatus=2 does not restart every 5
    seconds forever. A full, read-only or failing disk may heal by itself: exit 1, restarted."""
    where = Path(os.fsdecode(exc.filename)) if exc.filename else config.state_dir
    log_dir = config.log.path.parent  # (made with its parents: the directory failing may be one above it)
    in_log = where.is_relative_to(log_dir) or log_dir.is_relative_to(where)
    in_log = where == config.log.path or in_log and not where.is_relative_to(config.state_dir)
    key, value = ("log.path", config.log.path) if in_log else ("state_dir", config.state_dir)
    message = (
        f"{key}: cannot use {value}: {exc.strerror or exc} (the user syncd runs as must be able to create and write it)"
    )
    if exc.errno in TRANSIENT_ERRNOS:
        return SyncdError(message, str(config.path), kind="environment", transient=True)
    return ConfigError(message, str(config.path))


def _identity(path: Path) -> tuple[int, int] | None:
    """The directory at `path` (device, inode), or None where there is none."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (info.st_dev, info.st_ino) if stat.S_ISDIR(info.st_mode) else None


def _file_stamp(path: Path) -> FileStamp | None:
    """What changes when a file is edited or replaced (None if it cannot be stat'ed)."""
    try:
        return FileStamp.of_path(path)
    except OSError:
        return None


def shared_watches(config: Config) -> dict[Path, str]:
    """The watches other nodes write to as well (their path -> the filesystem's name): by `cluster.shared`,
    or on `auto` those whose tree or mirror is on a network filesystem."""
    shared: dict[Path, str] = {}
    for watch in config.watches:
        if config.cluster.shared is True:
            shared[watch.path] = shared_filesystem(watch.path, watch.mirror) or "shared: true"
        elif config.cluster.shared == "auto":
            name = shared_filesystem(watch.path, watch.mirror)
            if name is not None:
                shared[watch.path] = name
    return shared


def run_daemon(config_path: Path) -> int:
    config = load_config(config_path)
    configure_logging(config.log.level)
    try:
        lock_state_dir(config.state_dir)  # its descriptor stays open until the process ends; a second daemon stops here
        daemon = Daemon(config)
        daemon.synclog.open_now()  # (a sync log it cannot write: exit 2 here, as check-config says, not run blind)
    except OSError as exc:
        raise _unusable_setting(config, exc) from None
    signal.signal(signal.SIGTERM, daemon.request_stop)
    signal.signal(signal.SIGINT, daemon.request_stop)
    signal.signal(signal.SIGHUP, daemon.request_reload)
    signal.signal(signal.SIGUSR1, daemon.request_retry)
    daemon.start()
    try:
        daemon.serve()
    finally:
        daemon.stop()
    if daemon.queue.idle() is False:
        # worker threads still run abandoned conversions whose scratch files are gone; do not wait for them
        os._exit(0)
    return 0
