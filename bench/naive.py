"""The obvious Python pipeline the benchmark compares against: load everything, transpose, save everything.

    python bench/naive.py SRC.safetensors DST.safetensors
    python bench/naive.py --torch SRC.safetensors DST.safetensors     # the torch pipeline, any dtype

F32 (and every dtype numpy has): `safetensors.numpy.load_file`, `np.ascontiguousarray(w.T)` for each Linear
weight, `safetensors.numpy.save_file`. numpy has no bfloat16, and `safetensors.numpy.load_file` refuses BF16
files, so a file holding BF16 goes through `safetensors.torch` instead (`w.T.contiguous()`), the same three
steps with torch tensors. (Importing torch costs the torch row about 1-2 s and ~300 MiB of RSS on its own;
the table reports that honestly, since it is what the obvious BF16 pipeline pays.)

`--torch` runs the same three steps with `safetensors.torch` and `w.t().contiguous()` for every dtype: the
five-line script a PyTorch user writes, the peer syncd must beat on Linear-heavy models.

Which tensors are transposed: every 2-D `*.weight` with a 1-D `*.bias` sibling (a Linear with bias), which
is exactly the set `syncd convert` transposes for the synthetic models of gen.py. The output is a
safetensors file: the naive pipeline has no Burnpack writer, so it stands for the work of either direction
(read all, transpose the Linear weights, write all) rather than for one container format.
"""

from __future__ import annotations

import json
import struct
import sys


def header(path: str) -> dict:
    with open(path, "rb") as handle:
        (size,) = struct.unpack("<Q", handle.read(8))
        return json.loads(handle.read(size))


def linear_weights(doc: dict) -> set[str]:
    names = set(doc) - {"__metadata__"}
    return {
        name
        for name in names
        if name.endswith(".weight")
        and len(doc[name]["shape"]) == 2
        and name[: -len("weight")] + "bias" in names
        and len(doc[name[: -len("weight")] + "bias"]["shape"]) == 1
    }


def main(src: str, dst: str, use_torch: bool = False) -> int:
    doc = header(src)
    metadata = doc.get("__metadata__")
    transpose = linear_weights(doc)
    uses_bf16 = any(v["dtype"] == "BF16" for k, v in doc.items() if k != "__metadata__")
    if uses_bf16 or use_torch:
        from safetensors.torch import load_file, save_file

        tensors = load_file(src)
        for name in transpose:
            tensors[name] = tensors[name].T.contiguous()
    else:
        import numpy as np
        from safetensors.numpy import load_file, save_file

        tensors = load_file(src)
        for name in transpose:
            tensors[name] = np.ascontiguousarray(tensors[name].T)
    save_file(tensors, dst, metadata=metadata)
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    with_torch = "--torch" in args
    paths = [a for a in args if a != "--torch"]
    sys.exit(main(paths[0], paths[1], with_torch))
