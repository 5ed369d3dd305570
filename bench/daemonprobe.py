"""The daemon probe: `syncd run` on a fresh watched directory, and the latency from a checkpoint's close to
its published output (see bench/README.md, "Daemon latency")."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import gen
from undertest import WORK, SyncdUnderTest


def start_daemon(syncd: SyncdUnderTest, config: Path, stderr_path: Path, cwd: Path | None = None) -> subprocess.Popen:
    """`syncd run -c CONFIG` in its own session, its output into `stderr_path`."""
    with open(stderr_path, "wb") as err:
        return subprocess.Popen(
            [*syncd.argv(), "run", "-c", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=err,
            stderr=err,
            start_new_session=True,
            cwd=cwd,
        )


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


def daemon_latency(files: int, syncd: SyncdUnderTest, log: Callable[[str], None]) -> dict:
    root = WORK / "daemon"
    shutil.rmtree(root, ignore_errors=True)
    probe = subprocess.run(syncd.import_argv("syncd.daemon.service"), capture_output=True, text=True)
    if probe.returncode != 0:
        return _unavailable((probe.stderr.strip().splitlines() or ["cannot import syncd.daemon.service"])[-1])
    config = daemon_config(root)
    checked = subprocess.run([*syncd.argv(), "check-config", str(config)], capture_output=True, text=True)
    if checked.returncode != 0:
        return _unavailable("check-config: " + ((checked.stderr or checked.stdout).strip().splitlines() or ["?"])[0])
    payloads = daemon_payloads(files + 1)
    sync_log = root / "sync.log.jsonl"
    stderr_path = root / "daemon.stderr"
    os.sync()
    proc = start_daemon(syncd, config, stderr_path)
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


def _started(sync_log: Path) -> bool:
    return any(r.get("status") == "started" for r in _read_log(sync_log))


def daemon_big(mib: int, reps: int, syncd: SyncdUnderTest, log: Callable[[str], None]) -> dict:
    """A checkpoint of wide Linears (1 GiB: gen.py's `wide`; --quick: a 64 MiB `linear`) renamed into a watched
    tree, with inotify and with polling (`poll: true`, every 2 s), against `syncd convert` of the same file;
    interleaved, `reps` rounds (after a warm-up round). Latency = the .bpk appears - rename returned."""
    root = WORK / "daemon-big"
    shutil.rmtree(root, ignore_errors=True)
    staging = root / "staging"
    staging.mkdir(parents=True)
    source = staging / "source.safetensors"
    model = gen.wide_model(0, "F32") if mib >= 1024 else gen.linear_model(mib * (1 << 20), "F32")
    gen.write_safetensors(str(source), model)
    size = source.stat().st_size
    daemons: dict[str, tuple[subprocess.Popen, Path]] = {}
    result: dict = {"available": True, "file_bytes": size, "settle_seconds": 1.0, "poll_seconds": 2.0}
    times: dict[str, list[float]] = {"convert": [], "inotify": [], "poll": []}
    try:
        for mode in ("inotify", "poll"):
            tree = root / mode
            config = daemon_config(tree)
            if mode == "poll":
                config.write_text(
                    config.read_text().replace("    recursive: true\n", "    recursive: true\n    poll: true\n")
                )
            sync_log = tree / "sync.log.jsonl"
            proc = start_daemon(syncd, config, tree / "daemon.stderr", cwd=tree)
            daemons[mode] = (proc, tree)
            if not _wait_for(lambda log=sync_log: _started(log), 30, proc, 0.02):
                return _unavailable(f"{mode} daemon did not start ({(tree / 'daemon.stderr').read_text()[-300:]})")
        for round_ in range(reps + 1):  # round 0 warms up
            for what in ("convert", "inotify", "poll"):
                staged = staging / f"r{round_}-{what}.safetensors"
                subprocess.run(["cp", "--reflink=never", str(source), str(staged)], check=True)
                os.sync()
                if what == "convert":
                    out = staging / f"r{round_}.bpk"
                    started = time.monotonic()
                    subprocess.run([*syncd.argv(), "convert", str(staged), "-o", str(out)], check=True)
                    seconds = time.monotonic() - started
                    out.unlink()
                else:
                    proc, tree = daemons[what]
                    target = tree / "runs" / staged.name
                    started = time.monotonic()
                    os.rename(staged, target)
                    if not _wait_for(target.with_suffix(".bpk").exists, 600, proc, 0.001):
                        return _unavailable(f"{what}: no output for {target.name}")
                    seconds = time.monotonic() - started
                    time.sleep(0.2)  # the daemon's bookkeeping after publishing, before the files are removed
                    target.unlink()
                    target.with_suffix(".bpk").unlink()
                staged.unlink(missing_ok=True)
                if round_:
                    times[what].append(seconds)
        convert = statistics.median(times["convert"])
        for what in ("inotify", "poll"):
            median = statistics.median(times[what])
            floor = convert + result["settle_seconds"] + (result["poll_seconds"] if what == "poll" else 0.0)
            result[what] = {"median_s": median, "runs_s": times[what], "x_convert_plus_settle": median / floor}
        result["convert"] = {"median_s": convert, "runs_s": times["convert"]}
        log(
            f"  daemon {size / (1 << 20):.0f} MiB renamed in: convert {convert:.2f} s; inotify "
            f"{result['inotify']['median_s']:.2f} s ({result['inotify']['x_convert_plus_settle']:.2f}x convert + "
            f"settle); poll {result['poll']['median_s']:.2f} s ({result['poll']['x_convert_plus_settle']:.2f}x "
            "convert + settle + poll interval)"
        )
        return result
    finally:
        for proc, _ in daemons.values():
            _stop(proc)
        shutil.rmtree(root, ignore_errors=True)
