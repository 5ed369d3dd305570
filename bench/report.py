"""The benchmark's report: tables (printed and markdown), the targets, the environment, the chart, the JSON."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shlex
import subprocess
import sys
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from cases import NUMPY, MiB
from undertest import BENCH, PYTHON, RESULTS

if TYPE_CHECKING:
    from cases import Case
    from measure import Log, Measurement


def _shown_python() -> str:
    """The interpreter as the report shows it: relative to the repository (.venv/bin/python), else `python`
    (a machine's own paths do not belong in a committed report)."""
    path = Path(PYTHON)
    return path.relative_to(BENCH.parent).as_posix() if path.is_relative_to(BENCH.parent) else "python"


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
                fmt(m.user_s, "{:.2f}"),
            ]
        )
        _ = c
    return rows


HEADERS = [
    "case",
    "source",
    "command",
    "median s",
    "min-max s",
    "x cp",
    "x cp+fsync",
    "peak RSS MiB",
    "CPU s",
    "user s",
]


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
    """The targets of every case, for the compiled kernel and the numpy one (what a machine without a C
    compiler gets): transposing cases <= 1.5x cp+fsync and >= 2.5x faster than the torch pipeline,
    non-transposing <= 1.2x, 10,000 small tensors <= 0.35 s, peak RSS <= 256 MiB everywhere."""
    by = {(m.case, m.command): m for m in measurements}
    targets = []

    def add(name: str, figure: str, met: bool | None, note: str = "") -> None:
        status = "n/a" if met is None else ("met" if met else "MISSED")
        targets.append({"target": name, "measured": figure, "status": status, "note": note})

    directions = (("syncd_to_bpk", "pytorch->burn"), ("syncd_to_st", "burn->pytorch"))
    for case in cases:
        torch, disk = by.get((case.name, "torch")), by.get((case.name, "disk"))
        for base, label in directions:
            for key, kernel in ((base, ""), (base + NUMPY, ", numpy kernel")):
                m = by.get((case.name, key))
                if m is None:
                    continue
                what = f"{label}{kernel} [{case.name}]"
                if case.target in ("transpose", "notranspose"):
                    limit = 1.5 if case.target == "transpose" else 1.2
                    ok = None if m.x_cp_fsync is None else m.x_cp_fsync <= limit
                    figure = fmt(m.x_cp_fsync, "{:.2f}x cp+fsync") + fmt(m.median_s, " ({:.2f} s)")
                    add(f"<= {limit}x cp+fsync, {what}", figure if not m.error else m.error, ok)
                if case.target == "transpose" and torch is not None and torch.median_s and m.median_s:
                    speedup = torch.median_s / m.median_s
                    add(
                        f">= 2.5x faster than torch, {what}",
                        f"{speedup:.2f}x (torch {torch.median_s:.2f} s)",
                        speedup >= 2.5,
                        "" if speedup >= 2.5 else _durable_ceiling_note(torch.median_s, disk),
                    )
                if case.target == "small":
                    ok = None if m.median_s is None else m.median_s <= 0.35
                    add(f"10,000 x 4 KiB <= 0.35 s, {what}", fmt(m.median_s, "{:.2f} s"), ok)
                ok = None if m.peak_rss_mib is None else m.peak_rss_mib <= 256
                add(f"peak RSS <= 256 MiB, {what}", fmt(m.peak_rss_mib, "{:.0f} MiB"), ok)
    if daemon.get("available"):
        add("daemon latency 10 MB: median <= 250 ms", f"{daemon['median_ms']:.0f} ms", daemon["median_ms"] <= 250)
        add("daemon latency 10 MB: p95 <= 500 ms", f"{daemon['p95_ms']:.0f} ms", daemon["p95_ms"] <= 500)
    else:
        add("daemon latency 10 MB (median <= 250 ms, p95 <= 500 ms)", daemon.get("reason", "not run"), None)
    big = daemon.get("big") or {}
    if big.get("available"):
        for mode, floor in (("inotify", "convert + settle"), ("poll", "convert + settle + poll interval")):
            ratio = big[mode]["x_convert_plus_settle"]
            add(
                f"daemon, {big['file_bytes'] / (1 << 20):.0f} MiB renamed in, {mode}: <= 1.1x {floor}",
                f"{big[mode]['median_s']:.2f} s ({ratio:.2f}x; convert {big['convert']['median_s']:.2f} s)",
                ratio <= 1.1,
            )
    elif big:
        add("daemon, 1 GiB renamed in (<= 1.1x convert + settle)", big.get("reason", "not run"), None)
    if quick:
        for t in targets:
            t["note"] = (t["note"] + "; " if t["note"] else "") + "quick mode: smaller files than the targets name"
    return targets


def _durable_ceiling_note(torch_s: float, disk: Measurement | None) -> str:
    """torch's pipeline does not fsync; syncd must (commit_new: the scratch file is fsync'ed before it is linked
    into place), so no conversion can take less than the disk takes to store its output. That time is
    measured in the same run (`disk`: diskwrite.py, O_DIRECT writes of as many bytes, then fsync). Where a
    missed target asks for less than it, the note says so, with both figures."""
    if disk is None or not disk.median_s:
        return ""
    allowed = torch_s / 2.5
    if allowed >= disk.median_s:
        return ""
    return (
        f"beyond this disk: 2.5x faster than torch is {allowed:.2f} s, and writing the output's bytes alone, "
        f"straight to the disk (O_DIRECT, then fsync), took {disk.median_s:.2f} s"
    )


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
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cores_allowed": len(os.sched_getaffinity(0)),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30), 1),
        "kernel": platform.release(),
        "filesystem": fs[0].split()[1] if fs else "?",
        "python": platform.python_version(),
        "numpy": version("numpy"),
        "safetensors": version("safetensors"),
        "cp": cp_version[0] if cp_version else "?",
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        "free_page_reporting": _page_reporting(),
    }


def _reporting_line(env: dict) -> str:
    found = env.get("free_page_reporting") or {}
    if not found:
        return ""
    return (
        f" Free page reporting: order {found.get('page_reporting_order', '?')}, "
        f"min_free_ms {found.get('min_free_ms', '?')}."
    )


def _page_reporting() -> dict[str, str]:
    """This VM's free page reporting settings, where the kernel has them: how soon freed memory goes back to
    the host (min_free_ms), whose first touch afterwards costs system time (bench/README.md)."""
    params = Path("/sys/module/page_reporting/parameters")
    found = {}
    for name in ("page_reporting_order", "min_free_ms"):
        with contextlib.suppress(OSError):
            found[name] = (params / name).read_text().strip()
    return found


def write_chart(path: Path, cases: list[dict], measurements: list[Measurement], log: Log) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("  matplotlib is not installed: no chart (pip install matplotlib, the `bench` extra)")
        return False
    names = [c["case"] for c in cases]
    shown = [
        ("cp", "cp"),
        ("naive", "naive"),
        ("torch", "torch"),
        ("syncd_to_bpk", "syncd pytorch->burn"),
        ("syncd_to_st", "syncd burn->pytorch"),
    ]
    by = {(m.case, m.command): m for m in measurements}
    fig, (ax_t, ax_m) = plt.subplots(2, 1, figsize=(11, 8), constrained_layout=True)
    width = 0.8 / len(shown)
    for j, (key, label) in enumerate(shown):
        xs = [i + (j - (len(shown) - 1) / 2) * width for i in range(len(names))]
        ratios = [by.get((n, key)).x_cp_fsync or 0 if by.get((n, key)) else 0 for n in names]
        rss = [by.get((n, key)).peak_rss_mib or 0 if by.get((n, key)) else 0 for n in names]
        bars = ax_t.bar(xs, ratios, width, label=label)
        ax_t.bar_label(bars, labels=[f"{r:.1f}" if r else "" for r in ratios], fontsize=7, padding=1)
        ax_m.bar(xs, rss, width, label=label)
    ax_t.axhline(1.0, color="black", linewidth=0.8)
    for limit in (1.2, 1.5):  # the targets: non-transposing, transposing
        ax_t.axhline(limit, color="grey", linestyle="--", linewidth=0.6)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("wall time / (cp + fsync) (log)")
    ax_t.set_title("Time relative to a durable copy (cp + fsync) of the same source (median, warm cache)")
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
    args, cases: list[Case], infos: list[dict], measurements: list[Measurement], daemon: dict, startup: dict, log: Log
) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = args.name or ("results-quick" if args.quick else "results")
    env = environment()
    rows = table_rows(infos, measurements)
    targets = evaluate_targets(cases, measurements, daemon, args.quick)
    target_rows = [
        [t["target"], t["measured"], t["status"] + (f" ({t['note']})" if t["note"] else "")] for t in targets
    ]
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
        f"Command: `{shlex.join([_shown_python(), 'bench/run.py', *sys.argv[1:]])}` "
        f"— {mode}; warm page cache; outputs deleted and `sync` run before every run"
        + (
            "."
            if getattr(args, "no_prefault", False)
            else "; before every run, as much memory as it will need touched and freed (bench/README.md)."
        ),
        "",
        f"Machine: {env['cpu']}, {env['cores']} cores ({env['cores_allowed']} allowed), {env['memory_gib']} GiB RAM, "
        f"kernel {env['kernel']}, "
        f"{env['filesystem']}; Python {env['python']}, numpy {env['numpy']}, safetensors {env['safetensors']}; "
        f"{env['cp']}; {env['date']}.{_reporting_line(env)} Measured: {args.under_test}. "
        "Load average (1 min) at the start "
        f"{args.load_at_start:.1f}, at the end {env['load_average_1m_at_end']:.1f}: the machine is shared, and "
        "the JSON has the load before each command's runs and every run's time.",
        "",
        "`x cp`: median wall time over the median of the `cp --reflink=never` runs of the case, both source "
        "files pooled (6 runs; the .safetensors and .bpk differ in size by < 2%; GNU cp uses copy_file_range, an "
        "in-kernel copy, and does not fsync). `x cp+fsync`: the same for cp followed by `sync FILE` "
        "(syncd fsyncs its output before publishing). `disk write (O_DIRECT)`: as many bytes as the source, written "
        "straight to the disk and fsync'ed (bench/diskwrite.py): the disk's own time, under any durable writer. "
        "Peak RSS: ru_maxrss of the command (wait4 in /usr/bin/time), "
        "highest of the timed runs. The naive pipeline writes safetensors (numpy; BF16 through safetensors.torch); "
        "the torch pipeline is the same with safetensors.torch for every dtype. Rows `syncd ..., N core(s)` ran "
        "pinned to the first N CPUs with taskset (syncd starts one writer thread per core it may use). "
        "`CPU s`: median user + system CPU seconds; `user s`: user alone, which the host's page faults on freshly "
        "reported memory (counted as system time) do not touch.",
        "",
        f"Fixed cost in every `syncd convert` row: Python start + `import syncd.cli, syncd.engine.convert` = "
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
        "cores": {**getattr(args, "core_record", {}), "pinned_runs": getattr(args, "core_counts", [])},
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
