"""Operators' metrics: Prometheus text format that a real parser reads, written atomically to the file the
configuration names, with counts by status, bytes and seconds converted, queue depth, conversions in flight
and the times of the last success and failure; a real daemon keeps it current."""

from __future__ import annotations

import os
import re
import shutil
import textwrap
import threading
import time
from pathlib import Path

import pytest
from conftest import MNIST_BPK
from daemonutil import DaemonRun, wait_until
from prometheus_client.parser import text_string_to_metric_families

from syncd.daemon import metrics
from syncd.daemon.config import load_config
from syncd.daemon.status import Activity
from syncd.errors import ConfigError


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample as Prometheus' own parser reads it, by (name, labels)."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _record(activity: Activity, status: str, **fields: object) -> None:
    activity.record({"status": status, "source": f"/srv/runs/{status}.bpk", **fields})


def test_the_metrics_count_what_the_sync_log_said(tmp_path: Path) -> None:
    path = tmp_path / "syncd.prom"
    activity = Activity(tmp_path, tmp_path / "syncd.yaml", path)
    before = time.time()
    _record(activity, "converted", bytes=1000, duration_ms=250.0)
    _record(activity, "updated", bytes=500, duration_ms=250.0)
    _record(activity, "in_sync", bytes=9999, duration_ms=1.0)  # nothing written: not counted as converted
    _record(activity, "refused", error="not a checkpoint")
    _record(activity, "skipped", error="Permission denied")
    activity.tick(queued=7)
    samples = _samples(path.read_text())
    by_status = {dict(labels)["status"]: value for (name, labels), value in samples.items() if labels}
    assert by_status["converted"] == 1 and by_status["updated"] == 1 and by_status["in_sync"] == 1
    assert by_status["refused"] == 1 and by_status["skipped"] == 1 and by_status["error"] == 0
    assert samples[("syncd_converted_bytes_total", ())] == 1500
    assert samples[("syncd_conversion_seconds_total", ())] == 0.5
    assert samples[("syncd_queue_depth", ())] == 7
    assert samples[("syncd_conversions_in_flight", ())] == 0
    assert before <= samples[("syncd_last_success_timestamp_seconds", ())] <= time.time()
    assert before <= samples[("syncd_last_failure_timestamp_seconds", ())] <= time.time()
    assert oct(os.stat(path).st_mode & 0o777) == "0o644"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["status.json", "syncd.prom"]  # no scratch left


def test_a_conversion_in_flight_is_counted(tmp_path: Path) -> None:
    path = tmp_path / "syncd.prom"
    activity = Activity(tmp_path, tmp_path / "syncd.yaml", path)
    started, release = threading.Event(), threading.Event()

    def worker() -> None:
        with activity.working(Path("/srv/runs/big.safetensors")):
            progress = activity.progress_for(Path("/srv/runs/big.safetensors"))
            assert progress is not None
            progress(10, 100)  # bytes written so far of the total: a conversion is writing
            started.set()
            release.wait(60)

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        assert started.wait(60)
        activity.tick(queued=0)
        assert _samples(path.read_text())[("syncd_conversions_in_flight", ())] == 1
    finally:
        release.set()
        thread.join(60)


def test_the_file_is_replaced_whole_never_seen_half_written(tmp_path: Path) -> None:
    path = tmp_path / "syncd.prom"
    doc = Activity(tmp_path, tmp_path / "syncd.yaml").document(time.monotonic())
    metrics.write(path, doc)
    inode = os.stat(path).st_ino
    metrics.write(path, doc)
    assert os.stat(path).st_ino != inode  # a new file renamed over the old one, not rewritten in place


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("syncd.txt", "the textfile collector reads only files named *.prom"),
        ("nowhere/syncd.prom", "is not a directory"),
    ],
)
def test_the_metrics_path_is_checked(tmp_path: Path, value: str, problem: str) -> None:
    (tmp_path / "runs").mkdir()
    config = tmp_path / "syncd.yaml"
    config.write_text(textwrap.dedent(f"metrics: {value}\nwatches:\n  - path: runs\n"))
    config.chmod(0o644)
    with pytest.raises(ConfigError, match=re.escape(problem)):
        load_config(config)


@pytest.mark.daemon
def test_a_running_daemon_keeps_the_metrics_file_current(tmp_path: Path) -> None:
    with DaemonRun(tmp_path / "d", metrics="metrics/syncd.prom") as run:
        (run.root / "metrics").mkdir()
        path = run.root / "metrics" / "syncd.prom"
        run.start()
        source = run.watch_dir() / "mnist.bpk"
        shutil.copy(MNIST_BPK, source)
        run.wait_for("converted", [source])

        def converted() -> dict | None:
            samples = _samples(path.read_text()) if path.exists() else {}
            done = samples.get(("syncd_decisions_total", (("status", "converted"),)), 0) == 1
            return samples if done else None

        samples = wait_until(converted, 30, "the metrics to count the conversion")
        assert samples[("syncd_converted_bytes_total", ())] == os.stat(run.root / "runs" / "mnist.safetensors").st_size
        assert samples[("syncd_conversion_seconds_total", ())] > 0
        assert samples[("syncd_last_failure_timestamp_seconds", ())] == 0
        assert run.stop()[0] == 0
