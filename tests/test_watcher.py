"""The watcher against the real daemon: names that are temporary by convention, events the kernel dropped
(a real inotify queue overflow), events that never came (the periodic safety rescan). Real files, real
inotify, real signals; see daemonutil.py for the harness."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from daemonutil import DaemonRun, mentioning, stop_cleanly, write_file
from safetensors.torch import save
from watchdog.events import FileClosedEvent, FileSystemEvent, FileSystemEventHandler

from syncd.daemon.config import load_config
from syncd.daemon.watcher import Watcher
from syncd.engine.publish import is_scratch_name, open_scratch
from syncd.formats import BURNPACK, open_checkpoint

pytestmark = [pytest.mark.daemon, pytest.mark.torch]

MAX_QUEUED_EVENTS = Path("/proc/sys/fs/inotify/max_queued_events")


def checkpoint(seed: int) -> bytes:
    """A small PyTorch checkpoint: one Linear (`fc.weight` [4, 3], `fc.bias` [4])."""
    generator = torch.Generator().manual_seed(seed)
    return save({"fc.weight": torch.randn(4, 3, generator=generator), "fc.bias": torch.randn(4, generator=generator)})


def check_converted(source: Path, data: bytes) -> None:
    """`source`'s output beside it is the Burn form of `data` (the Linear weight transposed)."""
    with open_checkpoint(source.with_suffix(".bpk")) as reader:
        assert reader.header.format == BURNPACK
        assert {t.name: t.shape for t in reader.tensors} == {"fc.weight": (3, 4), "fc.bias": (4,)}
        assert reader.header.metadata["syncd.source"] == source.name
    assert source.read_bytes() == data


def names(directory: Path) -> set[str]:
    return {path.name for path in directory.iterdir()}


# ------------------------------------------------------------------------------------------ temporary names


def test_a_writers_temporary_names_are_never_converted(make_daemon: Callable[..., DaemonRun]) -> None:
    """Writers that save under a temporary name and rename when done: only the final names are converted,
    nothing is left beside the temporary names, and no line speaks of them."""
    run = make_daemon()
    run.start()
    runs = run.watch_dir("runs")
    settled = {".tmp-1.safetensors": "model.safetensors", "ckpt.tmp.safetensors": "ckpt.safetensors"}
    data = {final: checkpoint(seed) for seed, final in enumerate(settled.values())}
    for temporary, final in settled.items():
        write_file(runs / temporary, data[final])
    run.quiet(1.5)  # several settle periods: a daemon that takes temporary names has converted them by now
    for temporary, final in settled.items():
        os.rename(runs / temporary, runs / final)
    # renamed away at once, before any settle time: a daemon that queued the temporary name finds it gone
    data["quick.safetensors"] = checkpoint(7)
    write_file(runs / ".quick.safetensors.part.safetensors", data["quick.safetensors"])
    os.rename(runs / ".quick.safetensors.part.safetensors", runs / "quick.safetensors")

    run.wait_for("converted", [runs / final for final in data])
    run.quiet(1.0)
    assert [r["status"] for r in run.records()] == ["started"] + ["converted"] * len(data), run.log_text()
    assert names(runs) == set(data) | {Path(final).with_suffix(".bpk").name for final in data}
    for final, content in data.items():
        check_converted(runs / final, content)
    for temporary in [*settled, ".quick"]:
        assert mentioning(run.records(), temporary) == []
    stop_cleanly(run)


def test_the_ignore_setting_replaces_the_default(make_daemon: Callable[..., DaemonRun]) -> None:
    """A global `ignore:` replaces the default list (dotfiles are converted then); a watch's own `ignore:`
    replaces the global one."""
    run = make_daemon([{"path": "runs"}, {"path": "other", "ignore": []}], ignore=["draft-*"])
    run.start()
    runs, other = run.watch_dir("runs"), run.watch_dir("other")
    data = {name: checkpoint(seed) for seed, name in enumerate(["draft-1.safetensors", ".hidden.safetensors"])}
    for directory in (runs, other):
        for name, content in data.items():
            write_file(directory / name, content)
    converted = [runs / ".hidden.safetensors", other / ".hidden.safetensors", other / "draft-1.safetensors"]
    run.wait_for("converted", converted)
    run.quiet(1.0)
    assert sorted(r["source"] for r in run.statuses("converted")) == sorted(map(str, converted))
    assert names(runs) == {"draft-1.safetensors", ".hidden.safetensors", ".hidden.bpk"}
    for source in converted:
        check_converted(source, data[source.name])
    stop_cleanly(run)


# ------------------------------------------------------------------------------------------ lost events


@pytest.mark.root
def test_a_real_inotify_queue_overflow_is_caught_up_by_a_rescan(make_daemon: Callable[..., DaemonRun]) -> None:
    """While the daemon is stopped, more files appear than the kernel queues events for (each new file makes
    at least two: create and close); the checkpoints written last find the queue full and their events are
    dropped. The daemon learns of the overflow from inotify itself, logs it and rescans: every checkpoint is
    converted. The periodic safety rescan is far off, so only the overflow can have found them."""
    run = make_daemon(rescan_interval=3600)
    run.start()
    runs = run.watch_dir("runs")
    noise = runs / "noise"
    noise.mkdir()
    run.quiet(0.5)  # the new directory is watched
    flood = int(MAX_QUEUED_EVENTS.read_text()) + 1000
    data = {runs / f"late-{index}.safetensors": checkpoint(index) for index in range(5)}
    with run.held():
        for index in range(flood):
            (noise / f"{index}.txt").touch()
        for path, content in data.items():
            write_file(path, content)
    run.wait_for("converted", data, timeout=180)
    overflow = [r for r in run.statuses("error") if "overflowed" in r.get("reason", "")]
    assert [r["watch"] for r in overflow] == [str(runs)], run.log_text()
    run.quiet(1.0)
    assert {r["status"] for r in run.records()} == {"started", "error", "converted"}, run.log_text()
    for path, content in data.items():
        check_converted(path, content)
    stop_cleanly(run)


@contextlib.contextmanager
def bind_mounted(source: Path, target: Path) -> Iterator[None]:
    subprocess.run(["mount", "--bind", os.fspath(source), os.fspath(target)], check=True)
    try:
        yield
    finally:
        subprocess.run(["umount", os.fspath(target)], check=True)


@pytest.mark.root
def test_the_safety_rescan_finds_files_no_event_announced(make_daemon: Callable[..., DaemonRun]) -> None:
    """A directory mounted over a watched subdirectory: inotify watches the directory underneath, so files
    written into the mounted one make no event at all. Only the periodic rescan finds them."""
    run = make_daemon(rescan_interval=1)
    runs = run.watch_dir("runs")
    (runs / "sub").mkdir()
    elsewhere = run.root / "elsewhere"
    elsewhere.mkdir()
    run.start()
    with bind_mounted(elsewhere, runs / "sub"):
        data = checkpoint(3)
        write_file(runs / "sub" / "unseen.safetensors", data)
        run.wait_for("converted", [runs / "sub" / "unseen.safetensors"], timeout=60)
        check_converted(runs / "sub" / "unseen.safetensors", data)
        stop_cleanly(run)
    assert names(elsewhere) == {"unseen.safetensors", "unseen.bpk"}


# ------------------------------------------------------------------------------------------ events asked for


class _Seen:
    """A WatchListener that keeps nothing: the test looks at the events queued, through Watcher.on_queued."""

    def on_file(self, watch: object, path: Path, closed: bool) -> None:
        pass

    def on_directory(self, watch: object, directory: Path) -> None:
        pass

    def on_overflow(self, watch: object) -> None:
        pass

    def on_fallback(self, watch: object, reason: str) -> None:
        raise AssertionError(reason)


def test_writes_in_progress_and_syncds_own_scratch_files_queue_no_events(tmp_path: Path) -> None:
    """A checkpoint written in 300 writes, and syncd's own scratch file written beside it in 300 more, queue
    only the checkpoint's creation and close: no event per write, none at all about the scratch file. (The
    events of one inotify reader come in order: once the last file's close is queued, every earlier event
    that was going to be queued has been.)"""
    runs = tmp_path / "runs"
    runs.mkdir()
    (tmp_path / "syncd.yaml").write_text("watches:\n  - path: runs\n")
    queued: list[FileSystemEvent] = []
    last = threading.Event()

    def on_queued(event: FileSystemEvent) -> None:
        queued.append(event)
        if os.fsdecode(event.src_path).endswith("last.safetensors") and isinstance(event, FileClosedEvent):
            last.set()

    watcher = Watcher(load_config(tmp_path / "syncd.yaml"), _Seen())
    watcher.on_queued = on_queued
    watcher.start()
    try:
        scratch = open_scratch(runs / "model.bpk")
        with open(runs / "model.safetensors", "wb", buffering=0) as model:
            for _ in range(300):
                model.write(bytes(4096))
                os.write(scratch.fd, bytes(4096))
        scratch.discard()
        write_file(runs / "last.safetensors", b"x")
        assert last.wait(30), queued
    finally:
        watcher.stop()
    about = [(type(e).__name__, os.path.basename(os.fsdecode(e.src_path))) for e in queued]
    assert not [name for _, name in about if is_scratch_name(name)], about
    assert [kind for kind, name in about if name == "model.safetensors"] == ["FileCreatedEvent", "FileClosedEvent"]


def test_a_directory_removed_while_the_tree_is_walked_is_not_reported(tmp_path: Path) -> None:
    """A trainer rotating its checkpoint directories away during a scan: a directory gone by the time the
    walk reaches it is nothing to report (it was a `skipped ... not scanned` line, one per rotation)."""
    from syncd.daemon.watcher import walk_files

    (tmp_path / "latest.safetensors").write_bytes(b"")
    (tmp_path / "checkpoint-10").mkdir()
    (tmp_path / "checkpoint-10" / "model.safetensors").write_bytes(b"")
    reported: list[tuple[Path, str]] = []
    walk = walk_files(tmp_path, recursive=True, on_limit=lambda path, why: reported.append((path, why)))
    assert next(walk) == tmp_path / "latest.safetensors"  # the root listed; checkpoint-10 not yet
    shutil.rmtree(tmp_path / "checkpoint-10")
    assert list(walk) == []
    assert reported == []
    shutil.rmtree(tmp_path)  # the watched tree itself gone: said
    assert list(walk_files(tmp_path, recursive=True, on_limit=lambda path, why: reported.append((path, why)))) == []
    assert reported == [(tmp_path, "not scanned: cannot list the directory (No such file or directory)")]


class _Told:
    """A WatchListener keeping what it is told, and waking the test at each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Path, bool | None]] = []
        self.changed = threading.Condition()

    def _tell(self, what: str, path: Path, closed: bool | None = None) -> None:
        with self.changed:
            self.calls.append((what, path, closed))
            self.changed.notify_all()

    def wait_for(self, call: tuple[str, Path, bool | None]) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: call in self.calls, 30), self.calls

    def on_file(self, watch: object, path: Path, closed: bool) -> None:
        self._tell("file", path, closed)

    def on_directory(self, watch: object, directory: Path) -> None:
        self._tell("directory", directory)

    def on_overflow(self, watch: object) -> None:
        pass

    def on_fallback(self, watch: object, reason: str) -> None:
        raise AssertionError(reason)


def test_a_polled_file_that_took_a_removed_directorys_inode_is_a_file(tmp_path: Path) -> None:
    """A poll pairs a removed entry with a new one by inode: a checkpoint saved right after a checkpoint
    directory was rotated away often takes its inode (ext4 gives a freed inode out again at once), and the poll
    calls that "the directory moved" to the checkpoint's name. It was scanned as a directory ("not scanned:
    cannot list the directory"), never converted until the safety rescan. Nor does a poll ever see a writer
    close: no poll event says it is done. (Given the events such a poll makes: which inode the next file
    takes depends on every other writer of the filesystem.)"""
    from watchdog.events import DirMovedEvent, FileMovedEvent

    from syncd.daemon.watcher import _Handler

    runs = tmp_path / "runs"
    (runs / "checkpoint-2").mkdir(parents=True)
    (tmp_path / "syncd.yaml").write_text("watches:\n  - path: runs\n    poll: true\n")
    (watch,) = load_config(tmp_path / "syncd.yaml").watches
    latest = runs / "latest.safetensors"
    write_file(latest, checkpoint(0))
    told = _Told()
    polled = _Handler(watch, told, polled=True)
    polled.on_any_event(DirMovedEvent(os.fspath(runs / "checkpoint-1"), os.fspath(latest)))
    polled.on_any_event(DirMovedEvent(os.fspath(runs / "checkpoint-1"), os.fspath(runs / "checkpoint-2")))
    polled.on_any_event(FileMovedEvent(os.fspath(runs / "old.safetensors"), os.fspath(latest)))
    assert told.calls == [("file", latest, False), ("directory", runs / "checkpoint-2", None), ("file", latest, False)]
    inotify = _Handler(watch, told := _Told(), polled=False)  # a rename inotify saw: the writer is done
    inotify.on_any_event(FileMovedEvent(os.fspath(runs / "old.safetensors"), os.fspath(latest)))
    assert told.calls == [("file", latest, True)]


def test_a_read_under_way_when_a_watch_is_stopped_is_no_error_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """watchdog's emitter logs "queue_events() called when the thread is inactive" at ERROR when it reads once
    more after being stopped (a reload, a tree watched anew): a line naming no file, for nothing lost."""
    from syncd.daemon.watcher import _InotifyObserver

    observer = _InotifyObserver(lambda: None, lambda _event: None)
    observer.schedule(FileSystemEventHandler(), os.fspath(tmp_path), recursive=True)
    observer.start()
    (emitter,) = observer.emitters
    observer.stop()
    observer.join(timeout=10)
    with caplog.at_level(logging.DEBUG):
        emitter.queue_events(0.01)  # what its thread does once more when the stop lands mid-read
        logging.getLogger("watchdog.observers.inotify").error("another watchdog error")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == ["another watchdog error"]
