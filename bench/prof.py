"""Profile one `syncd convert` with cProfile (main thread; the sha256 thread runs on the other core).

    .venv/bin/python bench/prof.py SRC DST [--top N] [--out FILE.txt] [--at SRC_ROOT]

Prints the functions with the most own time and the most cumulative time. The destination is removed
first (and the profiled conversion runs warm: the source is read once before profiling). `--at ROOT` imports
syncd from ROOT/syncd (e.g. a `git archive` of one commit) instead of the installed package.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("source")
    parser.add_argument("dest")
    parser.add_argument("--top", type=int, default=18)
    parser.add_argument("--out", help="also write the report to this file")
    parser.add_argument("--at", help="import syncd from this source root (as bench/syncd_at.py does)")
    args = parser.parse_args()
    if os.path.exists(args.dest):
        os.unlink(args.dest)
    with open(args.source, "rb") as handle:  # warm the page cache, as the benchmark does
        while handle.read(64 << 20):
            pass
    os.sync()

    if args.at:
        sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
        sys.path.insert(0, args.at)
    import syncd
    from syncd.cli import main as syncd_main

    profiler = cProfile.Profile()
    started, cpu = time.perf_counter(), time.process_time()
    profiler.enable()
    status = syncd_main(["convert", args.source, "-o", args.dest])
    profiler.disable()
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    text = io.StringIO()
    text.write(f"syncd ({os.path.dirname(syncd.__file__)}) convert {args.source} -o {args.dest}: exit {status}, ")
    text.write(f"wall {wall:.2f} s, ")
    text.write(f"process CPU {cpu:.2f} s (all threads)\n\n")
    stats = pstats.Stats(profiler, stream=text).strip_dirs()
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)
    report = text.getvalue()
    print(report)
    if args.out:
        with open(args.out, "w") as out:
            out.write(report)
    return status


if __name__ == "__main__":
    sys.exit(main())
