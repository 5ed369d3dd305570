"""The daemon pauses Python's cyclic collector while it converts (syncd/daemon/collector.py): off from the
first conversion's start to the last one's end, whichever thread ends last; one full collection per
`max_pause` while conversions overlap without a break; never turned on where someone else had turned it off."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest

from syncd.daemon.collector import CollectorPause


@pytest.fixture(autouse=True)
def collector_on() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def full_collections() -> tuple[list[int], object]:
    """A list that gets one entry per full collection from now on, and the callback to remove after."""
    seen: list[int] = []

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "stop" and info["generation"] == 2:
            seen.append(1)

    gc.callbacks.append(callback)
    return seen, callback


def test_off_while_any_conversion_runs_and_on_when_the_last_one_ends() -> None:
    pause = CollectorPause()
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def first() -> None:
        with pause.converting():
            seen["first, alone"] = gc.isenabled()
            first_in.set()
            second_in.wait(30)
        first_out.set()

    def second() -> None:
        first_in.wait(30)
        with pause.converting():
            second_in.set()
            first_out.wait(30)
            seen["second, after the first ended"] = gc.isenabled()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert seen == {"first, alone": False, "second, after the first ended": False}
    assert gc.isenabled()
    with pytest.raises(RuntimeError), pause.converting():  # a conversion that fails resumes it too
        raise RuntimeError("failed")
    assert gc.isenabled()


def test_overlapping_conversions_get_a_full_collection_every_max_pause() -> None:
    clock = Clock()
    pause = CollectorPause(max_pause=30.0, clock=clock)
    seen, callback = full_collections()
    try:
        with pause.converting():
            for step in range(4):  # conversions that overlap, one ending 20 s after the other began
                clock.now += 20.0
                with pause.converting():
                    pass
                assert not gc.isenabled()
                if step == 0:
                    assert not seen  # 20 s paused: none yet
            clock.now += 5.0
        assert len(seen) == 2  # at 40 s and at 80 s (a collection at 40 s restarted the count)
    finally:
        gc.callbacks.remove(callback)
    assert gc.isenabled()


def test_a_collector_someone_else_turned_off_stays_off_and_is_not_run() -> None:
    clock = Clock()
    pause = CollectorPause(max_pause=1.0, clock=clock)
    gc.disable()
    seen, callback = full_collections()
    try:
        with pause.converting():
            clock.now += 5.0
            with pause.converting():
                pass
        assert not gc.isenabled() and not seen
    finally:
        gc.callbacks.remove(callback)
