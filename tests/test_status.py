"""What the people who run the daemon see: one journal line per decision (with its priority under
systemd), `syncd status` from the status file, STATUS= with progress, and `converting` lines for long
conversions."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
from conftest import MNIST_BPK
from convcheck import run_cli
from daemonutil import CAP_LEASE, NOBODY, DaemonRun, wait_until
from safetensors.torch import save_file

from syncd.cli.status import render_status
from syncd.daemon.journal import journal_line
from syncd.daemon.status import CONVERTING_AFTER, STATUS_FILE, Activity
from syncd.engine.convert import ConvertRequest, convert
from syncd.engine.progress import ProgressState

pytestmark = [pytest.mark.daemon, pytest.mark.torch]


@pytest.fixture
def run(tmp_path: Path) -> Iterator[DaemonRun]:
    watches = [{"path": "runs"}, {"path": "strict", "direction": "safetensors->bpk", "on_exists": "error"}]
    with DaemonRun(tmp_path / "d", watches) as daemon:
        yield daemon


def _populate(run: DaemonRun) -> dict[str, Path]:
    runs, strict = run.watch_dir("runs"), run.watch_dir("strict")
    files = {
        "converted": runs / "mnist.bpk",
        "ambiguous": runs / "amb.safetensors",
        "not_a_checkpoint": runs / "model.safetensors",
        "conflict": strict / "c.safetensors",
    }
    shutil.copy(MNIST_BPK, files["converted"])
    save_file({"table.weight": torch.zeros(3, 3)}, files["ambiguous"])
    torch.save({"w": torch.zeros(2)}, files["not_a_checkpoint"])  # a zip, under a checkpoint's name
    shutil.copy(MNIST_BPK, strict / "c.bpk")  # someone else's file where the output would go
    save_file({"fc.weight": torch.zeros(4, 3), "fc.bias": torch.zeros(4)}, files["conflict"])
    return files


def test_the_journal_gets_one_line_per_decision(run: DaemonRun) -> None:
    files = _populate(run)
    run.start()
    run.wait_for("converted", [files["converted"]])
    run.wait_for("refused", [files["ambiguous"], files["not_a_checkpoint"]])
    run.wait_for("conflict", [files["conflict"]])
    code, _ = run.stop()
    assert code == 0
    lines = [line for line in run.stderr().splitlines() if line.strip()]
    assert len(lines) == len(run.records()), run.stderr()  # one line per sync log record, nothing else
    text = "\n".join(lines)
    converted = re.escape(str(files["converted"]))
    assert re.search(rf"converted {converted} -> mnist.safetensors \(18 tensors, [0-9.]+ KiB, ", text)
    assert f"WARNING: refused {files['not_a_checkpoint']} -> model.bpk: not a safetensors or burnpack file" in text
    refusal = next(line for line in lines if str(files["ambiguous"]) in line)
    assert "cannot convert to burn layout" in refusal and "syncd log --status refused" in refusal
    assert f"WARNING: conflict {files['conflict']} -> c.bpk" in text
    assert any(line.endswith("stopped: finished in-flight work") for line in lines)


def test_under_systemd_the_lines_carry_their_priority(run: DaemonRun, monkeypatch: pytest.MonkeyPatch) -> None:
    files = _populate(run)
    run.stderr_path.touch()
    info = os.stat(run.stderr_path)  # the daemon's stderr is this file: it stands in for the journal stream
    monkeypatch.setenv("JOURNAL_STREAM", f"{info.st_dev}:{info.st_ino}")
    run.start()
    run.wait_for("refused", [files["ambiguous"], files["not_a_checkpoint"]])
    run.wait_for("converted", [files["converted"]])
    run.stop()
    lines = run.stderr().splitlines()
    assert f"<6>converted {files['converted']} -> mnist.safetensors" in "\n".join(lines)
    assert any(line.startswith(f"<4>refused {files['ambiguous']}") for line in lines)
    assert all(line[:1] == "<" and line[2:3] == ">" for line in lines if line)  # journald sets the priority


def test_syncd_status_while_running_and_after(run: DaemonRun) -> None:
    files = _populate(run)
    run.start()
    run.wait_for("converted", [files["converted"]])
    run.wait_for("refused", [files["ambiguous"], files["not_a_checkpoint"]])
    run.wait_for("conflict", [files["conflict"]])

    def settled() -> dict | None:
        doc = json.loads((run.state_dir / STATUS_FILE).read_text())
        return doc if doc["counts"].get("conflict") and doc["queued"] == 0 and not doc["running"] else None

    wait_until(settled, 30, "the status file to show every decision")
    shown = run_cli("status", "-c", run.config_path)
    assert shown.returncode == 0, shown.stderr
    # which node, where several share a tree and pids repeat (containers): in the status and the log's start
    assert shown.stdout.startswith(f"syncd: running; pid {run.proc.pid} on {socket.gethostname()}, started ")
    (started,) = run.statuses("started")
    assert (started["host"], started["pid"]) == (socket.gethostname(), run.proc.pid)
    assert "since start: 1 converted, 0 updated, 0 in_sync, 2 refused, 1 conflict, 0 error, 0 skipped" in shown.stdout
    assert "queued: 0" in shown.stdout and "converting: nothing" in shown.stdout
    assert "recent failures: 3" in shown.stdout
    assert f"refused  {files['not_a_checkpoint']}: not a safetensors or burnpack file" in shown.stdout

    doc = json.loads(run_cli("status", "-c", run.config_path, "--json").stdout)
    assert doc["alive"] is True and doc["counts"] == {"converted": 1, "refused": 2, "conflict": 1}
    assert {f["source"] for f in doc["recent_failures"]} == {
        str(files[k]) for k in ("ambiguous", "not_a_checkpoint", "conflict")
    }
    assert oct(os.stat(run.state_dir / STATUS_FILE).st_mode & 0o777) == "0o640"

    def status_sent() -> bool:  # the same tick writes the file, then sends STATUS=
        statuses = [line for lines in run.receive() for line in lines if line.startswith("STATUS=")]
        return any("converted 1; failed 3; queue 0" in line for line in statuses)

    wait_until(status_sent, 30, "STATUS= with the counts")

    run.stop()
    after = run_cli("status", "-c", run.config_path)
    assert after.returncode == 1 and "not running" in after.stdout and "stopped" in after.stdout


def test_status_names_the_files_waiting_in_the_queue(tmp_path: Path) -> None:
    """A file still open for writing waits to settle: it is listed by name with its due time, not only counted."""
    with DaemonRun(tmp_path / "d", [{"path": "runs"}], settle_seconds=600) as run, ExitStack() as held:
        run.start()
        waiting = run.watch_dir("runs") / "mnist.bpk"
        writer = held.enter_context(waiting.open("wb"))
        writer.write(MNIST_BPK.read_bytes())
        writer.flush()

        def listed() -> dict | None:
            doc = json.loads((run.state_dir / STATUS_FILE).read_text())
            return doc if [item["source"] for item in doc["waiting"]] == [str(waiting)] else None

        doc = wait_until(listed, 30, "the status file to list the waiting file")
        assert doc["queued"] == 1 and 500 < doc["waiting"][0]["due_in"] <= 600
        shown = run_cli("status", "-c", run.config_path).stdout.splitlines()
        at = shown.index("queued: 1")
        assert re.fullmatch(rf"  {re.escape(str(waiting))}  due in (9|10):\d\d", shown[at + 1]), shown


@pytest.mark.root
def test_a_file_no_lease_vouches_for_waits_unleased_settle_seconds(tmp_path: Path) -> None:
    """A file found at start (no close seen), owned by another user, the daemon without CAP_LEASE: nothing
    tells whether a writer has it open, so it waits `unleased_settle_seconds`, not `settle_seconds`."""
    settings = {"settle_seconds": 0.2, "unleased_settle_seconds": 600}
    with DaemonRun(tmp_path / "d", [{"path": "runs", "poll": True}], **settings) as run:
        found = run.watch_dir("runs") / "mnist.bpk"
        shutil.copyfile(MNIST_BPK, found)
        os.chown(found, NOBODY, NOBODY)
        run.start(drop_capabilities=[CAP_LEASE])

        def put_off() -> dict | None:  # found at start, it is first queued due at once, then looked at
            doc = json.loads((run.state_dir / STATUS_FILE).read_text())
            waiting = [item for item in doc["waiting"] if item["source"] == str(found)]
            return waiting[0] if waiting and waiting[0]["due_in"] > 1 else None

        assert 500 < wait_until(put_off, 30, "the status file to list the file found at start")["due_in"] <= 600
        assert not run.statuses("converted")


def test_status_without_a_daemon_is_one_line(tmp_path: Path) -> None:
    with DaemonRun(tmp_path / "d") as never_started:
        proc = run_cli("status", "-c", never_started.config_path)
    assert proc.returncode == 1 and proc.stdout == ""
    assert "no status file: the daemon has not run with this configuration" in proc.stderr
    assert len(proc.stderr.splitlines()) == 1


def test_a_running_daemon_that_cannot_write_its_status_is_not_called_stopped(
    run: DaemonRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full or read-only state directory: the status file goes stale while the daemon runs and retries.
    `syncd status` said "not running" (exit 1), which invites a restart and hides the failure."""
    from syncd.daemon import status as status_module

    run.start()
    wait_until((run.state_dir / STATUS_FILE).exists, 30, "the status file")
    (run.state_dir / f".{STATUS_FILE}.{run.proc.pid}.tmp").mkdir()  # where each status is written first
    wait_until(lambda: "cannot write the status file" in run.stderr(), 30, "the warning")
    monkeypatch.setattr(status_module, "STALE_AFTER", 0.0)  # as if 30 s had passed since
    doc = status_module.read_status(run.state_dir)
    assert doc["alive"] is True and "stale_seconds" in doc
    assert render_status(doc)[0].startswith("syncd: running, but its status is from ")
    run.stop()
    assert not status_module.read_status(run.state_dir)["alive"]  # stopped: said so
    assert run.stderr().count("cannot write the status file") == 1


def test_status_and_log_of_a_running_daemon_whose_config_has_a_typo_since(run: DaemonRun) -> None:
    """They need the state and the log's places only: a typo elsewhere, which the running daemon refused at its
    reload, made both exit 2 on a healthy daemon (a monitor's check failed, the log was out of reach)."""
    _populate(run)
    run.start()
    wait_until((run.state_dir / STATUS_FILE).exists, 30, "the status file")
    run.wait_for("converted", [run.watch_dir("runs") / "mnist.bpk"])
    text = run.config_path.read_text()
    run.config_path.write_text(text.replace("watches:", "recursve: true\nwatches:", 1))
    assert run_cli("check-config", "-c", run.config_path).returncode != 0
    shown = run_cli("status", "-c", run.config_path)
    assert shown.returncode == 0 and shown.stdout.startswith("syncd: running"), shown.stderr
    log = run_cli("log", "-c", run.config_path)
    assert log.returncode == 0 and "converted" in log.stdout, log.stderr
    run.config_path.write_text(text.replace("state_dir:", "state_dir: [", 1))  # where the state is: unknown
    assert run_cli("status", "-c", run.config_path).returncode == 2
    run.stop()


def test_a_long_conversion_is_announced_and_reported(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A real conversion held half-way by the test: the status file, STATUS= and the journal show it."""
    source = tmp_path / "big.safetensors"
    save_file({f"l{n}.weight": torch.ones(256, 256) for n in range(16)} | {"l0.bias": torch.zeros(256)}, source)
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    activity = Activity(state_dir, tmp_path / "syncd.yaml")
    halfway, resume = threading.Event(), threading.Event()

    def worker() -> None:
        with activity.working(source):
            report = activity.progress_for(source)
            assert report is not None

            def progress(done: int, total: int) -> None:
                report(done, total)
                if done * 2 >= total and not halfway.is_set():
                    halfway.set()
                    resume.wait(60)

            convert(ConvertRequest(source=source, layout="keep", progress=progress))

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        assert halfway.wait(60)
        with caplog.at_level(logging.INFO, logger="syncd"):
            status = activity.tick(queued=2, now=time.monotonic() + CONVERTING_AFTER + 1)
        doc = json.loads((state_dir / STATUS_FILE).read_text())
    finally:
        resume.set()
        thread.join(60)
    (running,) = doc["running"]
    assert running["source"] == str(source) and 50 <= running["percent"] < 100
    assert running["total"] == 16 * 256 * 256 * 4 + 256 * 4
    assert doc["queued"] == 2
    assert f"converting big.safetensors {running['percent']:.0f}%" in status and "queue 2" in status
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("converting ")]
    assert line.startswith(f"converting {source}: ") and "% of 4.0 MiB" in line
    activity.tick(queued=0)
    assert json.loads((state_dir / STATUS_FILE).read_text())["running"] == []
    assert (tmp_path / "big.bpk").exists()


def test_status_text_counts_updated_outputs() -> None:
    doc = {"alive": True, "counts": {"converted": 1, "updated": 2}, "running": [], "queued": 0}
    (line,) = [text for text in render_status(doc) if text.startswith("since start:")]
    assert "2 updated" in line and "1 converted" in line


def test_an_updated_line_carries_tensors_size_and_time_like_a_converted_one() -> None:
    fields = {"source": "/srv/runs/a.bpk", "dest": "/srv/runs/a.safetensors", "tensors": 8, "bytes": 2048}
    for status in ("converted", "updated"):
        line = journal_line({"status": status, **fields, "duration_ms": 12.0})
        assert line == f"{status} /srv/runs/a.bpk -> a.safetensors (8 tensors, 2.0 KiB, 12 ms)", line


def test_a_refused_reload_says_what_was_refused(run: DaemonRun) -> None:
    """The refusal names the file and line once, where each view names a record's file, then what is wrong:
    `c.yaml: reload refused, keeping the running configuration: c.yaml:3: ...` said the path twice."""
    run.start()
    run.write_config_text("watches:\n  - path: runs\n    direction: sideways\n")
    run.send(signal.SIGHUP)
    run.wait_for("error")
    (error,) = run.statuses("error")
    where, refused = f"{run.config_path}:3", "reload refused, keeping the running configuration: watches[0].direction: "
    assert error["config"] == where and error["reason"].startswith(refused), error

    def listed() -> str | None:
        shown = run_cli("status", "-c", run.config_path).stdout  # the running config: the edited one is invalid
        return shown if "recent failures: 1" in shown else None

    run.write_config([{"path": "runs"}, {"path": "strict", "direction": "safetensors->bpk", "on_exists": "error"}])
    shown = wait_until(listed, 30, "the refused reload among the recent failures")
    (line,) = [line for line in shown.splitlines() if "reload refused" in line]
    assert f"  error  {where}: {refused}" in line and line.count(str(run.config_path)) == 1, line
    assert "None" not in shown
    journal = [line for line in run.stderr().splitlines() if "reload refused" in line]
    assert len(journal) == 1 and f" error {where}: {refused}" in journal[0], journal
    assert journal[0].count(str(run.config_path)) == 1 and "ERROR: error" not in journal[0]
    (row,) = [line for line in run_cli("log", "-c", run.config_path).stdout.splitlines() if "reload refused" in line]
    assert f"  error    {where}  " in row and row.count(str(run.config_path)) == 1, row


def test_a_failure_converted_since_is_no_longer_a_recent_failure(tmp_path: Path) -> None:
    """A refusal a reload fixed stayed among the recent failures after its file converted: operating-metrics.md
    calls a failure a file left without its output."""
    activity = Activity(tmp_path, tmp_path / "syncd.yaml")
    activity.record({"status": "refused", "source": "/srv/runs/a.safetensors", "error": "ambiguous layout"})
    activity.record({"status": "refused", "source": "/srv/runs/b.safetensors", "error": "ambiguous layout"})
    activity.record({"status": "converted", "source": "/srv/runs/a.safetensors", "bytes": 1, "duration_ms": 1})
    failures = activity.document(time.time())["recent_failures"]
    assert [failure["source"] for failure in failures] == ["/srv/runs/b.safetensors"]
    assert activity.document(time.time())["counts"] == {"refused": 2, "converted": 1}  # the counts stay


def test_a_conversion_shows_from_its_start_and_its_rate_is_the_writings(tmp_path: Path) -> None:
    """A model definition built for seconds before a byte was written: status said "converting: nothing"
    meanwhile, and the first journal line then gave a rate and time left counted from before the writing
    ("8.1 KiB/s, 9:36 left", one second before the end)."""
    activity = Activity(tmp_path, tmp_path / "syncd.yaml")
    source = tmp_path / "model.safetensors"
    with activity.working(source):
        update = activity.progress_for(source)
        assert update is not None
        doc = {**activity.document(time.monotonic()), "alive": True}
        assert [(item["source"], item["total"]) for item in doc["running"]] == [(str(source), 0)]
        assert f"  {source}  preparing (reading its table, planning) for " in "\n".join(render_status(doc))
    progress = ProgressState(started=time.monotonic() - 100.0)  # 100 s of planning
    progress.update(0, 1000)
    progress.update(500, 1000)
    assert progress.writing_since is not None
    snapshot = progress.snapshot(progress.writing_since + 1.0)
    assert (snapshot["rate"], snapshot["eta"]) == (500.0, 1.0)
