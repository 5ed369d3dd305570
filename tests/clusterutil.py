"""Several real daemons on one tree, as one syncd per node on a shared filesystem: each in its own PID namespace
(`unshare --pid --fork --mount-proc`, as root: it is PID 1 there, as in a container), with its own state
directory and sync log, all watching the same directory with `cluster: {shared: true}`.

`run_cluster` is the acceptance run: writers save checkpoints into the tree, one node is SIGKILLed mid-
conversion halfway through (held with SIGSTOP while it provably has a scratch file open, then killed), and
the figures are counted: conversions (sync logs), bytes the daemons read (/proc/PID/io rchar, every read and
pread, page cache or not), files replaced, scratch files left and how long the dead node's took to go.

    .venv/bin/python tests/clusterutil.py                      # the full run: 3 nodes, 120 checkpoints
    .venv/bin/python tests/clusterutil.py --checkpoints 300 --nodes 4
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, os.fspath(Path(__file__).resolve().parent))

from daemonutil import DaemonRun, scratch_files, wait_until
from safetensors.numpy import save

from syncd.engine.convert import ConvertRequest, convert

OWN_PID_NAMESPACE = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"]


def checkpoint(seed: int, width: int) -> bytes:
    """A PyTorch-layout checkpoint of two Linears [width, 3/4 width] (not square: the layout shows); every seed
    the same size."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(2):
        tensors[f"layers.{i}.weight"] = rng.standard_normal((width, width * 3 // 4), dtype=np.float32)
        tensors[f"layers.{i}.bias"] = rng.standard_normal(width, dtype=np.float32)
    return save(tensors)


def conversion_of(source: Path, work: Path) -> bytes:
    """What syncd publishes for `source`: converted in `work` under the same name, with the same mode."""
    work.mkdir(parents=True, exist_ok=True)
    copy = work / source.name
    shutil.copyfile(source, copy)
    os.chmod(copy, source.stat().st_mode & 0o777)
    convert(ConvertRequest(source=copy, dest=copy.with_suffix(".bpk")))
    data = copy.with_suffix(".bpk").read_bytes()
    shutil.rmtree(work)
    return data


def daemon_pid(run: DaemonRun) -> int:
    """The daemon's PID as this namespace sees it: the child `unshare --fork` started."""
    assert run.proc is not None
    pid = run.proc.pid

    def child() -> int | None:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return int(text[0]) if text else None

    return wait_until(child, 10, "the daemon inside its PID namespace")


def bytes_read(pid: int) -> int:
    """/proc/PID/io rchar: every byte the process read with read(2), pread(2) and the like."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/PID/io")


def open_scratch_files(pid: int) -> list[Path]:
    """The scratch files the process has open: a conversion in flight."""
    found = []
    try:
        descriptors = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return []
    for fd in descriptors:
        try:
            target = Path(os.readlink(fd))
        except OSError:
            continue
        if ".syncd-" in target.name and target.name.endswith(".tmp") and not target.name.endswith(" (deleted)"):
            found.append(target)
    return found


def stop_while_converting(pids: list[int], timeout: float = 120.0, min_size: int = 0) -> tuple[int, list[Path]]:
    """SIGSTOP the first of `pids` found converting, and return it with the scratch files it holds (each at
    least `min_size` bytes): looked for without pause (a conversion lasts a fraction of a second), and
    confirmed after the stop, so the process is held mid-conversion whatever the machine's load."""

    def writing(pid: int) -> list[Path]:
        held = []
        for path in open_scratch_files(pid):
            try:
                if path.stat().st_size >= min_size:
                    held.append(path)
            except FileNotFoundError:
                continue
        return held

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for node, pid in enumerate(pids):
            if not writing(pid):
                continue
            os.kill(pid, signal.SIGSTOP)
            held = writing(pid)
            if held:
                return node, held
            os.kill(pid, signal.SIGCONT)  # it finished meanwhile: look again
        time.sleep(0.001)
    raise AssertionError("no process was ever seen converting")


@dataclass
class Figures:
    nodes: int
    checkpoints: int
    checkpoint_bytes: int
    conversions: int = 0
    in_sync_lines: int = 0
    updated: int = 0
    bytes_read: int = 0
    scratch_left: int = 0
    dead_scratch_seconds: float = 0.0
    rescan_interval: float = 0.0
    wrong: list[str] = field(default_factory=list)
    noisy: list[str] = field(default_factory=list)  # error/conflict lines
    seconds: float = 0.0

    @property
    def conversions_per_checkpoint(self) -> float:
        """Every conversion run counts: one that found its bytes already published says `in_sync`."""
        return (self.conversions + self.in_sync_lines + self.updated) / self.checkpoints

    @property
    def read_ratio(self) -> float:
        return self.bytes_read / self.checkpoint_bytes

    def __str__(self) -> str:
        return (
            f"{self.nodes} nodes, {self.checkpoints} checkpoints ({self.checkpoint_bytes / 2**20:.1f} MiB) in "
            f"{self.seconds:.1f} s: {self.conversions} converted and {self.in_sync_lines} in_sync lines "
            f"({self.conversions_per_checkpoint:.3f} conversions per checkpoint), {self.updated} replaced, bytes read "
            f"{self.read_ratio:.3f}x the checkpoints', {len(self.wrong)} wrong, {len(self.noisy)} error/conflict "
            f"lines, {self.scratch_left} scratch left; the dead node's scratch gone {self.dead_scratch_seconds:.1f} s "
            f"after its death (rescan interval {self.rescan_interval:g} s)"
        )


class Cluster:
    """`nodes` daemons under `root` (root/node0, root/node1...) on the one tree root/shared."""

    def __init__(
        self, root: Path, nodes: int, rescan_interval: float, poll_interval: float, shared: bool = True
    ) -> None:
        self.tree = root / "shared"
        self.tree.mkdir(parents=True)
        for i in range(nodes):
            (root / f"node{i}").mkdir()
        self.runs = [
            DaemonRun(
                root / f"node{i}",
                [{"path": os.fspath(self.tree), "direction": "safetensors->bpk"}],
                rescan_interval=rescan_interval,
                cluster={"shared": shared, "poll_interval": poll_interval},
            )
            for i in range(nodes)
        ]
        self.pids: list[int] = []
        self.baseline: list[int] = []
        self.final_read: dict[int, int] = {}  # node -> rchar, taken before it was killed

    def start(self) -> None:
        for run in self.runs:
            run.start(wrapper=OWN_PID_NAMESPACE)
            pid = daemon_pid(run)
            self.pids.append(pid)
            self.baseline.append(bytes_read(pid))

    def kill_one_mid_conversion(self, timeout: float = 120.0) -> tuple[int, list[Path]]:
        """SIGKILL a node while it is converting: the first found with a scratch file open is stopped, found
        still holding it (so the kill lands mid-conversion, whatever the machine's load), and killed.
        Returns the node and the scratch files it left."""
        live = [pid for node, pid in enumerate(self.pids) if self.runs[node].running()]
        index, held = stop_while_converting(live, timeout)
        node = self.pids.index(live[index])
        self.final_read[node] = bytes_read(self.pids[node])
        os.kill(self.pids[node], signal.SIGKILL)
        run = self.runs[node]
        assert run.proc is not None
        run.proc.wait(30)
        return node, held

    def read_by_all(self) -> int:
        total = 0
        for node, pid in enumerate(self.pids):
            end = self.final_read.get(node)
            total += (end if end is not None else bytes_read(pid)) - self.baseline[node]
        return total

    def stop(self) -> None:
        """SIGTERM to every live daemon (inside `unshare`, which passes no signal on)."""
        for node, run in enumerate(self.runs):
            if run.running():
                os.kill(self.pids[node], signal.SIGTERM)
                assert run.proc is not None
                assert run.proc.wait(60) == 0, run.stderr()

    def close(self) -> None:
        for run in self.runs:
            run.close()


def write_checkpoints(tree: Path, writers: int, names: list[str], width: int, first_seed: int) -> None:
    """`writers` threads save the checkpoints `names` into their own directories of `tree`, as trainers
    would (each written whole, then closed)."""

    def writer(index: int) -> None:
        for position, name in enumerate(names):
            if position % writers == index:
                with open(tree / f"w{index}" / name, "wb") as handle:
                    handle.write(checkpoint(first_seed + position, width))

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def run_cluster(
    root: Path,
    *,
    nodes: int = 3,
    checkpoints: int = 120,
    writers: int = 3,
    width: int = 256,
    rescan_interval: float = 3.0,
    poll_interval: float = 1.0,
    timeout: float = 600.0,
    shared: bool = True,
) -> Figures:
    """The acceptance run (module docstring); returns what was counted. Every node's sync log is kept."""
    started = time.monotonic()
    cluster = Cluster(root, nodes, rescan_interval, poll_interval, shared)
    try:
        for index in range(writers):
            (cluster.tree / f"w{index}").mkdir()
        cluster.start()
        names = [f"step-{n:04d}.safetensors" for n in range(checkpoints)]
        half = checkpoints // 2
        # the node to kill is looked for while the first half is written and converted: the first node
        # found converting is the one that dies
        killed: list[tuple[int, list[Path], float]] = []
        killer = threading.Thread(
            target=lambda: killed.append((*cluster.kill_one_mid_conversion(timeout), time.monotonic()))
        )
        killer.start()
        write_checkpoints(cluster.tree, writers, names[:half], width, first_seed=0)
        killer.join()
        assert killed, "no node was ever seen converting"
        dead, left, killed_at = killed[0]
        wait_until(lambda: not any(path.exists() for path in left), timeout, "the dead node's scratch removed")
        dead_scratch_seconds = time.monotonic() - killed_at
        write_checkpoints(cluster.tree, writers, names[half:], width, first_seed=half)
        sources = sorted(cluster.tree.glob("w*/*.safetensors"))
        wait_until(
            lambda: all(source.with_suffix(".bpk").exists() for source in sources), timeout, "every output published"
        )
        live = [run for node, run in enumerate(cluster.runs) if node != dead]
        for run in live:  # each survivor has looked at every source: converted it, or adopted another's output
            run.quiet(max(1.0, poll_interval * 2))
        read = cluster.read_by_all()
        cluster.stop()
        figures = Figures(
            nodes=nodes,
            checkpoints=len(sources),
            checkpoint_bytes=sum(source.stat().st_size for source in sources),
            bytes_read=read,
            dead_scratch_seconds=dead_scratch_seconds,
            rescan_interval=rescan_interval,
            seconds=time.monotonic() - started,
        )
        for run in cluster.runs:
            for record in run.records():
                status = record["status"]
                if status == "converted":
                    figures.conversions += 1
                elif status == "in_sync":
                    figures.in_sync_lines += 1
                elif status == "updated":
                    figures.updated += 1
                elif status in ("error", "conflict"):
                    figures.noisy.append(f"{run.root.name}: {record}")
        figures.scratch_left = len(scratch_files(cluster.tree))
        work = root / "expected"
        for source in sources:
            if source.with_suffix(".bpk").read_bytes() != conversion_of(source, work):
                figures.wrong.append(source.name)
        return figures
    finally:
        cluster.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--checkpoints", type=int, default=120)
    parser.add_argument("--width", type=int, default=512, help="each checkpoint holds two [width, 3/4 width] Linears")
    parser.add_argument("--rescan-interval", type=float, default=10.0)
    parser.add_argument("--poll-interval", type=float, default=2.0)
    parser.add_argument(
        "--not-shared", action="store_true", help="cluster: {shared: false}: no claims, for comparison (fails)"
    )
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="syncd-cluster-"))
    try:
        figures = run_cluster(
            root,
            nodes=args.nodes,
            checkpoints=args.checkpoints,
            width=args.width,
            rescan_interval=args.rescan_interval,
            poll_interval=args.poll_interval,
            shared=not args.not_shared,
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(figures)
    for line in figures.noisy:
        print(line)
    ok = (
        not figures.wrong
        and figures.updated == 0
        and figures.conversions_per_checkpoint <= 1.1
        and figures.read_ratio <= 1.3
        and figures.scratch_left == 0
        and figures.dead_scratch_seconds <= figures.rescan_interval
        and not figures.noisy
    )
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
