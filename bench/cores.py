"""How many cores the benchmark ran on, and running a command on fewer.

`syncd convert` uses one writer thread per core it may run on (os.sched_getaffinity), so the benchmark
records the machine's cores and the cores it was allowed, and can run the conversions again pinned to the
first N cores with `taskset -c 0-(N-1)`: `--cores 1,2,all` measures how the ratio to cp + fsync changes with
the core count. The floors (cp, cp + fsync) run unpinned: they use one core whatever they are given.
"""

from __future__ import annotations

import os
import platform
import shutil


def core_record() -> dict:
    """What the report says about the machine's cores."""
    allowed = sorted(os.sched_getaffinity(0))
    return {
        "cpu_count": os.cpu_count(),
        "allowed": len(allowed),
        "allowed_cpus": allowed,
        "machine": platform.machine(),
        "model": _cpu_model(),
        "taskset": shutil.which("taskset") is not None,
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def parse_cores(text: str) -> list[int | None]:
    """'1,2,all' -> [1, 2, None] (None: every allowed core, unpinned); counts above the allowed are dropped."""
    allowed = len(os.sched_getaffinity(0))
    counts: list[int | None] = []
    for word in (w.strip() for w in text.split(",") if w.strip()):
        count = None if word == "all" else int(word)
        if count is not None and not 1 <= count <= allowed:
            continue
        if count == allowed:
            count = None  # pinning to every allowed core is the unpinned run
        if count not in counts:
            counts.append(count)
    return counts or [None]


def pinned(argv: list[str], cores: int | None) -> list[str]:
    """`argv` restricted to the first `cores` allowed CPUs (None: unchanged)."""
    if cores is None:
        return argv
    cpus = sorted(os.sched_getaffinity(0))[:cores]
    return ["taskset", "-c", ",".join(map(str, cpus)), *argv]


def label(cores: int | None) -> str:
    return "all cores" if cores is None else f"{cores} core" + ("s" if cores > 1 else "")
