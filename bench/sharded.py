"""The sharded-set case: a save_pretrained-style set converted to one .bpk and back into the set.

The set is the linear model (gen.py) split into shards by syncd's own `--shard-size`, which follows
huggingface_hub's rule and names the files as save_pretrained does. Measured: wall time and peak RSS of
`syncd convert SET/model.safetensors.index.json -o OUT.bpk` and of `syncd convert model.bpk -o DIR
--shard-size ...`; the peak must stay that of the largest tensor, not of the set (tensors are streamed shard
after shard). Results: bench/results/sharded[-quick].json.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess

import gen
from cases import MiB
from measure import Log, run_once
from undertest import WORK, SyncdUnderTest


def sharded_case(quick: bool, reps: int, warmup: bool, syncd: SyncdUnderTest, log: Log) -> dict:
    mib, shards = (64, 4) if quick else (1024, 8)
    workdir = WORK / "sharded"
    shutil.rmtree(workdir, ignore_errors=True)
    (workdir / "set").mkdir(parents=True)
    (workdir / "back").mkdir()
    single, bpk = workdir / "model.safetensors", workdir / "model.bpk"
    tensors = gen.model("linear", mib * MiB, "F32")
    gen.write_safetensors(str(single), tensors)
    split = str(mib * MiB // shards)
    for argv in (
        ["convert", str(single), "-o", str(bpk)],
        ["convert", str(bpk), "-o", str(workdir / "set"), "--shard-size", split],
    ):
        subprocess.run([*syncd.argv(), *argv], check=True, capture_output=True)
    index = next((workdir / "set").glob("*.index.json"))
    info = {
        "case": f"sharded-linear-f32-{mib}m",
        "shards": len(list((workdir / "set").glob("*.safetensors"))),
        "set_bytes": sum(p.stat().st_size for p in (workdir / "set").iterdir()),
        **gen.describe(tensors),
    }
    log(
        f"  {info['case']}: {info['shards']} shards, {info['set_bytes'] / MiB:.0f} MiB, largest tensor "
        f"{info['largest_tensor_bytes'] / MiB:.2f} MiB"
    )
    out_bpk = workdir / "out.bpk"
    commands = {
        "syncd set->burn (one .bpk)": (["convert", str(index), "-o", str(out_bpk)], out_bpk),
        "syncd burn->set": (
            ["convert", str(bpk), "-o", str(workdir / "back"), "--overwrite", "--shard-size", split],
            workdir / "back" / index.name,
        ),
    }
    info["commands"] = {
        label: _measure(label, [*syncd.argv(), *argv], dst, reps, warmup, log)
        for label, (argv, dst) in commands.items()
    }
    shutil.rmtree(workdir, ignore_errors=True)
    return info


def _measure(label: str, argv: list[str], dst, reps: int, warmup: bool, log: Log) -> dict:
    runs = [run_once(argv, dst, dst.parent / "stderr") for _ in range(reps + (1 if warmup else 0))]
    ok = [r for r in (runs[1:] if warmup else runs) if r.status == 0]
    result = {
        "median_s": statistics.median(r.seconds for r in ok) if ok else None,
        "peak_rss_mib": max(r.maxrss_kib for r in ok) / 1024 if ok else None,
        "failed": len(runs) - len(ok) - (1 if warmup else 0),
    }
    if ok:
        log(f"    {label:28s} median {result['median_s']:7.2f} s  peak RSS {result['peak_rss_mib']:7.1f} MiB")
    else:
        log(f"    {label:28s} FAILED")
    return result
