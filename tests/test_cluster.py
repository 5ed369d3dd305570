"""One syncd per node on a shared filesystem: real daemons, each in its own PID namespace with its own state
directory, on one tree (tests/clusterutil.py). Each checkpoint is converted once in the cluster, a node that
did not publish an output adopts it quietly from the publisher's record, a node that dies mid-conversion leaves
nothing the survivors do not take over and clean up, and a claim whose holder is alive is never broken."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from clusterutil import Cluster, bytes_read, checkpoint, conversion_of, run_cluster, stop_while_converting
from daemonutil import wait_until

from syncd.daemon.config import ClusterSettings, Config, LogSettings, Watch
from syncd.daemon.service import TICK_SECONDS as TICK
from syncd.daemon.state import StateDB
from syncd.daemon.watcher import Watcher

pytestmark = [pytest.mark.daemon, pytest.mark.root]

RESCAN = 2.0
POLL = 0.5


@pytest.mark.slow
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
        handle.write(checkpoint(1, width=2048))  # 24 MiB: a conversion long enough to be met

    node, held = stop_while_converting(cluster.pids)
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


def test_a_dead_nodes_scratch_nobody_claims_again_is_removed_by_the_survivors_next_rescan(cluster: Cluster) -> None:
    """The node dies converting a checkpoint that is then deleted: no survivor takes that claim again, and
    the dead node's scratch file (tens of GiB, on a real cluster) is removed by a survivor's rescan, within
    one rescan interval, not at some node's next start."""
    cluster.start()
    source = cluster.tree / "w0" / "doomed.safetensors"
    with open(source, "wb") as handle:
        handle.write(checkpoint(2, width=2048))

    node, held = stop_while_converting(cluster.pids, min_size=1)  # past its first write: no grace spares it
    survivor = cluster.runs[1 - node]
    source.unlink()  # the trainer's cleanup: nobody needs that output any more
    survivor.quiet(2 * POLL + 0.5)  # the survivor has seen the source go (its claim retries end)
    os.kill(cluster.pids[node], signal.SIGKILL)
    killed_at = time.monotonic()
    dead = cluster.runs[node]
    assert dead.proc is not None
    dead.proc.wait(30)
    wait_until(lambda: not any(path.exists() for path in held), 4 * RESCAN, "the dead node's scratch removed")
    assert time.monotonic() - killed_at <= RESCAN + 2 * TICK, "not removed at the first rescan after the death"
    # the survivor logs the removal right after it: wait for the line, not for the next read to happen after it
    wait_until(lambda: survivor.statuses("removed"), 10, "the survivor's line for the removal")
    assert [r["source"] for r in survivor.statuses("removed")] == [str(path) for path in held]
    assert not list(cluster.tree.rglob("*.bpk"))


def test_a_shared_watch_is_polled_as_well_as_inotified(tmp_path: Path) -> None:
    """With its inotify observer gone (as for a file another node wrote: this kernel makes no event), the
    poll alone still brings a new file to the daemon's listener."""
    watched = tmp_path / "runs"
    watched.mkdir()
    config = Config(
        path=tmp_path / "syncd.yaml",
        state_dir=tmp_path / "state",
        log=LogSettings(path=tmp_path / "log"),
        watches=(Watch(path=watched),),
        cluster=ClusterSettings(shared=True, poll_interval=0.2),
    )
    seen: list[Path] = []
    arrived = threading.Event()

    class Listener:
        def on_file(self, watch: Watch, path: Path, closed: bool) -> None:
            seen.append(path)
            arrived.set()

        def on_directory(self, watch: Watch, directory: Path) -> None:
            pass

        def on_overflow(self, watch: Watch) -> None:
            pass

        def on_fallback(self, watch: Watch, reason: str) -> None:
            raise AssertionError(reason)

    watcher = Watcher(config, Listener(), shared={watched})
    watcher.start()
    try:
        kinds = [type(observer).__name__ for observer in watcher.observers]
        assert kinds == ["_InotifyObserver", "PollingObserver"], kinds
        inotify = watcher.observers.pop(0)
        inotify.stop()
        inotify.join(5)
        (watched / "other-node.safetensors").write_bytes(checkpoint(3, width=16))
        assert arrived.wait(30), "the poll never reported the file"
        assert seen[0] == watched / "other-node.safetensors"
    finally:
        watcher.stop()


def test_a_claim_file_whose_output_is_gone_is_removed_at_the_next_rescan(cluster: Cluster) -> None:
    cluster.start()
    source = cluster.tree / "w0" / "old.safetensors"
    with open(source, "wb") as handle:
        handle.write(checkpoint(4, width=16))
    output, claim = source.with_suffix(".bpk"), cluster.tree / "w0" / ".old.bpk.syncd-claim"
    wait_until(lambda: output.exists() and claim.exists() and claim.stat().st_size > 0, 60, "the output and its record")
    source.unlink()
    output.unlink()  # the run is cleaned up
    wait_until(lambda: not claim.exists(), 4 * RESCAN, "the orphaned claim file removed")
    assert sorted(p.name for p in (cluster.tree / "w0").iterdir()) == []
    cluster.stop()
