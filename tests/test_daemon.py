"""Acceptance tests for `syncd run`: the real daemon in a subprocess, real inotify, real signals,
a real sd_notify socket, real checkpoint files. See daemonutil.py for the harness."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES
from daemonutil import (
    CAP_LEASE,
    NOBODY,
    REPO,
    DaemonRun,
    mentioning,
    scratch_files,
    stop_cleanly,
    wait_until,
    write_file,
)
from safetensors.torch import load_file, save

from syncd.formats import BURNPACK, SAFETENSORS, open_checkpoint

pytestmark = [pytest.mark.daemon, pytest.mark.torch]

# SIGTERM must not wait for an in-flight conversion to finish; generous, so a loaded machine does not fail it.
STOP_BOUND = 30.0
SHM = "/dev/shm"
MNIST_BPK = FIXTURES / "burn" / "mnist_web.bpk"
MNIST_BPK_TENSORS = {
    "conv1.conv.weight": (64, 1, 3, 3),
    "conv1.conv.bias": (64,),
    "conv1.norm.weight": (64,),
    "conv1.norm.bias": (64,),
    "conv1.norm.running_mean": (64,),
    "conv1.norm.running_var": (64,),
    "conv2.conv.weight": (64, 64, 3, 3),
    "conv2.conv.bias": (64,),
    "conv2.norm.weight": (64,),
    "conv2.norm.bias": (64,),
    "conv2.norm.running_mean": (64,),
    "conv2.norm.running_var": (64,),
    "fc1.weight": (128, 1600),
    "fc1.bias": (128,),
    "fc2.weight": (128, 128),
    "fc2.bias": (128,),
    "fc3.weight": (10, 128),
    "fc3.bias": (10,),
}


# ------------------------------------------------------------------------------------------ checkpoints


class Linear:
    """A one-Linear PyTorch checkpoint (`fc.weight` [out, in], `fc.bias` [out]) and its expected Burn form."""

    def __init__(self, seed: int, out_features: int = 4, in_features: int = 3) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.weight = torch.randn(out_features, in_features, generator=generator)
        self.bias = torch.randn(out_features, generator=generator)

    def bytes(self) -> bytes:
        return save({"fc.weight": self.weight, "fc.bias": self.bias})

    def check_bpk(self, path: Path) -> None:
        """`path` reads back with syncd's reader as this model in Burn's layout (weight transposed)."""
        with open_checkpoint(path) as reader:
            assert reader.header.format == BURNPACK
            assert {t.name: t.shape for t in reader.tensors} == {
                "fc.weight": tuple(self.weight.T.shape),
                "fc.bias": tuple(self.bias.shape),
            }
            assert reader.read("fc.weight") == self.weight.T.contiguous().numpy().tobytes()
            assert reader.read("fc.bias") == self.bias.numpy().tobytes()


def check_mnist_safetensors(path: Path) -> None:
    """The conversion of mnist_web.bpk: PyTorch names and shapes, Linear weights transposed; read by both
    syncd's reader and the safetensors library."""
    with open_checkpoint(path) as reader:
        assert reader.header.format == SAFETENSORS
        assert {t.name: t.shape for t in reader.tensors} == MNIST_BPK_TENSORS
    tensors = load_file(path)
    with open_checkpoint(MNIST_BPK) as source:
        burn_fc1 = torch.frombuffer(bytearray(source.read("fc1.weight")), dtype=torch.float32).reshape(1600, 128)
        burn_gamma = source.read("conv1.norm.gamma")
    assert torch.equal(tensors["fc1.weight"], burn_fc1.T)
    assert tensors["conv1.norm.weight"].numpy().tobytes() == burn_gamma


def write_slowly(
    path: Path,
    data: bytes,
    pieces: int,
    pause: float,
    between: Callable[[bool], None] = lambda written_all: None,
    owner: int | None = None,
) -> None:
    """Open, write the header, then the rest in `pieces`, pausing `pause` (longer than the settle time) after
    each write and calling `between(written_all)` while pausing; close. `owner`: chown the file at once."""
    header_end = 8 + int.from_bytes(data[:8], "little") if path.suffix == ".safetensors" else 64
    step = -(-(len(data) - header_end) // pieces)
    chunks = [data[:header_end]] + [data[i : i + step] for i in range(header_end, len(data), step)]
    with open(path, "wb", buffering=0) as handle:
        if owner is not None:
            os.fchown(handle.fileno(), owner, owner)
        for index, chunk in enumerate(chunks):
            handle.write(chunk)
            deadline = time.monotonic() + pause
            while time.monotonic() < deadline:
                between(index == len(chunks) - 1)
                time.sleep(0.02)


def dir_names(directory: Path) -> set[str]:
    return {path.name for path in directory.iterdir()}


def only(records: list[dict], status: str, source: Path) -> list[dict]:
    return [r for r in records if r["status"] == status and r.get("source") == str(source)]


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture
def daemon(make_daemon: Callable[..., DaemonRun]) -> DaemonRun:
    run = make_daemon()
    run.start()
    return run


# ------------------------------------------------------------------------------------------ systemd, signals


def test_ready_and_status_on_notify_socket_then_sigterm_exits_0(make_daemon: Callable[..., DaemonRun]) -> None:
    run = make_daemon()
    ready = run.start()
    assert ready[:2] == ["READY=1", f"MAINPID={run.proc.pid}"]
    assert any(line.startswith("STATUS=watching 1 tree(s)") for line in ready)
    # the serve loop keeps the status current
    wait_until(lambda: len([n for n in run.receive() if n[0].startswith("STATUS=")]) >= 2, 30, "STATUS= updates")
    assert [r["status"] for r in run.records()] == ["started"]
    stop_cleanly(run)
    assert ["STOPPING=1"] in run.receive()
    assert [r["status"] for r in run.records()] == ["started", "stopped"]


def test_start_up_and_reloads_ask_systemd_for_more_time_until_ready(make_daemon: Callable[..., DaemonRun]) -> None:
    """A start-up scan of a large tree can outlast TimeoutStartSec, and a unit killed for it restarts into the
    same scan: until READY=1, the daemon extends the start timeout first thing and at every beat of its walks
    (here the first file of each: the stale-scratch sweep and the scan); after it, never but in a reload."""
    run = make_daemon()
    write_file(run.watch_dir("runs") / "old.safetensors", Linear(1).bytes())
    run.start()
    extension = f"EXTEND_TIMEOUT_USEC={30 * 1_000_000}"
    notes = run.receive()
    ready_at = next(k for k, lines in enumerate(notes) if "READY=1" in lines)
    assert extension in notes[0]
    assert sum(extension in lines for lines in notes[:ready_at]) >= 3  # at the start, and as each walk begins
    run.wait_for("converted", [run.root / "runs" / "old.safetensors"])
    wait_until(lambda: len([n for n in run.receive() if n[0].startswith("STATUS=")]) >= 6, 30, "STATUS= updates")
    before = len(run.receive())
    assert not [lines for lines in run.receive()[ready_at:] if extension in lines]
    run.send(signal.SIGHUP)

    def reloaded() -> list[list[str]] | None:
        after = run.receive()[before:]
        firsts = [lines[0] for lines in after]
        return after if "RELOADING=1" in firsts and "READY=1" in firsts[firsts.index("RELOADING=1") :] else None

    after = wait_until(reloaded, 30, "RELOADING=1 then READY=1")
    firsts = [lines[0] for lines in after]
    reloading = after[firsts.index("RELOADING=1") : firsts.index("READY=1")]
    assert any(extension in lines for lines in reloading)  # the reload's scan
    stop_cleanly(run)


def test_sighup_with_a_new_watch_serves_it(daemon: DaemonRun) -> None:
    runs, more = daemon.watch_dir("runs"), daemon.watch_dir("more")
    daemon.write_config([{"path": "runs"}, {"path": "more"}])
    before = len(daemon.receive())
    daemon.send(signal.SIGHUP)
    daemon.wait_for("reloaded")

    def ready_again() -> list[str] | None:  # READY=1 follows the `reloaded` line: wait for it, not for luck
        after = [lines[0] for lines in daemon.receive()[before:]]
        return after if "RELOADING=1" in after and "READY=1" in after[after.index("RELOADING=1") :] else None

    wait_until(ready_again, 30, "RELOADING=1 then READY=1")
    model, old = Linear(1), Linear(2)
    write_file(more / "new.safetensors", model.bytes())
    write_file(runs / "old.safetensors", old.bytes())
    daemon.wait_for("converted", [more / "new.safetensors", runs / "old.safetensors"])
    model.check_bpk(more / "new.bpk")
    old.check_bpk(runs / "old.bpk")
    stop_cleanly(daemon)


def test_the_configured_hash_is_recorded_and_a_reload_changes_it(daemon: DaemonRun) -> None:
    runs = daemon.watch_dir("runs")
    first, second = Linear(1), Linear(2)
    write_file(runs / "first.safetensors", first.bytes())
    daemon.wait_for("converted", [runs / "first.safetensors"])
    daemon.write_config([{"path": "runs"}], hash="sha256")
    daemon.send(signal.SIGHUP)
    daemon.wait_for("reloaded")
    write_file(runs / "second.safetensors", second.bytes())
    daemon.wait_for("converted", [runs / "second.safetensors"])
    with open_checkpoint(runs / "first.bpk") as a, open_checkpoint(runs / "second.bpk") as b:
        assert set(a.header.metadata) & {"syncd.source_xxh3_128", "syncd.source_sha256"} == {"syncd.source_xxh3_128"}
        assert set(b.header.metadata) & {"syncd.source_xxh3_128", "syncd.source_sha256"} == {"syncd.source_sha256"}
        assert b.header.metadata["syncd.source_sha256"] == hashlib.sha256(second.bytes()).hexdigest()


def test_a_burst_of_sighups_leaves_the_daemon_serving(daemon: DaemonRun) -> None:
    """Each signal's handler wakes the main loop. Through a threading.Event it could run inside that loop's
    own Event.clear() or wait(), and wait for the lock the loop held: the daemon hung for good (two runs in
    three of 3,000 SIGHUPs). A pipe takes no lock."""
    runs = daemon.watch_dir("runs")
    pid = daemon.proc.pid
    for _ in range(3000):
        os.kill(pid, signal.SIGHUP)
    model = Linear(3)
    write_file(runs / "a.safetensors", model.bytes())
    daemon.wait_for("converted", [runs / "a.safetensors"])
    model.check_bpk(runs / "a.bpk")
    stop_cleanly(daemon)


def test_sighup_with_an_invalid_config_keeps_the_old_one(daemon: DaemonRun) -> None:
    runs = daemon.watch_dir("runs")
    daemon.write_config([{"path": "runs", "direction": "sideways"}, {"path": "more"}])
    daemon.send(signal.SIGHUP)
    daemon.wait_for("error")
    (error,) = daemon.statuses("error")
    assert "reload refused" in error["reason"] and "direction" in error["reason"]
    assert daemon.running()
    model = Linear(3)
    write_file(runs / "a.safetensors", model.bytes())
    write_file(daemon.watch_dir("more") / "b.safetensors", Linear(4).bytes())  # not watched: the reload failed
    daemon.wait_for("converted", [runs / "a.safetensors"])
    model.check_bpk(runs / "a.bpk")
    daemon.quiet(0.6)
    assert not (daemon.watch_dir("more") / "b.bpk").exists()
    assert [r["status"] for r in daemon.records()] == ["started", "error", "converted"]
    stop_cleanly(daemon)


@pytest.fixture
def memory_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on tmpfs when there is one (see test_sigterm_during_a_large_conversion), else tmp_path."""
    if not os.path.isdir(SHM) or shutil.disk_usage(SHM).free < 2 << 30:
        yield tmp_path
        return
    directory = Path(tempfile.mkdtemp(prefix="syncd-test-", dir=SHM))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.slow
def test_sigterm_during_a_large_conversion(memory_dir: Path) -> None:
    """The files live on tmpfs: what is timed is the daemon's stop, not the disk. (On a disk, the kernel frees
    an abandoned scratch file's blocks as the process exits; with an ext4 mounted `-o discard` under load that
    alone has taken over 10 s here, in blkdev_issue_discard, which no daemon can shorten.)"""
    weight = torch.randn(8192, 9216)  # 302 MB of float32: seconds to convert
    bias = torch.randn(8192)
    with DaemonRun(memory_dir, workers=1) as run:
        runs, staging = run.watch_dir("runs"), run.watch_dir("staging")
        big = staging / "big.safetensors"
        write_file(big, save({"big.weight": weight, "big.bias": bias}))
        run.start()
        os.rename(big, runs / big.name)
        in_flight = wait_until(lambda: scratch_files(runs), 20, "the conversion's scratch file")
        assert in_flight[0].name.startswith(".big.bpk.syncd-")
        code, seconds = run.stop()
        assert code == 0, run.stderr()
        assert seconds < STOP_BOUND
        assert scratch_files(runs) == []
        assert run.records()[-1]["status"] == "stopped"
        dest = runs / "big.bpk"
        if dest.exists():  # it finished within the grace period: it must be complete
            with open_checkpoint(dest) as reader:
                assert {t.name: t.shape for t in reader.tensors} == {"big.weight": (9216, 8192), "big.bias": (8192,)}
                assert reader.read("big.bias") == bias.numpy().tobytes()
                assert reader.read("big.weight") == weight.T.contiguous().numpy().tobytes()
        assert dir_names(runs) <= {"big.safetensors", "big.bpk"}


# ------------------------------------------------------------------------------------------ how files arrive


def test_checkpoint_written_slowly_in_place_is_converted_once_when_complete(daemon: DaemonRun) -> None:
    runs = daemon.watch_dir("runs")
    model = Linear(5, 64, 128)
    source, dest = runs / "slow.safetensors", runs / "slow.bpk"

    def not_yet(written_all: bool) -> None:
        assert not dest.exists(), "converted before the writer closed the file"

    started = time.monotonic()
    write_slowly(source, model.bytes(), pieces=4, pause=0.45, between=not_yet)
    assert time.monotonic() - started >= 2.0
    daemon.wait_for("converted", [source])
    daemon.quiet(0.8)
    records = daemon.records()
    assert len(only(records, "converted", source)) == 1
    assert [r["status"] for r in records] == ["started", "converted"], daemon.log_text()
    model.check_bpk(dest)
    stop_cleanly(daemon)


@pytest.mark.root
def test_slow_writer_of_a_file_the_daemon_does_not_own(make_daemon: Callable[..., DaemonRun]) -> None:
    """As the service runs: its own user, without CAP_LEASE, so it cannot ask the kernel whether the file is
    still open for writing. Until the file has been seen closed, a file that does not read yet is not refused."""
    assert os.geteuid() == 0, "this test gives a file away and drops CAP_LEASE: run the suite as root, as CI does"
    run = make_daemon()
    run.start(drop_capabilities=[CAP_LEASE])
    runs = run.watch_dir("runs")
    model = Linear(14, 64, 128)
    source, dest = runs / "slow.safetensors", runs / "slow.bpk"

    def not_before_complete(written_all: bool) -> None:
        assert written_all or not dest.exists(), "converted before the file was complete"

    write_slowly(source, model.bytes(), pieces=4, pause=0.45, between=not_before_complete, owner=NOBODY)
    run.wait_for("converted", [source])
    run.quiet(0.8)
    assert [r["status"] for r in run.records()] == ["started", "converted"], run.log_text()
    model.check_bpk(dest)
    # a broken file whose writer closed it is still refused at once
    with open(runs / "broken.safetensors", "wb") as handle:
        os.fchown(handle.fileno(), NOBODY, NOBODY)
        handle.write(b"\xff" * 16)
    run.wait_for("refused", [runs / "broken.safetensors"], timeout=5)
    stop_cleanly(run)


def test_burn_scratch_then_rename_is_converted_once_and_the_scratch_is_never_touched(daemon: DaemonRun) -> None:
    runs = daemon.watch_dir("runs")
    scratch = runs / f"model.bpk.{os.getpid()}-0.tmp"
    write_slowly(scratch, MNIST_BPK.read_bytes(), pieces=3, pause=0.3)
    seen = os.stat(scratch)
    # longer than the settle time: a daemon that looks at it would have done so by now
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        now = os.stat(scratch)
        assert (now.st_ino, now.st_mtime_ns, now.st_atime_ns, now.st_size) == (
            seen.st_ino,
            seen.st_mtime_ns,
            seen.st_atime_ns,  # relatime: the first read after a write would move it
            seen.st_size,
        )
        assert dir_names(runs) == {scratch.name}
        time.sleep(0.05)
    os.rename(scratch, runs / "model.bpk")
    daemon.wait_for("converted", [runs / "model.bpk"])
    daemon.quiet(0.8)
    records = daemon.records()
    assert [r["status"] for r in records] == ["started", "converted"], daemon.log_text()
    assert mentioning(records, scratch.name) == []
    check_mnist_safetensors(runs / "model.safetensors")
    stop_cleanly(daemon)


def test_direction_both_yields_one_output_per_checkpoint_and_nothing_more(daemon: DaemonRun) -> None:
    runs = daemon.watch_dir("runs")
    model = Linear(6)
    write_file(runs / "torch.safetensors", model.bytes())
    write_file(runs / "burn.bpk", MNIST_BPK.read_bytes())
    daemon.wait_for("converted", [runs / "torch.safetensors", runs / "burn.bpk"])
    daemon.quiet(1.5)  # several settle periods: our own outputs must not come back as sources
    records = daemon.records()
    assert [r["status"] for r in records] == ["started", "converted", "converted"], daemon.log_text()
    assert dir_names(runs) == {"torch.safetensors", "torch.bpk", "burn.bpk", "burn.safetensors"}
    model.check_bpk(runs / "torch.bpk")
    check_mnist_safetensors(runs / "burn.safetensors")
    stop_cleanly(daemon)


def test_500_files_at_once(daemon: DaemonRun) -> None:
    runs = daemon.watch_dir("runs")
    models = [Linear(seed) for seed in range(500)]
    sources = [runs / f"m{i:03d}.safetensors" for i in range(500)]
    for model, source in zip(models, sources, strict=True):
        write_file(source, model.bytes())
    daemon.wait_for("converted", sources, timeout=600)
    daemon.quiet(0.8)
    records = daemon.records()
    assert sorted(r["source"] for r in records if r["status"] == "converted") == sorted(map(str, sources))
    assert {r["status"] for r in records} == {"started", "converted"}, daemon.log_text()
    for index in (0, 137, 499):
        models[index].check_bpk(sources[index].with_suffix(".bpk"))
    assert len(dir_names(runs)) == 1000
    stop_cleanly(daemon)


def test_catch_up_at_start_up_and_a_restart_does_not_redo(make_daemon: Callable[..., DaemonRun]) -> None:
    run = make_daemon()
    runs = run.watch_dir("runs")
    first = Linear(7)
    write_file(runs / "before.safetensors", first.bytes())  # there before the first start
    run.start()
    run.wait_for("converted", [runs / "before.safetensors"])
    stop_cleanly(run)

    (runs / "exp" / "deep").mkdir(parents=True)
    late = {runs / "late.safetensors": Linear(8), runs / "exp" / "deep" / "late.safetensors": Linear(9)}
    for path, model in late.items():
        write_file(path, model.bytes())
    write_file(runs / "exp" / "late.bpk", MNIST_BPK.read_bytes())
    write_file(runs / "broken.safetensors", b"\x02" + bytes(7) + b"[]")  # a header that is not a JSON object
    run.start()
    run.wait_for("converted", [*late, runs / "exp" / "late.bpk"])
    run.wait_for("refused", [runs / "broken.safetensors"])
    for path, model in late.items():
        model.check_bpk(path.with_suffix(".bpk"))
    check_mnist_safetensors(runs / "exp" / "late.safetensors")
    run.quiet(0.6)
    stop_cleanly(run)
    converted = len(run.statuses("converted"))
    assert converted == 4

    run.start()  # everything is up to date: the state database says so
    run.quiet(1.0)
    stop_cleanly(run)
    statuses = [r["status"] for r in run.records()]
    assert statuses.count("converted") == converted, run.log_text()
    assert statuses.count("refused") == 1  # a failure is remembered per version, across restarts too
    assert statuses[-2:] == ["started", "stopped"]
    assert statuses.count("started") == 3


def test_a_corrupt_file_is_refused_once_and_the_daemon_keeps_serving(daemon: DaemonRun) -> None:
    runs = daemon.watch_dir("runs")
    bad = runs / "bad.safetensors"
    # a header of exactly the length it declares that is not JSON (one cut short would be a file still being
    # written, looked at again for a while: test_training_loop.py)
    write_file(bad, (64).to_bytes(8, "little") + b'{"w": {"dtype": "F32", "shape": [2], "data_offsets"' + b" " * 13)
    daemon.wait_for("refused", [bad])
    os.chmod(bad, 0o600)  # more events for the same content: no new line
    write_file(runs / "junk.bpk", b"not a burnpack at all")
    daemon.wait_for("refused", [runs / "junk.bpk"])
    model = Linear(10)
    write_file(runs / "good.safetensors", model.bytes())
    daemon.wait_for("converted", [runs / "good.safetensors"])
    model.check_bpk(runs / "good.bpk")
    daemon.quiet(0.8)
    records = daemon.records()
    assert len(only(records, "refused", bad)) == 1
    assert [r["status"] for r in records] == ["started", "refused", "refused", "converted"], daemon.log_text()
    assert dir_names(runs) == {"bad.safetensors", "junk.bpk", "good.safetensors", "good.bpk"}
    stop_cleanly(daemon)


# ------------------------------------------------------------------------------------------ outputs


@pytest.mark.parametrize("on_exists", ["skip", "error", "overwrite"])
def test_on_exists(make_daemon: Callable[..., DaemonRun], on_exists: str) -> None:
    run = make_daemon([{"path": "runs", "direction": "safetensors->bpk", "on_exists": on_exists}])
    runs = run.watch_dir("runs")
    foreign = runs / "a.bpk"
    write_file(foreign, MNIST_BPK.read_bytes())  # someone else's model under the output's name
    before = os.stat(foreign)
    run.start()
    model = Linear(11)
    write_file(runs / "a.safetensors", model.bytes())
    expected = {"skip": "skipped", "error": "conflict", "overwrite": "converted"}[on_exists]
    run.wait_for(expected, [runs / "a.safetensors"])
    run.quiet(0.8)
    assert [r["status"] for r in run.records()] == ["started", expected], run.log_text()
    after = os.stat(foreign)
    if on_exists == "overwrite":
        assert after.st_ino != before.st_ino
        model.check_bpk(foreign)
        # what was lost says so: the line tells it from a first conversion
        assert run.records()[-1]["reason"] == "replaced the file that was there, not syncd's (on_exists: overwrite)"
    else:
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
        assert foreign.read_bytes() == MNIST_BPK.read_bytes()
    assert dir_names(runs) == {"a.safetensors", "a.bpk"}
    stop_cleanly(run)


def said(run: DaemonRun, text: str) -> bool:
    return any(text in record.get("reason", "") for record in run.records())


@pytest.mark.parametrize("when", ["removed while running", "not there at start"])
def test_a_tree_not_there_is_watched_once_it_is_made_and_the_others_all_along(
    make_daemon: Callable[..., DaemonRun], when: str
) -> None:
    """`rm -rf runs && mkdir runs`, as a job cleaning its output does: the new directory is no watch's, so every
    checkpoint saved into it waited for the safety rescan (10 minutes). Not there at start (a late mount, a job's
    output directory made by its first save), the daemon refused the whole configuration (exit 2, which systemd
    does not restart), so no tree was converted. Either way the daemon says the tree is not there, watches it once
    it is made, converts what is saved into it, and never stops watching its other trees meanwhile."""
    run = make_daemon([{"path": "runs", "direction": "safetensors->bpk"}, {"path": "other"}])
    runs, other = run.watch_dir("runs"), run.watch_dir("other")
    at_start = when == "not there at start"
    if at_start:
        runs.rmdir()
    run.start()
    if not at_start:
        shutil.rmtree(runs)
    gone, made = ("does not exist; it is watched once it is made", "was made") if at_start else ("is gone", "is back")
    wait_until(lambda: said(run, f"the watched tree {gone}"), 30, "the tree's absence said")
    first = Linear(11)
    write_file(other / "a.safetensors", first.bytes())
    run.wait_for("converted", [other / "a.safetensors"])
    runs.mkdir()
    wait_until(lambda: said(run, f"the watched tree {made}"), 30, "the new tree watched")
    for epoch in range(2):  # the second save is seen by the new watch, not by a scan of the new tree
        model = Linear(12 + epoch)
        write_file(runs / "a.safetensors", model.bytes())
        run.wait_for("converted" if epoch == 0 else "updated", [runs / "a.safetensors"])
        model.check_bpk(runs / "a.bpk")
    first.check_bpk(other / "a.bpk")
    stop_cleanly(run)


def test_a_tree_made_anew_that_another_daemon_holds_is_watched_once_it_lets_go(
    make_daemon: Callable[..., DaemonRun], tmp_path: Path
) -> None:
    """The new directory may already be another daemon's (two daemons on one tree convert each other's outputs
    back and forth): it is not watched nor scanned, said once, and taken when the other daemon ends. Neither
    `syncd retry` nor a reload scans it meanwhile, and a reload keeps the daemon (it ended it)."""
    run = make_daemon([{"path": "runs", "direction": "safetensors->bpk"}, {"path": "elsewhere"}])
    runs, elsewhere = run.watch_dir("runs"), run.watch_dir("elsewhere")
    run.start()
    (tmp_path / "d1").mkdir()
    other = make_daemon([{"path": str(runs.parent / "runs.new"), "direction": "safetensors->bpk"}])
    other.start()
    (runs.parent / "runs.old").mkdir()
    os.rename(runs, runs.parent / "runs.old" / "runs")
    os.rename(runs.parent / "runs.new", runs)  # the other daemon's tree (its lock is on the directory)
    wait_until(lambda: said(run, "another syncd watches this tree"), 30, "the refusal said")
    theirs = runs / "theirs.safetensors"
    write_file(theirs, Linear(10).bytes())
    run.send(signal.SIGUSR1)  # as `syncd retry` asks: a scan of every tree watched
    run.send(signal.SIGHUP)
    run.wait_for("reloaded")
    barrier = elsewhere / "b.safetensors"
    write_file(barrier, Linear(9).bytes())
    run.wait_for("converted", [barrier])  # the scans asked before it are done
    assert not (runs / "theirs.bpk").exists() and run.running()
    assert not mentioning(run.statuses("reloaded"), "failed")
    stop_cleanly(other, other.root)
    wait_until(lambda: said(run, "the watched tree is back"), 30, "the tree taken")
    model = Linear(12)
    write_file(runs / "a.safetensors", model.bytes())
    run.wait_for("converted", [runs / "a.safetensors", theirs])  # (theirs, at the scan of the tree taken)
    model.check_bpk(runs / "a.bpk")
    assert len(mentioning(run.records(), "cannot be watched")) == 1, run.log_text()
    stop_cleanly(run)


def test_a_shared_tree_made_anew_is_watched_again_even_in_the_old_directorys_inode(
    make_daemon: Callable[..., DaemonRun],
) -> None:
    """A shared tree has no tree lock, which keeps a removed directory's inode from being given out again: ext4
    gave the new directory the old one's at once, it looked the same, and this node's own saves waited for the
    next poll of other nodes' files."""
    run = make_daemon(
        [{"path": "runs", "direction": "safetensors->bpk"}], cluster={"shared": True, "poll_interval": 600}
    )
    runs = run.watch_dir("runs")
    run.start()

    def back() -> int:
        return len(mentioning(run.records(), "the watched tree is back"))

    for times in range(1, 4):
        shutil.rmtree(runs)
        runs.mkdir()
        wait_until(lambda: back() == times, 30, f"back {times}")  # noqa: B023 (waited for within the loop)
    source = runs / "a.safetensors"
    write_file(source, Linear(12).bytes())
    run.wait_for("converted", [source], timeout=60)  # seen by inotify, not by a poll ten minutes on
    stop_cleanly(run)


def test_mirror_output(make_daemon: Callable[..., DaemonRun]) -> None:
    run = make_daemon([{"path": "runs", "output": {"mirror": "out"}}])
    runs, out = run.watch_dir("runs"), run.watch_dir("out")
    run.start()
    nested = runs / "exp1" / "step100"
    nested.mkdir(parents=True)
    model = Linear(12)
    write_file(nested / "a.safetensors", model.bytes())
    write_file(runs / "top.bpk", MNIST_BPK.read_bytes())
    run.wait_for("converted", [nested / "a.safetensors", runs / "top.bpk"])
    records = run.records()
    assert {r["dest"] for r in records if r["status"] == "converted"} == {
        str(out / "exp1" / "step100" / "a.bpk"),
        str(out / "top.safetensors"),
    }
    model.check_bpk(out / "exp1" / "step100" / "a.bpk")
    check_mnist_safetensors(out / "top.safetensors")
    assert sorted(p.relative_to(runs).as_posix() for p in runs.rglob("*") if p.is_file()) == [
        "exp1/step100/a.safetensors",
        "top.bpk",
    ]
    stop_cleanly(run, runs, out)


def test_a_module_map_files_layout_settles_what_the_tensors_cannot(make_daemon: Callable[..., DaemonRun]) -> None:
    """A square Linear with bias does not show its layout; the watch's module-map file says `layout: pytorch`,
    and the daemon must honour it as `syncd convert --modules` does."""
    run = make_daemon([{"path": "runs", "direction": "safetensors->bpk", "modules": "model.yaml"}])
    module_map = run.root / "model.yaml"
    module_map.write_text("layout: pytorch\nmodules:\n  fc: Linear\n")
    module_map.chmod(0o644)
    runs = run.watch_dir("runs")
    run.start()
    model = Linear(14, out_features=4, in_features=4)
    write_file(runs / "square.safetensors", model.bytes())
    run.wait_for("converted", [runs / "square.safetensors"])
    model.check_bpk(runs / "square.bpk")
    stop_cleanly(run)


# ------------------------------------------------------------------------------------------ syncd log


def test_syncd_log_command(daemon: DaemonRun) -> None:
    runs = daemon.watch_dir("runs")
    write_file(runs / "broken.safetensors", b"\x00" * 8)  # an empty header: not a JSON object
    write_file(runs / "fine.safetensors", Linear(13).bytes())
    daemon.wait_for("refused", [runs / "broken.safetensors"])
    daemon.wait_for("converted", [runs / "fine.safetensors"])
    stop_cleanly(daemon)

    def syncd_log(*args: str) -> list[str]:
        result = subprocess.run(
            [sys.executable, "-m", "syncd", "log", "-c", str(daemon.config_path), *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert result.returncode == 0, result.stderr
        assert result.stderr == ""
        return result.stdout.splitlines()

    table = syncd_log()
    header = ["TIME", "(UTC)", "STATUS", "SOURCE", "->", "DEST", "TENSORS", "SIZE", "DURATION", "REASON"]
    assert table[0].split() == header
    assert table[2] == f"watch {runs}:"  # after the daemon's start line, which names no watch
    rows = [line for line in table[1:] if not line.startswith("watch ")]
    assert [row.split()[2] for row in rows] == [r["status"] for r in daemon.records()]
    (converted,) = [row for row in rows if " converted " in row]
    assert "  fine.safetensors -> fine.bpk  " in converted  # relative to the watch

    refused = syncd_log("--status", "refused")
    assert len(refused) == 3 and refused[0].split() == header and refused[1] == f"watch {runs}:"
    assert refused[2].split()[2] == "refused" and "broken.safetensors -> broken.bpk" in refused[2]

    as_json = syncd_log("--json")
    assert [json.loads(line) for line in as_json] == daemon.records()
    assert syncd_log("--json", "--status", "refused") == [
        line for line in daemon.log_path.read_text().splitlines() if '"status": "refused"' in line
    ]
