"""Progress of one conversion: a callback the writer feeds with bytes written, a rate/ETA estimate over it,
and a one-line bar for a terminal.

The conversion's one-pass writer (write/planned.py's write_planned) calls the callback as its writes land, with
(bytes written so far, bytes to write in all).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

ProgressCallback = Callable[[int, int], None]


def human_bytes(count: float) -> str:
    if count < 1024:
        return f"{int(count)} B"
    value = float(count)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def human_seconds(seconds: float) -> str:
    seconds = max(0, round(seconds))
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


# ---------------------------------------------------------------------------------------------- measuring


@dataclass
class ProgressState:
    """Where one conversion stands; thread-safe to update from the worker and read from elsewhere."""

    started: float = field(default_factory=time.monotonic)
    done: int = 0
    total: int = 0
    # when bytes began to be written: the rate is of the writing (planning, a model definition built for
    # seconds, made a daemon's first line say "8.1 KiB/s, 9:36 left" one second before the end)
    writing_since: float | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def update(self, done: int, total: int) -> None:
        with self._lock:
            if total and self.writing_since is None:
                self.writing_since = time.monotonic()
            self.done, self.total = done, total

    def snapshot(self, now: float | None = None) -> dict[str, float | int | None]:
        """percent, bytes, rate (bytes/s) and eta (s) as plain numbers (None where unknown)."""
        with self._lock:
            done, total, writing_since = self.done, self.total, self.writing_since
        now = now or time.monotonic()
        elapsed = max(now - self.started, 1e-9)
        rate = done / max(now - writing_since, 1e-9) if done and writing_since is not None else None
        eta = (total - done) / rate if rate and total >= done else None
        percent = 100.0 * done / total if total else None
        return {"done": done, "total": total, "percent": percent, "rate": rate, "eta": eta, "elapsed": elapsed}


def describe(snapshot: dict[str, Any]) -> str:
    """`42% of 1.0 GiB, 120.5 MiB/s, 0:05 left` from a ProgressState snapshot."""
    parts = []
    if snapshot["percent"] is not None:
        parts.append(f"{snapshot['percent']:.0f}% of {human_bytes(snapshot['total'])}")
    if snapshot["rate"]:
        parts.append(f"{human_bytes(snapshot['rate'])}/s")
    if snapshot["eta"] is not None:
        parts.append(f"{human_seconds(snapshot['eta'])} left")
    return ", ".join(parts) or "starting"


# ---------------------------------------------------------------------------------------------- the bar


class ProgressBar:
    """`name  42% [########            ] 430.1 MiB / 1.0 GiB  120.5 MiB/s  ETA 0:05` redrawn in place on a
    terminal, at most ten times a second; close() erases it so the result line stands alone."""

    WIDTH = 24
    INTERVAL = 0.1

    def __init__(self, stream: TextIO, label: str) -> None:
        self.stream = stream
        self.label = label
        self.state = ProgressState()
        self._last_draw = 0.0
        self._drawn = False

    @classmethod
    def for_stream(cls, stream: TextIO, label: str, enabled: bool = True) -> ProgressBar | None:
        """A bar on `stream` when it is a terminal and bars are wanted; otherwise None (nothing is drawn)."""
        try:
            tty = stream.isatty()
        except (AttributeError, ValueError):
            tty = False
        return cls(stream, label) if enabled and tty else None

    def update(self, done: int, total: int) -> None:
        self.state.update(done, total)
        now = time.monotonic()
        if now - self._last_draw >= self.INTERVAL or (total and done >= total):
            self._last_draw = now
            self._draw(self.state.snapshot(now))

    def render(self, snap: dict[str, Any]) -> str:
        fraction = snap["done"] / snap["total"] if snap["total"] else 0.0
        filled = int(fraction * self.WIDTH)
        rate = f"{human_bytes(snap['rate'])}/s" if snap["rate"] else "-"
        eta = human_seconds(snap["eta"]) if snap["eta"] is not None else "-"
        return (
            f"{self.label} {fraction * 100:3.0f}% [{'#' * filled}{' ' * (self.WIDTH - filled)}] "
            f"{human_bytes(snap['done'])} / {human_bytes(snap['total'])}  {rate}  ETA {eta}"
        )

    def _draw(self, snap: dict[str, Any]) -> None:
        self.stream.write("\r\x1b[K" + self.render(snap))
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._drawn = False
