"""One syncd per node on a shared filesystem: real daemons, each in its own PID namespace with its own state
directory, on one tree (tests/clusterutil.py). Each checkpoint is converted once in the cluster, a node that
did not publish an output adopts it quietly from the publisher's record, a node that dies mid-conversion leaves
nothing the survivors do not take over and clean up, and a claim whose holder is alive is never broken."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from clusterutil import Cluster, bytes_read, checkpoint, conversion_of, open_scratch_files, run_cluster
from daemonutil import wait_until

from syncd.daemon.state import StateDB

RESCAN = 2.0
POLL = 0.5


def test_three_nodes_convert_each_checkpoint_once_and_survive_one_killed_mid_conversion(tmp_path: Path) -> None:
    figures = run_cluster(tmp_path, nodes=3, checkpoints=18, width=128, rescan_interval=RESCAN, poll_interval=POLL)
    assert figures.wrong == [], figures
    assert figures.updated == 0, figures
    assert figures.noisy == [], figures
    assert figures.scratch_left == 0, figures
    assert figures.conversions_per_checkpoint <= 1.1, figures
    assert figures.read_ratio <= 1.3, figures
    # the survivors take the dead node's claim and its scratch at their next look (or their next rescan)
    assert figures.dead_scratch_seconds <= RESCAN, figures


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    made = Cluster(tmp_path, 2, rescan_interval=RESCAN, poll_interval=POLL)
    (made.tree / "w0").mkdir()
    yield made
    for pid in made.pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    made.close()


def test_the_started_line_says_the_tree_is_shared_and_how_it_is_watched(cluster: Cluster) -> None:
    cluster.start()
    (started,) = cluster.runs[0].statuses("started")
    assert "1 on a shared filesystem (shared: true)" in started["reason"], started
    assert "polled every 0.5 s for other nodes'" in started["reason"], started
    cluster.stop()


def test_a_claim_whose_holder_is_alive_is_never_broken(cluster: Cluster) -> None:
    """A node held (SIGSTOP) mid-conversion keeps its claim and its scratch file through the other node's
    rescans; once it goes on, it publishes, and the other node adopts its output without converting."""
    cluster.start()
    holder, other = cluster.runs
    source = cluster.tree / "w0" / "big.safetensors"
    with open(source, "wb") as handle:
        handle.write(checkpoint(1, width=2048))  # 24 MiB: long enough to be met mid-conversion

    def converting() -> tuple[int, list[Path]] | None:
        for node, pid in enumerate(cluster.pids):
            os.kill(pid, signal.SIGSTOP)
            held = open_scratch_files(pid)
            if held:
                return node, held
            os.kill(pid, signal.SIGCONT)
        return None

    node, held = wait_until(converting, 60, "a node converting big.safetensors")
    holder, other = cluster.runs[node], cluster.runs[1 - node]
    other_pid = cluster.pids[1 - node]
    read_before = bytes_read(other_pid)
    other.quiet(3 * RESCAN)  # several rescans and claim retries of the other node while the holder is stopped
    assert all(path.exists() for path in held), "a live holder's scratch file was removed"
    assert not source.with_suffix(".bpk").exists()
    os.kill(cluster.pids[node], signal.SIGCONT)
    holder.wait_for("converted", [source], timeout=120)

    def adopted() -> bool:
        with StateDB(other.state_dir) as state:
            row = state.get(source)
        return row is not None and row.status == "in_sync"

    wait_until(adopted, 30, "the other node's record of the output as in sync")
    assert other.statuses("converted") == [] and other.statuses("in_sync") == [], other.log_text()
    assert bytes_read(other_pid) - read_before < source.stat().st_size // 10  # adopted without reading it
    cluster.stop()


def test_a_checkpoint_re_saved_again_and_again_on_a_shared_tree_is_converted_once_per_save_and_quietly(
    cluster: Cluster,
) -> None:
    """Two nodes, one file saved over and over (as `latest.safetensors` is): each save converted once, by
    whichever node claims it first; the other adopts that output or replaces it at the next save, and
    neither says anything louder than the conversions."""
    cluster.start()
    latest, output = cluster.tree / "w0" / "latest.safetensors", cluster.tree / "w0" / "latest.bpk"
    saves = 8
    for epoch in range(saves):
        with open(latest, "wb") as handle:
            handle.write(checkpoint(epoch, width=64))
        expected = conversion_of(latest, cluster.tree.parent / "expected")
        wait_until(lambda e=expected: output.exists() and output.read_bytes() == e, 60, f"the output of save {epoch}")
    for run in cluster.runs:
        run.quiet(2 * POLL + 0.5)
    statuses = [record["status"] for run in cluster.runs for record in run.records()]
    assert [s for s in statuses if s not in ("started", "converted", "updated")] == [], statuses
    assert statuses.count("converted") + statuses.count("updated") <= saves, statuses
    cluster.stop()
