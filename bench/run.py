"""syncd benchmark: conversion time and peak memory against `cp`, and the daemon's close-to-publish latency.

    .venv/bin/python bench/run.py            # full run (< 15 min on 2 cores): results in bench/results/
    .venv/bin/python bench/run.py --quick    # small files, one timed run (< 1 min): results-quick.*
    add --snapshot to measure syncd as committed at HEAD instead of the working tree (see docs/performance.md)

For every synthetic checkpoint (see gen.py) it measures, each as a subprocess:

- `cp --reflink=never SRC DST` of the source file: the floor. (GNU cp >= 9 copies with copy_file_range, an
  in-kernel copy, and does not fsync.)
- `cp --reflink=never SRC DST && sync DST`: the same plus an fsync of the copy, because `syncd convert`
  fsyncs its output (and the directory) before publishing. Reported as a second floor.
- diskwrite.py: as many bytes as the source written with O_DIRECT, then fsync: the disk's own time for them.
- the naive pipeline (naive.py): safetensors load_file, np.ascontiguousarray(w.T), save_file (BF16 through
  safetensors.torch, since numpy has no bfloat16).
- the torch pipeline (naive.py --torch): the same three steps with safetensors.torch and `w.t().contiguous()`,
  the five-line script a PyTorch user writes.
- `syncd convert SRC.safetensors -o DST.bpk` (PyTorch -> Burn) and `syncd convert SRC.bpk -o DST.safetensors`
  (Burn -> PyTorch). The .bpk source is made by syncd itself before the measurements (untimed). With
  `--cores 1,2,all` (the default) both also run pinned with taskset to 1 and 2 cores (cores.py), in the same
  interleaved rounds; the report records the machine's core count.

Commands run interleaved: a warm-up round runs every command of a case once, then `--reps` (3) timed rounds
each run every command once (so a slow phase of a shared machine hits the floor and the conversions alike);
the table shows the median wall time and the highest peak RSS of the timed runs. The cp floors pool the
copies of both sources of a case (their sizes differ by < 2%): ratios divide by the median of those 6 runs.
After the warm-up the sources are in the page cache: these are warm-cache figures. (--quick: one timed
round and no warm-up; the sources were just written, so they are in the page cache anyway.) Before every
run (warm-up included) the previous output is deleted and `sync` flushes dirty pages, so no run pays for
another's writeback. Peak RSS is the command's ru_maxrss as /usr/bin/time
reports it (wait4 on a child it forked; see run_once for why not our own wait4). It includes file pages the
process has mapped, and the children it waited for (cp under sh).

The daemon part starts `syncd run -c CONFIG` on a fresh watched directory (settings as config/syncd.yaml:
2 workers, settle_seconds 1.0, inotify; direction safetensors->bpk, output beside), writes 50 files of 10 MB
one after another (each written with one write() to its final name and closed), and polls os.stat every
millisecond for the published .bpk. Latency = time the .bpk appears - time close() returned in the writer.

Modules: cases.py (checkpoints and commands), measure.py (timed runs, floors), daemonprobe.py (the daemon
latency), report.py (tables, targets, chart, JSON), undertest.py (which syncd runs: working tree or snapshot).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

from cases import FULL_CASES, QUICK_CASES, commands
from cores import core_record, parse_cores
from daemonprobe import daemon_big, daemon_latency
from measure import run_case, startup_cost
from report import environment, report
from sharded import sharded_case
from undertest import RESULTS, WORK, SyncdUnderTest, git_state, make_snapshot


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small files, one timed run; under a minute")
    parser.add_argument("--reps", type=int, help="timed runs per command after the warm-up (default 3; quick 1)")
    parser.add_argument("--cases", help="comma-separated case names to run (default: all of the mode)")
    parser.add_argument("--daemon-files", type=int, help="files for the daemon latency (default 50; quick 10)")
    parser.add_argument("--no-daemon", action="store_true", help="skip the daemon latency measurement")
    parser.add_argument(
        "--snapshot",
        action="store_true",
        help="measure syncd as committed at HEAD (git archive into bench/work/) instead of the working tree",
    )
    parser.add_argument("--keep", action="store_true", help="keep the generated checkpoints under bench/work/")
    parser.add_argument("--no-sharded", action="store_true", help="skip the sharded-set case (sharded.py)")
    parser.add_argument(
        "--cores",
        default="all",
        help="also run the syncd conversions pinned (taskset) to these core counts: e.g. 1,2,4,all (default "
        "all: no pinned runs; counts above the machine's are skipped, 'all' is the unpinned run)",
    )
    parser.add_argument("--naive", action="store_true", help="also run the naive numpy pipeline (naive.py)")
    parser.add_argument(
        "--no-warmup", action="store_true", help="no warm-up round (the sources were just written: in the cache)"
    )
    parser.add_argument(
        "--no-prefault",
        action="store_true",
        help="do not touch the memory a run will need just before it (see measure.touch_memory)",
    )
    parser.add_argument("--no-daemon-1g", action="store_true", help="skip the daemon's 1 GiB case")
    parser.add_argument(
        "--name", help="file stem of the results under bench/results/ (default results, or results-quick)"
    )
    args = parser.parse_args(argv)
    args.reps = args.reps or (1 if args.quick else 3)
    cases = QUICK_CASES if args.quick else FULL_CASES
    if args.cases:
        wanted = set(args.cases.split(","))
        cases = [c for c in cases if c.name in wanted]

    def log(message: str) -> None:
        print(message, flush=True)

    started = time.perf_counter()
    args.load_at_start = os.getloadavg()[0]
    plan = f"{args.reps} timed run(s) per command" + ("" if args.quick else " after a warm-up")
    log(f"syncd benchmark: {'quick' if args.quick else 'full'} mode, {plan}")
    args.git_start = git_state()
    syncd = SyncdUnderTest()
    if args.snapshot:
        syncd, commit = make_snapshot()
        args.under_test = f"syncd as committed at {commit} (a snapshot; the working tree is not used)"
    else:
        changed = args.git_start["uncommitted"]
        args.under_test = f"the syncd working tree at {args.git_start['head']}" + (
            f" with uncommitted changes to {', '.join(changed)}" if changed else ""
        )
    args.kernel = syncd.kernel_name()
    args.under_test += f" (transpose kernel: {args.kernel})"
    log(f"  measuring {args.under_test}")
    WORK.mkdir(parents=True, exist_ok=True)
    args.core_counts = parse_cores(args.cores)
    args.core_record = core_record()
    log(
        f"  cores: {args.core_record['allowed']} of {args.core_record['cpu_count']} allowed; syncd also pinned to "
        f"{[c for c in args.core_counts if c is not None] or 'none'}"
    )
    infos, measurements = [], []
    startup = startup_cost(args.reps, syncd)
    median = startup["median_s"]
    log(f"  python start + import syncd.engine.convert: {median:.2f} s (a fixed cost of every syncd convert)")
    try:
        for case in cases:
            warmup = not (args.quick or args.no_warmup)
            info, results = run_case(
                case,
                args.reps,
                warmup,
                args.keep,
                syncd,
                log,
                commands(args.core_counts, args.naive),
                prefault=not args.no_prefault,
            )
            infos.append(info)
            measurements += results
        if not args.no_sharded:
            sharded = sharded_case(args.quick, args.reps, not args.quick, syncd, log)
            RESULTS.mkdir(parents=True, exist_ok=True)
            name = "sharded-quick.json" if args.quick else "sharded.json"
            (RESULTS / name).write_text(json.dumps({"environment": environment(), **sharded}, indent=2) + "\n")
        if args.no_daemon:
            daemon = {"available": False, "reason": "daemon latency skipped (--no-daemon)"}
        else:
            daemon = daemon_latency(args.daemon_files or (10 if args.quick else 50), syncd, log)
            if not daemon.get("available"):
                log(f"  {daemon['reason']}")
            if not args.no_daemon_1g:
                daemon["big"] = daemon_big(64 if args.quick else 1024, args.reps, syncd, log)
    finally:
        if not args.keep:
            for child in WORK.iterdir() if WORK.exists() else []:
                shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink()
    args.git_end = git_state()
    if not args.snapshot and args.git_end != args.git_start:
        args.under_test += (
            f" -- WARNING: syncd changed during the run (HEAD {args.git_start['head']} -> {args.git_end['head']}, "
            "or uncommitted files changed): rows measured different code; use --snapshot"
        )
        log(f"  {args.under_test}")
    report(args, cases, infos, measurements, daemon, startup, log)
    log(f"total {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
