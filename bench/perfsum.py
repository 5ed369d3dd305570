"""Per-thread on-CPU summary of a `perf record` profile: which functions each thread spends its samples in.

    perf record -F 1999 -g -o run.perf -- .venv/bin/syncd convert SRC -o DST
    .venv/bin/python bench/perfsum.py run.perf 1999

(syncd's hashing thread and numpy's OpenBLAS threads show up as their own threads; cProfile sees only the
main thread and counts wall time, which on a busy machine includes time spent preempted.)
"""

from __future__ import annotations

import collections
import subprocess
import sys


def main(data: str, hz: float, threshold: float = 0.015) -> int:
    out = subprocess.run(["perf", "script", "-i", data, "-F", "tid,ip,sym,dso"], capture_output=True, text=True)
    samples: collections.Counter[tuple[str, str]] = collections.Counter()
    per_tid: collections.Counter[str] = collections.Counter()
    tid = None
    for line in out.stdout.splitlines():
        if not line.strip():
            continue
        if not line.startswith((" ", "\t")):
            tid = line.split()[0]  # a sample's header; its first frame (the leaf) follows
            continue
        if tid is None:
            continue
        parts = line.strip().split(None, 1)
        sym, _, dso = (parts[1] if len(parts) > 1 else "?").rpartition(" (")
        dso = dso.rstrip(")").split("/")[-1]
        if "libcrypto" in dso:
            name = "sha256 (libcrypto, no symbols)"
        elif sym in ("", "[unknown]"):
            name = f"[{dso}]"
        else:
            name = f"{sym} [{dso}]"
        samples[(tid, name)] += 1
        per_tid[tid] += 1
        tid = None
    for thread, n in per_tid.most_common():
        print(f"thread {thread}: {n} samples = {n / hz:.2f} s on CPU")
        shown = 0
        for (t, name), k in samples.most_common():
            if t == thread and k / n >= threshold:
                print(f"  {100 * k / n:5.1f}%  {k / hz:5.2f} s  {name}")
                shown += k
        print(f"  {100 * (n - shown) / n:5.1f}%  {(n - shown) / hz:5.2f} s  (everything else)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], float(sys.argv[2])))
