"""The benchmark's synthetic checkpoints (see gen.py) and the commands measured on each."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cores import label as cores_label
from cores import pinned
from undertest import BENCH, PYTHON, SyncdUnderTest

MiB = 1 << 20


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
    ("torch", "torch (load, .t(), save)", "st", ".safetensors"),
    ("syncd_to_bpk", "syncd pytorch->burn", "st", ".bpk"),
    ("cp_bpk", "cp (.bpk)", "bpk", ".bpk"),
    ("cp_fsync_bpk", "cp + fsync (.bpk)", "bpk", ".bpk"),
    ("syncd_to_st", "syncd burn->pytorch", "bpk", ".safetensors"),
]
FLOOR = {"st": ("cp", "cp_fsync"), "bpk": ("cp_bpk", "cp_fsync_bpk")}
SYNCD_KEYS = ("syncd_to_bpk", "syncd_to_st")


def commands(cores: list[int | None]) -> list[tuple[str, str, str, str]]:
    """COMMANDS, plus both syncd conversions again pinned to each core count of `cores` (None: all cores,
    which is the unpinned run already in COMMANDS). Keys of pinned runs are `syncd_to_bpk@N`."""
    extra = []
    for count in (c for c in cores if c is not None):
        for key, label, kind, suffix in COMMANDS:
            if key in SYNCD_KEYS:
                extra.append((f"{key}@{count}", f"{label}, {cores_label(count)}", kind, suffix))
    return COMMANDS + extra


def command_argv(key: str, src: Path, dst: Path, syncd: SyncdUnderTest) -> list[str]:
    if "@" in key:  # a pinned run: taskset -c to the first N allowed CPUs
        base, count = key.split("@")
        return pinned(command_argv(base, src, dst, syncd), int(count))
    if key.startswith("cp_fsync"):
        return ["sh", "-c", 'cp --reflink=never -- "$1" "$2" && sync -- "$2"', "sh", str(src), str(dst)]
    if key.startswith("cp"):
        return ["cp", "--reflink=never", "--", str(src), str(dst)]
    if key == "naive":
        return [PYTHON, str(BENCH / "naive.py"), str(src), str(dst)]
    if key == "torch":
        return [PYTHON, str(BENCH / "naive.py"), "--torch", str(src), str(dst)]
    return [*syncd.argv(), "convert", str(src), "-o", str(dst)]
