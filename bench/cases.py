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
    target: str = ""  # which target this case checks: transpose | notranspose | small (and peak RSS, every case)


FULL_CASES = [
    Case("llama-bf16", "llama", "BF16", 0, "Llama-7B shapes, 2 layers: 32000x4096 embedding + lm_head", "transpose"),
    Case("heads-bf16", "heads", "BF16", 0, "the 32000x4096 embedding (copied) and lm_head alone", "transpose"),
    Case("wide-f32-1g", "wide", "F32", 0, "16 Linears [1024, 16384] + biases", "transpose"),
    Case("square-f32-1g", "square", "F32", 0, "16 Linears [4096, 4096] + biases", "transpose"),
    Case("huge-f32-1g", "huge", "F32", 0, "4 Linears [8192, 8192] + biases", "transpose"),
    Case("linear-f32-1g", "linear", "F32", 1024, "transformer-like d=1024, 4-16 MiB Linears", "transpose"),
    Case("conv-f32-1g", "conv", "F32", 1024, "ResNet-like convs + BatchNorm, no transposes", "notranspose"),
    Case("small-f32-10k", "small", "F32", 40, "10,000 tensors of 4 KiB (LayerNorms)", "small"),
    Case("big-f32-2g", "big", "F32", 2048, "d=2048 stack + one 512 MiB Linear head [16384, 8192]", "transpose"),
]
QUICK_CASES = [
    Case("linear-f32-64m", "linear", "F32", 64, "transformer-like, every Linear transposed", "transpose"),
    Case("linear-bf16-32m", "linear", "BF16", 32, "transformer-like, every Linear transposed", "transpose"),
    Case("conv-f32-64m", "conv", "F32", 64, "convs + BatchNorm, no transposes", "notranspose"),
    Case("small-f32-10k", "small", "F32", 40, "10,000 tensors of 4 KiB (LayerNorms)", "small"),
    Case("big-f32-128m", "big", "F32", 128, "linear stack + one 32 MiB Linear head", "transpose"),
]

# (key, label, source kind, output suffix). A key ending in NUMPY runs syncd without its compiled kernel
# (SYNCD_KERNEL=numpy: the path a machine without a C compiler takes, where the extension failed to build and
# syncd.engine.write.kernels falls back to numpy). The naive numpy pipeline (naive.py) is kept for --naive.
NUMPY = "~numpy"
NAIVE = ("naive", "naive (load, .T, save)", "st", ".safetensors")
COMMANDS = [
    ("cp", "cp", "st", ".safetensors"),
    ("cp_fsync", "cp + fsync", "st", ".safetensors"),
    ("disk", "disk write (O_DIRECT)", "st", ".safetensors"),
    ("torch", "torch (load, .t(), save)", "st", ".safetensors"),
    ("syncd_to_bpk", "syncd pytorch->burn", "st", ".bpk"),
    ("syncd_to_bpk" + NUMPY, "syncd pytorch->burn, numpy kernel", "st", ".bpk"),
    ("cp_bpk", "cp (.bpk)", "bpk", ".bpk"),
    ("cp_fsync_bpk", "cp + fsync (.bpk)", "bpk", ".bpk"),
    ("syncd_to_st", "syncd burn->pytorch", "bpk", ".safetensors"),
    ("syncd_to_st" + NUMPY, "syncd burn->pytorch, numpy kernel", "bpk", ".safetensors"),
]
FLOOR = {"st": ("cp", "cp_fsync"), "bpk": ("cp_bpk", "cp_fsync_bpk")}
SYNCD_KEYS = ("syncd_to_bpk", "syncd_to_st")


def commands(cores: list[int | None], naive: bool = False) -> list[tuple[str, str, str, str]]:
    """COMMANDS (with the naive numpy pipeline if asked), plus both syncd conversions again pinned to each core
    count of `cores` (None: all cores, which is the unpinned run already in COMMANDS). Keys of pinned runs are
    `syncd_to_bpk@N`."""
    extra = [NAIVE] if naive else []
    for count in (c for c in cores if c is not None):
        for key, label, kind, suffix in COMMANDS:
            if key in SYNCD_KEYS:
                extra.append((f"{key}@{count}", f"{label}, {cores_label(count)}", kind, suffix))
    return COMMANDS + extra


def command_argv(key: str, src: Path, dst: Path, syncd: SyncdUnderTest) -> list[str]:
    if "@" in key:  # a pinned run: taskset -c to the first N allowed CPUs
        base, count = key.split("@")
        return pinned(command_argv(base, src, dst, syncd), int(count))
    if key.endswith(NUMPY):
        return ["env", "SYNCD_KERNEL=numpy", *command_argv(key.removesuffix(NUMPY), src, dst, syncd)]
    if key.startswith("cp_fsync"):
        return ["sh", "-c", 'cp --reflink=never -- "$1" "$2" && sync -- "$2"', "sh", str(src), str(dst)]
    if key.startswith("cp"):
        return ["cp", "--reflink=never", "--", str(src), str(dst)]
    if key == "disk":
        return [PYTHON, str(BENCH / "diskwrite.py"), str(src), str(dst)]
    if key == "naive":
        return [PYTHON, str(BENCH / "naive.py"), str(src), str(dst)]
    if key == "torch":
        return [PYTHON, str(BENCH / "naive.py"), "--torch", str(src), str(dst)]
    return [*syncd.argv(), "convert", str(src), "-o", str(dst)]
