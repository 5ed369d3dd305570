"""Filesystem events in, candidate paths out: watchdog's inotify observer, or polling where configured or
where inotify cannot serve (watch limit reached, unsupported filesystem).

The watcher knows nothing about conversion; it reports paths with how sure we are that the writer is done:
`closed` (close-after-write or a rename into place) or `changed` (created/modified: wait for it to settle).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

from watchdog.events import (
    DirCreatedEvent,
    DirMovedEvent,
    FileClosedEvent,
    FileCreatedEvent,
    FileModifiedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer
from watchdog.observers.polling import PollingObserver

from syncd.daemon.config import Config, Watch

log = logging.getLogger("syncd.watcher")

CLOSED, CHANGED = "closed", "changed"
FALLBACK_POLL_SECONDS = 2.0
MAX_DEPTH = 64  # directory levels scanned below a watch; deeper trees are reported, not walked
Notify = Callable[[Watch, Path, str], None]
EVENTS = [FileClosedEvent, FileCreatedEvent, FileModifiedEvent, FileMovedEvent, DirCreatedEvent, DirMovedEvent]


class _Handler(FileSystemEventHandler):
    def __init__(self, watch: Watch, notify: Notify, rescan: Callable[[Watch, Path], None]) -> None:
        self.watch = watch
        self.notify = notify
        self.rescan = rescan

    def on_any_event(self, event: FileSystemEvent) -> None:
        try:
            self._dispatch(event)
        except Exception:  # an observer thread must never die on one odd event
            log.exception("ignoring an event that could not be handled: %r", event)

    def _dispatch(self, event: FileSystemEvent) -> None:
        if isinstance(event, DirCreatedEvent | DirMovedEvent):
            # files that arrive with a directory produce no events of their own
            target = event.dest_path if isinstance(event, DirMovedEvent) else event.src_path
            self.rescan(self.watch, Path(os.fsdecode(target)))
        elif isinstance(event, FileMovedEvent):
            self.notify(self.watch, Path(os.fsdecode(event.dest_path)), CLOSED)
        elif isinstance(event, FileClosedEvent):
            self.notify(self.watch, Path(os.fsdecode(event.src_path)), CLOSED)
        elif isinstance(event, FileCreatedEvent | FileModifiedEvent):
            self.notify(self.watch, Path(os.fsdecode(event.src_path)), CHANGED)


class _OverflowListener(logging.Handler):
    """watchdog reports a kernel queue overflow only through its logger; we turn it into a rescan."""

    def __init__(self, on_overflow: Callable[[], None]) -> None:
        super().__init__(logging.WARNING)
        self.on_overflow = on_overflow

    def emit(self, record: logging.LogRecord) -> None:
        if "overflow" in record.getMessage().lower():
            self.on_overflow()


class Watcher:
    def __init__(
        self,
        config: Config,
        notify: Notify,
        rescan: Callable[[Watch, Path], None],
        on_overflow: Callable[[], None],
        on_limit: Callable[[Watch, str], None],
    ) -> None:
        self.config = config
        self.notify = notify
        self.rescan = rescan
        self.on_limit = on_limit
        self.observers: list[Observer] = []
        self.polled: list[Watch] = []
        self._overflow = _OverflowListener(on_overflow)
        logging.getLogger("watchdog.observers.inotify_c").addHandler(self._overflow)
        logging.getLogger("watchdog.observers.inotify").addHandler(self._overflow)

    def start(self) -> None:
        for watch in self.config.watches:
            self._start_watch(watch)

    def _start_watch(self, watch: Watch) -> None:
        interval = self.config.polling_interval_for(watch)
        if interval is None:
            reason = self._try_inotify(watch)
            if reason is None:
                return
            self.on_limit(watch, f"inotify unavailable ({reason}); polling every {FALLBACK_POLL_SECONDS:g} s instead")
            interval = FALLBACK_POLL_SECONDS
        self.polled.append(watch)
        self._observe(watch, PollingObserver(timeout=interval))

    def _try_inotify(self, watch: Watch) -> str | None:
        """Watch with inotify; None on success, else why not. watchdog silently skips subdirectories it
        cannot watch once the kernel's watch limit is reached, so we count the watches it really added."""
        before = inotify_watch_count()
        try:
            observer = self._observe(watch, Observer())
        except OSError as exc:  # the limit hit at the root, no inotify instances left, or no inotify here
            return exc.strerror or str(exc)
        # inotify can only watch directories we may read; those we may not are reported by the scans
        wanted = sum(1 for d in walk_dirs(watch.path, watch.recursive) if os.access(d, os.R_OK | os.X_OK))
        added = inotify_watch_count() - before
        if added < wanted:
            observer.stop()
            self.observers.remove(observer)
            return f"watch limit reached: {added} of {wanted} directories watched (fs.inotify.max_user_watches)"
        return None

    def _observe(self, watch: Watch, observer: Observer) -> Observer:
        observer.schedule(
            _Handler(watch, self.notify, self.rescan),
            os.fspath(watch.path),
            recursive=watch.recursive,
            event_filter=EVENTS,
        )
        observer.daemon = True
        try:
            observer.start()
        except BaseException:
            observer.stop()
            raise
        self.observers.append(observer)
        return observer

    def stop(self) -> None:
        for observer in self.observers:
            observer.stop()
        for observer in self.observers:
            observer.join(timeout=2)
        self.observers.clear()
        for name in ("watchdog.observers.inotify_c", "watchdog.observers.inotify"):
            logging.getLogger(name).removeHandler(self._overflow)


def walk_files(root: Path, recursive: bool, max_depth: int = MAX_DEPTH,
               on_limit: Callable[[Path, str], None] | None = None) -> Iterator[Path]:
    """Every entry below `root` that is not a directory (symlinks, FIFOs and the like included, so the
    caller can report them), iteratively (deep trees cannot exhaust the stack), never following a symlink,
    never descending past `max_depth` levels (reported through `on_limit`)."""
    stack = [(root, 0)]
    while stack:
        directory, depth = stack.pop()
        try:
            entries = list(os.scandir(directory))
        except OSError as exc:
            log.warning("cannot list %s: %s", directory, exc.strerror)
            if on_limit is not None:
                on_limit(directory, f"not scanned: cannot list the directory ({exc.strerror})")
            continue
        for entry in entries:
            try:
                mode = entry.stat(follow_symlinks=False).st_mode
            except OSError:
                continue
            if not stat.S_ISDIR(mode):
                yield Path(entry.path)
            elif recursive:
                if depth + 1 > max_depth:
                    reason = f"not scanned: deeper than {max_depth} directory levels below the watch"
                    log.warning("%s: %s", entry.path, reason)
                    if on_limit is not None:
                        on_limit(Path(entry.path), reason)
                    continue
                stack.append((Path(entry.path), depth + 1))


def walk_dirs(root: Path, recursive: bool) -> Iterator[Path]:
    """`root` and, if recursive, every directory below it, without following symlinks."""
    yield root
    if not recursive:
        return
    for directory, subdirs, _ in os.walk(root):
        for name in subdirs:
            path = Path(directory) / name
            if not path.is_symlink():
                yield path


def inotify_watch_count() -> int:
    """inotify watches this process holds, from /proc/self/fdinfo (one `inotify wd:` line per watch)."""
    count = 0
    for fd in os.listdir("/proc/self/fdinfo"):
        try:
            with open(f"/proc/self/fdinfo/{fd}", "rb") as info:
                count += info.read().count(b"inotify wd:")
        except OSError:
            continue  # closed meanwhile
    return count
