"""`syncd status -c FILE`: what the running daemon does now, what waits, what failed (from its status file)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, TextIO

from syncd.daemon.config import load_locations
from syncd.daemon.status import read_status
from syncd.engine.progress import human_bytes, human_seconds


def render_status(doc: dict[str, Any]) -> list[str]:
    state = "running" if doc["alive"] else f"not running (last status {doc.get('updated')}, {doc.get('state')})"
    if doc["alive"] and "stale_seconds" in doc:
        state = (
            f"running, but its status is from {doc.get('updated')}: it cannot write its status file (a full or "
            "read-only state directory? the journal says)"
        )
    host = f" on {doc['host']}" if doc.get("host") else ""  # (absent from a status written by an older daemon)
    lines = [f"syncd: {state}; pid {doc.get('pid')}{host}, started {doc.get('started')}, config {doc.get('config')}"]
    counts = doc["counts"]
    order = ("converted", "updated", "in_sync", "refused", "conflict", "error", "skipped")
    lines.append("since start: " + ", ".join(f"{counts.get(status, 0)} {status}" for status in order))
    lines.append(f"queued: {doc.get('queued', 0)}")
    for item in doc.get("waiting") or []:  # absent from a status written by an older daemon
        due = f"due in {human_seconds(item['due_in'])}" if (item.get("due_in") or 0) >= 1 else "due now"
        lines.append(f"  {item.get('source')}  {due}")
    running = doc.get("running") or []
    lines.append(f"converting: {len(running) if running else 'nothing'}")
    for item in running:
        if not item.get("total"):
            since = human_seconds(item.get("elapsed") or 0)
            lines.append(f"  {item['source']}  preparing (reading its table, planning) for {since}")
            continue
        rate = f"{human_bytes(item['rate'])}/s" if item.get("rate") else "-"
        eta = f"{human_seconds(item['eta'])} left" if item.get("eta") is not None else ""
        lines.append(
            f"  {item['source']}  {item.get('percent') or 0:.0f}% of {human_bytes(item['total'])}  {rate}  {eta}"
        )
    failures = doc.get("recent_failures") or []
    lines.append(f"recent failures: {len(failures) if failures else 'none'}")
    lines.extend(_failure_line(f) for f in failures)
    return [line.rstrip() for line in lines]


def run_status_command(config_path: Path, as_json: bool = False, out: TextIO | None = None) -> int:
    """`syncd status -c FILE`: 0 when the daemon runs, 1 when its last status says it does not."""
    out = out or sys.stdout
    config = load_locations(config_path)
    doc = read_status(config.state_dir)
    if as_json:
        out.write(json.dumps(doc) + "\n")
    else:
        out.write("\n".join(render_status(doc)) + "\n")
    out.flush()
    return 0 if doc["alive"] else 1


def _failure_line(failure: dict[str, Any]) -> str:
    """`  TIME  STATUS  WHAT: WHY`; WHAT left out when the record named no file (a status of an older daemon)."""
    what = failure.get("source")
    why = f"{what}: {failure.get('error')}" if what else str(failure.get("error"))
    return f"  {failure.get('time')}  {failure.get('status')}  {why}"
