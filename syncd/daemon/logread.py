"""Reading the sync log back: its files (rotated backups oldest first, then the current file), its lines as
records, filters on them, and a tail that follows the current file across rotations. `syncd log` prints what
this reads.

Lines that are not a JSON object with a readable `time` and a `status` are skipped and counted.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, BinaryIO

from syncd.daemon.statuses import STATUSES
from syncd.daemon.synclog import backup_path, parse_timestamp
from syncd.errors import UsageError

_SINCE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_RELATIVE_SINCE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
MAX_BACKUPS_SCANNED = 1000  # how far `path.N` is looked for; the daemon's default keeps 5


# ---------------------------------------------------------------------------------------------- filtering


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """`30s`, `15m`, `1h`, `2d`, `1w` ago, or an ISO 8601 time (UTC when it has no offset)."""
    match = _RELATIVE_SINCE.match(text)
    if match:
        now = now or datetime.now(UTC)
        try:
            return now - timedelta(seconds=float(match.group(1)) * _SINCE_UNITS[match.group(2)])
        except (OverflowError, ValueError):  # past year 1 (timedelta's and datetime's range)
            return datetime.min.replace(tzinfo=UTC)
    iso = text.strip()
    try:
        moment = datetime.fromisoformat(iso[:-1] + "+00:00" if iso.endswith("Z") else iso)
    except ValueError:
        raise UsageError(f"--since: expected a duration like 30s, 15m, 1h, 2d or an ISO time, got {text!r}") from None
    # a time without an offset is UTC, as the log shows its times: one copied from `syncd log` means that
    # moment wherever it is read (journalctl reads local time, and shows it)
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def parse_statuses(values: Iterable[str] | None) -> frozenset[str] | None:
    """Repeated and comma-separated statuses as one set; None means every status."""
    if not values:
        return None
    statuses = frozenset(part.strip() for value in values for part in value.split(",") if part.strip())
    unknown = sorted(statuses - set(STATUSES))
    if unknown:
        raise UsageError(f"--status: unknown status {', '.join(unknown)} (known: {', '.join(STATUSES)})")
    return statuses or None


def path_matches(glob: str, path: str) -> bool:
    """fnmatch on the whole path; a relative glob also matches at any depth (`exp1/*.bpk`)."""
    if fnmatch.fnmatchcase(path, glob):
        return True
    return not glob.startswith("/") and fnmatch.fnmatchcase(path, "*/" + glob)


@dataclass(frozen=True)
class LogFilter:
    statuses: frozenset[str] | None = None
    since: datetime | None = None
    path_glob: str | None = None

    def matches(self, record: dict[str, Any], moment: datetime) -> bool:
        if self.statuses is not None and record["status"] not in self.statuses:
            return False
        if self.since is not None and moment < self.since:
            return False
        if self.path_glob is not None:
            paths = [record.get(key) for key in ("source", "dest")]
            return any(isinstance(path, str) and path_matches(self.path_glob, path) for path in paths)
        return True


# ---------------------------------------------------------------------------------------------- reading


def log_files(log_path: str | os.PathLike[str]) -> list[Path]:
    """The existing files of a log, oldest first: path.N .. path.1, then path."""
    path = Path(log_path)
    backups = []
    for number in range(1, MAX_BACKUPS_SCANNED + 1):
        candidate = backup_path(path, number)
        if not candidate.exists():
            break
        backups.append(candidate)
    current = [path] if path.exists() else []
    return list(reversed(backups)) + current


@dataclass
class Entry:
    raw: str  # the line as in the file, without its newline
    record: dict[str, Any]
    moment: datetime


@dataclass
class LineParser:
    """Turns lines into entries, counting the ones that are not records."""

    corrupt: int = 0

    def parse(self, line: bytes) -> Entry | None:
        line = line.rstrip(b"\r")
        if not line.strip():
            return None
        raw = line.decode("utf-8", errors="replace")
        try:
            record = json.loads(raw)
            moment = parse_timestamp(record["time"])
            if not isinstance(record["status"], str):
                raise TypeError("status is not a string")
        except (ValueError, TypeError, KeyError, AttributeError):
            self.corrupt += 1
            return None
        return Entry(raw, record, moment)


@dataclass
class LineBuffer:
    """Splits a byte stream into lines; holds a partial last line until its newline arrives."""

    pending: bytes = b""

    def feed(self, data: bytes) -> list[bytes]:
        lines = (self.pending + data).split(b"\n")
        self.pending = lines.pop()
        return lines

    def flush(self) -> list[bytes]:
        rest, self.pending = self.pending, b""
        return [rest] if rest else []


def read_whole(path: Path) -> list[bytes]:
    try:
        data = path.read_bytes()
    except FileNotFoundError:  # rotated away between listing and reading
        return []
    buffer = LineBuffer()
    return buffer.feed(data) + buffer.flush()


class Tail:
    """Follows a log path: reads what is appended, and moves to the new file when the old one is rotated."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file: BinaryIO | None = None
        self.buffer = LineBuffer()

    def open_current(self) -> bool:
        try:
            self.file = open(self.path, "rb")  # noqa: SIM115 - held open across calls on purpose
        except FileNotFoundError:
            return False
        return True

    def read_new(self) -> list[bytes]:
        if self.file is None and not self.open_current():
            return []
        assert self.file is not None
        lines = self.buffer.feed(self.file.read())
        if self._was_truncated():
            self.file.seek(0)
            self.buffer = LineBuffer()
        elif self._was_replaced():
            # whatever was appended before the rename is still readable through the old descriptor
            lines += self.buffer.feed(self.file.read()) + self.buffer.flush()
            left = os.fstat(self.file.fileno())
            self.close()
            lines += self._rotated_after(left)
            if self.open_current():
                lines += self.buffer.feed(self.file.read())
        return lines

    def _rotated_after(self, left: os.stat_result) -> list[bytes]:
        """The whole files rotated out after the one just left: the log rotated more than once between two
        reads. None if that file is no longer among the backups (removed, or rotated past the last)."""
        backups = [path for path in log_files(self.path) if path != self.path]  # oldest first
        for at, backup in enumerate(backups):
            try:
                info = os.stat(backup)
            except FileNotFoundError:
                continue
            if (info.st_dev, info.st_ino) == (left.st_dev, left.st_ino):
                return [line for newer in backups[at + 1 :] for line in read_whole(newer)]
        return []

    def _was_replaced(self) -> bool:
        assert self.file is not None
        try:
            on_disk = os.stat(self.path)
        except FileNotFoundError:
            return True
        mine = os.fstat(self.file.fileno())
        return (on_disk.st_dev, on_disk.st_ino) != (mine.st_dev, mine.st_ino)

    def _was_truncated(self) -> bool:
        assert self.file is not None
        return os.fstat(self.file.fileno()).st_size < self.file.tell()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def parse_all(parser: LineParser, lines: Iterable[bytes]) -> Iterator[Entry]:
    """The records among `lines` (the parser counts the others)."""
    for line in lines:
        entry = parser.parse(line)
        if entry is not None:
            yield entry
