"""Python's cyclic garbage collector, paused while the daemon converts.

A conversion builds a few objects per tensor that all live until it ends (hundreds of thousands for a
10,000-tensor checkpoint); the collector's passes over them free nothing. `syncd convert` turns it off for its
one conversion (cli/main.py). In the daemon, which runs for months, the same passes took a fifth of each such
conversion (10,000 tensors of 4 KiB: 570-870 ms with the collector, 470-610 ms without). So the collector is
paused while at least one conversion runs and resumed when the last one ends; while conversions overlap
without a break, one full collection runs every `max_pause` seconds, so that garbage in reference cycles made
meanwhile, by any thread, stays bounded.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

MAX_PAUSE = 30.0  # seconds the collector may stay paused while conversions follow each other without a break


class CollectorPause:
    def __init__(self, max_pause: float = MAX_PAUSE, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_pause = max_pause
        self._clock = clock
        self._lock = threading.Lock()
        self._running = 0
        self._paused_at = 0.0
        self._resume = False  # whether the collector was on when the pause began (someone else may have turned it off)

    @contextmanager
    def converting(self) -> Iterator[None]:
        """Around one conversion (any thread)."""
        with self._lock:
            if self._running == 0:
                self._resume = gc.isenabled()
                self._paused_at = self._clock()
                gc.disable()
            self._running += 1
        try:
            yield
        finally:
            self._end()

    def _end(self) -> None:
        with self._lock:
            self._running -= 1
            if self._running == 0:
                if self._resume:
                    gc.enable()
                return
            collect = self._resume and self._clock() - self._paused_at >= self.max_pause
            if collect:
                self._paused_at = self._clock()
        if collect:
            gc.collect()
