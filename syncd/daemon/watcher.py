"""Filesystem events in, candidate paths out: watchdog's inotify observer, or polling where configured or
where inotify cannot serve (watch limit reached, unsupported filesystem). A watch on a filesystem other nodes
write to (`shared`, syncd.daemon.fstype) gets both: inotify sees this node's writes at once, and a poll every
`cluster.poll_interval` seconds finds the files other nodes wrote, of which this kernel hears nothing.

The watcher knows nothing about conversion. It tells its `WatchListener` what happened, by name: a candidate
file appeared or changed (and whether its writer is known to be done), a directory appeared (its files make
no events of their own), events were lost (the kernel's inotify queue overflowed), or a watch fell back to
polling. Which names are candidates is decided by `syncd.daemon.names`, the same test the scans and the
daemon's decision code apply.

Only events that can start work are asked of the kernel: close-after-write, moves, creation (of directories;
of files, once each) and attribute changes. Not IN_MODIFY: a file being written would cost an event per
`write()` (a 1 GiB checkpoint, or syncd's own scratch output beside its source, tens of thousands of them),
each read, parsed and handed between watchdog's threads before the name test dropped it; the settle time is
decided from the file's stat by the daemon, not from events. syncd's own scratch names are dropped where the
events are made, before watchdog's queue.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Protocol

from watchdog.events import (
    DirAttribEvent,
    DirCreatedEvent,
    DirMovedEvent,
    FileAttribEvent,
    FileClosedEvent,
    FileCreatedEvent,
    FileModifiedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import inotify_c
from watchdog.observers.api import BaseObserver, EventEmitter
from watchdog.observers.inotify import InotifyEmitter, InotifyWatchGroup
from watchdog.observers.inotify_c import InotifyConstants, InotifyEvent, InotifyFD
from watchdog.observers.polling import PollingObserver

from syncd.daemon.config import Config, Watch
from syncd.daemon.names import is_candidate
from syncd.engine.publish import is_scratch_name

log = logging.getLogger("syncd.watcher")


def _not_a_stopped_emitters_read(record: logging.LogRecord) -> bool:
    """watchdog's inotify emitter says "queue_events() called when the thread is inactive", at ERROR, when a
    read was under way as we stopped it (a reload, a tree watched anew): a file or tree it does not name, and
    nothing lost (a reload rescans). Dropped; the rest of its lines go to the journal."""
    return "called when the thread is inactive" not in str(record.msg)


logging.getLogger("watchdog.observers.inotify").addFilter(_not_a_stopped_emitters_read)

FALLBACK_POLL_SECONDS = 2.0
MAX_DEPTH = 64  # directory levels scanned below a watch; deeper trees are reported, not walked
# FileAttribEvent (IN_ATTRIB, or a mode change a poll sees): a file skipped as unreadable gets looked at
# again once a chmod lets the daemon read it
EVENTS = [
    FileAttribEvent,
    FileClosedEvent,
    FileCreatedEvent,
    FileModifiedEvent,
    FileMovedEvent,
    DirCreatedEvent,
    DirMovedEvent,
    DirAttribEvent,
]
# what the kernel is asked for: EVENTS without IN_MODIFY (no event per write; IN_ATTRIB makes FileAttribEvents);
# moves both ways, which watchdog pairs; IN_DELETE_SELF, on which watchdog drops the watch of a removed directory
INOTIFY_MASK = (
    InotifyConstants.IN_CLOSE_WRITE
    | InotifyConstants.IN_MOVE
    | InotifyConstants.IN_CREATE
    | InotifyConstants.IN_ATTRIB
    | InotifyConstants.IN_DELETE_SELF
)


class WatchListener(Protocol):
    """What the watcher reports, from its observer threads (implementations must be thread-safe)."""

    def on_file(self, watch: Watch, path: Path, closed: bool) -> None:
        """A candidate file appeared or changed. `closed`: its writer is done (close-after-write, or a rename
        into place); otherwise it must stay unchanged for the settle time."""

    def on_directory(self, watch: Watch, directory: Path) -> None:
        """A directory appeared (created or moved in): the files it brought need a scan."""

    def on_overflow(self, watch: Watch) -> None:
        """The kernel dropped events of this watch (inotify queue overflow): only a scan finds what changed."""

    def on_fallback(self, watch: Watch, reason: str) -> None:
        """inotify cannot serve this watch (`reason`); it is polled instead."""

    def on_watch_limit(self, watch: Watch) -> None:
        """A directory made in this inotify-watched tree could not be watched (the kernel's watch limit): the
        tree must be watched again, from a thread of the listener's own (`Watcher.rewatch` falls back to
        polling), and scanned."""


class _Handler(FileSystemEventHandler):
    """Turns one watch's watchdog events into listener calls, for candidate names only.

    A poll's events are inferred by comparing two listings, pairing entries by inode: a file that took the
    inode of a directory removed since is "a directory moved" there, and a file renamed over a name "moved"
    as well as one written there while a removed file's inode came free. So a poll's events say only that a
    name changed: never that its writer is done, nor what the name now is (which `_dispatch` looks at)."""

    def __init__(self, watch: Watch, listener: WatchListener, polled: bool = False) -> None:
        self.watch = watch
        self.listener = listener
        self.polled = polled
        self.emitters: Callable[[], Collection[EventEmitter]] = tuple  # its observer's, once scheduled

    def on_any_event(self, event: FileSystemEvent) -> None:
        try:
            self._dispatch(event)
        except Exception:  # an observer thread must never die on one odd event
            log.exception("ignoring an event that could not be handled: %r", event)

    def _dispatch(self, event: FileSystemEvent) -> None:
        if isinstance(event, DirAttribEvent):
            self._directory_opened(Path(os.fsdecode(event.src_path)))
        elif isinstance(event, DirCreatedEvent | DirMovedEvent):
            target = Path(os.fsdecode(event.dest_path if isinstance(event, DirMovedEvent) else event.src_path))
            if _is_directory(target):
                self.listener.on_directory(self.watch, target)
            else:  # a file there now (one that took a removed directory's inode, as a poll sees it)
                self._file(os.fspath(target), closed=False)
        elif isinstance(event, FileMovedEvent):
            self._file(event.dest_path, closed=True)
        elif isinstance(event, FileClosedEvent):
            self._file(event.src_path, closed=True)
        elif isinstance(event, FileCreatedEvent | FileModifiedEvent | FileAttribEvent):
            self._file(event.src_path, closed=False)

    def _file(self, raw_path: bytes | str, closed: bool) -> None:
        path = Path(os.fsdecode(raw_path))
        if is_candidate(self.watch, path):
            self.listener.on_file(self.watch, path, closed and not self.polled)

    def _directory_opened(self, directory: Path) -> None:
        """A directory's mode or owner changed: one the daemon could not read when it appeared (a trainer's
        umask 077) and may now is watched from now on, and scanned; it waited for the safety rescan."""
        if not self.watch.recursive or not os.access(directory, os.R_OK | os.X_OK):
            return
        if any(_watch_directory(emitter, directory) for emitter in self.emitters()):
            self.listener.on_directory(self.watch, directory)


def _watch_directory(emitter: EventEmitter, directory: Path) -> bool:
    """Have an inotify emitter watch `directory` and the directories below it, where it does not already:
    True if it did not. (watchdog adds a directory's watch only when it sees it made; one it could not read
    then stays unwatched.)"""
    group = getattr(emitter, "_inotify", None)
    if not isinstance(group, InotifyWatchGroup):
        return False  # a poll lists every directory it may read, each time
    path = os.fsencode(directory)
    with group._lock:
        if path in group._active_callbacks_by_path:
            return False
        group._add_all_callbacks(path)
    return True


def _is_directory(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False  # gone again: a file event for it finds nothing


def _is_own(event: FileSystemEvent) -> bool:
    """An event about syncd's own scratch files only (a rename out of one, a publish, is not)."""
    paths = [event.src_path] + ([event.dest_path] if event.dest_path else [])
    return all(is_scratch_name(os.path.basename(os.fsdecode(p))) for p in paths)


class _Quiet(EventEmitter):
    """An emitter that drops the events about syncd's own scratch files before they are queued, and tells
    `on_queued` of every event it does queue (the daemon's count of them)."""

    def __init__(self, *args: object, on_queued: Callable[[FileSystemEvent], None] | None = None, **kw: object):
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self._on_queued = on_queued

    def queue_event(self, event: FileSystemEvent) -> None:
        if _is_own(event):
            return
        super().queue_event(event)
        if self._on_queued is not None:
            self._on_queued(event)


class _QuietInotifyEmitter(_Quiet, InotifyEmitter):
    def get_event_mask_from_filter(self) -> int:  # type: ignore[override]
        return INOTIFY_MASK


class _OverflowReportingInotify(InotifyFD):
    """watchdog's inotify reader, also telling us when the kernel's event queue overflowed.

    watchdog >= 7.1 reads the kernel's IN_Q_OVERFLOW event and answers it itself only by re-adding its
    recursive watches (`WatchCallback.on_queue_overflow`); the events lost meanwhile are ours to find.
    """

    def __init__(self, on_overflow: Callable[[], None]) -> None:
        super().__init__()
        self._on_overflow = on_overflow
        # told when a directory cannot be watched for the kernel's watch limit, once the tree is watched:
        # watchdog skips such a subdirectory made later without a word, and the files saved there waited for the
        # ten-minute rescan (the limit met while the tree is first watched is counted there instead)
        self.on_limit: Callable[[], None] | None = None

    def handle_event(self, event: InotifyEvent) -> None:
        super().handle_event(event)  # first: watches are whole again before we rescan
        if event.is_queue_overflow:
            self._on_overflow()

    def _get_or_create_watch(self, path: bytes, mask: inotify_c.Mask) -> inotify_c.Watch:
        """watchdog takes a directory it may not read (EACCES) for watched, under descriptor -1, shared by
        every such directory: the second one's bookkeeping broke the reader thread, and the whole tree went
        unwatched, silently. Such a directory is refused here: not watched (the scans report it)."""
        try:
            watch = super()._get_or_create_watch(path, mask)
        except OSError as exc:
            if exc.errno == errno.ENOSPC and self.on_limit is not None:
                self.on_limit()
            raise
        if watch.wd == -1:
            if not watch.callbacks:
                self._watch_for_wd.pop(watch.wd, None)
            raise PermissionError(errno.EACCES, "cannot watch the directory", os.fsdecode(path))
        return watch


class _InotifyObserver(BaseObserver):
    """watchdog's `InotifyObserver`, over an inotify reader that reports queue overflows."""

    def __init__(self, on_overflow: Callable[[], None], on_queued: Callable[[FileSystemEvent], None]) -> None:
        self._inotify = _OverflowReportingInotify(on_overflow)  # OSError when no inotify instance is left
        self._inotify.start()
        super().__init__(_QuietInotifyEmitter, inotify_fd=self._inotify, on_queued=on_queued)

    def on_limit(self, told: Callable[[], None]) -> None:
        """Tell `told`, once, when a directory made from now on cannot be watched for the watch limit."""
        reader = self._inotify

        def once() -> None:
            reader.on_limit = None
            told()

        reader.on_limit = once

    def on_thread_stop(self) -> None:
        super().on_thread_stop()
        self._inotify.stop()
        self._inotify.join()


class Watcher:
    """Every watch of a configuration, each with its own observer, reporting to one listener. `on_queued`, if
    set, is told of every event an inotify observer queues (syncd's own scratch files make none; a polled
    watch makes its events once per poll, not per write, and is not told of)."""

    def __init__(self, config: Config, listener: WatchListener, shared: Collection[Path] = ()) -> None:
        self.config = config
        self.listener = listener
        self.shared = shared  # the paths of the watches other nodes write to as well
        self.observers: list[BaseObserver] = []
        self.polled: list[Watch] = []
        self._of_watch: dict[Path, list[BaseObserver]] = {}  # each watch's observers, to stop them alone
        self.on_queued: Callable[[FileSystemEvent], None] | None = None

    def _queued(self, event: FileSystemEvent) -> None:
        if self.on_queued is not None:
            self.on_queued(event)

    def start(self, skip: Collection[Path] = ()) -> None:
        """Watch every tree of the configuration but those of `skip` (watched later, through `rewatch`)."""
        for watch in self.config.watches:
            if watch.path not in skip:
                self._start_watch(watch)

    def unwatch(self, watch: Watch) -> None:
        """Stop watching one tree (its directory is gone, or another daemon holds it); the others go on."""
        observers = self._of_watch.pop(watch.path, [])
        for observer in observers:
            observer.stop()
        for observer in observers:
            observer.join(timeout=2)
            self.observers.remove(observer)
        self.polled = [polled for polled in self.polled if polled.path != watch.path]

    def rewatch(self, watch: Watch) -> None:
        """Watch one tree anew: its directory was made again, and the old watch saw the one removed."""
        self.unwatch(watch)
        self._start_watch(watch)

    def _start_watch(self, watch: Watch) -> None:
        interval = self.config.polling_interval_for(watch)
        if interval is None:
            reason = self._try_inotify(watch)
            if reason is None:
                if watch.path in self.shared:  # and other nodes' files, which make no inotify event here
                    self.polled.append(watch)
                    self._observe(watch, PollingObserver(timeout=self.config.cluster.poll_interval))
                return
            self.listener.on_fallback(
                watch, f"inotify unavailable ({reason}); polling every {FALLBACK_POLL_SECONDS:g} s instead"
            )
            interval = FALLBACK_POLL_SECONDS
        self.polled.append(watch)
        self._observe(watch, PollingObserver(timeout=interval))

    def _try_inotify(self, watch: Watch) -> str | None:
        """Watch with inotify; None on success, else why not. watchdog silently skips subdirectories it
        cannot watch once the kernel's watch limit is reached, so we count the watches it really added."""
        before = inotify_watch_count()
        try:
            inotify = _InotifyObserver(lambda: self.listener.on_overflow(watch), self._queued)
            observer = self._observe(watch, inotify)
        except OSError as exc:  # the limit hit at the root, no inotify instances left, or no inotify here
            return exc.strerror or str(exc)
        # inotify can only watch directories we may read; those we may not are reported by the scans
        wanted = sum(1 for d in walk_dirs(watch.path, watch.recursive) if os.access(d, os.R_OK | os.X_OK))
        added = inotify_watch_count() - before
        if added < wanted:
            observer.stop()
            self.observers.remove(observer)
            self._of_watch[watch.path].remove(observer)
            return f"watch limit reached: {added} of {wanted} directories watched (fs.inotify.max_user_watches)"
        inotify.on_limit(lambda: self.listener.on_watch_limit(watch))
        return None

    def _observe(self, watch: Watch, observer: BaseObserver) -> BaseObserver:
        observer.daemon = True
        try:
            handler = _Handler(watch, self.listener, polled=isinstance(observer, PollingObserver))
            handler.emitters = lambda: observer.emitters
            observer.schedule(handler, os.fspath(watch.path), recursive=watch.recursive, event_filter=EVENTS)
            observer.start()
        except BaseException:
            observer.stop()
            raise
        self.observers.append(observer)
        self._of_watch.setdefault(watch.path, []).append(observer)
        return observer

    def stop(self) -> None:
        for observer in self.observers:
            observer.stop()
        for observer in self.observers:
            observer.join(timeout=2)
        self.observers.clear()
        self._of_watch.clear()


def walk_files(
    root: Path, recursive: bool, max_depth: int = MAX_DEPTH, on_limit: Callable[[Path, str], None] | None = None
) -> Iterator[Path]:
    """Every entry below `root` that is not a directory (symlinks, FIFOs and the like included, so the
    caller can report them), iteratively (deep trees cannot exhaust the stack), never following a symlink,
    never descending past `max_depth` levels. What is not walked (too deep, a directory it cannot list) goes
    to `on_limit`, which says it; without one, a directory it cannot list is a warning here."""
    stack = [(root, 0)]
    while stack:
        directory, depth = stack.pop()
        try:
            entries = list(os.scandir(directory))
        except OSError as exc:
            if directory != root and isinstance(exc, FileNotFoundError | NotADirectoryError):
                # removed since it was seen (a trainer rotating its checkpoint directories): nothing to scan
                log.debug("%s is gone: not scanned", directory)
                continue
            if on_limit is None:
                log.warning("cannot list %s: %s", directory, exc.strerror)
            else:  # one line for one directory: the caller's (a scan's `skipped` record)
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
