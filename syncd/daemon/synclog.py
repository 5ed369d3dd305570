"""The sync log: one JSON object per line for every decision the daemon makes, read by `syncd log`.

Each line is written with a single os.write on an O_APPEND descriptor, so a reader (or a crash) never sees
half a line and threads never interleave. Lines are pure ASCII: paths go through os.fsdecode and
json.dumps(ensure_ascii=True), so file names with newlines or undecodable bytes (kept as surrogate escapes)
stay on one line and come back exactly with os.fsencode(json.loads(...)).

Lines are not fsync'ed: the log is a record for people, and a lost tail after a power cut is acceptable
where a disk sync per decision is not.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

log = logging.getLogger("syncd.synclog")

DEFAULT_MAX_BYTES = 10 * 1024 * 1024  # rotate before a line would take the file past this (0: never)
DEFAULT_BACKUPS = 5  # rotated files kept: path.1 .. path.5

# the order fields appear in on a line; others follow in the order given
FIELD_ORDER = (
    "time",
    "status",
    "watch",
    "source",
    "dest",
    "direction",
    "tensors",
    "bytes",
    "duration_ms",
    "layout",
    "reason",
    "error",
)


def utc_timestamp(moment: datetime | None = None) -> str:
    """ISO 8601 UTC with milliseconds, e.g. 2025-01-31T12:00:00.123Z."""
    moment = (moment or datetime.now(UTC)).astimezone(UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def parse_timestamp(text: str) -> datetime:
    """The inverse of utc_timestamp; accepts any ISO 8601 time with an offset (naive means UTC)."""
    moment = datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text)
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _jsonable(value: Any) -> Any:
    """Paths (str, bytes or PathLike) become str with surrogate escapes; containers are walked."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (bytes, os.PathLike)):
        return os.fsdecode(value)
    if isinstance(value, Mapping):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(item) for item in value]
    return str(value)


def encode_record(record: Mapping[str, Any]) -> bytes:
    """One record as one ASCII line ending in a newline; None fields are left out."""
    present = {key: value for key, value in record.items() if value is not None}
    ordered = {key: present[key] for key in FIELD_ORDER if key in present}
    ordered.update((key, value) for key, value in present.items() if key not in ordered)
    text = json.dumps(_jsonable(ordered), ensure_ascii=True, separators=(", ", ": "), allow_nan=False)
    return text.encode("ascii") + b"\n"


class SyncLog:
    """Thread-safe appender with size-based rotation to `path.1` .. `path.<backups>`.

    Rotation happens before a line that would take the file past `max_bytes` (0: never rotate). A file that
    someone else moved or removed (logrotate) is noticed and reopened at the next write.
    """

    def __init__(
        self, path: str | os.PathLike[str], max_bytes: int = DEFAULT_MAX_BYTES, backups: int = DEFAULT_BACKUPS
    ) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self._lock = threading.Lock()
        self._fd: int | None = None
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, status: str, **fields: Any) -> dict[str, Any]:
        """Append one decision; returns the record as written (with its time).

        Usual fields: watch, source, dest, direction, tensors, bytes, duration_ms, layout, reason, error.
        """
        record: dict[str, Any] = {"time": utc_timestamp(), "status": status, **fields}
        self.append(record)
        return record

    def append(self, record: Mapping[str, Any]) -> None:
        """Append one line. Never raises for the file system's sake: a removed log directory is created
        again; a line that still cannot be written (disk full, read-only) is reported on stderr (the
        journal) with the line itself, so nothing is lost silently and the daemon goes on."""
        line = encode_record(record)
        with self._lock:
            try:
                self._append_locked(line)
            except OSError as exc:
                self._close_quietly()
                log.error(
                    "cannot write the sync log %s (%s); the line was: %s",
                    self.path,
                    exc.strerror or exc,
                    line.decode("ascii").rstrip(),
                )

    def _append_locked(self, line: bytes) -> None:
        fd = self._current_fd()
        if self._needs_rotation(fd, len(line)):
            self._rotate()
            fd = self._current_fd()
        size = os.fstat(fd).st_size
        try:
            _write_all(fd, line)
        except OSError:
            # a full disk took part of the line: without it, the next line would be fused to the piece and
            # both lost to a reader (syncd log: "skipped 1 corrupt line")
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise

    def _close_quietly(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        with self._lock:
            self._close_quietly()

    def __enter__(self) -> SyncLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def open_now(self) -> None:
        """Open (and make) the file now: OSError if it cannot be written. A daemon checks at its start, where it
        would otherwise run with every line of its log lost."""
        with self._lock:
            self._current_fd()

    def _current_fd(self) -> int:
        if self._fd is not None and not self._still_at_path(self._fd):
            os.close(self._fd)
            self._fd = None
        if self._fd is None:
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
            try:
                self._fd = os.open(self.path, flags, 0o644)
            except FileNotFoundError:  # the log directory was removed: make it again
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, flags, 0o644)
        return self._fd

    def _still_at_path(self, fd: int) -> bool:
        try:
            on_disk = os.stat(self.path)
        except FileNotFoundError:
            return False
        except PermissionError:  # its directory made unreadable to us: the file we hold is all we can write
            return True
        mine = os.fstat(fd)
        return (on_disk.st_dev, on_disk.st_ino) == (mine.st_dev, mine.st_ino)

    def _needs_rotation(self, fd: int, incoming: int) -> bool:
        if self.max_bytes <= 0:
            return False
        size = os.fstat(fd).st_size
        # an empty file takes any line, however long: rotating would only make empty backups
        return size > 0 and size + incoming > self.max_bytes

    def _rotate(self) -> None:
        assert self._fd is not None
        os.close(self._fd)
        self._fd = None
        if self.backups <= 0:
            os.unlink(self.path)
            return
        for number in range(self.backups - 1, 0, -1):
            older = backup_path(self.path, number)
            if older.exists():
                os.replace(older, backup_path(self.path, number + 1))
        os.replace(self.path, backup_path(self.path, 1))


def backup_path(path: Path, number: int) -> Path:
    return path.with_name(f"{path.name}.{number}")


def _write_all(fd: int, data: bytes) -> None:
    # a regular file takes the whole line at once; the loop only matters on a full disk or a signal
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]
