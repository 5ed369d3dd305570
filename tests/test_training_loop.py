"""The daemon under a real training loop: re-saves, in-place rewrites, swaps, hangs, reloads,
faults that heal. Every test runs the real daemon (tests/daemonutil.py) on real files with real signals."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from convcheck import cli_env, run_cli
from daemonutil import CAP_LEASE, NOBODY, DaemonRun, scratch_files, stop_cleanly, wait_until, write_file
from hfsets import save_llama
from safetensors.numpy import save

from syncd.engine.convert import ConvertRequest, convert

pytestmark = [pytest.mark.daemon, pytest.mark.torch]

# ------------------------------------------------------------------------------------------ checkpoints


def checkpoint(seed: int, layers: int = 2, width: int = 8) -> bytes:
    """A PyTorch-layout checkpoint of `layers` Linears [width, 3/4 width] with biases; same seed, same bytes.
    Every seed gives the same header, so two seeds are two same-size versions of one file."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(layers):
        tensors[f"layers.{i}.weight"] = rng.standard_normal((width, width * 3 // 4), dtype=np.float32)
        tensors[f"layers.{i}.bias"] = rng.standard_normal(width, dtype=np.float32)
    return save(tensors)


def rewrite_in_place(path: Path, data: bytes, keep_times: os.stat_result | None = None) -> None:
    """Overwrite `path`'s bytes without truncating or replacing it (same inode); optionally set its times
    back to `keep_times` (a writer that preserves mtime, as `cp -p` or rsync would)."""
    with open(path, "r+b") as handle:
        handle.write(data)
    if keep_times is not None:
        os.utime(path, ns=(keep_times.st_atime_ns, keep_times.st_mtime_ns))


def conversion_of(source_bytes: bytes, name: str, work: Path) -> bytes:
    """What syncd publishes for a source named `name` holding `source_bytes` (same name, same mode bits)."""
    work.mkdir(parents=True, exist_ok=True)
    source = work / name
    write_file(source, source_bytes)
    dest = source.with_suffix(".bpk" if source.suffix == ".safetensors" else ".safetensors")
    convert(ConvertRequest(source=source, dest=dest))
    data = dest.read_bytes()
    shutil.rmtree(work)
    return data


def bytes_read_by(pid: int) -> int:
    """Bytes the process has read so far (read, pread, preadv: /proc/PID/io rchar)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/PID/io")


def has_open(pid: int, path: Path) -> bool:
    """The process has `path` open (one of its descriptors names it)."""
    try:
        descriptors = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False  # gone, or not ours to look at
    for fd in descriptors:
        try:
            if os.readlink(fd) == os.fspath(path):
                return True
        except OSError:
            continue
    return False


def statuses_of(run: DaemonRun, source: Path) -> list[str]:
    return [r["status"] for r in run.records() if r.get("source") == str(source)]


def one_way(make_daemon: Callable[..., DaemonRun]) -> tuple[DaemonRun, Path]:
    """A daemon (not started) on one watch, `runs`, converting safetensors to bpk only; and that directory."""
    run = make_daemon([{"path": "runs", "direction": "safetensors->bpk"}])
    return run, run.watch_dir()


def started_one_way(make_daemon: Callable[..., DaemonRun]) -> tuple[DaemonRun, Path]:
    """one_way's daemon, started as it is by default."""
    run, runs = one_way(make_daemon)
    run.start()
    return run, runs


# ------------------------------------------------------------------------------------------ 1. rewritten in place

BIG = {"layers": 6, "width": 2048}  # 6 x 12 MiB transposed weights: the conversion takes long enough to meet


@pytest.mark.slow
def test_a_source_rewritten_in_place_during_its_conversion_is_never_published_mixed(
    make_daemon: Callable[..., DaemonRun], tmp_path: Path
) -> None:
    run, runs = started_one_way(make_daemon)
    assert run.proc is not None
    source = runs / "model.safetensors"
    first, second = checkpoint(1, **BIG), checkpoint(2, **BIG)
    assert len(first) == len(second)
    baseline = bytes_read_by(run.proc.pid)
    write_file(source, first)
    times = os.stat(source)
    # the daemon is reading the tensors (more than any header check reads): rewrite every byte in place,
    # same size, modification time set back -- a same-size rewrite that size and mtime cannot show
    wait_until(lambda: bytes_read_by(run.proc.pid) - baseline > 24 << 20, 60, "the daemon reading the source")
    rewrite_in_place(source, second, keep_times=times)
    run.wait_for("converted", [source])
    run.quiet(3.0)
    expected = conversion_of(second, source.name, tmp_path / "expected")
    assert (runs / "model.bpk").read_bytes() == expected, run.log_text()
    stop_cleanly(run)


def test_syncd_convert_refuses_a_source_changed_while_it_converts(tmp_path: Path) -> None:
    source = tmp_path / "model.safetensors"
    write_file(source, checkpoint(1, **BIG))
    proc = subprocess.Popen(
        [sys.executable, "-m", "syncd", "convert", os.fspath(source)], env=cli_env(), stderr=subprocess.PIPE, text=True
    )
    wait_until(lambda: has_open(proc.pid, source) or proc.poll() is not None, 60, "syncd convert opening it")
    size = source.stat().st_size
    with open(source, "r+b", buffering=0) as handle:  # one page of tensor data, same size, until it is done
        while proc.poll() is None:
            os.pwrite(handle.fileno(), os.urandom(4096), size - 4096)
            time.sleep(0.005)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stderr
    assert stderr.count("\n") == 1 and "changed while it was being converted" in stderr, stderr
    assert not (tmp_path / "model.bpk").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


# ------------------------------------------------------------------------------------------ 3. re-saved each epoch


@pytest.mark.parametrize("on_exists", ["skip", "error"])
@pytest.mark.parametrize("how", ["in place", "renamed into place"])
def test_latest_saved_every_epoch_keeps_its_output_current(
    make_daemon: Callable[..., DaemonRun], tmp_path: Path, on_exists: str, how: str
) -> None:
    run = make_daemon([{"path": "runs", "direction": "safetensors->bpk", "on_exists": on_exists}])
    runs = run.watch_dir()
    run.start()
    latest, output = runs / "latest.safetensors", runs / "latest.bpk"
    for epoch in range(1, 4):
        data = checkpoint(epoch)
        if how == "in place" or epoch == 1:
            write_file(latest, data)
        else:
            write_file(runs / "latest.new", data)
            os.replace(runs / "latest.new", latest)
        expected = conversion_of(data, latest.name, tmp_path / "expected")
        wait_until(lambda e=expected: output.exists() and output.read_bytes() == e, 60, f"latest.bpk of epoch {epoch}")
    run.quiet(1.0)
    assert statuses_of(run, latest) == ["converted", "updated", "updated"], run.log_text()
    stop_cleanly(run)


def test_a_file_someone_else_put_at_the_output_name_is_never_replaced(
    make_daemon: Callable[..., DaemonRun], tmp_path: Path
) -> None:
    run = make_daemon([{"path": "runs", "direction": "safetensors->bpk", "on_exists": "error"}])
    runs = run.watch_dir()
    run.start()
    latest, output = runs / "latest.safetensors", runs / "latest.bpk"
    write_file(latest, checkpoint(1))
    run.wait_for("converted", [latest])
    theirs = conversion_of(checkpoint(7), latest.name, tmp_path / "theirs")  # even our format and our name
    write_file(output, theirs)  # replaced by someone: no longer what syncd published
    write_file(latest, checkpoint(2))
    run.wait_for("conflict", [latest])
    run.quiet(1.0)
    assert output.read_bytes() == theirs
    stop_cleanly(run)


def test_overwrite_never_swaps_two_users_files_in_a_both_tree(make_daemon: Callable[..., DaemonRun]) -> None:
    run = make_daemon([{"path": "runs", "direction": "both", "on_exists": "overwrite"}])
    runs = run.watch_dir()
    alice, bob = runs / "model.safetensors", runs / "model.bpk"
    write_file(alice, checkpoint(1))
    bob_bytes = conversion_of(checkpoint(2), "other.safetensors", runs.parent / "bob")  # a Burn user's model
    write_file(bob, bob_bytes)
    run.start()
    run.wait_for("conflict", count=2)
    run.quiet(1.0)
    assert alice.read_bytes() == checkpoint(1)
    assert bob.read_bytes() == bob_bytes
    stop_cleanly(run)


# ------------------------------------------------------------------------------------------ 4. FIFOs and devices


def test_symlinks_to_devices_and_fifos_renamed_onto_a_source_never_hang_a_worker(
    make_daemon: Callable[..., DaemonRun], tmp_path: Path
) -> None:
    run, runs = started_one_way(make_daemon)
    source = runs / "a.safetensors"
    write_file(source, checkpoint(1))
    run.wait_for("converted", [source])  # a.bpk now names a.safetensors as its source
    aside = tmp_path / "aside"
    aside.mkdir()
    for round_ in range(40):  # swap a checkpoint, a symlink to /dev/zero and a FIFO under the source's name
        write_file(runs / "a.new", checkpoint(1))
        os.replace(runs / "a.new", source)
        if round_ % 2:
            os.symlink("/dev/zero", runs / "a.link")
            os.replace(runs / "a.link", source)
        else:
            os.mkfifo(runs / "a.fifo")
            os.replace(runs / "a.fifo", source)
        wait_until(lambda: True, 0, "")
    write_file(runs / "a.new", checkpoint(2))
    os.replace(runs / "a.new", source)
    late = runs / "late.safetensors"
    write_file(late, checkpoint(3))
    run.wait_for("converted", [late], timeout=60)  # a worker is free
    expected = conversion_of(checkpoint(2), source.name, tmp_path / "expected")
    wait_until(lambda: (runs / "a.bpk").read_bytes() == expected, 60, "a.bpk of the last version")
    stop_cleanly(run)


def test_a_worker_stuck_past_the_limit_stops_the_watchdog_pings_and_is_logged(
    make_daemon: Callable[..., DaemonRun],
) -> None:
    # a limit well under what converting and fsyncing 256 MiB takes anywhere, checked every 20 ms: the one-pass
    # writer converts it in about 0.25 s here, which a 0.2 s limit checked every 50 ms could miss
    run = make_daemon([{"path": "runs", "direction": "safetensors->bpk"}], stuck_worker_seconds=0.02)
    runs = run.watch_dir()
    run.start(env={"WATCHDOG_USEC": "40000"})
    source = runs / "big.safetensors"
    # 20,000 tensors: a plan of a second or so (no byte is written meanwhile, no progress), then 256 MiB
    tensors = {f"t.{n}": np.ones(1, dtype=np.float32) for n in range(20_000)}
    write_file(source, save({**tensors, "big": np.ones((64, 1 << 20), dtype=np.float32)}))

    def stuck_line() -> bool:
        return any("watchdog pings withheld" in r.get("reason", "") for r in run.statuses("error", source))

    wait_until(stuck_line, 60, "the stuck-worker line")
    run.wait_for("converted", [source])
    pinged_while_stuck = sum("WATCHDOG=1" in lines for lines in run.receive())  # (in the beats' datagrams)
    wait_until(
        lambda: sum("WATCHDOG=1" in lines for lines in run.receive()) > pinged_while_stuck + 3,
        30,
        "pings again once the worker is done",
    )
    stop_cleanly(run)


def test_a_conversion_longer_than_the_limit_that_makes_progress_keeps_the_pings(tmp_path: Path) -> None:
    """Only time without progress makes a worker stuck: a conversion taking longer than stuck_worker_seconds
    (a 70B set over a slow network filesystem) withheld the pings, so systemd restarted the daemon, which began
    the conversion again, without end. The worker here is held inside its work, told when to make progress."""
    from syncd.daemon.config import load_config
    from syncd.daemon.service import Daemon
    from syncd.daemon.sync import Outcome

    (tmp_path / "runs").mkdir()
    (tmp_path / "syncd.yaml").write_text(
        "stuck_worker_seconds: 2\nstate_dir: state\nlog: {path: sync.log.jsonl}\nwatches:\n  - path: runs\n"
    )
    daemon = Daemon(load_config(tmp_path / "syncd.yaml"))
    steps: queue.Queue[str] = queue.Queue()
    working = threading.Event()

    def held(watch: object, path: Path, closed: bool) -> Outcome:
        progress = daemon.syncer.progress_for(path)
        assert progress is not None
        working.set()
        while steps.get() == "progress":
            progress(1, 100)
        return Outcome(None)

    daemon.syncer.process = held  # type: ignore[method-assign]
    daemon.queue.start()
    try:
        daemon.queue.put(daemon.config.watches[0], tmp_path / "runs" / "a.safetensors", True, 0.0)
        assert working.wait(60)
        wait_until(lambda: not daemon._workers_healthy(), 60, "no progress for stuck_worker_seconds: stuck")
        steps.put("progress")
        wait_until(daemon._workers_healthy, 60, "progress made: not stuck")
    finally:
        steps.put("done")
        assert daemon.queue.stop(60)


def test_a_long_scan_keeps_the_watchdog_pinged_and_stops_for_sigterm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scan takes the main thread: a tree of 100,000 files held the watchdog pings and SIGTERM for 13-40 s,
    past the unit's WatchdogSec (a restart at every rescan). Here every file is a tick's worth."""
    from syncd.daemon import notify
    from syncd.daemon import service as service_module
    from syncd.daemon.config import load_config
    from syncd.daemon.service import Daemon

    runs = tmp_path / "runs"
    runs.mkdir()
    for n in range(40):
        (runs / f"m{n}.safetensors").write_bytes(b"")
    (tmp_path / "syncd.yaml").write_text("state_dir: state\nlog: {path: sync.log.jsonl}\nwatches:\n  - path: runs\n")
    daemon = Daemon(load_config(tmp_path / "syncd.yaml"))
    pings: list[str] = []
    monkeypatch.setattr(notify, "beat", lambda status, alive, starting=None: pings.append(f"alive={alive}"))
    monkeypatch.setattr(service_module, "TICK_SECONDS", 0.0)
    assert daemon._scan_all() == 40
    assert pings.count("alive=True") >= 40  # one before each file
    daemon.request_stop()
    assert daemon._scan_all() == 0  # SIGTERM: the scan stops at once
    # a directory made and rotated away before its scan is nothing to say ("skipped ... cannot list" it was)
    assert daemon._scan(daemon.config.watches[0], runs / "checkpoint-10") == 0
    assert not (tmp_path / "sync.log.jsonl").exists() or "skipped" not in (tmp_path / "sync.log.jsonl").read_text()


# ------------------------------------------------------------------------------------------ 5. reloads, lost log
# ------------------------------------------------------------------------------------------ 5. reloads, lost log


@pytest.mark.parametrize("first", ["outer", "inner"])
def test_a_daemon_on_a_tree_inside_another_daemons_tree_is_refused_whichever_starts_first(
    tmp_path: Path, first: str
) -> None:
    """A system-wide daemon on a tree and a user's on a directory inside it serve the inner tree twice, from
    two states: the same endless conversion back and forth as two daemons on one tree."""
    roots = {"outer": tmp_path / "data", "inner": tmp_path / "data" / "alice" / "runs"}
    roots["inner"].mkdir(parents=True)
    runs = {}
    for name in roots:
        (tmp_path / name).mkdir()
        runs[name] = DaemonRun(tmp_path / name, [{"path": os.fspath(roots[name])}])
    second = "inner" if first == "outer" else "outer"
    why = f"another syncd watches {roots['outer']}, which holds it" if first == "outer" else "a directory inside it"
    with runs[first], runs[second]:
        runs[first].start()
        refused = run_cli("run", "-c", os.fspath(runs[second].config_path), cwd=runs[second].root, timeout=60)
        assert refused.returncode == 1, refused
        assert refused.stderr.count("\n") == 1 and why in refused.stderr, refused.stderr
        assert str(roots[second]) in refused.stderr
        stop_cleanly(runs[first])


@pytest.mark.slow
@pytest.mark.parametrize(
    "text",
    [
        'watches:\n  - path: "runs\\0evil"\n',
        "watches: " + "[" * 5000 + "]" * 5000 + "\n",
    ],
    ids=["nul-byte", "5000-deep"],
)
def test_a_reload_with_a_config_the_parser_chokes_on_keeps_the_daemon(
    make_daemon: Callable[..., DaemonRun], text: str
) -> None:
    run, runs = started_one_way(make_daemon)
    good = run.config_path.read_text()
    run.write_config_text(text)
    check = run_cli("check-config", os.fspath(run.config_path), timeout=60)
    assert check.returncode == 2 and "internal error" not in check.stdout + check.stderr
    assert (check.stdout + check.stderr).count("\n") == 1, check
    run.send(signal.SIGHUP)
    wait_until(
        lambda: any("reload refused" in r.get("reason", "") for r in run.statuses("error")), 30, "the refused reload"
    )
    write_file(runs / "a.safetensors", checkpoint(1))
    run.wait_for("converted", [runs / "a.safetensors"])
    run.write_config_text(good)
    stop_cleanly(run)


def test_a_removed_log_directory_is_recreated_and_never_fatal(make_daemon: Callable[..., DaemonRun]) -> None:
    run = make_daemon([{"path": "runs"}], log={"path": "logs/sync.log.jsonl", "level": "info"})
    run.log_path = run.root / "logs" / "sync.log.jsonl"
    runs = run.watch_dir()
    run.start()
    shutil.rmtree(run.root / "logs")
    write_file(runs / "a.safetensors", checkpoint(1))
    run.wait_for("converted", [runs / "a.safetensors"])
    run.send(signal.SIGHUP)
    run.wait_for("reloaded")
    shutil.rmtree(run.root / "logs")
    stop_cleanly(run)
    assert [r["status"] for r in run.records()] == ["stopped"]


def test_the_reloaded_line_names_settings_that_need_a_restart(make_daemon: Callable[..., DaemonRun]) -> None:
    run = make_daemon([{"path": "runs"}])
    run.start()
    run.write_config([{"path": "runs"}], workers=3, state_dir="state2")
    run.send(signal.SIGHUP)
    run.wait_for("reloaded")
    reason = run.statuses("reloaded")[0]["reason"]
    assert "workers" in reason and "state_dir" in reason and "restart" in reason, reason
    assert not (run.root / "state2").exists()
    stop_cleanly(run)


# ------------------------------------------------------------------------------------------ 8. one daemon per state


def test_a_second_daemon_on_the_same_state_exits_1_naming_the_first(make_daemon: Callable[..., DaemonRun]) -> None:
    run = make_daemon([{"path": "runs"}])
    run.start()
    assert run.proc is not None
    second = run_cli("run", "-c", os.fspath(run.config_path), cwd=run.root, timeout=60)
    assert second.returncode == 1, second
    assert second.stderr.count("\n") == 1 and f"pid {run.proc.pid}" in second.stderr, second.stderr
    assert [r["status"] for r in run.records()] == ["started"]
    assert run.running()
    stop_cleanly(run)


def _small_checkpoint() -> bytes:
    return save({"fc.weight": np.ones((3, 5), np.float32), "fc.bias": np.zeros(3, np.float32)})


def test_a_second_daemon_on_the_same_tree_with_a_state_of_its_own_is_refused(
    make_daemon: Callable[..., DaemonRun], tmp_path: Path
) -> None:
    """Each would take the other's outputs for checkpoints and convert them back, without end. The tree is
    watched by one daemon; another refused at start-up, or at a reload that would add the tree, keeps running
    on what it had."""
    run = make_daemon([{"path": "runs"}])
    run.start()
    (tmp_path / "other").mkdir()
    other = DaemonRun(tmp_path / "other", [{"path": os.fspath(run.watch_dir())}])
    second = run_cli("run", "-c", os.fspath(other.config_path), cwd=other.root, timeout=60)
    assert second.returncode == 1, second
    assert second.stderr.count("\n") == 1 and "another syncd watches this tree" in second.stderr, second.stderr
    assert str(run.watch_dir()) in second.stderr
    with other:
        other.write_config([{"path": "own"}])
        other.start()
        other.write_config([{"path": "own"}, {"path": os.fspath(run.watch_dir())}])
        other.send(signal.SIGHUP)
        # finished while the reload runs (its watcher stopped, then restarted): found all the same
        during = other.watch_dir("own") / "during.safetensors"
        write_file(during, _small_checkpoint())
        other.wait_for("error")
        (error,) = other.statuses("error")
        assert "reload failed, keeping the running configuration" in error["reason"], error
        assert "another syncd watches this tree" in error["reason"], error
        source = other.watch_dir("own") / "model.safetensors"  # the line said: the tree is watched again
        write_file(source, _small_checkpoint())
        other.wait_for("converted", [during, source])
        stop_cleanly(other)
        assert "Traceback" not in other.stderr(), other.stderr()  # the refusal is said in one line
    write_file(run.watch_dir() / "model.safetensors", _small_checkpoint())
    run.wait_for("converted", [run.watch_dir() / "model.safetensors"])
    assert [r["status"] for r in run.records()] == ["started", "converted"], run.log_text()
    stop_cleanly(run)


# ------------------------------------------------------------------------------------------ 6. faults that heal


class Tmpfs:
    """A real tmpfs mounted at `path` (the suite runs as root), unmounted on leaving."""

    def __init__(self, path: Path, size: str = "4m") -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", os.fspath(path)], check=True)

    def remount(self, options: str) -> None:
        subprocess.run(["mount", "-o", f"remount,{options}", os.fspath(self.path)], check=True)

    def fill(self) -> Path:
        """Fill it up; returns the file holding the space."""
        junk = self.path / "junk"
        with open(junk, "wb", buffering=0) as handle:
            try:
                while True:
                    handle.write(b"\0" * 65536)
            except OSError:
                pass
        return junk

    def __enter__(self) -> Tmpfs:
        return self

    def __exit__(self, *exc_info: object) -> None:
        subprocess.run(["umount", "-l", os.fspath(self.path)], check=False)


FAULTS = ["missing output directory", "read-only", "disk full"]


def _break(fault: str, out: Path, disk: Tmpfs) -> None:
    if fault == "missing output directory":
        shutil.rmtree(disk.path / "mirror")
    elif fault == "read-only":
        disk.remount("ro")
    else:
        disk.fill()


def _heal(fault: str, out: Path, disk: Tmpfs) -> None:
    if fault == "missing output directory":
        (disk.path / "mirror").mkdir()
    elif fault == "read-only":
        disk.remount("rw")
    else:
        (disk.path / "junk").unlink()


@pytest.mark.root
@pytest.mark.parametrize("fault", FAULTS)
def test_environment_errors_are_retried_until_they_heal_also_across_a_restart(
    make_daemon: Callable[..., DaemonRun], fault: str
) -> None:
    run = make_daemon([{"path": "runs", "direction": "safetensors->bpk", "output": {"mirror": "disk/mirror"}}])
    runs = run.watch_dir()
    with Tmpfs(run.root / "disk") as disk:
        out = disk.path / "mirror"
        out.mkdir()
        run.start()
        for number, across_restart in ((1, False), (2, True)):
            source = runs / f"s{number}.safetensors"
            _break(fault, out, disk)
            write_file(source, checkpoint(number, width=64))
            run.wait_for("error", [source])
            if across_restart:
                stop_cleanly(run)
            _heal(fault, out, disk)
            if across_restart:
                run.start()
            run.wait_for("converted", [source], timeout=90)
            assert (out / f"s{number}.bpk").read_bytes() == conversion_of(
                checkpoint(number, width=64), source.name, run.root / "expected"
            )
        stop_cleanly(run)


@pytest.mark.root
def test_a_full_disk_under_the_state_database_is_logged_and_retried(make_daemon: Callable[..., DaemonRun]) -> None:
    run = make_daemon([{"path": "runs", "direction": "safetensors->bpk"}], state_dir="statefs/state")
    runs = run.watch_dir()
    with Tmpfs(run.root / "statefs", size="1m") as disk:
        run.start()
        junk = disk.fill()
        source = runs / "a.safetensors"
        write_file(source, checkpoint(1, layers=40))
        wait_until(
            lambda: any("state database" in r.get("error", "") for r in run.statuses("error")),
            60,
            "the state database error",
        )
        junk.unlink()
        wait_until(
            lambda: run.statuses("in_sync", source) or run.statuses("converted", source),
            90,
            "the file recorded once the disk has room",
        )
        stop_cleanly(run)


def test_a_modification_time_in_the_future_is_taken_as_now_and_said_once(
    make_daemon: Callable[..., DaemonRun],
) -> None:
    run, runs = one_way(make_daemon)
    source = runs / "ahead.safetensors"
    write_file(source, checkpoint(1))
    year = 365 * 24 * 3600
    os.utime(source, (time.time() + year, time.time() + year))  # copied with `cp -p` from a fast clock
    run.start()
    run.wait_for("converted", [source])
    assert len(run.statuses("warning", source)) == 1, run.log_text()
    stop_cleanly(run)


SQUARE_ONLY = {"fc": "Linear"}


def test_a_refusal_a_setting_decides_is_looked_at_again_after_the_reload_that_settles_it(
    make_daemon: Callable[..., DaemonRun],
) -> None:
    run, runs = started_one_way(make_daemon)
    source = runs / "square.safetensors"
    write_file(source, save({"fc.weight": np.ones((4, 4), np.float32)}))  # a lone square weight: ambiguous
    run.wait_for("refused", [source])
    run.write_config([{"path": "runs", "direction": "safetensors->bpk", "modules": SQUARE_ONLY, "layout": "pytorch"}])
    run.send(signal.SIGHUP)
    run.wait_for("converted", [source])
    stop_cleanly(run)


def test_a_refusal_a_reload_does_not_settle_is_not_logged_again_at_each_reload(
    make_daemon: Callable[..., DaemonRun],
) -> None:
    """The reload looks again at what a setting decided; the same refusal for the same reason is not news, and
    a line at every reload would count as a new failure each time (and fire an alert on the failure rate)."""
    run, runs = started_one_way(make_daemon)
    source = runs / "square.safetensors"
    write_file(source, save({"fc.weight": np.ones((4, 4), np.float32)}))  # a lone square weight: ambiguous
    run.wait_for("refused", [source])
    for reloads in (1, 2):
        run.send(signal.SIGHUP)
        run.wait_for("reloaded", count=reloads)
    run.quiet(1.0)
    assert [r["status"] for r in run.records()] == ["started", "refused", "reloaded", "reloaded"], run.log_text()
    run.write_config([{"path": "runs", "direction": "safetensors->bpk", "modules": SQUARE_ONLY, "layout": "pytorch"}])
    run.send(signal.SIGHUP)
    run.wait_for("converted", [source])
    stop_cleanly(run)


def test_syncd_retry_looks_again_at_a_failure_whose_cause_was_fixed(make_daemon: Callable[..., DaemonRun]) -> None:
    run = make_daemon([{"path": "runs", "direction": "safetensors->bpk", "output": {"mirror": "mirror"}}])
    runs = run.watch_dir()
    (runs / "sub").mkdir()
    (run.root / "mirror").mkdir()
    (run.root / "elsewhere").mkdir()
    os.symlink(run.root / "elsewhere", run.root / "mirror" / "sub")  # a mirror directory leading out: refused
    run.start()
    source = runs / "sub" / "a.safetensors"
    write_file(source, checkpoint(1))
    run.wait_for("error", [source])
    (error,) = run.statuses("error", source)
    assert error["reason"].endswith(f"once the cause is fixed, `syncd retry -c {run.config_path} {source}`"), error
    (run.root / "mirror" / "sub").unlink()  # fixed by the administrator; the source itself did not change
    retry = run_cli("retry", "-c", os.fspath(run.config_path), os.fspath(source), timeout=60)
    assert retry.returncode == 0, retry.stderr
    assert retry.stdout.startswith("1 failed file(s) marked") and retry.stdout.count("\n") == 1, retry.stdout
    run.wait_for("converted", [source])
    assert (run.root / "mirror" / "sub" / "a.bpk").exists()
    stop_cleanly(run)


# ------------------------------------------------------------------------------------------ 2. pre-sized writers


@pytest.mark.root
@pytest.mark.slow
def test_a_presized_file_filled_in_with_pauses_is_not_taken_for_complete_without_leases(
    make_daemon: Callable[..., DaemonRun], tmp_path: Path
) -> None:
    run, runs = one_way(make_daemon)
    run.start(drop_capabilities=[CAP_LEASE])  # and the file is not the daemon's: no lease answers
    source = runs / "presized.safetensors"
    data = checkpoint(1, layers=4, width=256)
    header_end = 8 + int.from_bytes(data[:8], "little")
    with open(source, "wb", buffering=0) as handle:
        os.fchown(handle.fileno(), NOBODY, NOBODY)
        os.ftruncate(handle.fileno(), len(data))  # full size first: zeros that parse as tensors
        handle.write(data[:header_end])
        step = -(-(len(data) - header_end) // 3)
        for start in range(header_end, len(data), step):
            time.sleep(2.5)
            os.pwrite(handle.fileno(), data[start : start + step], start)
    run.wait_for("converted", [source])
    run.quiet(1.0)
    assert statuses_of(run, source) == ["converted"], run.log_text()
    assert (runs / "presized.bpk").read_bytes() == conversion_of(data, source.name, tmp_path / "expected")
    stop_cleanly(run)


# ------------------------------------------------------------------------------------------ 7. PID namespaces

OWN_PID_NAMESPACE = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"]  # the daemon is PID 1 there
HUGE = {"layers": 24, "width": 2048}  # 288 MiB: a conversion still in flight while another daemon starts


def stop_wrapped(run: DaemonRun) -> None:
    """SIGTERM to the daemon inside `unshare` (which passes no signal on), then as stop_cleanly."""
    assert run.proc is not None
    children = Path(f"/proc/{run.proc.pid}/task/{run.proc.pid}/children").read_text().split()
    os.kill(int(children[0]), signal.SIGTERM)
    assert run.proc.wait(60) == 0, run.stderr()
    assert scratch_files(run.root) == []


def _holding_bytes(paths: list[Path]) -> list[Path]:
    def size(path: Path) -> int:
        try:
            return path.stat().st_size
        except FileNotFoundError:
            return 0  # published since it was listed

    return [path for path in paths if size(path) > 0]


@pytest.mark.root
@pytest.mark.slow
def test_a_daemon_in_another_pid_namespace_leaves_a_live_scratch_alone(
    make_daemon: Callable[..., DaemonRun],
) -> None:
    # daemons sharing a tree say so (cluster: shared), or the second is refused (one daemon per tree)
    shared = {"shared": True, "poll_interval": 1}
    first = make_daemon([{"path": "runs", "direction": "safetensors->bpk"}], cluster=shared)
    runs = first.watch_dir()
    first.start()
    source = runs / "big.safetensors"
    write_file(source, checkpoint(1, **HUGE))
    # (holding bytes: an empty one may not be locked yet, which the second daemon's start then keeps all the same
    # for its grace period, test_publish.py)
    live = wait_until(
        lambda: [p for p in scratch_files(runs) if p.stat().st_size > 0], 60, "the first daemon's scratch"
    )
    # held mid-conversion (alive, its flock held) while the second daemon starts and scans: a conversion that
    # finished first would leave nothing to test
    with first.held():
        # a second daemon on the same tree (another state), as a container or another host would run one
        (first.root.parent / "d1").mkdir()
        second = make_daemon([{"path": os.fspath(runs), "direction": "bpk->safetensors"}], cluster=shared)
        second.start(wrapper=OWN_PID_NAMESPACE)
        second.quiet(1.0)
        assert scratch_files(runs) == live
    first.wait_for("converted", [source], timeout=120)
    assert second.statuses("removed") == [], second.log_text()
    stop_wrapped(second)
    stop_cleanly(first)


@pytest.mark.root
@pytest.mark.slow
def test_a_daemon_running_as_pid_1_removes_its_own_scratch_after_a_sigkill(
    make_daemon: Callable[..., DaemonRun],
) -> None:
    run, runs = one_way(make_daemon)
    run.start(wrapper=OWN_PID_NAMESPACE)
    source = runs / "big.safetensors"
    write_file(source, checkpoint(1, **HUGE))
    left = wait_until(lambda: scratch_files(runs), 60, "a scratch file in flight")
    run.send(signal.SIGKILL)  # unshare --kill-child passes it on to the daemon, PID 1 in its namespace
    assert run.proc is not None
    run.proc.wait(30)
    wait_until(
        lambda: not any(has_open(int(p.name), source) for p in Path("/proc").iterdir() if p.name.isdigit()),
        30,
        "the killed daemon gone",
    )
    assert scratch_files(runs) == left
    run.start(wrapper=OWN_PID_NAMESPACE)
    run.wait_for("converted", [source], timeout=120)
    assert [r["source"] for r in run.statuses("removed")] == [str(p) for p in left]
    stop_wrapped(run)


# ------------------------------------------------------------------------------------------ 9. vanished sources


def test_a_source_renamed_away_during_its_conversion_leaves_no_output(make_daemon: Callable[..., DaemonRun]) -> None:
    run, runs = started_one_way(make_daemon)
    source = runs / "big.safetensors"
    write_file(source, checkpoint(1, **HUGE))
    wait_until(lambda: scratch_files(runs), 60, "the conversion in flight")
    os.rename(source, run.root / "kept-elsewhere.safetensors")  # the writer's cleanup took it away
    wait_until(lambda: not scratch_files(runs), 120, "the conversion to end")
    run.quiet(1.0)
    assert sorted(p.name for p in runs.iterdir()) == [], run.log_text()
    stop_cleanly(run)


@pytest.mark.slow
def test_a_directory_moved_out_of_the_tree_mid_conversion_keeps_no_scratch(
    make_daemon: Callable[..., DaemonRun],
) -> None:
    run, runs = one_way(make_daemon)
    (runs / "job").mkdir()
    run.start()
    source = runs / "job" / "big.safetensors"
    write_file(source, checkpoint(1, **HUGE))
    wait_until(lambda: scratch_files(runs), 60, "the conversion in flight")
    moved = run.root / "archived-job"
    os.rename(runs / "job", moved)
    wait_until(lambda: not scratch_files(moved), 120, "the scratch file gone from the moved directory")
    run.quiet(1.0)
    assert sorted(p.name for p in moved.iterdir()) == ["big.safetensors"], run.log_text()
    stop_cleanly(run)


def test_a_syncd_output_copied_alone_into_a_tree_is_converted(
    make_daemon: Callable[..., DaemonRun], tmp_path: Path
) -> None:
    run = make_daemon([{"path": "runs", "direction": "both"}])
    runs = run.watch_dir()
    output = conversion_of(checkpoint(1), "model.safetensors", tmp_path / "made-elsewhere")  # names its source
    run.start()
    write_file(runs / "model.bpk", output)  # copied without its source
    run.wait_for("converted", [runs / "model.bpk"])
    assert (runs / "model.safetensors").exists()
    stop_cleanly(run)


# ------------------------------------------------------------------------------------------ 9. writers in chunks


def write_in_chunks(path: Path, data: bytes, cuts: list[int], pause: float) -> None:
    """A writer that opens, appends one chunk and closes, pausing between chunks (every close is an event)."""
    for start, end in zip([0, *cuts], [*cuts, len(data)], strict=True):
        with open(path, "ab") as handle:
            handle.write(data[start:end])
        time.sleep(pause)


def test_a_writer_closing_after_every_chunk_gets_one_converted_line_and_no_refusal(
    make_daemon: Callable[..., DaemonRun], tmp_path: Path
) -> None:
    run, runs = started_one_way(make_daemon)
    source = runs / "chunked.safetensors"
    data = checkpoint(1, layers=4, width=64)
    step = len(data) // 5
    cuts = [20, 200, step, 2 * step, 3 * step, 4 * step]  # inside the header, then through the tensor data
    write_in_chunks(source, data, cuts, pause=0.5)
    run.wait_for("converted", [source])
    run.quiet(2.0)
    assert statuses_of(run, source) == ["converted"], run.log_text()
    assert (runs / "chunked.bpk").read_bytes() == conversion_of(data, source.name, tmp_path / "expected")
    stop_cleanly(run)


def test_a_file_that_stays_truncated_is_refused_once_saying_so(make_daemon: Callable[..., DaemonRun]) -> None:
    run, runs = started_one_way(make_daemon)
    source = runs / "cut.safetensors"
    write_file(source, checkpoint(1, layers=4, width=64)[:3000])  # header whole, tensor data cut short
    long_ago = time.time() - 3600  # unchanged for an hour: nobody is still writing it
    os.utime(source, (long_ago, long_ago))
    run.wait_for("refused", [source], timeout=120)
    run.quiet(2.0)
    refusals = run.statuses("refused", source)
    assert len(refusals) == 1 and "truncated" in refusals[0]["error"], run.log_text()
    assert not (runs / "cut.bpk").exists()
    stop_cleanly(run)


def holds(path: Path, data: bytes) -> bool:
    """`path` exists and holds exactly `data`."""
    try:
        return path.read_bytes() == data
    except FileNotFoundError:
        return False


def save_then_rename(temporary: Path, final: Path, epochs: range, delay: Callable[[int], float]) -> None:
    """A writer that saves each epoch under `temporary` and renames it to `final` `delay(epoch)` s later."""
    for epoch in epochs:
        write_file(temporary, checkpoint(epoch))
        time.sleep(delay(epoch))
        os.rename(temporary, final)
        time.sleep(0.1)


def test_a_source_renamed_away_before_the_daemon_looks_at_it_is_not_reported(
    make_daemon: Callable[..., DaemonRun], tmp_path: Path
) -> None:
    run, runs = started_one_way(make_daemon)
    x, y = runs / "x.safetensors", runs / "y.safetensors"
    for epoch in range(1, 6):
        # saved and renamed while the daemon is held: it sees x's close only once x is gone
        with run.held():
            write_file(x, checkpoint(epoch))
            os.rename(x, y)
        expected = conversion_of(checkpoint(epoch), y.name, tmp_path / "expected")
        wait_until(partial(holds, runs / "y.bpk", expected), 60, f"y.bpk of epoch {epoch}")
    run.quiet(2.0)
    assert [r for r in run.records() if r.get("source") == str(x)] == [], run.log_text()
    assert sorted(p.name for p in runs.iterdir()) == ["y.bpk", "y.safetensors"], run.log_text()
    stop_cleanly(run)


@pytest.mark.slow
def test_a_source_renamed_away_while_the_daemon_first_looks_at_it_is_never_a_failure(
    make_daemon: Callable[..., DaemonRun], tmp_path: Path
) -> None:
    run, runs = started_one_way(make_daemon)
    x, y = runs / "x.safetensors", runs / "y.safetensors"
    # renamed 40-100 ms after its close, while the daemon's first look at x may be under way (its settle
    # check, lease probe and open): x may have been converted when it sat closed long enough, but a vanished
    # x is never reported as a failure
    save_then_rename(x, y, range(21, 61), lambda epoch: 0.04 + 0.0015 * (epoch % 40))
    expected = conversion_of(checkpoint(60), y.name, tmp_path / "expected")
    wait_until(lambda: (runs / "y.bpk").exists() and (runs / "y.bpk").read_bytes() == expected, 60, "y.bpk")
    run.quiet(2.0)
    assert {r["status"] for r in run.records() if r.get("source") == str(x)} <= {"converted", "updated"}, run.log_text()
    assert not [r for r in run.records() if r["status"] in ("refused", "error", "conflict", "skipped")], run.log_text()
    stop_cleanly(run)


# ------------------------------------------------------------------------------------------ retry --all-failed


def test_syncd_retry_all_failed_looks_again_with_the_fixed_configuration(make_daemon: Callable[..., DaemonRun]) -> None:
    run, runs = started_one_way(make_daemon)
    source = runs / "square.safetensors"
    write_file(source, save({"fc.weight": np.ones((4, 4), np.float32)}))  # a lone square weight: ambiguous
    run.wait_for("refused", [source])
    # the administrator adds the module map, with no SIGHUP; the source itself does not change
    run.write_config([{"path": "runs", "direction": "safetensors->bpk", "modules": SQUARE_ONLY, "layout": "pytorch"}])
    retry = run_cli("retry", "-c", os.fspath(run.config_path), "--all-failed", timeout=60)
    assert retry.returncode == 0, retry.stderr
    assert retry.stdout.startswith("1 failed file(s) marked") and retry.stdout.count("\n") == 1, retry.stdout
    run.wait_for("converted", [source])
    assert (runs / "square.bpk").exists()
    assert len(run.statuses("refused", source)) == 1, run.log_text()
    stop_cleanly(run)


# ------------------------------------------------------------------------------------------ sharded sets


@pytest.mark.parametrize("on_exists", ["skip", "error"])
def test_a_sharded_sets_existing_output_is_in_sync_after_a_restart_with_no_state(
    make_daemon: Callable[..., DaemonRun], on_exists: str
) -> None:
    run = make_daemon([{"path": "runs", "on_exists": on_exists}])
    runs = run.watch_dir()
    run.start()
    index = save_llama(runs / "llama", sharded=True)  # save_pretrained writes straight into the watch
    run.wait_for("converted", [index])
    published = (runs / "llama" / "model.bpk").read_bytes()
    stop_cleanly(run)
    shutil.rmtree(run.state_dir)  # the state is lost (a new machine, a wiped state directory)
    run.start()
    run.wait_for("in_sync", [index])
    run.quiet(2.0)
    assert [r["status"] for r in run.records() if r["status"] not in ("started", "stopped")] == [
        "converted",
        "in_sync",
    ], run.log_text()
    assert (runs / "llama" / "model.bpk").read_bytes() == published
    stop_cleanly(run)
