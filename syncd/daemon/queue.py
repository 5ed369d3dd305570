"""A bounded, de-duplicating work queue with due times, served by a pool of worker threads.

A path is queued at most once: a new event for a path already waiting only moves its due time (and marks
it `closed` if the writer closed it); a path being worked on is queued again after its worker finishes,
so a file rewritten mid-conversion is looked at once more. When the queue is full, new paths are dropped
and `overflowed` is set, and the daemon schedules a full scan for when there is room again.

Due times are read from `clock` (time.monotonic unless given): a test passes a clock it moves by hand, then
calls `wake()` so that idle workers look at it again (tests/test_queue.py).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("syncd.queue")


@dataclass
class _Item:
    key: tuple[Any, Path]
    watch: Any
    path: Path
    due: float
    closed: bool


def _due(item: _Item) -> float:
    return item.due


Work = Callable[[Any, Path, bool], float | None]  # returns seconds until a retry, or None


class WorkQueue:
    def __init__(
        self, work: Work, workers: int, capacity: int = 100_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.work = work
        self.capacity = capacity
        self._clock = clock
        self.overflowed = False
        self._items: dict[tuple[Any, Path], _Item] = {}
        self._heap: list[tuple[float, int, tuple[Any, Path]]] = []
        self._busy: set[tuple[Any, Path]] = set()
        # worker thread name -> (started, or last made progress; path) while busy
        self._since: dict[str, tuple[float, Path]] = {}
        self._again: dict[tuple[Any, Path], _Item] = {}
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._stopping = False
        self._threads = [
            threading.Thread(target=self._serve, name=f"syncd-worker-{i}", daemon=True) for i in range(workers)
        ]
        self.done = 0

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def put(self, watch: Any, path: Path, closed: bool, delay: float = 0.0) -> bool:
        with self._cond:
            return self._put(watch, path, closed, self._clock() + delay)

    def _put(self, watch: Any, path: Path, closed: bool, due: float) -> bool:
        """`put` with the lock held: `_finish` queues a path again in the same hold that ends its work, so
        `pending()` and `idle()` never see it out of the queue in between."""
        if self._stopping:
            return False
        key = (watch.path, path)
        if key in self._busy:
            self._again[key] = _Item(key, watch, path, due, closed or key in self._again and self._again[key].closed)
            return True
        item = self._items.get(key)
        if item is None:
            if len(self._items) >= self.capacity:
                self.overflowed = True
                return False
            item = self._items[key] = _Item(key, watch, path, due, closed)
        else:
            item.watch = watch  # the latest event's: a reload since the first event changed its settings
            item.closed = item.closed or closed
            item.due = due if not closed else min(item.due, due)
        heapq.heappush(self._heap, (item.due, next(self._seq), key))
        self._cond.notify()
        return True

    def pending(self) -> int:
        """Paths waiting or being worked on (what the queue's capacity counts)."""
        with self._cond:
            return len(self._items) + len(self._busy)

    def queued(self) -> int:
        """Paths waiting, not those being worked on: what `syncd status` counts as queued, beside what it
        shows converting."""
        with self._cond:
            return len(self._items)

    def waiting(self, limit: int) -> list[tuple[Path, float]]:
        """The `limit` waiting paths due first, each with its due time (on the queue's clock): what `syncd status`
        shows, so an operator sees a file settling or backing off instead of guessing."""
        with self._cond:
            return [(item.path, item.due) for item in heapq.nsmallest(limit, self._items.values(), key=_due)]

    def _next(self) -> _Item | None:
        with self._cond:
            while True:
                if self._stopping:
                    return None
                now = self._clock()
                while self._heap:
                    due, _, key = self._heap[0]
                    item = self._items.get(key)
                    if item is None or item.due != due:
                        heapq.heappop(self._heap)  # superseded entry
                        continue
                    if due > now:
                        break
                    heapq.heappop(self._heap)
                    del self._items[key]
                    self._busy.add(key)
                    self._since[threading.current_thread().name] = (now, item.path)
                    return item
                timeout = (self._heap[0][0] - now) if self._heap else None
                self._cond.wait(timeout)

    def _serve(self) -> None:
        while (item := self._next()) is not None:
            retry = None
            try:
                retry = self.work(item.watch, item.path, item.closed)
            except Exception:  # the work function logs its own failures; this is a last line of defence
                log.exception("unexpected failure while processing %s", item.path)
            self._finish(item, retry)

    def _finish(self, item: _Item, retry: float | None) -> None:
        with self._cond:
            self._busy.discard(item.key)
            self._since.pop(threading.current_thread().name, None)
            self.done += 1
            again = self._again.pop(item.key, None)
            now = self._clock()
            if again is not None:
                self._put(again.watch, again.path, again.closed, max(now, again.due))
            elif retry is not None:
                self._put(item.watch, item.path, item.closed, now + retry)
            self._cond.notify_all()

    def progressed(self, worker: str) -> None:
        """The work of the worker thread named `worker` moved on (bytes converted, told from any thread): it
        is not stuck, however long it has had its path."""
        with self._cond:
            since = self._since.get(worker)
            if since is not None:
                self._since[worker] = (self._clock(), since[1])

    def stuck(self, limit: float) -> list[tuple[str, float, Path]]:
        """Workers busy with one path for more than `limit` seconds without progress: (worker, seconds, path)."""
        now = self._clock()
        with self._cond:
            return [(name, now - t, path) for name, (t, path) in self._since.items() if now - t > limit]

    def wake(self) -> None:
        """Have idle workers read the clock again. With time.monotonic nothing needs it (a worker's wait ends
        when the first waiting path falls due); a clock moved by hand does."""
        with self._cond:
            self._cond.notify_all()

    def idle(self) -> bool:
        with self._cond:
            return not self._items and not self._busy

    def stop(self, timeout: float) -> bool:
        """Stop taking work; wait up to `timeout` for running work. True if everything finished."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)
