"""Running the commands of a case as timed subprocesses: wall time, peak RSS, CPU, and the cp floors."""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import gen
import numpy as np
from cases import COMMANDS, FLOOR, Case, MiB, command_argv
from undertest import WORK, SyncdUnderTest

Log = Callable[[str], None]


@dataclass
class Run:
    seconds: float
    maxrss_kib: int
    status: int
    cpu_s: float | None = None  # user + system, from /usr/bin/time
    user_s: float | None = None  # user alone: what this VM's host faults (system time) do not inflate


@dataclass
class Measurement:
    case: str
    command: str
    label: str
    source_bytes: int
    runs: list[Run] = field(default_factory=list)
    error: str | None = None
    median_s: float | None = None
    min_s: float | None = None
    max_s: float | None = None
    peak_rss_mib: float | None = None
    cpu_s: float | None = None  # median user + system CPU seconds
    user_s: float | None = None  # median user CPU seconds
    loads: list[float] = field(default_factory=list)  # 1-minute load average before each timed run
    x_cp: float | None = None
    x_cp_fsync: float | None = None

    def finish(self) -> None:
        ok = [r for r in self.runs if r.status == 0]
        if ok and not self.error:
            times = [r.seconds for r in ok]
            self.median_s = statistics.median(times)
            self.min_s, self.max_s = min(times), max(times)
            self.peak_rss_mib = max(r.maxrss_kib for r in ok) / 1024
            cpu = [r.cpu_s for r in ok if r.cpu_s is not None]
            self.cpu_s = statistics.median(cpu) if cpu else None
            user = [r.user_s for r in ok if r.user_s is not None]
            self.user_s = statistics.median(user) if user else None


TIME = "/usr/bin/time"  # GNU time: forks the command from its own small process, reports the child's ru_maxrss


def run_once(argv: list[str], dst: Path, stderr_path: Path) -> Run:
    """One subprocess, timed from spawn to reap; its peak RSS from its parent's wait4.

    A child forked straight from this process would report our own RSS at fork time as its peak (Linux
    carries the pre-exec high-water mark into ru_maxrss), so the command runs under /usr/bin/time, which
    forks it from a process of ~2 MiB and writes the child's ru_maxrss (wait4) to a file. Without GNU time,
    os.wait4 of the direct child is used and small peaks are overstated by this process's RSS.
    """
    if dst.exists():
        dst.unlink()
    rss_path = stderr_path.with_suffix(".rss")
    rss_path.unlink(missing_ok=True)
    wrapped = [TIME, "-f", "%M %U %S", "-o", str(rss_path), *argv] if os.access(TIME, os.X_OK) else argv
    os.sync()
    with open(stderr_path, "wb") as err:
        started = time.perf_counter()
        proc = subprocess.Popen(wrapped, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - started
    code = os.waitstatus_to_exitcode(status)
    if code == 0 and not dst.exists():
        code = -1000
    maxrss, cpu, user = usage.ru_maxrss, usage.ru_utime + usage.ru_stime, usage.ru_utime
    if wrapped is not argv:
        last = rss_path.read_text().splitlines()[-1:] if rss_path.exists() else []
        fields = last[0].split() if last else []
        with contextlib.suppress(ValueError, IndexError):
            maxrss, cpu, user = int(fields[0]), float(fields[1]) + float(fields[2]), float(fields[1])
    return Run(seconds, maxrss, code, cpu, user)


def touch_memory(nbytes: int) -> None:
    """Write one byte in every page of `nbytes` of fresh anonymous memory, then give it back.

    This VM reports freed memory to its host (virtio-balloon free page reporting, about 2 s after it is freed),
    and the first touch of a reported page faults it back in on the host: writing 1 GiB of new page cache took
    0.3 s of system time right after a 1 GiB file was deleted and 0.9-2.2 s when the freed memory had been
    left alone for 6 s. Which run of a round drew reported pages was luck, and it moved whole rows (cp of
    the .bpk 0.38-1.60 s within one case). Touching as much memory as the next run will need just before it
    makes those pages the most recently freed ones, which the next allocations get back unreported, for cp,
    torch and syncd alike.
    """
    if nbytes <= 0:
        return
    region = mmap.mmap(-1, nbytes)
    pages = np.frombuffer(region, dtype=np.uint8)
    pages[:: mmap.PAGESIZE] = 1
    del pages
    region.close()


def _failure(stderr_path: Path, status: int) -> str:
    text = stderr_path.read_text(errors="replace").strip().splitlines() if stderr_path.exists() else []
    return f"exit {status}: {text[-1] if text else 'no output written'}"


def measure_case(
    case: Case,
    sources: dict[str, Path],
    workdir: Path,
    reps: int,
    warmup: bool,
    syncd: SyncdUnderTest,
    log: Log,
    commands: list[tuple[str, str, str, str]] = COMMANDS,
    prefault: bool = True,
) -> list[Measurement]:
    """Every command of one case, interleaved: a warm-up round, then `reps` rounds each running every command
    once, so slow phases of a shared machine hit the floor and the conversions alike. With `prefault`, each
    run is preceded by `touch_memory` of its source's size (its output) plus the command's peak RSS in its
    last run (twice the source's size before any run)."""
    jobs = []
    for key, label, kind, suffix in commands:
        src = sources[kind]
        m = Measurement(case.name, key, label, src.stat().st_size if src.exists() else 0)
        if not src.exists():
            m.error = f"no source {src.name}"
        dst = workdir / f"out-{key}{suffix}"
        jobs.append((m, command_argv(key, src, dst, syncd), dst, workdir / f"out-{key}.stderr"))
    last_rss: dict[str, int] = {}
    for round_ in range(0 if warmup else 1, reps + 1):  # round 0 is the warm-up
        for m, argv, dst, stderr_path in jobs:
            if m.error:
                continue
            if prefault and round_:
                source_bytes = m.source_bytes
                touch_memory(source_bytes + (last_rss.get(m.command, 0) * 1024 or source_bytes))
            load = os.getloadavg()[0]
            run = run_once(argv, dst, stderr_path)
            last_rss[m.command] = run.maxrss_kib
            if run.status != 0:
                m.error = _failure(stderr_path, run.status)
                log(f"    {m.label}: FAILED {m.error}")
            elif round_:
                m.runs.append(run)
                m.loads.append(round(load, 2))
    for m, _, dst, _ in jobs:
        dst.unlink(missing_ok=True)
        m.finish()
        if m.median_s is not None:
            times = " ".join(f"{r.seconds:.2f}" for r in m.runs)
            log(
                f"    {m.label:26s} median {m.median_s:7.2f} s  [{times}]  cpu {m.cpu_s or 0:6.2f} s  "
                f"peak RSS {m.peak_rss_mib:7.1f} MiB  (load {statistics.median(m.loads):.1f})"
            )
    return [m for m, *_ in jobs]


def floors(by_key: dict[str, Measurement]) -> dict[str, dict[str, float | None]]:
    """The cp and cp+fsync floors of each source kind. The .safetensors and .bpk sources of a case differ in
    size by well under 2%, so both files' copies are pooled into one median: six samples are steadier than
    three, and both directions are held to the same floor. (Sizes further apart: each its own.)"""
    sizes = [by_key[k].source_bytes for k in ("cp", "cp_bpk")]
    pooled = min(sizes) > 0 and (max(sizes) - min(sizes)) / max(sizes) < 0.02

    def median_of(*keys: str) -> float | None:
        times = [r.seconds for k in keys if not by_key[k].error for r in by_key[k].runs]
        return statistics.median(times) if times else None

    result: dict[str, dict[str, float | None]] = {}
    for kind, (cp, cp_fsync) in FLOOR.items():
        other_cp, other_fsync = FLOOR["bpk" if kind == "st" else "st"]
        result[kind] = {
            "cp": median_of(cp, other_cp) if pooled else median_of(cp),
            "cp_fsync": median_of(cp_fsync, other_fsync) if pooled else median_of(cp_fsync),
        }
    return result


def startup_cost(reps: int, syncd: SyncdUnderTest) -> dict:
    """What every `syncd convert` pays before touching a file: interpreter start and imports."""
    argv = syncd.startup_argv()
    times = []
    for i in range(reps + 1):
        started = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        if i:
            times.append(time.perf_counter() - started)
    return {"command": " ".join(argv), "median_s": statistics.median(times)}


def run_case(
    case: Case,
    reps: int,
    warmup: bool,
    keep: bool,
    syncd: SyncdUnderTest,
    log: Log,
    commands: list[tuple[str, str, str, str]] = COMMANDS,
    prefault: bool = True,
) -> tuple[dict, list[Measurement]]:
    workdir = WORK / case.name
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    src = workdir / "model.safetensors"
    bpk = workdir / "model.bpk"
    t0 = time.perf_counter()
    tensors = gen.model(case.model, case.mib * MiB, case.dtype)
    gen.write_safetensors(str(src), tensors)
    info = {"case": case.name, "model": case.model, "dtype": case.dtype, "note": case.note, **gen.describe(tensors)}
    info["safetensors_bytes"] = src.stat().st_size
    made = subprocess.run([*syncd.argv(), "convert", str(src), "-o", str(bpk)], capture_output=True, text=True)
    if made.returncode != 0:
        info["bpk_error"] = (made.stderr.strip().splitlines() or ["?"])[-1]
    else:
        info["bpk_bytes"] = bpk.stat().st_size
    log(
        f"  {case.name}: {info['tensors']} tensors, {info['safetensors_bytes'] / MiB:.0f} MiB, largest tensor "
        f"{info['largest_tensor_bytes'] / MiB:.2f} MiB; generated in {time.perf_counter() - t0:.1f} s"
    )
    results = measure_case(case, {"st": src, "bpk": bpk}, workdir, reps, warmup, syncd, log, commands, prefault)
    by_key = {m.command: m for m in results}
    floor = floors(by_key)
    info["floors_s"] = floor
    for key, _, kind, _ in commands:
        m = by_key[key]
        cp, cp_fsync = floor[kind]["cp"], floor[kind]["cp_fsync"]
        if m.median_s is not None and cp:
            m.x_cp = m.median_s / cp
        if m.median_s is not None and cp_fsync:
            m.x_cp_fsync = m.median_s / cp_fsync
    if not keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return info, results
