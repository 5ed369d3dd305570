"""The daemon's work queue on a clock moved by hand: which path a worker gets and when, backoff, repeated
events, a full queue, being stuck and stopping. Real worker threads; no sleeps: every wait is for a state the
test can name, with a timeout that only catches a hang."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from daemonutil import wait_until

from syncd.daemon.queue import WorkQueue

HANG = 30.0  # seconds: a bound that catches a hang, never a measure of speed
START = 1000.0


@dataclass(frozen=True)
class Tree:
    """What the queue needs of a watch: its path, half of each item's key."""

    path: Path


RUNS = Tree(Path("/runs"))
OTHER = Tree(Path("/other"))


class ManualClock:
    """time.monotonic's stand-in: it moves only when the test moves it, and tells the test when a worker
    (any thread but the one that made it) has read the time it now shows."""

    def __init__(self) -> None:
        self.now = START
        self._test_thread = threading.current_thread()
        self._read_by_worker = False
        self._cond = threading.Condition()

    def __call__(self) -> float:
        with self._cond:
            if threading.current_thread() is not self._test_thread:
                self._read_by_worker = True
                self._cond.notify_all()
            return self.now

    def advance(self, seconds: float) -> None:
        with self._cond:
            self.now += seconds
            self._read_by_worker = False

    def wait_for_a_worker_to_read_it(self) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self._read_by_worker, HANG), "no worker read the clock"


class Work:
    """The work function: records what each call saw (watch path, path, closed) and answers with the retry
    delays it was given, in turn. A path in `held` waits inside its call until `release(path)`."""

    def __init__(self, retries: list[float | None] | None = None, held: tuple[Path, ...] = ()) -> None:
        self.calls: list[tuple[Path, Path, bool]] = []
        self.watches: list[Tree] = []  # the watch of each call, settings and all
        self.retries = list(retries or [])
        self.gates = {path: threading.Event() for path in held}
        self.inside: dict[Path, int] = {}
        self.most_inside = 0
        self._cond = threading.Condition()

    def __call__(self, watch: Tree, path: Path, closed: bool) -> float | None:
        with self._cond:
            self.calls.append((watch.path, path, closed))
            self.watches.append(watch)
            self.inside[path] = self.inside.get(path, 0) + 1
            self.most_inside = max(self.most_inside, self.inside[path])
            self._cond.notify_all()
        gate = self.gates.get(path)
        if gate is not None:
            assert gate.wait(HANG), f"{path} was never released"
        with self._cond:
            self.inside[path] -= 1
            return self.retries.pop(0) if self.retries else None

    def wait_for_calls(self, count: int) -> list[tuple[Path, Path, bool]]:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.calls) >= count, HANG), f"calls so far: {self.calls}"
            return list(self.calls)

    def paths(self) -> list[Path]:
        with self._cond:
            return [path for _, path, _ in self.calls]

    def release(self, path: Path) -> None:
        self.gates[path].set()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def make_queue(clock: ManualClock) -> Callable[..., WorkQueue]:
    """Queues on `clock`; each is stopped at the end of the test (its held work released first)."""
    made: list[tuple[WorkQueue, Work]] = []

    def make(work: Work, workers: int = 1, capacity: int = 100) -> WorkQueue:
        queue = WorkQueue(work, workers, capacity, clock=clock)
        made.append((queue, work))
        return queue

    yield make
    for queue, work in made:
        for gate in work.gates.values():
            gate.set()
        assert queue.stop(HANG), "a worker did not stop"


def look(queue: WorkQueue, clock: ManualClock) -> None:
    """Have the workers look at the clock now; return once one of them has read it and taken a path or gone
    back to waiting (it decides while holding the queue's lock, which `pending` takes after it)."""
    queue.wake()
    clock.wait_for_a_worker_to_read_it()
    queue.pending()


def busy_with(make_queue: Callable[..., WorkQueue], path: Path, workers: int = 1) -> tuple[WorkQueue, Work]:
    """A started queue one of whose workers is inside the work function with `path`, held there."""
    work = Work(held=(path,))
    queue = make_queue(work, workers=workers)
    queue.start()
    queue.put(RUNS, path, closed=False)
    work.wait_for_calls(1)
    return queue, work


def finished(queue: WorkQueue, count: int) -> None:
    wait_until(lambda: queue.done >= count, HANG, f"{count} finished path(s)")


a, b, c, d, e = (Path(f"/runs/{name}.safetensors") for name in "abcde")


# ------------------------------------------------------------------------------------------ order and due times


def test_paths_are_handed_out_in_due_order_and_equal_due_times_in_arrival_order(
    make_queue: Callable[..., WorkQueue], clock: ManualClock
) -> None:
    work = Work()
    queue = make_queue(work)
    for path, delay in [(a, 3.0), (b, 1.0), (c, 2.0), (d, 0.0), (e, 2.0)]:
        assert queue.put(RUNS, path, closed=False, delay=delay)
    assert queue.waiting(2) == [(d, START), (b, START + 1)]
    clock.advance(10)
    queue.start()
    work.wait_for_calls(5)
    assert work.paths() == [d, b, c, e, a]


def test_a_path_is_not_handed_out_before_it_is_due(make_queue: Callable[..., WorkQueue], clock: ManualClock) -> None:
    work = Work()
    queue = make_queue(work)
    queue.start()
    queue.put(RUNS, a, closed=False, delay=5.0)
    clock.advance(4.5)
    look(queue, clock)
    assert work.calls == [] and queue.waiting(5) == [(a, START + 5)]
    clock.advance(0.5)
    look(queue, clock)
    assert work.wait_for_calls(1) == [(RUNS.path, a, False)]
    finished(queue, 1)
    assert queue.idle()


def test_a_retry_comes_back_when_the_work_asked_and_no_sooner(
    make_queue: Callable[..., WorkQueue], clock: ManualClock
) -> None:
    work = Work(retries=[30.0, 60.0, None])  # backoff: the work function says how long to wait each time
    queue = make_queue(work)
    queue.start()
    queue.put(RUNS, a, closed=True)
    finished(queue, 1)
    assert queue.waiting(5) == [(a, START + 30)] and queue.pending() == 1 and not queue.idle()
    clock.advance(29.5)
    look(queue, clock)
    assert len(work.calls) == 1
    clock.advance(0.5)
    look(queue, clock)
    finished(queue, 2)
    assert queue.waiting(5) == [(a, START + 90)]
    clock.advance(60)
    look(queue, clock)
    finished(queue, 3)
    assert work.calls == [(RUNS.path, a, True)] * 3  # the writer's close is remembered across retries
    assert queue.idle()


# ------------------------------------------------------------------------------------------ repeated events


def test_repeated_events_for_a_waiting_path_are_one_item_whose_due_time_they_move(
    make_queue: Callable[..., WorkQueue], clock: ManualClock
) -> None:
    work = Work()
    queue = make_queue(work)
    assert queue.put(RUNS, a, closed=False, delay=2.0)
    clock.advance(1)
    assert queue.put(RUNS, a, closed=False, delay=2.0)  # still being written: its settle time starts again
    assert queue.waiting(5) == [(a, START + 3)] and queue.pending() == 1
    assert queue.put(RUNS, a, closed=True)  # closed: due now, whatever settle time was left
    assert queue.waiting(5) == [(a, START + 1)]
    assert queue.put(RUNS, a, closed=False, delay=2.0)  # written again after its close: settles again
    assert queue.waiting(5) == [(a, START + 3)]
    assert queue.put(OTHER, a, closed=False)  # the same path under another watch is another item
    assert queue.pending() == 2
    clock.advance(2)
    queue.start()
    finished(queue, 2)
    assert work.calls == [(OTHER.path, a, False), (RUNS.path, a, True)]  # the close is remembered
    assert queue.idle()


@dataclass(frozen=True)
class ReloadedTree(Tree):
    """A watch of the same tree whose settings a reload changed."""

    settle_seconds: float = 1.0


def test_a_path_is_worked_on_with_the_watch_of_its_latest_event(
    make_queue: Callable[..., WorkQueue], clock: ManualClock
) -> None:
    # a reload replaces a watch's settings while its paths wait or are worked on: the next conversion of each
    # must see the new ones, not those of the event that first queued it
    before, after = ReloadedTree(RUNS.path, 1.0), ReloadedTree(RUNS.path, 30.0)
    work = Work(held=(b,))
    queue = make_queue(work, workers=2)
    assert queue.put(before, a, closed=False, delay=2.0)
    assert queue.put(after, a, closed=True)  # waiting: one item, now with the reloaded watch
    assert queue.pending() == 1
    queue.start()
    queue.put(before, b, closed=True)
    work.wait_for_calls(2)  # a done (or being done), b held inside the work
    assert queue.put(after, b, closed=True)  # an event for b while it is worked on: it comes back, reloaded
    work.release(b)
    finished(queue, 3)
    calls = [(path, watch) for (_, path, _), watch in zip(work.calls, work.watches, strict=True)]
    assert [watch for path, watch in calls if path == a] == [after]
    assert [watch for path, watch in calls if path == b] == [before, after]


def test_a_path_being_worked_on_is_pending_but_not_queued(make_queue: Callable[..., WorkQueue]) -> None:
    """`syncd status` said `queued: 1` beside the one file it showed converting, and listed nothing waiting."""
    queue, work = busy_with(make_queue, a)
    assert (queue.pending(), queue.queued(), queue.waiting(5)) == (1, 0, [])
    queue.put(RUNS, b, closed=True)
    assert (queue.pending(), queue.queued()) == (2, 1)
    work.release(a)
    finished(queue, 2)


def test_events_for_a_path_being_worked_on_bring_it_back_once_after_and_never_alongside(
    make_queue: Callable[..., WorkQueue], clock: ManualClock
) -> None:
    queue, work = busy_with(make_queue, a, workers=2)
    assert queue.put(RUNS, a, closed=True)
    assert queue.put(RUNS, a, closed=False, delay=10.0)  # the last event's settle time counts
    assert queue.waiting(5) == [] and queue.pending() == 1  # not waiting while it is worked on: held back
    work.release(a)
    finished(queue, 1)
    assert queue.waiting(5) == [(a, START + 10)]
    clock.advance(10)
    look(queue, clock)
    finished(queue, 2)
    assert work.calls == [(RUNS.path, a, False), (RUNS.path, a, True)]
    assert work.most_inside == 1  # the second worker never took it while the first had it
    assert queue.idle()


def test_a_full_queue_refuses_new_paths_and_says_it_overflowed(clock: ManualClock) -> None:
    queue = WorkQueue(Work(), workers=1, capacity=2, clock=clock)  # never started: nothing leaves it
    assert queue.put(RUNS, a, closed=False) and queue.put(RUNS, b, closed=False)
    assert not queue.overflowed
    assert not queue.put(RUNS, c, closed=False)
    assert queue.overflowed
    assert queue.put(RUNS, a, closed=True)  # a path already waiting needs no room
    assert queue.pending() == 2 and [path for path, _ in queue.waiting(5)] == [a, b]


# ------------------------------------------------------------------------------------------ workers


def test_a_work_function_that_raises_does_not_end_its_worker(
    make_queue: Callable[..., WorkQueue], caplog: pytest.LogCaptureFixture
) -> None:
    class Raises(Work):
        def __call__(self, watch: Tree, path: Path, closed: bool) -> float | None:
            super().__call__(watch, path, closed)
            if path == a:
                raise RuntimeError("a bug in the work function")
            return None

    work = Raises()
    queue = make_queue(work)
    queue.put(RUNS, a, closed=False)
    queue.put(RUNS, b, closed=False)
    with caplog.at_level(logging.ERROR, logger="syncd.queue"):
        queue.start()
        finished(queue, 2)
    assert work.paths() == [a, b] and queue.idle()
    assert [r.getMessage() for r in caplog.records] == [f"unexpected failure while processing {a}"]


def test_a_worker_busy_with_one_path_too_long_is_reported_stuck(
    make_queue: Callable[..., WorkQueue], clock: ManualClock
) -> None:
    queue, work = busy_with(make_queue, a)
    clock.advance(31)
    assert queue.stuck(30) == [("syncd-worker-0", 31.0, a)]
    assert queue.stuck(31) == []
    work.release(a)
    finished(queue, 1)
    assert queue.stuck(0) == []


def test_a_worker_making_progress_is_never_stuck_however_long_it_takes(
    make_queue: Callable[..., WorkQueue], clock: ManualClock
) -> None:
    """A checkpoint that takes longer than the limit to convert is no hang: only time without progress counts."""
    queue, work = busy_with(make_queue, a)
    for _ in range(5):
        clock.advance(20)
        queue.progressed("syncd-worker-0")
    clock.advance(30)
    assert queue.stuck(30) == []
    clock.advance(1)
    assert queue.stuck(30) == [("syncd-worker-0", 31.0, a)]
    queue.progressed("syncd-worker-1")  # (another worker's progress, or none's, changes nothing)
    assert queue.stuck(30) == [("syncd-worker-0", 31.0, a)]
    work.release(a)
    finished(queue, 1)


# ------------------------------------------------------------------------------------------ stopping


def test_stopping_hands_out_nothing_more_and_waits_only_as_long_as_asked(
    make_queue: Callable[..., WorkQueue],
) -> None:
    queue, work = busy_with(make_queue, a)
    queue.put(RUNS, b, closed=True)  # due, but the only worker is busy
    assert queue.stop(0) is False  # a conversion still runs: the daemon does not wait for it
    assert queue.put(RUNS, c, closed=True) is False
    work.release(a)
    assert queue.stop(HANG) is True
    assert work.paths() == [a]  # b was never handed out
    assert not queue.idle()  # and the daemon can tell that work was left


def test_stopping_idle_workers_ends_their_waits(make_queue: Callable[..., WorkQueue]) -> None:
    work = Work()
    queue = make_queue(work, workers=3)
    queue.start()
    queue.put(RUNS, a, closed=False, delay=3600.0)  # one waits for a due time, the others for work
    assert queue.stop(HANG) is True
    assert work.calls == []
