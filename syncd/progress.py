"""Progress of one conversion: a callback the writer feeds with bytes written, a rate/ETA estimate over it,
and a one-line bar for a terminal.

The hook into the conversion is `track(specs, callback)`: every tensor's fill is wrapped so the bytes it
delivers are counted, whatever path they take (sequential writes, positioned writes of a transpose, or the
kernel's copy_file_range). The callback receives (bytes written so far, bytes to write in all).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
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


# ---------------------------------------------------------------------------------------------- the hook


class _CountingSink:
    """Passes everything to the writer's sink and reports what went through."""

    def __init__(self, sink: Any, counter: _Counter) -> None:
        self._sink = sink
        self._counter = counter

    @property
    def checks_data(self) -> bool:
        return self._sink.checks_data

    def write(self, data: Any) -> None:
        self._sink.write(data)
        self._counter.add(memoryview(data).nbytes)

    def pwrite(self, data: Any, rel_offset: int) -> None:
        self._sink.pwrite(data, rel_offset)
        self._counter.add(memoryview(data).nbytes)

    def copy_from(self, src_fd: int, src_offset: int, count: int) -> bool:
        copied = self._sink.copy_from(src_fd, src_offset, count)
        if copied:
            self._counter.add(count)
        return copied

    def __getattr__(self, name: str) -> Any:  # anything else a sink offers, unchanged
        return getattr(self._sink, name)


@dataclass
class _Counter:
    total: int
    callback: ProgressCallback
    done: int = 0

    def add(self, count: int) -> None:
        self.done += count
        self.callback(self.done, self.total)


def track(specs: Sequence[Any], callback: ProgressCallback) -> list[Any]:
    """The same tensor specs (syncd.formats.table.TensorSpec) with fills that report to `callback`."""
    counter = _Counter(sum(spec.nbytes for spec in specs), callback)
    callback(0, counter.total)

    def wrap(fill: Callable[[Any], None]) -> Callable[[Any], None]:
        return lambda sink: fill(_CountingSink(sink, counter))

    return [replace(spec, fill=wrap(spec.fill)) for spec in specs]


# ---------------------------------------------------------------------------------------------- measuring


@dataclass
class ProgressState:
    """Where one conversion stands; thread-safe to update from the worker and read from elsewhere."""

    started: float = field(default_factory=time.monotonic)
    done: int = 0
    total: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def update(self, done: int, total: int) -> None:
        with self._lock:
            self.done, self.total = done, total

    def snapshot(self, now: float | None = None) -> dict[str, float | int | None]:
        """percent, bytes, rate (bytes/s) and eta (s) as plain numbers (None where unknown)."""
        with self._lock:
            done, total = self.done, self.total
        elapsed = max((now or time.monotonic()) - self.started, 1e-9)
        rate = done / elapsed if done else None
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
