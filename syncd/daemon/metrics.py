"""Operators' metrics in Prometheus' text format, written to a file for node_exporter's textfile collector.

`metrics: /var/lib/node_exporter/textfile/syncd.prom` in the configuration makes the daemon rewrite that file
once a second, atomically (a scratch file beside it, then a rename: the collector reads the old or the new
document, never half of one). No port is opened. The counters start at zero when the daemon starts
(`syncd_start_time_seconds` says when), as a Prometheus counter may.

The values come from the status document (`syncd.daemon.status.Activity.document`), so `syncd status`, the
status file and the metrics never disagree.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from syncd.daemon.statuses import FAILURES, SUCCESSES, Status

METRICS_MODE = 0o644  # the collector runs as another user; nothing in the file is secret
# every status a file's decision can have, always written (0 until seen) so that rate() works from the start
COUNTED = (*sorted(SUCCESSES), *sorted(FAILURES), Status.WARNING, Status.REMOVED)


def render(doc: dict[str, Any]) -> str:
    """The status document as Prometheus text exposition format (version 0.0.4)."""
    return "".join(f"{line}\n" for line in _lines(doc))


def _lines(doc: dict[str, Any]) -> Iterator[str]:
    counts = doc["counts"]
    yield from _metric(
        "syncd_decisions_total", "counter", "Sync log lines written since the daemon started, by status."
    )
    for status in COUNTED:
        yield f'syncd_decisions_total{{status="{status}"}} {counts.get(status, 0)}'
    yield from _single("syncd_converted_bytes_total", "counter", "Bytes of outputs written.", doc["converted_bytes"])
    yield from _single(
        "syncd_conversion_seconds_total",
        "counter",
        "Seconds spent in conversions that wrote an output.",
        doc["converted_seconds"],
    )
    yield from _single("syncd_queue_depth", "gauge", "Files waiting in the work queue.", doc["queued"])
    yield from _single("syncd_conversions_in_flight", "gauge", "Conversions writing now.", len(doc["running"]))
    yield from _single(
        "syncd_last_success_timestamp_seconds",
        "gauge",
        "Unix time of the last converted, updated or in_sync decision (0: none since start).",
        doc["last_success_unix"] or 0,
    )
    yield from _single(
        "syncd_last_failure_timestamp_seconds",
        "gauge",
        "Unix time of the last refused, conflict, error or skipped decision (0: none since start).",
        doc["last_failure_unix"] or 0,
    )
    yield from _single("syncd_start_time_seconds", "gauge", "Unix time the daemon started.", doc["started_unix"])


def _metric(name: str, kind: str, help_text: str) -> Iterator[str]:
    yield f"# HELP {name} {help_text}"
    yield f"# TYPE {name} {kind}"


def _single(name: str, kind: str, help_text: str, value: float) -> Iterator[str]:
    yield from _metric(name, kind, help_text)
    yield f"{name} {_number(value)}"


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else repr(float(value))


def write(path: Path, doc: dict[str, Any]) -> None:
    """Replace the metrics file at `path` with the document's metrics, atomically."""
    scratch = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # not *.prom: the collector skips it
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, METRICS_MODE)
    try:
        os.fchmod(fd, METRICS_MODE)
        os.write(fd, render(doc).encode("ascii"))
    finally:
        os.close(fd)
    os.replace(scratch, path)
