"""The kill -9 soak for releases (not run in CI): the daemon is SIGKILLed again and again while checkpoints
stream in, some rewritten in place and some re-saved under the same name; at the end every source must have
exactly one output, equal to its conversion, and no scratch file may be left anywhere.

    .venv/bin/python tests/soak.py                 # 30 kills (a few minutes)
    .venv/bin/python tests/soak.py --kills 200 --seed 7
    .venv/bin/python tests/soak.py --shared --lose-state   # claims as on a shared filesystem; each restart
                                                           # without the state, as another node would be
    .venv/bin/python tests/soak.py --sets          # Burn checkpoints published as sharded sets (shard_size)
    .venv/bin/python tests/soak.py --lose-state --adopt   # a tree not shared: `syncd retry --adopt` at the end

Prints one line per kill and a verdict; exits 1 on the first broken property.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.fspath(Path(__file__).resolve().parent))

from convcheck import run_cli
from daemonutil import DaemonRun, scratch_files, wait_until
from test_training_loop import checkpoint, conversion_of, rewrite_in_place, write_file

from syncd.engine.convert import ConvertRequest, convert

NAMES = 12  # distinct source names; each is created, rewritten and re-saved many times over


SHARD_SIZE = 400_000  # --sets: the small checkpoints are one shard, the larger ones two or four


def stream(runs: Path, rng: random.Random, versions: dict[str, int], seconds: float, sets: bool) -> None:
    """For `seconds`, write checkpoints as a training loop would: a new file, a re-save (new inode, renamed
    into place), or an in-place rewrite of an existing one (same size, same inode). `sets`: Burn checkpoints
    (.bpk), which the daemon publishes as sharded sets."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        name = f"ckpt-{rng.randrange(NAMES)}.{'bpk' if sets else 'safetensors'}"
        version = rng.randrange(1 << 30)
        data = checkpoint(version, layers=3, width=rng.choice((64, 256, 512)))
        if sets:
            data = conversion_of(data, "trainer.safetensors", runs.parent / "making")
        path = runs / name
        how = rng.random()
        if path.exists() and how < 0.4 and path.stat().st_size == len(data):
            rewrite_in_place(path, data)
        elif how < 0.7:
            write_file(runs / "incoming.partial", data)
            os.replace(runs / "incoming.partial", path)
        else:
            write_file(path, data)
        versions[name] = version
        time.sleep(rng.uniform(0.0, 0.15))


def check_sets(runs: Path, work: Path) -> list[str]:
    """Every .bpk has exactly its set (index and shards, nothing stale), each file the conversion's."""
    problems = []
    found = {p.name for p in runs.iterdir() if p.suffix != ".bpk" and not p.name.startswith(".")}
    expected_names: set[str] = set()
    for source in sorted(runs.glob("*.bpk")):
        out = work / source.stem
        out.mkdir(parents=True)
        index = out / f"{source.stem}.safetensors.index.json"
        shutil.copy(source, out / source.name)
        convert(ConvertRequest(source=out / source.name, dest=index, shard_size=SHARD_SIZE, always_index=True))
        for file in sorted(out.iterdir()):
            if file.suffix == ".bpk":
                continue
            expected_names.add(file.name)
            if not (runs / file.name).exists() or (runs / file.name).read_bytes() != file.read_bytes():
                problems.append(f"{file.name} is not the conversion of {source.name}")
        shutil.rmtree(out)
    if found != expected_names:
        problems.append(f"files {sorted(found - expected_names)} left, {sorted(expected_names - found)} missing")
    leftovers = scratch_files(runs)
    if leftovers:
        problems.append(f"scratch files left: {[p.name for p in leftovers]}")
    return problems


def check(run: DaemonRun, runs: Path, work: Path) -> list[str]:
    problems = []
    sources = sorted(p for p in runs.iterdir() if p.suffix == ".safetensors")
    outputs = sorted(p for p in runs.iterdir() if p.suffix == ".bpk")
    if [p.stem for p in sources] != [p.stem for p in outputs]:
        problems.append(f"sources {[p.name for p in sources]} but outputs {[p.name for p in outputs]}")
    for source in sources:
        output = source.with_suffix(".bpk")
        if output.exists() and output.read_bytes() != conversion_of(source.read_bytes(), source.name, work):
            problems.append(f"{output.name} is not the conversion of {source.name}")
    leftovers = scratch_files(runs)
    if leftovers:
        problems.append(f"scratch files left: {[p.name for p in leftovers]}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=30)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--shared", action="store_true", help="the watch is shared: outputs are claimed")
    parser.add_argument(
        "--lose-state",
        action="store_true",
        help="wipe the state directory at every restart (with --shared: the claims' records then prove the outputs)",
    )
    parser.add_argument("--sets", action="store_true", help="Burn checkpoints, published as sharded sets")
    parser.add_argument(
        "--adopt",
        action="store_true",
        help="with --lose-state on a tree not shared: at the end, `syncd retry --adopt` vouches for the outputs",
    )
    args = parser.parse_args()
    if args.lose_state and not (args.shared or args.adopt):
        # without the state and without claims nothing proves an output of an older version of its source
        # syncd's (docs/daemon.md): every source saved while no record was kept would fail the check, unless
        # the operator vouches for them
        parser.error("--lose-state needs --shared or --adopt")
    if args.adopt and (args.shared or not args.lose_state):
        parser.error("--adopt is for --lose-state on a tree not shared")
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="syncd-soak-"))
    versions: dict[str, int] = {}
    settings = {"cluster": {"shared": True, "poll_interval": 0.5}} if args.shared else {}
    watch = (
        {"path": "runs", "direction": "bpk->safetensors", "shard_size": SHARD_SIZE}
        if args.sets
        else {"path": "runs", "direction": "safetensors->bpk"}
    )
    with DaemonRun(root / "d", [watch], **settings) as run:
        runs = run.watch_dir()
        for kill in range(1, args.kills + 1):
            if args.lose_state:
                shutil.rmtree(run.state_dir, ignore_errors=True)
            run.start()
            stream(runs, rng, versions, rng.uniform(0.5, 2.5), args.sets)
            run.send(signal.SIGKILL)
            assert run.proc is not None
            run.proc.wait(30)
            print(f"kill {kill}/{args.kills}: {len(scratch_files(runs))} scratch file(s) left by the kill", flush=True)
        run.start()
        wait_until(lambda: not scratch_files(runs), 120, "start-up cleaning the scratch files")
        run.quiet(5.0)
        if args.adopt:
            adopted = run_cli("retry", "-c", run.config_path, "--adopt")
            said = [line for line in adopted.stdout.splitlines() if "adopted;" in line or "no output adopted" in line]
            print(said[0] if said else adopted.stdout + adopted.stderr, flush=True)
            run.quiet(5.0)
        problems = check_sets(runs, root / "expected") if args.sets else check(run, runs, root / "expected")
        code, _ = run.stop()
        if code != 0:
            problems.append(f"the last daemon exited {code}")
    statuses: dict[str, int] = {}
    for record in run.records():
        statuses[record["status"]] = statuses.get(record["status"], 0) + 1
    print(f"seed {args.seed}; {len(versions)} sources; sync log: {statuses}")
    for problem in problems:
        print(f"FAIL: {problem}")
    if not problems:
        print(f"PASS: {args.kills} kills; each source has exactly one output, equal to its conversion; no scratch")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
