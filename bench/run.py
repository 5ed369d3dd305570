"""syncd benchmark: conversion time and peak memory against `cp`, and the daemon's close-to-publish latency.

    .venv/bin/python bench/run.py            # full run (< 15 min on 2 cores): results in bench/results/
    .venv/bin/python bench/run.py --quick    # small files, one timed run (< 1 min): results-quick.*
    add --snapshot to measure syncd as committed at HEAD instead of the working tree (see README.md)

For every synthetic checkpoint (see gen.py) it measures, each as a subprocess:

- `cp --reflink=never SRC DST` of the source file: the floor. (GNU cp >= 9 copies with copy_file_range, an
  in-kernel copy, and does not fsync.)
- `cp --reflink=never SRC DST && sync DST`: the same plus an fsync of the copy, because `syncd convert`
  fsyncs its output (and the directory) before publishing. Reported as a second floor.
- the naive pipeline (naive.py): safetensors load_file, np.ascontiguousarray(w.T), save_file (BF16 through
  safetensors.torch, since numpy has no bfloat16).
- `syncd convert SRC.safetensors -o DST.bpk` (PyTorch -> Burn) and `syncd convert SRC.bpk -o DST.safetensors`
  (Burn -> PyTorch). The .bpk source is made by syncd itself before the measurements (untimed).

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
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import gen

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results"
WORK = BENCH / "work"
MiB = 1 << 20
PYTHON = sys.executable


SNAPSHOT: Path | None = None  # --snapshot: the `git archive HEAD` copy of syncd/ that is measured


def syncd_argv() -> list[str]:
    if SNAPSHOT is not None:
        return [PYTHON, str(BENCH / "syncd_at.py"), str(SNAPSHOT)]
    script = Path(sys.executable).parent / "syncd"
    return [str(script)] if script.exists() else [PYTHON, "-m", "syncd"]


def make_snapshot() -> tuple[Path, str]:
    """syncd/ as committed at HEAD, extracted under bench/work/; checked to be what syncd_at.py imports."""
    root = WORK / "syncd-snapshot"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    commit = head.stdout.strip()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "syncd"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive.stdout, check=True)
    where = subprocess.run([PYTHON, str(BENCH / "syncd_at.py"), str(root), "--where"], capture_output=True, text=True)
    if not where.stdout.strip().startswith(str(root)):
        raise SystemExit(f"--snapshot: syncd_at.py imports {where.stdout.strip() or where.stderr.strip()}, not {root}")
    return root, commit[:12]


def git_state() -> dict:
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "--", "syncd"], capture_output=True, text=True
    ).stdout.splitlines()
    changed = {}
    for line in dirty:
        path = REPO / line[3:]
        with contextlib.suppress(OSError):
            changed[line[3:]] = path.stat().st_mtime_ns
    return {"head": head.stdout.strip(), "uncommitted": changed}


# ---------------------------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    name: str
    model: str  # gen.MODELS key
    dtype: str
    mib: int  # target size (the small model ignores it)
    note: str
    target: str = ""  # which target this case checks: linear | notranspose | rss | small


FULL_CASES = [
    Case("linear-f32-1g", "linear", "F32", 1024, "transformer-like, every Linear transposed", "linear"),
    Case("linear-f32-256m", "linear", "F32", 256, "transformer-like, every Linear transposed"),
    Case("linear-bf16-512m", "linear", "BF16", 512, "transformer-like, every Linear transposed"),
    Case("conv-f32-1g", "conv", "F32", 1024, "ResNet-like convs + BatchNorm, no transposes", "notranspose"),
    Case("conv-bf16-256m", "conv", "BF16", 256, "ResNet-like convs + BatchNorm, no transposes"),
    Case("small-f32-10k", "small", "F32", 40, "10,000 tensors of 4 KiB (LayerNorms)", "small"),
    Case("big-f32-2g", "big", "F32", 2048, "linear stack + one 512 MiB Linear head", "rss"),
]
QUICK_CASES = [
    Case("linear-f32-64m", "linear", "F32", 64, "transformer-like, every Linear transposed", "linear"),
    Case("linear-bf16-32m", "linear", "BF16", 32, "transformer-like, every Linear transposed"),
    Case("conv-f32-64m", "conv", "F32", 64, "convs + BatchNorm, no transposes", "notranspose"),
    Case("small-f32-10k", "small", "F32", 40, "10,000 tensors of 4 KiB (LayerNorms)", "small"),
    Case("big-f32-128m", "big", "F32", 128, "linear stack + one 32 MiB Linear head", "rss"),
]

# (key, label, source kind, output suffix)
COMMANDS = [
    ("cp", "cp", "st", ".safetensors"),
    ("cp_fsync", "cp + fsync", "st", ".safetensors"),
    ("naive", "naive (load, .T, save)", "st", ".safetensors"),
    ("syncd_to_bpk", "syncd pytorch->burn", "st", ".bpk"),
    ("cp_bpk", "cp (.bpk)", "bpk", ".bpk"),
    ("cp_fsync_bpk", "cp + fsync (.bpk)", "bpk", ".bpk"),
    ("syncd_to_st", "syncd burn->pytorch", "bpk", ".safetensors"),
]
FLOOR = {"st": ("cp", "cp_fsync"), "bpk": ("cp_bpk", "cp_fsync_bpk")}


def command_argv(key: str, src: Path, dst: Path) -> list[str]:
    if key.startswith("cp_fsync"):
        return ["sh", "-c", 'cp --reflink=never -- "$1" "$2" && sync -- "$2"', "sh", str(src), str(dst)]
    if key.startswith("cp"):
        return ["cp", "--reflink=never", "--", str(src), str(dst)]
    if key == "naive":
        return [PYTHON, str(BENCH / "naive.py"), str(src), str(dst)]
    return [*syncd_argv(), "convert", str(src), "-o", str(dst)]


# ---------------------------------------------------------------------------------------------- measuring


@dataclass
class Run:
    seconds: float
    maxrss_kib: int
    status: int
    cpu_s: float | None = None  # user + system, from /usr/bin/time


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
    maxrss, cpu = usage.ru_maxrss, usage.ru_utime + usage.ru_stime
    if wrapped is not argv:
        last = rss_path.read_text().splitlines()[-1:] if rss_path.exists() else []
        fields = last[0].split() if last else []
        with contextlib.suppress(ValueError, IndexError):
            maxrss, cpu = int(fields[0]), float(fields[1]) + float(fields[2])
    return Run(seconds, maxrss, code, cpu)


def _failure(stderr_path: Path, status: int) -> str:
    text = stderr_path.read_text(errors="replace").strip().splitlines() if stderr_path.exists() else []
    return f"exit {status}: {text[-1] if text else 'no output written'}"


def measure_case(
    case: Case, sources: dict[str, Path], workdir: Path, reps: int, warmup: bool, log
) -> list[Measurement]:
    """Every command of one case, interleaved: a warm-up round, then `reps` rounds each running every command
    once, so slow phases of a shared machine hit the floor and the conversions alike."""
    jobs = []
    for key, label, kind, suffix in COMMANDS:
        src = sources[kind]
        m = Measurement(case.name, key, label, src.stat().st_size if src.exists() else 0)
        if not src.exists():
            m.error = f"no source {src.name}"
        dst = workdir / f"out-{key}{suffix}"
        jobs.append((m, command_argv(key, src, dst), dst, workdir / f"out-{key}.stderr"))
    for round_ in range(0 if warmup else 1, reps + 1):  # round 0 is the warm-up
        for m, argv, dst, stderr_path in jobs:
            if m.error:
                continue
            load = os.getloadavg()[0]
            run = run_once(argv, dst, stderr_path)
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


def startup_cost(reps: int) -> dict:
    """What every `syncd convert` pays before touching a file: interpreter start and imports."""
    argv = [PYTHON, "-c", "import syncd.cli, syncd.convert"]
    if SNAPSHOT is not None:
        argv = [PYTHON, str(BENCH / "syncd_at.py"), str(SNAPSHOT), "--where"]
    times = []
    for i in range(reps + 1):
        started = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        if i:
            times.append(time.perf_counter() - started)
    return {"command": " ".join(argv), "median_s": statistics.median(times)}


def run_case(case: Case, reps: int, warmup: bool, keep: bool, log) -> tuple[dict, list[Measurement]]:
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
    made = subprocess.run([*syncd_argv(), "convert", str(src), "-o", str(bpk)], capture_output=True, text=True)
    if made.returncode != 0:
        info["bpk_error"] = (made.stderr.strip().splitlines() or ["?"])[-1]
    else:
        info["bpk_bytes"] = bpk.stat().st_size
    log(
        f"  {case.name}: {info['tensors']} tensors, {info['safetensors_bytes'] / MiB:.0f} MiB, largest tensor "
        f"{info['largest_tensor_bytes'] / MiB:.2f} MiB; generated in {time.perf_counter() - t0:.1f} s"
    )
    results = measure_case(case, {"st": src, "bpk": bpk}, workdir, reps, warmup, log)
    by_key = {m.command: m for m in results}
    floor = floors(by_key)
    info["floors_s"] = floor
    for key, _, kind, _ in COMMANDS:
        m = by_key[key]
        cp, cp_fsync = floor[kind]["cp"], floor[kind]["cp_fsync"]
        if m.median_s is not None and cp:
            m.x_cp = m.median_s / cp
        if m.median_s is not None and cp_fsync:
            m.x_cp_fsync = m.median_s / cp_fsync
    if not keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return info, results


# ---------------------------------------------------------------------------------------------- daemon


def nearest_rank(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(pct / 100 * len(ordered)) - 1)]


def daemon_payloads(count: int, seed: int = 1) -> list[bytes]:
    """`count` different ~10 MB safetensors files (a 2-block transformer, d=320, F32) as bytes."""
    tensors = gen.library_order(gen.transformer_blocks(320, 2, "F32"))
    header = gen.header_bytes(tensors, {"format": "pt"})
    pool = gen._Pool(seed)
    payloads = []
    for _ in range(count):
        data = bytearray(header)
        for t in tensors:
            for piece in pool.chunks(t):
                data += piece
        payloads.append(bytes(data))
    return payloads


def daemon_config(root: Path) -> Path:
    (root / "runs").mkdir(parents=True)
    config = root / "syncd.yaml"
    config.write_text(
        "# written by bench/run.py: config/syncd.yaml's settings, one watch converting safetensors -> bpk\n"
        "workers: 2\n"
        "settle_seconds: 1.0\n"
        "state_dir: ./state\n"
        "log:\n  path: ./sync.log.jsonl\n  level: warning\n"
        "poll_interval: null\n"
        "watches:\n"
        "  - path: ./runs\n"
        "    recursive: true\n"
        '    include: ["*.safetensors"]\n'
        "    direction: safetensors->bpk\n"
        "    output: beside\n"
        "    on_exists: overwrite\n"
        "    layout: auto\n"
    )
    config.chmod(0o644)
    return config


def _read_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def _wait_for(predicate, timeout: float, proc: subprocess.Popen | None = None, interval: float = 0.001) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc is not None and proc.poll() is not None:
            return predicate()
        time.sleep(interval)
    return False


def _vm_hwm_kib(pid: int) -> int | None:
    """The process's peak RSS so far (VmHWM belongs to the exec'ed image, unlike a child's ru_maxrss)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _stop(proc: subprocess.Popen) -> int | None:
    """SIGTERM (the daemon's clean stop), SIGKILL after 10 s; returns its peak RSS in KiB (VmHWM)."""
    if proc.poll() is not None:
        return None
    hwm = _vm_hwm_kib(proc.pid)
    os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    return hwm


def _unavailable(reason: str) -> dict:
    return {"available": False, "reason": f"daemon not available: {reason}"}


def daemon_latency(files: int, log) -> dict:
    root = WORK / "daemon"
    shutil.rmtree(root, ignore_errors=True)
    probe_argv = [PYTHON, "-c", "import syncd.daemon.service"]
    if SNAPSHOT is not None:
        probe_argv = [PYTHON, str(BENCH / "syncd_at.py"), str(SNAPSHOT), "--import", "syncd.daemon.service"]
    probe = subprocess.run(probe_argv, capture_output=True, text=True)
    if probe.returncode != 0:
        return _unavailable((probe.stderr.strip().splitlines() or ["cannot import syncd.daemon.service"])[-1])
    config = daemon_config(root)
    checked = subprocess.run([*syncd_argv(), "check-config", str(config)], capture_output=True, text=True)
    if checked.returncode != 0:
        return _unavailable("check-config: " + ((checked.stderr or checked.stdout).strip().splitlines() or ["?"])[0])
    payloads = daemon_payloads(files + 1)
    sync_log = root / "sync.log.jsonl"
    stderr_path = root / "daemon.stderr"
    os.sync()
    with open(stderr_path, "wb") as err:
        proc = subprocess.Popen(
            [*syncd_argv(), "run", "-c", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=err,
            stderr=err,
            start_new_session=True,
        )
    result: dict = {"available": True}
    try:
        started = _wait_for(lambda: any(r.get("status") == "started" for r in _read_log(sync_log)), 30, proc, 0.02)
        if not started:
            text = stderr_path.read_text(errors="replace").strip().splitlines()
            why = f"exited with {proc.returncode}" if proc.poll() is not None else "no 'started' line within 30 s"
            return _unavailable(f"{why}{': ' + text[-1] if text else ''}")
        latencies, conversion_ms, missing = [], [], []
        for i, payload in enumerate(payloads):
            name = "warmup" if i == 0 else f"ckpt-{i:03d}"
            path = root / "runs" / f"{name}.safetensors"
            out = path.with_suffix(".bpk")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(fd, payload)
            finally:
                os.close(fd)
            closed = time.monotonic()
            appeared = _wait_for(out.exists, 30 if i else 60, proc)
            seen = time.monotonic()
            if not appeared:
                missing.append(name)
                if proc.poll() is not None:
                    break
                continue
            if i:
                latencies.append(seen - closed)
            time.sleep(0.05)  # let the daemon finish its bookkeeping (state db, log) before the next file
        records = _read_log(sync_log)
        statuses: dict[str, int] = {}
        for record in records:
            statuses[record.get("status", "?")] = statuses.get(record.get("status", "?"), 0) + 1
            source = str(record.get("source", ""))
            if record.get("status") == "converted" and "ckpt-" in source and "duration_ms" in record:
                conversion_ms.append(float(record["duration_ms"]))
        if not latencies:
            text = stderr_path.read_text(errors="replace").strip().splitlines()
            return _unavailable(f"no output appeared for {len(missing)} file(s){': ' + text[-1] if text else ''}")
        ms = [x * 1000 for x in latencies]
        result.update(
            files=files,
            file_bytes=len(payloads[0]),
            measured=len(ms),
            missing=missing,
            median_ms=statistics.median(ms),
            p95_ms=nearest_rank(ms, 95),
            min_ms=min(ms),
            max_ms=max(ms),
            conversion_median_ms=statistics.median(conversion_ms) if conversion_ms else None,
            log_statuses=statuses,
            settle_seconds=1.0,
            latencies_ms=[round(x, 1) for x in ms],
        )
        log(
            f"  daemon: {len(ms)} files of {len(payloads[0]) / 1e6:.1f} MB: median {result['median_ms']:.0f} ms, "
            f"p95 {result['p95_ms']:.0f} ms (max {result['max_ms']:.0f}); conversion itself (sync log) median "
            f"{result['conversion_median_ms'] or float('nan'):.0f} ms"
        )
        return result
    finally:
        rss = _stop(proc)
        if rss is not None:
            result["daemon_peak_rss_mib"] = rss / 1024
        shutil.rmtree(root / "runs", ignore_errors=True)


# ---------------------------------------------------------------------------------------------- reporting


def fmt(value: float | None, pattern: str, missing: str = "-") -> str:
    return missing if value is None else pattern.format(value)


def human_bytes(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / MiB:.0f} MiB"


def table_rows(cases: list[dict], measurements: list[Measurement]) -> list[list[str]]:
    info = {c["case"]: c for c in cases}
    rows = []
    for m in measurements:
        c = info[m.case]
        rows.append(
            [
                m.case,
                human_bytes(m.source_bytes) if m.source_bytes else "-",
                m.label,
                fmt(m.median_s, "{:.2f}") if not m.error else "FAILED",
                f"{m.min_s:.2f}-{m.max_s:.2f}" if m.min_s is not None else "-",
                fmt(m.x_cp, "{:.2f}x"),
                fmt(m.x_cp_fsync, "{:.2f}x"),
                fmt(m.peak_rss_mib, "{:.0f}"),
                fmt(m.cpu_s, "{:.2f}"),
            ]
        )
        _ = c
    return rows


HEADERS = ["case", "source", "command", "median s", "min-max s", "x cp", "x cp+fsync", "peak RSS MiB", "CPU s"]


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    right = {i for i, h in enumerate(headers) if h not in ("case", "command", "target", "status")}
    lines = ["| " + " | ".join(headers) + " |"]
    lines.append("|" + "|".join("---:" if i in right else "---" for i in range(len(headers))) + "|")
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def text_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(out)


def evaluate_targets(cases: list[Case], measurements: list[Measurement], daemon: dict, quick: bool) -> list[dict]:
    by = {(m.case, m.command): m for m in measurements}
    role = {c.target: c.name for c in cases if c.target}
    targets = []

    def add(name: str, figure: str, met: bool | None, note: str = "") -> None:
        status = "n/a" if met is None else ("met" if met else "MISSED")
        targets.append({"target": name, "measured": figure, "status": status, "note": note})

    def ratio_target(case: str | None, limit: float, title: str) -> None:
        if case is None:
            return
        for key, label in (("syncd_to_bpk", "pytorch->burn"), ("syncd_to_st", "burn->pytorch")):
            m = by.get((case, key))
            ok = None if m is None or m.x_cp is None else m.x_cp <= limit
            figure = f"{m.x_cp:.2f}x cp ({m.median_s:.2f} s)" if m and m.x_cp else (m.error if m else "-")
            fsync = f"; {m.x_cp_fsync:.2f}x cp+fsync" if m and m.x_cp_fsync else ""
            add(f"{title} {label}: <= {limit}x cp [{case}]", figure + fsync, ok)

    ratio_target(role.get("linear"), 1.5, "Linear-heavy F32")
    ratio_target(role.get("notranspose"), 1.2, "no-transpose")
    case = role.get("rss")
    if case:
        for key, label in (("syncd_to_bpk", "pytorch->burn"), ("syncd_to_st", "burn->pytorch")):
            m = by.get((case, key))
            ok = None if m is None or m.peak_rss_mib is None else m.peak_rss_mib <= 256
            add(f"peak RSS {label} <= 256 MiB [{case}]", fmt(m.peak_rss_mib if m else None, "{:.0f} MiB"), ok)
        naive = by.get((case, "naive"))
        if naive and naive.peak_rss_mib:
            add(f"(naive peak RSS, expected > 4 GiB) [{case}]", f"{naive.peak_rss_mib:.0f} MiB", None, "reference")
    if daemon.get("available"):
        add("daemon latency 10 MB: median <= 250 ms", f"{daemon['median_ms']:.0f} ms", daemon["median_ms"] <= 250)
        add("daemon latency 10 MB: p95 <= 500 ms", f"{daemon['p95_ms']:.0f} ms", daemon["p95_ms"] <= 500)
    else:
        add("daemon latency 10 MB (median <= 250 ms, p95 <= 500 ms)", daemon.get("reason", "not run"), None)
    case = role.get("small")
    if case:
        for key, label in (("syncd_to_bpk", "pytorch->burn"), ("syncd_to_st", "burn->pytorch")):
            m = by.get((case, key))
            ok = None if m is None or m.median_s is None else m.median_s <= 2.0
            add(f"10,000 x 4 KiB {label}: <= 2 s", fmt(m.median_s if m else None, "{:.2f} s"), ok)
    if quick:
        for t in targets:
            t["note"] = (t["note"] + "; " if t["note"] else "") + "quick mode: smaller files than the targets name"
    return targets


def environment() -> dict:
    def version(module: str) -> str | None:
        try:
            return __import__(module).__version__
        except Exception:
            return None

    cpu = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "")
    cp_version = subprocess.run(["cp", "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    fs = subprocess.run(["df", "-T", str(BENCH)], capture_output=True, text=True).stdout.splitlines()[1:2]
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30), 1),
        "kernel": platform.release(),
        "filesystem": fs[0].split()[1] if fs else "?",
        "python": platform.python_version(),
        "numpy": version("numpy"),
        "safetensors": version("safetensors"),
        "cp": cp_version[0] if cp_version else "?",
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),
    }


def write_chart(path: Path, cases: list[dict], measurements: list[Measurement], log) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("  matplotlib is not installed: no chart (pip install matplotlib, the `bench` extra)")
        return False
    names = [c["case"] for c in cases]
    shown = [
        ("cp_fsync", "cp + fsync"),
        ("naive", "naive"),
        ("syncd_to_bpk", "syncd pytorch->burn"),
        ("syncd_to_st", "syncd burn->pytorch"),
    ]
    by = {(m.case, m.command): m for m in measurements}
    fig, (ax_t, ax_m) = plt.subplots(2, 1, figsize=(11, 8), constrained_layout=True)
    width = 0.8 / len(shown)
    for j, (key, label) in enumerate(shown):
        xs = [i + (j - (len(shown) - 1) / 2) * width for i in range(len(names))]
        ratios = [by.get((n, key)).x_cp or 0 if by.get((n, key)) else 0 for n in names]
        rss = [by.get((n, key)).peak_rss_mib or 0 if by.get((n, key)) else 0 for n in names]
        bars = ax_t.bar(xs, ratios, width, label=label)
        ax_t.bar_label(bars, labels=[f"{r:.1f}" if r else "" for r in ratios], fontsize=7, padding=1)
        ax_m.bar(xs, rss, width, label=label)
    ax_t.axhline(1.0, color="black", linewidth=0.8)
    for limit in (1.2, 1.5):
        ax_t.axhline(limit, color="grey", linestyle="--", linewidth=0.6)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("wall time / cp (log)")
    ax_t.set_title("Conversion time relative to cp of the same source (median, warm cache)")
    ax_m.axhline(256, color="grey", linestyle="--", linewidth=0.6)
    ax_m.set_yscale("log")
    ax_m.set_ylabel("peak RSS, MiB (log)")
    ax_m.set_title("Peak RSS of the process (dashed: 256 MiB)")
    for ax in (ax_t, ax_m):
        ax.set_xticks(range(len(names)), names, fontsize=8)
    handles, labels = ax_t.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside upper center", ncols=len(shown), fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def report(
    args, cases: list[Case], infos: list[dict], measurements: list[Measurement], daemon: dict, startup: dict, log
) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "results-quick" if args.quick else "results"
    env = environment()
    rows = table_rows(infos, measurements)
    targets = evaluate_targets(cases, measurements, daemon, args.quick)
    target_rows = [[t["target"], t["measured"], t["status"]] for t in targets]
    daemon_rows = []
    if daemon.get("available"):
        daemon_rows.append(
            [
                f"{daemon['measured']} x {daemon['file_bytes'] / 1e6:.1f} MB",
                f"{daemon['median_ms']:.0f}",
                f"{daemon['p95_ms']:.0f}",
                f"{daemon['min_ms']:.0f}-{daemon['max_ms']:.0f}",
                fmt(daemon.get("conversion_median_ms"), "{:.0f}"),
                fmt(daemon.get("daemon_peak_rss_mib"), "{:.0f}"),
            ]
        )
    daemon_headers = ["files", "median ms", "p95 ms", "min-max ms", "conversion median ms (sync log)", "daemon RSS MiB"]

    print()
    print(text_table(HEADERS, rows))
    print()
    if daemon_rows:
        print(text_table(daemon_headers, daemon_rows))
    else:
        print(daemon.get("reason", "daemon: not run"))
    print()
    print(text_table(["target", "measured", "status"], target_rows))

    mode = (
        "quick (one timed run, no separate warm-up: the sources were just written)"
        if args.quick
        else f"full (median of {args.reps} after a warm-up)"
    )
    md = [
        f"# syncd benchmark ({'quick' if args.quick else 'full'})",
        "",
        f"Command: `{shlex_join([Path(PYTHON).as_posix(), 'bench/run.py', *sys.argv[1:]])}` "
        f"— {mode}; warm page cache; outputs deleted and `sync` run before every run.",
        "",
        f"Machine: {env['cpu']}, {env['cores']} cores, {env['memory_gib']} GiB RAM, kernel {env['kernel']}, "
        f"{env['filesystem']}; Python {env['python']}, numpy {env['numpy']}, safetensors {env['safetensors']}; "
        f"{env['cp']}; {env['date']}. Measured: {args.under_test}. Load average (1 min) at the start "
        f"{args.load_at_start:.1f}, at the end {env['load_average_1m_at_end']:.1f}: the machine is shared, and "
        "the JSON has the load before each command's runs and every run's time.",
        "",
        "`x cp`: median wall time over the median of the `cp --reflink=never` runs of the case, both source "
        "files pooled (6 runs; the .safetensors and .bpk differ in size by < 2%; GNU cp uses copy_file_range, an "
        "in-kernel copy, and does not fsync). `x cp+fsync`: the same for cp followed by `sync FILE` "
        "(syncd fsyncs its output before publishing). Peak RSS: ru_maxrss of the command (wait4 in /usr/bin/time), "
        "highest of the timed runs. The naive pipeline writes safetensors (numpy; BF16 through safetensors.torch).",
        "",
        f"Fixed cost in every `syncd convert` row: Python start + `import syncd.cli, syncd.convert` = "
        f"{startup['median_s']:.2f} s (median).",
        "",
        "## Conversion",
        "",
        markdown_table(HEADERS, rows),
        "",
        "## Checkpoints",
        "",
        markdown_table(
            ["case", "model", "tensors", "safetensors", "largest tensor", "transposed"],
            [
                [
                    c["case"],
                    f"{c['model']} {c['dtype']}: {c['note']}",
                    str(c["tensors"]),
                    human_bytes(c["safetensors_bytes"]),
                    f"{c['largest_tensor_bytes'] / MiB:.2f} MiB",
                    f"{c['transposed_fraction'] * 100:.1f}%",
                ]
                for c in infos
            ],
        ),
        "",
        "## Daemon latency (close of the written file -> published .bpk)",
        "",
    ]
    if daemon_rows:
        md += [
            markdown_table(daemon_headers, daemon_rows),
            "",
            "`syncd run` with config/syncd.yaml's settings (2 workers, settle_seconds 1.0, inotify), one watch "
            "`direction: safetensors->bpk`, `output: beside`. Files are written one at a time (one write(), "
            "close), the next after the previous output appeared; the output is polled with os.stat every "
            "millisecond; p95 by nearest rank. A warm-up file is not counted.",
        ]
    else:
        md.append(daemon.get("reason", "not run"))
    md += ["", "## Targets", "", markdown_table(["target", "measured", "status"], target_rows), ""]
    if write_chart(RESULTS / f"{stem}.png", infos, measurements, log):
        md += [f"![chart]({stem}.png)", ""]
    else:
        (RESULTS / f"{stem}.png").unlink(missing_ok=True)  # a chart of an earlier run would not match
    (RESULTS / f"{stem}.md").write_text("\n".join(md))
    document = {
        "mode": "quick" if args.quick else "full",
        "reps": args.reps,
        "warm_cache": True,
        "environment": {**env, "load_average_1m_at_start": round(args.load_at_start, 2)},
        "syncd_under_test": args.under_test,
        "git_at_start": args.git_start,
        "git_at_end": args.git_end,
        "checkpoints": infos,
        "measurements": [asdict(m) for m in measurements],
        "daemon": daemon,
        "startup": startup,
        "targets": targets,
    }
    (RESULTS / f"{stem}.json").write_text(json.dumps(document, indent=2) + "\n")
    chart = f", {stem}.png" if (RESULTS / f"{stem}.png").exists() else ""
    log(f"\nwrote {RESULTS / (stem + '.md')}, {stem}.json{chart}")


def shlex_join(parts: list[str]) -> str:
    import shlex

    return shlex.join(parts)


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
    if args.snapshot:
        global SNAPSHOT
        SNAPSHOT, commit = make_snapshot()
        args.under_test = f"syncd as committed at {commit} (a snapshot; the working tree is not used)"
    else:
        changed = args.git_start["uncommitted"]
        args.under_test = f"the syncd working tree at {args.git_start['head']}" + (
            f" with uncommitted changes to {', '.join(changed)}" if changed else ""
        )
    log(f"  measuring {args.under_test}")
    WORK.mkdir(parents=True, exist_ok=True)
    infos, measurements = [], []
    startup = startup_cost(args.reps)
    log(f"  python start + import syncd.convert: {startup['median_s']:.2f} s (a fixed cost of every syncd convert)")
    try:
        for case in cases:
            info, results = run_case(case, args.reps, not args.quick, args.keep, log)
            infos.append(info)
            measurements += results
        if args.no_daemon:
            daemon = {"available": False, "reason": "daemon latency skipped (--no-daemon)"}
        else:
            daemon = daemon_latency(args.daemon_files or (10 if args.quick else 50), log)
            if not daemon.get("available"):
                log(f"  {daemon['reason']}")
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
