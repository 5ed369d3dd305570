"""Synthetic checkpoints for the benchmark, written straight to disk in bounded memory.

Files are laid out the way `safetensors.save_file` lays them out (`__metadata__` first, tensors ordered by
dtype size then name, header padded with spaces to a multiple of 8), so the converter sees what a real
PyTorch export looks like. Tensor data comes from a fixed pool of normally distributed values (seeded), cycled
through; every byte is written (no sparse holes for `cp` to skip).

Models (names follow PyTorch's conventions, so `syncd convert --layout auto` decides the layout by itself):

- linear: a transformer-like stack. Per block: attention q/k/v/o projections (Linear [d, d] + bias), an MLP
  (fc1 [4d, d], fc2 [d, 4d], with biases) and two LayerNorms. Every Linear weight is transposed by a
  PyTorch <-> Burn conversion (about 99.9% of the bytes). The non-square fc1/fc2 are what decide the layout.
- big: the linear stack at d=2048 plus one Linear head [16384, 8192] (512 MiB in F32): the peak-RSS case.
- conv: a ResNet-like stack of 3x3 convolutions (no bias) each followed by a BatchNorm with running stats and
  num_batches_tracked. Nothing is transposed; BatchNorm tensors are renamed (weight/bias -> gamma/beta) and
  num_batches_tracked is carried in metadata on the way to Burn.
- small: 5,000 LayerNorms of 1024 F32 elements (weight + bias): 10,000 tensors of 4 KiB each.
- llama: Llama-7B's shapes with 2 layers (1.3 GiB in BF16): embedding and untied lm_head [32000, 4096],
  q/k/v/o [4096, 4096], gate/up [11008, 4096], down [4096, 11008]; heads: the embedding and lm_head alone.
- wide, square, huge: Linears [1024, 16384] x 16, [4096, 4096] x 16, [8192, 8192] x 4, with biases (1 GiB in
  F32): the same bytes, transposed at three aspects and sizes.

Run alone: `python bench/gen.py linear F32 256 OUT.safetensors` (size in MiB).
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

MiB = 1 << 20
ITEMSIZE = {"F32": 4, "BF16": 2, "I64": 8}
POOL_ELEMENTS = 4 * MiB  # 16 MiB of F32 values; cycled through for every tensor
CHUNK_ELEMENTS = 4 * MiB


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = ITEMSIZE[self.dtype]
        for dim in self.shape:
            n *= dim
        return n


# ------------------------------------------------------------------------------------------------ models


def transformer_blocks(d: int, blocks: int, dtype: str, prefix: str = "layers") -> list[Tensor]:
    tensors: list[Tensor] = []
    for i in range(blocks):
        p = f"{prefix}.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors += [Tensor(f"{p}.attn.{proj}.weight", dtype, (d, d)), Tensor(f"{p}.attn.{proj}.bias", dtype, (d,))]
        tensors += [
            Tensor(f"{p}.mlp.fc1.weight", dtype, (4 * d, d)),
            Tensor(f"{p}.mlp.fc1.bias", dtype, (4 * d,)),
            Tensor(f"{p}.mlp.fc2.weight", dtype, (d, 4 * d)),
            Tensor(f"{p}.mlp.fc2.bias", dtype, (d,)),
        ]
        for norm in ("ln1", "ln2"):
            tensors += [Tensor(f"{p}.{norm}.weight", dtype, (d,)), Tensor(f"{p}.{norm}.bias", dtype, (d,))]
    return tensors


def linear_model(target_bytes: int, dtype: str) -> list[Tensor]:
    d = 1024 if target_bytes >= 256 * MiB else 512
    per_block = 12 * d * d * ITEMSIZE[dtype]
    blocks = max(1, round(target_bytes / per_block))
    return transformer_blocks(d, blocks, dtype) + [
        Tensor("norm.weight", dtype, (d,)),
        Tensor("norm.bias", dtype, (d,)),
    ]


def big_model(target_bytes: int, dtype: str) -> list[Tensor]:
    """A Linear head of a quarter of the file (512 MiB of a 2 GiB F32 file) plus transformer blocks."""
    itemsize = ITEMSIZE[dtype]
    head_bytes = target_bytes // 4
    cols = 8192 if target_bytes >= 1024 * MiB else 2048
    rows = head_bytes // (cols * itemsize)
    d = 2048 if target_bytes >= 1024 * MiB else 512
    per_block = 12 * d * d * itemsize
    blocks = max(1, round((target_bytes - head_bytes) / per_block))
    return transformer_blocks(d, blocks, dtype) + [
        Tensor("norm.weight", dtype, (d,)),
        Tensor("norm.bias", dtype, (d,)),
        Tensor("head.weight", dtype, (rows, cols)),
        Tensor("head.bias", dtype, (rows,)),
    ]


def conv_model(target_bytes: int, dtype: str) -> list[Tensor]:
    c = 512 if target_bytes >= 256 * MiB else 256
    per_layer = c * c * 9 * ITEMSIZE[dtype]
    layers = max(1, round(target_bytes / per_layer))
    tensors = [Tensor("stem.weight", dtype, (c, 3, 7, 7))]
    for i in range(layers):
        p = f"features.{i}"
        tensors.append(Tensor(f"{p}.conv.weight", dtype, (c, c, 3, 3)))
        for leaf in ("weight", "bias", "running_mean", "running_var"):
            tensors.append(Tensor(f"{p}.bn.{leaf}", dtype, (c,)))
        tensors.append(Tensor(f"{p}.bn.num_batches_tracked", "I64", ()))
    return tensors


def small_model(target_bytes: int, dtype: str) -> list[Tensor]:
    """10,000 tensors of 4 KiB (F32 [1024]) whatever the target size; BF16 gets [2048]."""
    n = 4096 // ITEMSIZE[dtype]
    tensors = []
    for i in range(5000):
        tensors += [Tensor(f"blocks.{i}.norm.weight", dtype, (n,)), Tensor(f"blocks.{i}.norm.bias", dtype, (n,))]
    return tensors


def llama_model(target_bytes: int, dtype: str) -> list[Tensor]:
    """Llama-7B's shapes, 2 layers (the size is ignored): a 32000 x 4096 embedding and untied lm_head, q/k/v/o
    [4096, 4096], gate/up [11008, 4096], down [4096, 11008], RMSNorms; named as Hugging Face names them."""
    d, ff, vocab = 4096, 11008, 32000
    tensors = [Tensor("model.embed_tokens.weight", dtype, (vocab, d))]
    for i in range(2):
        p = f"model.layers.{i}"
        tensors += [Tensor(f"{p}.self_attn.{proj}.weight", dtype, (d, d)) for proj in ("q_proj", "k_proj", "v_proj")]
        tensors += [
            Tensor(f"{p}.self_attn.o_proj.weight", dtype, (d, d)),
            Tensor(f"{p}.mlp.gate_proj.weight", dtype, (ff, d)),
            Tensor(f"{p}.mlp.up_proj.weight", dtype, (ff, d)),
            Tensor(f"{p}.mlp.down_proj.weight", dtype, (d, ff)),
            Tensor(f"{p}.input_layernorm.weight", dtype, (d,)),
            Tensor(f"{p}.post_attention_layernorm.weight", dtype, (d,)),
        ]
    return tensors + [Tensor("model.norm.weight", dtype, (d,)), Tensor("lm_head.weight", dtype, (vocab, d))]


def heads_model(target_bytes: int, dtype: str) -> list[Tensor]:
    """Llama's two 32000 x 4096 tensors alone: the embedding (copied) and the lm_head (transposed)."""
    return [Tensor("model.embed_tokens.weight", dtype, (32000, 4096)), Tensor("lm_head.weight", dtype, (32000, 4096))]


def _linears(shape: tuple[int, int], count: int, dtype: str) -> list[Tensor]:
    tensors = []
    for i in range(count):
        tensors += [Tensor(f"layers.{i}.weight", dtype, shape), Tensor(f"layers.{i}.bias", dtype, (shape[0],))]
    return tensors


def wide_model(target_bytes: int, dtype: str) -> list[Tensor]:
    """16 Linears [1024, 16384] with biases (1 GiB in F32, whatever the size asked)."""
    return _linears((1024, 16384), 16, dtype)


def square_model(target_bytes: int, dtype: str) -> list[Tensor]:
    """16 Linears [4096, 4096] with biases (1 GiB in F32)."""
    return _linears((4096, 4096), 16, dtype)


def huge_model(target_bytes: int, dtype: str) -> list[Tensor]:
    """4 Linears [8192, 8192] with biases (1 GiB in F32)."""
    return _linears((8192, 8192), 4, dtype)


MODELS = {
    "linear": linear_model,
    "big": big_model,
    "conv": conv_model,
    "small": small_model,
    "llama": llama_model,
    "heads": heads_model,
    "wide": wide_model,
    "square": square_model,
    "huge": huge_model,
}


def model(kind: str, target_bytes: int, dtype: str) -> list[Tensor]:
    return MODELS[kind](target_bytes, dtype)


# ------------------------------------------------------------------------------------------------ writing


class _Pool:
    """Seeded N(0, 0.02) values, handed out cyclically as raw bytes of the requested dtype."""

    def __init__(self, seed: int = 0) -> None:
        values = np.random.default_rng(seed).normal(0.0, 0.02, POOL_ELEMENTS).astype(np.float32)
        self.f32 = values.view(np.uint8)
        # BF16 is the top half of each F32 (truncation); numpy has no bf16 dtype, so it lives as uint16
        self.bf16 = (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        self.cursor = 0

    def chunks(self, tensor: Tensor) -> Iterator[memoryview]:
        if tensor.dtype == "I64":
            yield memoryview(np.full(max(1, int(np.prod(tensor.shape))), 1000, dtype="<i8").view(np.uint8))
            return
        src = self.f32 if tensor.dtype == "F32" else self.bf16
        itemsize = ITEMSIZE[tensor.dtype]
        left = tensor.nbytes
        while left:
            start = (self.cursor * itemsize) % len(src)
            n = min(left, len(src) - start, CHUNK_ELEMENTS * itemsize)
            yield memoryview(src[start : start + n])
            self.cursor += n // itemsize + 1  # +1: consecutive tensors do not start on the same values
            left -= n


def header_bytes(tensors: list[Tensor], metadata: dict[str, str]) -> bytes:
    document: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for t in tensors:
        document[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(document, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def library_order(tensors: list[Tensor]) -> list[Tensor]:
    """The data order of safetensors.save_file: larger dtypes first, then by name."""
    return sorted(tensors, key=lambda t: (-ITEMSIZE[t.dtype], t.name))


def write_safetensors(path: str, tensors: list[Tensor], seed: int = 0) -> int:
    tensors = library_order(tensors)
    pool = _Pool(seed)
    tmp = f"{path}.part"
    with open(tmp, "wb", buffering=0) as out:
        out.write(header_bytes(tensors, {"format": "pt"}))
        for t in tensors:
            for piece in pool.chunks(t):
                out.write(piece)
    os.replace(tmp, path)
    return os.path.getsize(path)


def describe(tensors: list[Tensor]) -> dict[str, object]:
    largest = max(tensors, key=lambda t: t.nbytes)
    transposed = sum(t.nbytes for t in tensors if len(t.shape) == 2 and t.name.endswith(".weight"))
    total = sum(t.nbytes for t in tensors)
    return {
        "tensors": len(tensors),
        "data_bytes": total,
        "largest_tensor": largest.name,
        "largest_tensor_bytes": largest.nbytes,
        "transposed_fraction": round(transposed / total, 4) if total else 0.0,
    }


def main(argv: list[str]) -> int:
    if len(argv) != 4 or argv[0] not in MODELS:
        print(f"usage: gen.py {{{'|'.join(MODELS)}}} F32|BF16 SIZE_MIB OUT.safetensors", file=sys.stderr)
        return 2
    kind, dtype, size, out = argv
    tensors = model(kind, int(size) * MiB, dtype)
    written = write_safetensors(out, tensors)
    print(json.dumps({"path": out, "file_bytes": written, **describe(tensors)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
