"""What the running daemon is doing, for `syncd status`, `systemctl status` (STATUS=) and the journal.

`Activity` follows the work: which conversions run and how far they are (fed by the conversion's progress
callback), the sync log's records (counts since start, recent failures), and the queue's length. Once a
second the daemon calls `tick()`, which rewrites `<state_dir>/status.json` atomically (a scratch file then
rename: a reader sees the old or the new document, never half of one) and logs a `converting` line for a
conversion that has run longer than CONVERTING_AFTER seconds (again every CONVERTING_EVERY seconds).
`read_status` reads that file back (for `syncd status -c FILE`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from syncd.daemon import metrics
from syncd.daemon.statuses import FAILURES, LIFECYCLE, SUCCESSES, Status
from syncd.daemon.synclog import utc_timestamp
from syncd.engine.progress import ProgressCallback, ProgressState, describe, human_bytes
from syncd.errors import SyncdError, UsageError

log = logging.getLogger("syncd")

STATUS_FILE = "status.json"
STATUS_MODE = 0o640  # the service's group (operators added to it) may read it; see docs/install.md
CONVERTING_AFTER = 5.0  # seconds before a running conversion gets a journal line
CONVERTING_EVERY = 60.0  # and then how often
RECENT_FAILURES = 10
SHOWN_WAITING = 10  # queued files listed by name, due first
STALE_AFTER = 30.0  # a status older than this (the daemon rewrites it every second) means no daemon


@dataclass
class Running:
    source: str
    progress: ProgressState = field(default_factory=ProgressState)
    announced: float | None = None  # monotonic time of the last `converting` line
    converting: bool = False  # past the settle checks: reading, planning (a model definition built), writing

    def doc(self, now: float) -> dict[str, Any]:
        snap = self.progress.snapshot(now)
        return {"source": self.source, **{key: _rounded(value) for key, value in snap.items()}}


def _number(value: Any) -> float:
    """A record's numeric field, 0 when absent or not a number."""
    return value if isinstance(value, int | float) and not isinstance(value, bool) else 0


def _rounded(value: Any) -> Any:
    return round(value, 2) if isinstance(value, float) else value


class Activity:
    """Thread-safe: workers start and feed conversions, the sync log reports records, the main thread ticks."""

    def __init__(self, state_dir: Path, config_path: Path, metrics_path: Path | None = None) -> None:
        self.path = Path(state_dir) / STATUS_FILE
        self.config_path = config_path
        self.metrics_path = metrics_path  # a Prometheus textfile, rewritten with the status (None: none)
        self.started = utc_timestamp()
        self.started_unix = time.time()
        self.counts: Counter[str] = Counter()
        self.converted_bytes = 0  # of outputs written (converted, updated)
        self.converted_seconds = 0.0  # spent in those conversions
        self.last_success_unix: float | None = None
        self.last_failure_unix: float | None = None
        self.failures: deque[dict[str, Any]] = deque(maxlen=RECENT_FAILURES)
        self.queued = 0
        self.waiting: list[dict[str, Any]] = []
        self._running: dict[int, Running] = {}  # by worker thread
        self._lock = threading.Lock()
        self._metrics_error: str | None = None
        self._status_error: str | None = None

    # -- fed by the workers and the sync log

    @contextlib.contextmanager
    def working(self, source: Path) -> Iterator[None]:
        """Around one worker's handling of `source`; it shows as running once bytes are being written."""
        key = threading.get_ident()
        with self._lock:
            self._running[key] = Running(os.fsdecode(source))
        try:
            yield
        finally:
            with self._lock:
                self._running.pop(key, None)

    def progress_for(self, source: Path) -> ProgressCallback | None:
        """The callback for the conversion this worker is about to run (None outside working())."""
        with self._lock:
            running = self._running.get(threading.get_ident())
        if running is None:
            return None
        running.progress = ProgressState()  # the clock starts with the conversion, not with the settle checks
        running.converting = True
        return running.progress.update

    def record(self, record: dict[str, Any]) -> None:
        status = str(record.get("status"))
        if status in LIFECYCLE:
            return
        with self._lock:
            self.counts[status] += 1
            if status in SUCCESSES:
                self.last_success_unix = time.time()
                source = record.get("source")
                if source is not None and any(failure["source"] == source for failure in self.failures):
                    # converted since: no longer a file left without its output (operating-metrics.md)
                    kept = [failure for failure in self.failures if failure["source"] != source]
                    self.failures = deque(kept, maxlen=RECENT_FAILURES)
            if status in (Status.CONVERTED, Status.UPDATED):
                self.converted_bytes += int(_number(record.get("bytes")))
                self.converted_seconds += _number(record.get("duration_ms")) / 1000
            if status in FAILURES:
                self.last_failure_unix = time.time()
                why = str(record.get("error") or str(record.get("reason") or "").split("\n")[0])
                # what failed: a source, else the configuration (a refused reload) or a watched tree
                what = record.get("source") or record.get("config") or record.get("watch")
                why = why.removeprefix(f"{what}: ")  # the error names the file listed beside it
                self.failures.append({"time": record.get("time"), "status": status, "source": what, "error": why})

    # -- the main thread, once a second

    def tick(
        self, queued: int, now: float | None = None, state: str = "running", waiting: Sequence[tuple[Path, float]] = ()
    ) -> str:
        """Write the status file, log `converting` lines that are due; returns the STATUS= text. `waiting` is
        the queue's first paths with their due times (monotonic)."""
        now = time.monotonic() if now is None else now
        self.queued = queued
        self.waiting = [{"source": os.fsdecode(path), "due_in": round(max(0.0, due - now), 1)} for path, due in waiting]
        doc = self.document(now, state)
        self._announce(now)
        try:
            _write_atomically(self.path, json.dumps(doc, indent=1) + "\n")
        except OSError as exc:  # a status nobody can read is no reason to stop converting; said once per cause
            if self._status_error != str(exc):
                self._status_error = str(exc)
                log.warning("cannot write the status file %s: %s", self.path, exc.strerror or exc)
        else:
            self._status_error = None
        self._write_metrics(doc)
        return status_line(doc)

    def _write_metrics(self, doc: dict[str, Any]) -> None:
        if self.metrics_path is None:
            return
        try:
            metrics.write(self.metrics_path, doc)
        except OSError as exc:  # said once per cause, not every second
            if self._metrics_error != str(exc):
                self._metrics_error = str(exc)
                log.warning("cannot write the metrics file %s: %s", self.metrics_path, exc.strerror or exc)
        else:
            self._metrics_error = None

    def document(self, now: float, state: str = "running") -> dict[str, Any]:
        with self._lock:
            # (shown from its start: a model definition built for seconds before a byte is written showed as
            # "converting: nothing")
            running = [item.doc(now) for item in self._running.values() if item.converting]
            counts = dict(self.counts)
            failures = list(self.failures)
            totals = {
                "converted_bytes": self.converted_bytes,
                "converted_seconds": round(self.converted_seconds, 3),
                "last_success_unix": self.last_success_unix,
                "last_failure_unix": self.last_failure_unix,
            }
        return {
            "state": state,
            "pid": os.getpid(),
            "host": socket.gethostname(),  # which node, where several share a tree (pids repeat in containers)
            "config": os.fsdecode(self.config_path),
            "started": self.started,
            "updated": utc_timestamp(),
            "updated_unix": time.time(),
            "running": running,
            "queued": self.queued,
            "waiting": self.waiting,
            "counts": counts,
            "recent_failures": failures,
            "started_unix": self.started_unix,
            **totals,
        }

    def _announce(self, now: float) -> None:
        with self._lock:
            items = list(self._running.values())
        for item in items:
            elapsed = now - item.progress.started
            if not item.progress.total or elapsed < CONVERTING_AFTER:
                continue
            if item.announced is None or now - item.announced >= CONVERTING_EVERY:
                item.announced = now
                log.info("converting %s: %s", item.source, describe(item.progress.snapshot(now)))


def status_line(doc: dict[str, Any]) -> str:
    """One line for systemd's STATUS=: counts, queue, and each running conversion's progress."""
    counts = doc["counts"]
    done = sum(counts.get(status, 0) for status in SUCCESSES)
    failed = sum(counts.get(status, 0) for status in FAILURES)
    text = f"converted {done}; failed {failed}; queue {doc['queued']}"
    for item in doc["running"]:
        if not item["total"]:
            text += f"; preparing {os.path.basename(item['source'])}"
            continue
        percent = item["percent"] or 0.0
        rate = f" at {human_bytes(item['rate'])}/s" if item["rate"] else ""
        text += f"; converting {os.path.basename(item['source'])} {percent:.0f}%{rate}"
    return text


def _write_atomically(path: Path, text: str) -> None:
    scratch = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, STATUS_MODE)
    try:
        os.fchmod(fd, STATUS_MODE)
        os.write(fd, text.encode("utf-8"))
    finally:
        os.close(fd)
    os.replace(scratch, path)


# ---------------------------------------------------------------------------------------------- syncd status


def read_status(state_dir: Path) -> dict[str, Any]:
    path = Path(state_dir) / STATUS_FILE
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SyncdError(
            "no status file: the daemon has not run with this configuration (a state_dir changed since the daemon "
            "started takes effect at its restart)",
            str(path),
        ) from None
    except PermissionError:  # exit 2, not `status`'s 1 ("the daemon does not run"), which a monitor would believe
        raise UsageError(
            "permission denied: run it as root or as a member of the service's group, who may read it", str(path)
        ) from None
    except (OSError, ValueError) as exc:
        raise SyncdError(f"unreadable status file: {exc}", str(path)) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("counts"), dict):
        raise SyncdError("not a syncd status file", str(path))
    running = doc.get("state") == "running" and _process_alive(doc)
    updated = doc.get("updated_unix")
    age = time.time() - updated if isinstance(updated, int | float) else None
    doc["alive"] = running and (age is not None and age <= STALE_AFTER or _is_syncd(doc))
    if doc["alive"] and (age is None or age > STALE_AFTER):
        # the daemon runs but does not rewrite its status (a full or read-only state directory): not "not
        # running", which invites a restart and hides the failure the journal tells
        doc["stale_seconds"] = None if age is None else round(age)
    return doc


def _process_alive(doc: dict[str, Any]) -> bool:
    try:
        os.kill(int(doc.get("pid", 0)), 0)
    except (OSError, ValueError, OverflowError) as exc:
        return isinstance(exc, OSError) and exc.errno == errno.EPERM  # alive, as another user
    return True


def _is_syncd(doc: dict[str, Any]) -> bool:
    """The process of the status's pid still is a syncd (not another one that took its pid since)."""
    try:
        with open(f"/proc/{int(doc.get('pid', 0))}/cmdline", "rb") as cmdline:
            return b"syncd" in cmdline.read()
    except (OSError, ValueError):
        return False
