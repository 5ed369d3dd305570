"""What the daemon tells the journal (or the terminal it runs on): one concise line per conversion,
refusal, conflict, error and skip, and per start, reload and stop. The sync log keeps the full record; these
lines are for `journalctl -u syncd` and for a person watching `syncd run` in a terminal.

Under systemd (stderr connected to the journal, $JOURNAL_STREAM) each line starts with its syslog priority
(`<3>` ... `<6>`, which journald turns into the entry's priority); on a terminal it starts with the time.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from syncd.daemon.statuses import FAILURES, LIFECYCLE, SUCCESSES, Status
from syncd.daemon.synclog import SyncLog
from syncd.engine.progress import human_bytes

log = logging.getLogger("syncd")

# the journal priority of each status's line; anything else (a `warning`, a `removed` scratch) is info
LEVELS: dict[str, int] = {
    **dict.fromkeys(SUCCESSES | LIFECYCLE, logging.INFO),
    **dict.fromkeys(FAILURES - {Status.ERROR}, logging.WARNING),
    Status.ERROR: logging.ERROR,
}
_SYSLOG_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


def journal_line(record: dict[str, Any]) -> str:
    """`converted /srv/ckpt/a.bpk -> a.safetensors (18 tensors, 1.0 MiB, 31 ms)`, `refused SRC: why`, ..."""
    status = str(record.get("status"))
    source, dest = record.get("source"), record.get("dest")
    what = _files(source, dest) if source else str(record.get("watch") or record.get("config") or "")
    detail = _why(record, source)
    sizes = _sizes(record) if status in SUCCESSES else ""
    text = f"{status.replace('_', ' ')} {what}".rstrip()
    if sizes:
        text += f" ({sizes})"
    if detail:
        text += f": {detail}"
    return _printable(text)


def _files(source: Any, dest: Any) -> str:
    source = str(source)
    if dest is None:
        return source
    dest = str(dest)
    same_dir = os.path.dirname(dest) == os.path.dirname(source)
    return f"{source} -> {os.path.basename(dest) if same_dir else dest}"


def _why(record: dict[str, Any], source: Any) -> str:
    error, reason = record.get("error"), record.get("reason")
    text = str(error) if error else str(reason).split("\n")[0] if reason else ""
    if source and text.startswith(f"{source}: "):  # errors name their file; the line already does
        text = text[len(str(source)) + 2 :]
    if record.get("status") == "refused" and reason and "module map" in str(reason):
        text += " (the module map that would settle it: syncd log --status refused)"
    return text


def _sizes(record: dict[str, Any]) -> str:
    parts = []
    if isinstance(record.get("tensors"), int):
        parts.append(f"{record['tensors']} tensors")
    if isinstance(record.get("bytes"), int):
        parts.append(human_bytes(record["bytes"]))
    if isinstance(record.get("duration_ms"), (int, float)):
        parts.append(f"{record['duration_ms']:.0f} ms")
    return ", ".join(parts)


def _printable(text: str) -> str:
    # one entry per line: a file name holding a line break or control character must not split it
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape", "backslashreplace").decode() for ch in text)


class JournalingSyncLog(SyncLog):
    """The sync log, also telling the journal a line per record and the observers (the status file)."""

    def __init__(self, *args: Any, observers: tuple[Callable[[dict[str, Any]], None], ...] = (), **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.observers = observers

    def log(self, status: str, **fields: Any) -> dict[str, Any]:
        record = super().log(status, **fields)
        log.log(LEVELS.get(status, logging.INFO), "%s", journal_line(record))
        for observer in self.observers:
            observer(record)
        return record


class _Formatter(logging.Formatter):
    def __init__(self, journal: bool) -> None:
        super().__init__("%(asctime)s %(message)s", datefmt="%H:%M:%S")
        self.journal = journal

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if self.journal:  # journald reads the priority from the prefix and adds its own time
            message = text.split(" ", 1)[1]
            return f"<{_SYSLOG_PRIORITY.get(record.levelno, 6)}>{message}"
        if record.levelno < logging.WARNING or record.getMessage().lower().startswith(record.levelname.lower()):
            return text  # `error ...` says it already: not `ERROR: error ...`
        return text.replace(" ", f" {record.levelname}: ", 1)


def configure_logging(level: str) -> None:
    """Lines to stderr at `level` (info by default: the journal tells the story)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(journal=_stderr_is_journal()))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))


def _stderr_is_journal() -> bool:
    """$JOURNAL_STREAM holds `device:inode` of the journal stream systemd gave us (systemd.exec(5))."""
    value = os.environ.get("JOURNAL_STREAM", "")
    try:
        device, inode = (int(part) for part in value.split(":"))
        info = os.fstat(sys.stderr.fileno())
    except (ValueError, OSError):
        return False
    return (info.st_dev, info.st_ino) == (device, inode)
