"""Acceptance tests for `syncd convert` between Burn `.bpk` and PyTorch `.safetensors`.

Real files (the shared fixtures, files written by PyTorch here, burnpacks built with Burn's byte layout), the
real CLI in a subprocess where exit codes and messages matter, `syncd.engine.convert.convert` otherwise. Outputs are
read back with the independent readers in convcheck.py and, for the PyTorch side, with torch itself.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import math
import os
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
import yaml
from conftest import MNIST_BPK as MNIST_WEB
from conftest import MNIST_ST as MNIST_PT
from convcheck import (
    Checkpoint,
    assert_one_line_error,
    dir_listing,
    read_any,
    read_bpk,
    read_safetensors,
    run_cli,
    transposed,
    verify_tensor,
)
from formatgen import bpk_bytes, bytes_spec, descriptor
from safetensors.torch import load_file, save_file
from torch import nn

from syncd.adapters import ModuleMap
from syncd.adapters.keys import NameCollisionError, compile_rule
from syncd.engine.convert import ConvertRequest, convert
from syncd.engine.options import StoreOptions
from syncd.engine.write.onepass import STRIP_BYTES
from syncd.engine.write.planned import FromSource, verify_full
from syncd.errors import FormatError, UnsupportedError, UsageError, VerificationError
from syncd.formats.burnpack import LAYOUT_PACKED, BurnpackReader, Scalar, write_burnpack
from syncd.formats.fileio import pwrite_all
from syncd.formats.safetensors import SafetensorsReader
from syncd.formats.table import TensorSpec

pytestmark = pytest.mark.torch

TO_TORCH_LEAF = {"gamma": "weight", "beta": "bias"}


def _copy(src: Path, directory: Path, name: str | None = None) -> Path:
    dest = directory / (name or src.name)
    shutil.copyfile(src, dest)
    return dest


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _xxh3_128(path: Path) -> str:
    return xxhash.xxh3_128_hexdigest(path.read_bytes())


def _assert_provenance(output: Checkpoint, source: Path) -> None:
    assert output.metadata["syncd.source"] == source.name
    assert output.metadata["syncd.source_xxh3_128"] == _xxh3_128(source)
    assert "syncd.source_sha256" not in output.metadata


def _write_bpk(path: Path, specs: list, metadata=None, scalars=None, layout: str = "aligned") -> Path:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_burnpack(fd, specs, metadata, scalars, layout)
    finally:
        os.close(fd)
    return path


def _convert(source: Path, dest: Path, **kwargs) -> Checkpoint:
    result = convert(ConvertRequest(source=source, dest=dest, **kwargs))
    assert result.dest == dest and dest.exists()
    return read_any(dest)


def _section(path: Path) -> bytes:
    """A burnpack's data section (everything after the header, metadata and padding)."""
    raw = path.read_bytes()
    (size,) = struct.unpack("<I", raw[6:10])
    return raw[-(-(10 + size) // 256) * 256 :]


# ------------------------------------------------------------------------------------------------------
# the shared fixtures


class _ConvBlock(nn.Module):
    def __init__(self, conv_shape: tuple[int, ...]) -> None:
        super().__init__()
        out_channels, in_channels, kernel = conv_shape[0], conv_shape[1], conv_shape[2]
        self.conv = nn.Conv2d(in_channels, out_channels, kernel)
        self.norm = nn.BatchNorm2d(out_channels)


class _BurnMnist(nn.Module):
    """The PyTorch twin of examples/mnist-inference-web, sized from the file's own tensor table."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        super().__init__()
        self.conv1 = _ConvBlock(shapes["conv1.conv.weight"])
        self.conv2 = _ConvBlock(shapes["conv2.conv.weight"])
        # Burn Linear weight is [d_input, d_output]
        self.fc1 = nn.Linear(*shapes["fc1.weight"])
        self.fc2 = nn.Linear(*shapes["fc2.weight"])
        self.fc3 = nn.Linear(*shapes["fc3.weight"])


def test_burn_mnist_converts_to_a_file_pytorch_loads_strictly(tmp_path: Path) -> None:
    source = _copy(MNIST_WEB, tmp_path)
    inspected = run_cli("inspect", "--json", source)
    assert inspected.returncode == 0, inspected.stderr
    shapes = {t["name"]: tuple(t["shape"]) for t in json.loads(inspected.stdout)["tensors"]}
    assert shapes["conv1.conv.weight"] == (64, 1, 3, 3) and shapes["fc1.weight"] == (1600, 128)

    proc = run_cli("convert", source, "-o", tmp_path / "mnist_web.safetensors")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    out = tmp_path / "mnist_web.safetensors"
    state = load_file(out)
    model = _BurnMnist(shapes)
    result = model.load_state_dict(state, strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []

    # No counter is invented: a Burn file has none, and PyTorch's BatchNorm fills in num_batches_tracked = 0
    # itself when the state dict carries no version metadata (every safetensors load_file result).
    assert not [name for name in state if name.endswith("num_batches_tracked")]
    assert model.conv1.norm.num_batches_tracked.item() == 0
    assert set(state) == set(model.state_dict()) - {"conv1.norm.num_batches_tracked", "conv2.norm.num_batches_tracked"}

    burn = read_bpk(MNIST_WEB)
    for name, tensor in burn.tensors.items():
        module, leaf = name.rsplit(".", 1)
        value = state[f"{module}.{TO_TORCH_LEAF.get(leaf, leaf)}"]
        assert value.dtype == torch.float32
        if module.startswith("fc") and leaf == "weight":
            assert tuple(value.shape) == tensor.shape[::-1]
            assert value.numpy().tobytes() == transposed(tensor.data, tensor.shape, 4), name
        else:
            assert tuple(value.shape) == tensor.shape
            assert value.numpy().tobytes() == tensor.data, name

    written = read_safetensors(out)
    assert written.metadata["format"] == "pt"
    _assert_provenance(written, source)
    # the model runs on the converted weights
    with torch.no_grad():
        assert model.fc3(model.fc2(model.fc1(torch.ones(1, 1600)))).shape == (1, 10)


def test_burn_mnist_round_trip_gives_back_the_same_burnpack(tmp_path: Path) -> None:
    source = _copy(MNIST_WEB, tmp_path)
    middle = tmp_path / "mnist_web.safetensors"
    convert(ConvertRequest(source=source, dest=middle))
    back = _convert(middle, tmp_path / "back.bpk")
    original = read_bpk(MNIST_WEB)

    assert back.tensors == original.tensors  # dtype as stored, shape, bytes, param_id
    assert back.order == original.order  # module order, not key order
    assert back.own_metadata() == original.own_metadata() == {}
    assert back.scalars == original.scalars == {}
    assert back.layout == original.layout == "aligned"
    assert _section(tmp_path / "back.bpk") == _section(MNIST_WEB)  # the data section, byte for byte
    _assert_provenance(back, middle)


MNIST_PT_BURN_SHAPES = {
    "conv1.weight": (8, 1, 3, 3),
    "conv1.bias": (8,),
    "conv2.weight": (16, 8, 3, 3),
    "conv2.bias": (16,),
    "conv3.weight": (24, 16, 3, 3),
    "conv3.bias": (24,),
    **{f"norm1.{leaf}": (24,) for leaf in ("gamma", "beta", "running_mean", "running_var")},
    "fc1.weight": (11616, 32),
    "fc1.bias": (32,),
    "fc2.weight": (32, 10),
    "fc2.bias": (10,),
    **{f"norm2.{leaf}": (10,) for leaf in ("gamma", "beta", "running_mean", "running_var")},
}


def test_pytorch_mnist_to_burn_names_and_back_bit_for_bit(tmp_path: Path) -> None:
    source = _copy(MNIST_PT, tmp_path)
    proc = run_cli("convert", source)
    assert proc.returncode == 0, proc.stderr
    assert "norm1.num_batches_tracked" in proc.stdout  # reported as carried
    bpk_path = tmp_path / "mnist.bpk"
    burn = read_bpk(bpk_path)
    original = read_safetensors(MNIST_PT)

    assert {n: t.shape for n, t in burn.tensors.items()} == MNIST_PT_BURN_SHAPES
    assert all(t.dtype == "F32" for t in burn.tensors.values())
    for name, tensor in burn.tensors.items():
        module, leaf = name.rsplit(".", 1)
        torch_tensor = original.tensors[f"{module}.{TO_TORCH_LEAF.get(leaf, leaf)}"]
        if module.startswith("fc") and leaf == "weight":
            assert tensor.data == transposed(torch_tensor.data, torch_tensor.shape, 4), name
        else:
            assert tensor.data == torch_tensor.data, name
    _assert_provenance(burn, source)

    back_path = tmp_path / "back.safetensors"
    back = _convert(bpk_path, back_path)
    assert back.tensors == original.tensors  # names, dtypes, shapes, bytes; num_batches_tracked restored
    assert back.tensors["norm1.num_batches_tracked"].dtype == "I64"

    assert back.metadata["format"] == "pt"
    _assert_provenance(back, bpk_path)


# ------------------------------------------------------------------------------------------------------
# models written by real PyTorch


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class _Cnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 6, 3, bias=False)
        self.bn2 = nn.BatchNorm2d(6)
        self.fc = nn.Linear(6 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.fc(x.flatten(1))


class _Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.query = nn.Linear(d, d)
        self.key = nn.Linear(d, d)
        self.value = nn.Linear(d, d)
        self.output = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.query(x), self.key(x), self.value(x)
        weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(x.shape[-1]), dim=-1)
        return self.output(weights @ v)


class _TransformerBlock(nn.Module):
    """Embedding, LayerNorms, square q/k/v/out projections, bias-free feed-forward and head Linears."""

    def __init__(self, vocab: int = 13, d: int = 8, d_ff: int = 16) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d)
        self.norm_1 = nn.LayerNorm(d)
        self.attn = _Attention(d)
        self.norm_2 = nn.LayerNorm(d)
        self.ff_in = nn.Linear(d, d_ff, bias=False)
        self.ff_out = nn.Linear(d_ff, d, bias=False)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens)
        x = x + self.attn(self.norm_1(x))
        x = x + self.ff_out(torch.relu(self.ff_in(self.norm_2(x))))
        return self.head(x)


TRANSFORMER_MAP = {
    "modules": {"tok_emb": "Embedding", "ff_in": "Linear", "ff_out": "Linear", "head": "Linear"},
}


def test_the_tensor_filter_decides_carried_tensors_too(tmp_path: Path) -> None:
    """A .bpk's carried BatchNorm counters were written back whatever --include/--exclude said, exit 0."""
    source = _copy(MNIST_PT, tmp_path)
    assert run_cli("convert", source, "-o", tmp_path / "a.bpk").returncode == 0
    for args, kept in (
        (["--include", r"^fc"], lambda name: name.startswith("fc")),
        (["--exclude", "num_batches"], lambda name: "num_batches" not in name),
    ):
        out = tmp_path / f"out{len(args[1])}.safetensors"
        done = run_cli("convert", tmp_path / "a.bpk", "-o", out, *args, "-v")
        assert done.returncode == 0, done.stderr
        names = set(read_safetensors(out).tensors)
        assert names == {name for name in read_safetensors(MNIST_PT).tensors if kept(name)}, args
        assert "left out by the tensor filter: norm1.num_batches_tracked" in done.stdout


def _converted(source: Path, out: Path, *args: str) -> Path:
    done = run_cli("convert", source, "-o", out, *args)
    assert done.returncode == 0, done.stderr
    return out


def test_carried_counters_follow_the_filter_and_renames_of_the_files_they_go_through(tmp_path: Path) -> None:
    """A .bpk's carried BatchNorm counters are its tensors too, under the name their module has in it: a .bpk
    converted to .bpk kept the counter of a module the filter left out; on a renamed .bpk the filter judged them
    by their original names; a PyTorch-layout renamed .bpk going to Burn's layout carried them under the file's
    names, which the way back then wrote (`first.num_batches_tracked` beside `norm1.weight`)."""
    source = _copy(MNIST_PT, tmp_path)
    original = read_safetensors(MNIST_PT)
    norm1 = {name for name in original.tensors if name.startswith("norm1.")}
    a_bpk = _converted(source, tmp_path / "a.bpk")
    b_bpk = _converted(a_bpk, tmp_path / "b.bpk", "--exclude", r"^norm1\.")
    back = read_safetensors(_converted(b_bpk, tmp_path / "b.safetensors"))
    assert set(back.tensors) == set(original.tensors) - norm1

    renamed = _converted(source, tmp_path / "r.bpk", "--remap", r"^norm1\.=first.")
    without = read_safetensors(_converted(renamed, tmp_path / "x1.safetensors", "--exclude", r"^first\."))
    assert set(without.tensors) == set(original.tensors) - norm1
    only = read_safetensors(_converted(renamed, tmp_path / "x2.safetensors", "--include", r"^first\."))
    assert set(only.tensors) == norm1

    kept = _converted(source, tmp_path / "k.bpk", "--layout", "keep", "--remap", r"^norm1\.=first.")
    burn = _converted(kept, tmp_path / "k2.bpk")
    again = read_safetensors(_converted(burn, tmp_path / "k2.safetensors"))
    assert set(again.tensors) == set(original.tensors)
    for name in original.tensors:
        assert again.tensors[name] == original.tensors[name], name


def test_a_bpk_converted_again_passes_its_carried_counters_on(tmp_path: Path) -> None:
    """A .bpk cast (or converted to .bpk in any way) left its carried BatchNorm counters behind, and the way
    back from the new file started them at 0; a PyTorch-layout .bpk (--layout keep) going to Burn's layout
    said it carried them and did not."""
    source = _copy(MNIST_PT, tmp_path)
    original = read_safetensors(MNIST_PT)
    assert run_cli("convert", source, "-o", tmp_path / "a.bpk").returncode == 0
    assert run_cli("convert", tmp_path / "a.bpk", "-o", tmp_path / "b.bpk", "--remap", "^fc=dense").returncode == 0
    kept = run_cli("convert", source, "-o", tmp_path / "kept.bpk", "--layout", "keep")
    assert kept.returncode == 0, kept.stderr
    burn = run_cli("convert", tmp_path / "kept.bpk", "-o", tmp_path / "burn.bpk", "--layout", "pytorch")
    assert burn.returncode == 0, burn.stderr
    for name in ("b.bpk", "burn.bpk"):
        back = _convert(tmp_path / name, tmp_path / f"{name}.safetensors")
        assert back.tensors["norm1.num_batches_tracked"] == original.tensors["norm1.num_batches_tracked"], name
        assert back.tensors == original.tensors, name


def _trained_cnn() -> _Cnn:
    model = _Cnn()
    model.train()
    with torch.no_grad():  # a few batches move the running stats and the counters away from their defaults
        for _ in range(3):
            model(torch.randn(5, 2, 8, 8))
    model.eval()
    return model


def _models() -> dict[str, tuple[nn.Module, torch.Tensor, dict | None]]:
    torch.manual_seed(3)
    return {
        "mlp": (_Mlp(), torch.randn(7, 4), None),
        "cnn": (_trained_cnn(), torch.randn(3, 2, 8, 8), None),
        "transformer": (_TransformerBlock(), torch.randint(0, 13, (2, 6)), TRANSFORMER_MAP),
    }


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_pytorch_model_round_trips_through_burnpack(tmp_path: Path, name: str) -> None:
    model, example, module_map = _models()[name]
    model.eval()
    source = tmp_path / f"{name}.safetensors"
    save_file(model.state_dict(), source)
    mapping = ModuleMap.from_dict(module_map) if module_map else None

    burn = _convert(source, tmp_path / f"{name}.bpk", module_map=mapping)
    assert not [n for n in burn.tensors if n.endswith("num_batches_tracked")]
    for param, value in model.state_dict().items():
        module, leaf = param.rsplit(".", 1)
        if leaf == "num_batches_tracked":
            continue
        is_linear = isinstance(model.get_submodule(module), nn.Linear) and leaf == "weight"
        is_norm = isinstance(model.get_submodule(module), nn.BatchNorm2d | nn.LayerNorm)
        burn_leaf = {"weight": "gamma", "bias": "beta"}.get(leaf, leaf) if is_norm else leaf
        burn_name = f"{module}.{burn_leaf}"
        expected = value.numpy().tobytes()
        if is_linear:
            expected = transposed(expected, tuple(value.shape), value.element_size())
        assert burn.tensors[burn_name].data == expected, burn_name

    back = tmp_path / f"{name}.back.safetensors"
    _convert(tmp_path / f"{name}.bpk", back, module_map=mapping)
    assert read_safetensors(back).tensors == read_safetensors(source).tensors

    fresh = type(model)()
    fresh.load_state_dict(load_file(back), strict=True)
    fresh.eval()
    with torch.no_grad():
        assert torch.equal(fresh(example), model(example))


def test_ambiguous_model_is_refused_without_a_module_map_and_converts_with_one(tmp_path: Path) -> None:
    torch.manual_seed(5)
    model = _TransformerBlock()
    source = tmp_path / "block.safetensors"
    save_file(model.state_dict(), source)

    refused = run_cli("convert", source)
    assert refused.returncode == 1 and refused.stdout == "" and "Traceback" not in refused.stderr
    line, *module_map = refused.stderr.splitlines()
    assert str(source) in line and "ff_in" in line and "module map" in line
    assert "head" in line and "tok_emb" not in line  # named like an embedding: settled by its name
    # without -v the refusal still prints the module map that would settle it, as YAML ready to edit
    assert "ff_in" in str(yaml.safe_load("\n".join(module_map))["modules"])
    assert dir_listing(tmp_path) == ["block.safetensors"]

    verbose = run_cli("convert", source, "-v")
    assert verbose.returncode == 1 and "Traceback" not in verbose.stderr
    assert verbose.stderr.splitlines()[0] == line
    suggestion = verbose.stderr[verbose.stderr.index("# module map") :]  # after the per-module reasons
    suggested = yaml.safe_load(suggestion)["modules"]
    # one glob per layer name; square Linears with bias take the file's layout
    assert suggested == {"**.ff_in": "Linear", "**.ff_out": "Linear", "**.head": "Linear"}

    map_file = tmp_path / "modules.yaml"
    map_file.write_text(yaml.safe_dump(TRANSFORMER_MAP))
    done = run_cli("convert", source, "--modules", map_file, "-v")
    assert done.returncode == 0, done.stderr
    burn = read_bpk(tmp_path / "block.bpk")
    # the Embedding keeps its [num, dim] table, the bias-free Linears and the square projections are transposed
    state = model.state_dict()
    assert burn.tensors["tok_emb.weight"].data == state["tok_emb.weight"].numpy().tobytes()
    for linear in ("ff_in", "head", "attn.query", "attn.output"):
        weight = state[f"{linear}.weight"]
        assert burn.tensors[f"{linear}.weight"].data == transposed(weight.numpy().tobytes(), tuple(weight.shape), 4)
    assert "norm_1.gamma" in burn.tensors and "norm_1.weight" not in burn.tensors

    # the way back needs no map: the .bpk records the kinds it was converted with
    back = tmp_path / "back.safetensors"
    returned = run_cli("convert", tmp_path / "block.bpk", "-o", back, "-v")
    assert returned.returncode == 0, returned.stderr
    assert "ff_in: Linear (recorded in the file (syncd.kinds))" in returned.stdout
    assert "source layout: burn (recorded in the file: syncd.layout)" in returned.stdout
    assert read_safetensors(back).tensors == read_safetensors(source).tensors


def test_mlp_written_in_burn_layout_computes_like_pytorch(tmp_path: Path) -> None:
    rng = np.random.default_rng(11)
    w1 = rng.standard_normal((4, 8), dtype=np.float32)  # Burn Linear: [d_input, d_output]
    b1 = rng.standard_normal(8, dtype=np.float32)
    w2 = rng.standard_normal((8, 3), dtype=np.float32)
    b2 = rng.standard_normal(3, dtype=np.float32)
    source = _write_bpk(
        tmp_path / "mlp.bpk",
        [
            bytes_spec("fc1.weight", "F32", w1.shape, w1.tobytes(), param_id=(1 << 63) + 1),
            bytes_spec("fc1.bias", "F32", b1.shape, b1.tobytes(), param_id=2),
            bytes_spec("fc2.weight", "F32", w2.shape, w2.tobytes(), param_id=3),
            bytes_spec("fc2.bias", "F32", b2.shape, b2.tobytes(), param_id=(1 << 64) - 1),
        ],
        {"format": "burnpack", "producer": "burn", "version": "0.22.1"},
    )
    proc = run_cli("convert", source)
    assert proc.returncode == 0, proc.stderr

    converted = _Mlp()
    converted.load_state_dict(load_file(tmp_path / "mlp.safetensors"), strict=True)
    reference = _Mlp()
    with torch.no_grad():
        for linear, weight, bias in ((reference.fc1, w1, b1), (reference.fc2, w2, b2)):
            linear.weight.copy_(torch.from_numpy(weight.T.copy()))
            linear.bias.copy_(torch.from_numpy(bias))
        x = torch.from_numpy(rng.standard_normal((9, 4), dtype=np.float32))
        assert torch.equal(converted(x), reference(x))
    written = read_safetensors(tmp_path / "mlp.safetensors")
    assert written.metadata["format"] == "pt"
    _assert_provenance(written, source)


# ------------------------------------------------------------------------------------------------------
# what only one format can hold survives a round trip through the other

CHAINS = {
    "auto": ["auto", "auto"],
    "keep": ["keep", "keep"],
    # a Burn-layout safetensors in the middle: it must neither hold the PyTorch-only counters (a mixed file
    # that Burn rejects and syncd itself calls conflicting) nor lose them
    "auto-keep-keep-auto": ["auto", "keep", "keep", "auto"],
    "auto-keep-auto-auto": ["auto", "keep", "auto", "auto"],
}


@pytest.mark.parametrize("chain", CHAINS)
def test_pytorch_only_facts_survive_every_layout_chain(tmp_path: Path, chain: str) -> None:
    torch.manual_seed(7)
    source = tmp_path / "cnn.safetensors"
    save_file(_trained_cnn().state_dict(), source, metadata={"format": "pt", "run": "42"})
    original = read_safetensors(source)
    current = source
    for step, layout in enumerate(CHAINS[chain]):
        dest = tmp_path / f"step{step}{'.safetensors' if current.suffix == '.bpk' else '.bpk'}"
        written = _convert(current, dest, layout=layout)
        if "bn1.gamma" in written.tensors:  # a file in Burn layout
            assert not [n for n in written.tensors if n.endswith("num_batches_tracked")], step
        _assert_provenance(written, current)
        current = dest
    final = read_safetensors(current)
    assert final.tensors == original.tensors
    assert final.own_metadata() == original.own_metadata()


QFLOAT = {"QFloat": {"value": "Q8S", "param": "F32", "store": "Native", "level": "Tensor", "mode": "Symmetric"}}


def _data(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _bools(n: int, itemsize: int, seed: int) -> bytes:
    values = np.random.default_rng(seed).integers(0, 2, n)
    return values.astype(np.uint32 if itemsize == 4 else np.uint8).astype("<u4" if itemsize == 4 else "u1").tobytes()


SCALARS = {
    "lr": Scalar("Float", 0.1),
    "half": Scalar("Float", 0.5),
    "neg_zero": Scalar("Float", -0.0),
    "inf": Scalar("Float", float("-inf")),
    "nan": Scalar("Float", float("nan")),
    "neg_nan": Scalar("Float", -float("nan")),
    "nan_payload": Scalar("Float", struct.unpack(">d", bytes.fromhex("fff4000000000abc"))[0]),  # signalling
    "epoch": Scalar("Int", -3),
    "big": Scalar("UInt", (1 << 64) - 1),
    "done": Scalar("Bool", True),
}


def _burn_022_file(path: Path) -> Path:
    """Burn >= 0.21 dtypes, scalars (0.22), metadata, param_ids (one missing), module data order."""
    f32 = np.arange(15, dtype=np.float32).reshape(3, 5) / 7
    return _write_bpk(
        path,
        [
            bytes_spec("enc.fc.weight", "Flex32", (3, 5), f32.tobytes(), param_id=(1 << 63) + 5),
            bytes_spec("enc.fc.bias", "Flex32", (5,), _data(20, 1), param_id=17),
            bytes_spec("enc.norm.gamma", "F32", (5,), _data(20, 2), param_id=18),
            bytes_spec("enc.norm.beta", "F32", (5,), _data(20, 3), param_id=19),
            bytes_spec("mask", "Bool(U8)", (2, 3), _bools(6, 1, 4)),  # no param_id
            bytes_spec("flags", "Bool(U32)", (4,), _bools(4, 4, 5), param_id=20),
            bytes_spec("counts", "U16", (6,), _data(12, 6), param_id=21),
            bytes_spec("stats.h", "F16", (3,), _data(6, 7), param_id=22),
            bytes_spec("stats.b", "BF16", (3,), _data(6, 8), param_id=23),
            bytes_spec("step", "I64", (), _data(8, 9), param_id=24),
        ],
        {"format": "burnpack", "producer": "burn", "version": "0.22.1", "note": "ünïcode ✓"},
        SCALARS,
    )


def _burn_019_file(path: Path) -> Path:
    """Burn 0.19: legacy "Bool" dtype and tensors packed right after the metadata."""
    path = _write_bpk(
        path,
        [
            bytes_spec("fc.weight", "F32", (3, 4), _data(48, 10), param_id=(1 << 63) + 9),
            bytes_spec("fc.bias", "F32", (4,), _data(16, 11), param_id=31),
            bytes_spec("mask", "Bool", (5,), _bools(5, 1, 12), param_id=32),
            bytes_spec("ids", "U16", (3,), _data(6, 13), param_id=33),
        ],
        {"format": "burnpack", "producer": "burn", "version": "0.19.1"},
        layout=LAYOUT_PACKED,
    )
    assert read_bpk(path).layout == "packed"  # 10 + N is not a multiple of 256 here
    return path


def _scalar_bits(scalars: dict) -> dict:
    """Scalars compared by exact bits (nan == nan, -0.0 != 0.0)."""
    out = {}
    for name, value in scalars.items():
        ((kind, inner),) = value.items()
        out[name] = (kind, struct.pack(">d", inner) if kind == "Float" else inner)
    return out


@pytest.mark.parametrize("layout", ["keep", "auto"])
@pytest.mark.parametrize("build", [_burn_022_file, _burn_019_file], ids=["burn-0.22", "burn-0.19-packed"])
def test_burn_only_facts_survive_safetensors(tmp_path: Path, build, layout: str) -> None:
    source = build(tmp_path / "extras.bpk")
    original = read_bpk(source)
    middle = tmp_path / "extras.safetensors"
    carried = _convert(source, middle, layout=layout)
    back = _convert(middle, tmp_path / "back.bpk", layout=layout)

    assert back.tensors == original.tensors  # dtypes exactly as Burn spells them, shapes, bytes, param_ids
    assert back.order == original.order
    assert back.own_metadata() == original.own_metadata()
    assert _scalar_bits(back.scalars) == _scalar_bits(original.scalars)
    assert back.layout == original.layout
    _assert_provenance(carried, source)
    _assert_provenance(back, middle)

    if layout == "auto":  # the middle file is in PyTorch layout
        assert carried.metadata["format"] == "pt"
        weight = "enc.fc.weight" if "enc.fc.weight" in original.tensors else "fc.weight"
        rows, cols = original.tensors[weight].shape
        assert carried.tensors[weight].shape == (cols, rows)
        assert carried.tensors[weight].data == transposed(original.tensors[weight].data, (rows, cols), 4)
    else:
        assert "format" not in carried.metadata
        assert {n: t.shape for n, t in carried.tensors.items()} == {n: t.shape for n, t in original.tensors.items()}
    if "flags" in original.tensors:  # Burn-only dtypes are stored as the safetensors dtype with the same bytes
        assert (carried.tensors["flags"].dtype, carried.tensors["mask"].dtype) == ("U32", "U8")
        assert carried.tensors["enc.fc.bias"].dtype == "F32"


def test_qfloat_is_refused_for_safetensors(tmp_path: Path) -> None:
    source = _write_bpk(
        tmp_path / "quant.bpk",
        [
            bytes_spec("fc.weight", "QFloat", (4,), _data(8, 1), raw_dtype=QFLOAT),
            bytes_spec("fc.bias", "F32", (4,), _data(16, 2)),
        ],
    )
    for args in ((), ("--layout", "keep")):
        proc = run_cli("convert", source, *args)
        assert_one_line_error(proc, 1, str(source), "QFloat", "fc.weight")
    assert dir_listing(tmp_path) == ["quant.bpk"]
    with pytest.raises(UnsupportedError):
        convert(ConvertRequest(source=source))


def test_remap_rewrites_output_names_and_the_carried_facts_follow(tmp_path: Path) -> None:
    """Remap rules rename the adapters' output: the written file, its data order and its carried param_ids use
    the new names, and the tensors are still verified."""
    source = _copy(MNIST_WEB, tmp_path)
    dest = tmp_path / "renamed.safetensors"
    prefix = StoreOptions(remap=(compile_rule(r"^", "model."),))
    convert(ConvertRequest(source=source, dest=dest, store=prefix))
    plain = tmp_path / "plain.safetensors"
    convert(ConvertRequest(source=source, dest=plain))
    renamed, reference = read_safetensors(dest), read_safetensors(plain)
    assert {f"model.{name}" for name in reference.tensors} == set(renamed.tensors)
    assert all(renamed.tensors[f"model.{n}"] == tensor for n, tensor in reference.tensors.items())
    order = json.loads(renamed.metadata["syncd.data_order"])
    assert order == [f"model.{name}" for name in json.loads(reference.metadata["syncd.data_order"])]
    assert set(json.loads(renamed.metadata["syncd.param_ids"])) == set(order)
    clash = StoreOptions(remap=(compile_rule(r"^conv\d\.", "conv."),))  # two modules moved onto one
    with pytest.raises(NameCollisionError, match="would both be named 'conv.conv.weight'"):
        convert(ConvertRequest(source=source, dest=tmp_path / "x.safetensors", store=clash))
    assert not (tmp_path / "x.safetensors").exists()


@pytest.mark.slow
def test_large_and_empty_linear_weights_transpose_exactly(tmp_path: Path) -> None:
    # one weight above the size transposed in memory in one piece (it goes strip by strip), and empty ones
    cols = 1027
    rows = STRIP_BYTES // (cols * 4) + 37
    assert rows * cols * 4 > STRIP_BYTES
    big = np.random.default_rng(1).integers(0, 1 << 32, (rows, cols), dtype=np.uint32).view(np.float32)
    state = {
        "big.weight": torch.from_numpy(big),
        "big.bias": torch.zeros(rows),
        "empty_in.weight": torch.zeros(3, 0),
        "empty_in.bias": torch.zeros(3),
        "empty_out.weight": torch.zeros(0, 5),
        "empty_out.bias": torch.zeros(0),
    }
    source = tmp_path / "wide.safetensors"
    save_file(state, source)
    burn = _convert(source, tmp_path / "wide.bpk")
    assert burn.tensors["big.weight"].shape == (cols, rows)
    assert burn.tensors["big.weight"].data == big.T.tobytes()
    assert (burn.tensors["empty_in.weight"].shape, burn.tensors["empty_out.weight"].shape) == ((0, 3), (5, 0))
    back = _convert(tmp_path / "wide.bpk", tmp_path / "back.safetensors")
    assert back.tensors == read_safetensors(source).tensors


# ------------------------------------------------------------------------------------------------------
# verification and failures: nothing half-made is ever published


def _mnist_good_and_corrupted(tmp_path: Path) -> tuple[Path, Path, Path]:
    """mnist_web.bpk, its conversion, and a copy of that with one bit flipped in a transposed tensor
    (fc1.weight) and in a copied one (conv2.conv.weight)."""
    source = _copy(MNIST_WEB, tmp_path)
    good = tmp_path / "good.safetensors"
    convert(ConvertRequest(source=source, dest=good))
    raw = bytearray(good.read_bytes())
    written = read_safetensors(good)
    header_end = 8 + struct.unpack("<Q", raw[:8])[0]
    for name in ("fc1.weight", "conv2.conv.weight"):
        where = raw.find(written.tensors[name].data, header_end)
        raw[where + len(written.tensors[name].data) // 2] ^= 0x01
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(raw))
    return source, good, bad


def test_verify_tensor_catches_a_corrupted_output(tmp_path: Path) -> None:
    source, good, bad = _mnist_good_and_corrupted(tmp_path)

    with BurnpackReader(source) as src, SafetensorsReader(good) as ok, SafetensorsReader(bad) as corrupt:
        verify_tensor(src, "fc1.weight", ok, "fc1.weight", True)
        verify_tensor(src, "conv2.conv.weight", ok, "conv2.conv.weight", False)
        verify_tensor(src, "fc2.bias", corrupt, "fc2.bias", False)  # untouched tensors still pass
        with pytest.raises(VerificationError, match="fc1.weight"):
            verify_tensor(src, "fc1.weight", corrupt, "fc1.weight", True)
        with pytest.raises(VerificationError, match="conv2.conv.weight"):
            verify_tensor(src, "conv2.conv.weight", corrupt, "conv2.conv.weight", False)
        with pytest.raises(VerificationError):  # a transpose that was not done
            verify_tensor(src, "fc2.weight", ok, "fc2.weight", False)


TABLE_DIFFERS = r"written tensor table differs from the plan at \['{}'\]"


@pytest.mark.parametrize(
    ("fixture", "lay_out", "tensor", "change", "caught"),
    [
        (MNIST_PT, "plan_burnpack", "fc1.weight", "shape", TABLE_DIFFERS),  # [in, out] laid out as [out, in]
        (MNIST_WEB, "plan_safetensors", "fc1.weight", "shape", TABLE_DIFFERS),
        (MNIST_WEB, "plan_safetensors", "fc2.bias", "dtype", TABLE_DIFFERS),  # F32 laid out as I32: the same bytes
        (MNIST_PT, "plan_burnpack", "fc2.bias", "param_id", "param_ids differ after writing"),
    ],
)
def test_a_header_that_does_not_describe_the_plan_is_never_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fixture: Path, lay_out: str, tensor: str, change: str, caught: str
) -> None:
    """A writer bug that lays out a table other than the planned one (same sizes, so every write still
    tiles its window): the re-read table is compared with the plan, as the format stores dtypes, and a
    burnpack's param_ids with the planned ones."""
    from syncd.engine import targets

    real = getattr(targets, lay_out)

    def misdescribing(specs: list[TensorSpec], *args: object, **kwargs: object) -> object:
        def wrong(spec: TensorSpec) -> TensorSpec:
            if spec.name != tensor:
                return spec
            if change == "shape":
                return dataclasses.replace(spec, shape=tuple(reversed(spec.shape)))
            if change == "param_id":
                return dataclasses.replace(spec, param_id=(spec.param_id or 0) + 1)
            return dataclasses.replace(spec, dtype="I32")

        return real([wrong(spec) for spec in specs], *args, **kwargs)

    monkeypatch.setattr(targets, lay_out, misdescribing)
    source = _copy(fixture, tmp_path)
    dest = tmp_path / "out.bin"
    with pytest.raises(VerificationError, match=caught.format(tensor)):
        convert(ConvertRequest(source=source, dest=dest, to_format="burnpack" if lay_out == "plan_burnpack" else None))
    assert sorted(p.name for p in tmp_path.iterdir()) == [source.name]


def test_a_header_that_reads_back_other_than_written_is_never_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The header goes out twice: first with a placeholder for the source hash, then with the hash (known once
    the source is read) written over it. A second write that does not land as written (a storage fault, stood
    in for by one changed byte) is read back and refused."""
    from syncd.engine import convert as engine

    def damaged(fd: int, data: bytes, offset: int) -> None:
        pwrite_all(fd, data[:-1] + bytes([data[-1] ^ 1]), offset)

    monkeypatch.setattr(engine, "pwrite_all", damaged)
    source = _copy(MNIST_PT, tmp_path)
    with pytest.raises(VerificationError, match="the output header reads back different from what was written"):
        convert(ConvertRequest(source=source, dest=tmp_path / "out.bpk"))
    assert sorted(p.name for p in tmp_path.iterdir()) == [source.name]


def test_a_carried_tensor_written_back_other_than_carried_is_never_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BatchNorm's num_batches_tracked has no Burn slot: it travels in the .bpk's metadata and is written back
    on the way to PyTorch, from those bytes (not from the one pass). What arrives is read back and compared
    with what was carried: a fill that writes other bytes (here one flipped) fails the conversion."""
    from syncd.engine import targets

    bpk = tmp_path / "mnist.bpk"
    convert(ConvertRequest(source=_copy(MNIST_PT, tmp_path), dest=bpk))
    real = targets._bytes_fill

    def flipped(data: bytes) -> Callable[[Any], None]:
        return real(bytes([data[0] ^ 1]) + data[1:])

    monkeypatch.setattr(targets, "_bytes_fill", flipped)
    out = tmp_path / "back.safetensors"
    with pytest.raises(VerificationError, match=r"restored tensor '.*num_batches_tracked' differs after writing"):
        convert(ConvertRequest(source=bpk, dest=out))
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["mnist.bpk", MNIST_PT.name]


def test_a_source_failing_mid_conversion_leaves_nothing(tmp_path: Path) -> None:
    # Bool bytes must be 0 or 1: the writer finds the 2 only when it reaches the tensor, after the scratch
    # file exists and earlier tensors are written.
    bools = bytes(64)
    source = _write_bpk(
        tmp_path / "bad.bpk",
        [
            bytes_spec("fc.weight", "F32", (3, 4), _data(48, 1)),
            bytes_spec("fc.bias", "F32", (4,), _data(16, 2)),
            bytes_spec("mask", "Bool(Native)", (64,), bools),
        ],
    )
    raw = bytearray(source.read_bytes())  # our writer refuses such a file, so corrupt it afterwards
    assert raw[-64:] == bools
    raw[-24] = 2
    source.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match="mask"):
        convert(ConvertRequest(source=source))
    assert dir_listing(tmp_path) == ["bad.bpk"]
    assert_one_line_error(run_cli("convert", source), 1, "mask")
    assert dir_listing(tmp_path) == ["bad.bpk"]


@pytest.mark.parametrize("fixture", [MNIST_WEB, MNIST_PT], ids=["bpk", "safetensors"])
def test_a_truncated_source_leaves_nothing(tmp_path: Path, fixture: Path) -> None:
    source = tmp_path / fixture.name
    source.write_bytes(fixture.read_bytes()[:-100])  # the last tensor's data is cut short
    line = assert_one_line_error(run_cli("convert", source), 1, str(source))
    assert "truncated" in line.lower()
    assert dir_listing(tmp_path) == [fixture.name]
    with pytest.raises(FormatError):
        convert(ConvertRequest(source=source, overwrite=True))
    assert dir_listing(tmp_path) == [fixture.name]


_COUNTER = '{"x":{"dtype":"I64","shape":[],"data":"AQAAAAAAAAA="}}'  # x: I64 scalar 1, as syncd carries it


@pytest.mark.parametrize(
    "key, value, fragment",
    [
        ("syncd.param_ids", "{not json", "malformed syncd metadata"),
        ("syncd.param_ids", '{"w":"18446744073709551616"}', "out of range"),
        ("syncd.dtypes", '{"w":"Bool(U32)"}', "syncd metadata says Bool(U32) but the tensor is F32"),
        ("syncd.dtypes", '{"w":"Complex"}', "unexpected carried dtype"),
        ("syncd.scalars", '{"s":["Decimal","1"]}', "unknown scalar kind"),
        ("syncd.scalars", '{"s":["Float","nan:3ff0000000000000"]}', "bad NaN scalar"),  # 1.0's bits
        ("syncd.scalars", '{"s":["Float","nan:7ff8"]}', "bad NaN scalar"),
        ("syncd.dropped", '{"c":{"dtype":"I64","shape":[2],"data":"AQAAAAAAAAA="}}', "does not match its data"),
        ("syncd.data_order", '{"w":1}', "not a list of names"),
    ],
)
def test_malformed_carried_metadata_is_refused(tmp_path: Path, key: str, value: str, fragment: str) -> None:
    source = tmp_path / "edited.safetensors"
    save_file({"w": torch.zeros(2, 3), "b": torch.zeros(4)}, source, metadata={key: value})
    with pytest.raises(FormatError, match=re.escape(fragment)):
        convert(ConvertRequest(source=source, layout="keep"))
    assert dir_listing(tmp_path) == ["edited.safetensors"]
    assert_one_line_error(run_cli("convert", source, "--layout", "keep"), 1, str(source))


def test_carried_counter_colliding_with_a_tensor_is_refused(tmp_path: Path) -> None:
    source = _write_bpk(tmp_path / "odd.bpk", [bytes_spec("x", "I64", (), bytes(8))], {"syncd.dropped": _COUNTER})
    with pytest.raises(FormatError, match="collides"):
        convert(ConvertRequest(source=source))
    assert dir_listing(tmp_path) == ["odd.bpk"]


# ------------------------------------------------------------------------------------------------------
# the command line


def test_existing_destination_is_left_alone_unless_overwrite(tmp_path: Path) -> None:
    source = _copy(MNIST_PT, tmp_path)
    dest = tmp_path / "mnist.bpk"
    dest.write_bytes(b"someone else's checkpoint")
    line = assert_one_line_error(run_cli("convert", source), 3, str(dest))
    assert "--overwrite" in line
    assert dest.read_bytes() == b"someone else's checkpoint"
    assert dir_listing(tmp_path) == ["mnist.bpk", "mnist.safetensors"]

    proc = run_cli("convert", source, "--overwrite")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert read_bpk(dest).tensors.keys() == MNIST_PT_BURN_SHAPES.keys()
    assert dir_listing(tmp_path) == ["mnist.bpk", "mnist.safetensors"]


@pytest.mark.parametrize(
    "args",
    [
        ("convert",),
        ("convert", "{src}", "--layout", "sideways"),
        ("convert", "{src}", "--to", "onnx"),
        ("convert", "{src}", "--frobnicate"),
        ("convert", "{src}", "--to", "safetensors"),  # the default destination is the source itself
        ("convert", "{src}", "-o", "{src}"),
        ("convert", "{src}", "--modules", "{map}"),
    ],
    ids=["no-source", "bad-layout", "bad-format", "unknown-option", "onto-itself", "same-path", "bad-map"],
)
def test_usage_errors_exit_2(tmp_path: Path, args: tuple[str, ...]) -> None:
    source = _copy(MNIST_PT, tmp_path)
    bad_map = tmp_path / "map.yaml"
    bad_map.write_text("modules:\n  fc1: Transformer\n")
    before = source.read_bytes()
    proc = run_cli(*(a.format(src=source, map=bad_map) for a in args))
    assert_one_line_error(proc, 2)
    assert source.read_bytes() == before
    assert dir_listing(tmp_path) == ["map.yaml", "mnist.safetensors"]


@pytest.mark.parametrize(
    "name, content",
    [
        ("garbage.bpk", b"NRUB\x01\x00\xff\xff\x00\x00 not cbor"),
        ("wrong_magic.bpk", b"\x00" * 64),
        ("garbage.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      "),
        ("empty.safetensors", b""),
        ("huge_header.safetensors", struct.pack("<Q", 1 << 40) + b"{}"),
        ("missing.bpk", None),
    ],
)
def test_bad_input_exits_1_with_one_line(tmp_path: Path, name: str, content: bytes | None) -> None:
    source = tmp_path / name
    if content is not None:
        source.write_bytes(content)
    assert_one_line_error(run_cli("convert", source), 1, str(source))
    assert dir_listing(tmp_path) == ([name] if content is not None else [])


def test_directory_as_source_exits_1(tmp_path: Path) -> None:
    (tmp_path / "model.bpk").mkdir()
    assert_one_line_error(run_cli("convert", tmp_path / "model.bpk"), 1, "model.bpk")


# ------------------------------------------------------------------------------------------------------
# the recorded source hash, and the full read-back kept for audits


def test_hash_sha256_records_the_sha256_of_the_source(tmp_path: Path) -> None:
    source = _copy(MNIST_WEB, tmp_path)
    proc = run_cli("convert", source, "-o", tmp_path / "out.safetensors", "--hash", "sha256")
    assert proc.returncode == 0, proc.stderr
    metadata = read_safetensors(tmp_path / "out.safetensors").metadata
    assert metadata["syncd.source_sha256"] == _sha256(source)
    assert "syncd.source_xxh3_128" not in metadata


def test_verify_full_converts_both_ways_and_gives_the_same_bytes_as_fast(tmp_path: Path) -> None:
    source = _copy(MNIST_WEB, tmp_path)
    for verify in ("fast", "full"):
        proc = run_cli("convert", source, "-o", tmp_path / f"{verify}.safetensors", "--verify", verify)
        assert proc.returncode == 0, proc.stderr
        proc = run_cli(
            "convert", tmp_path / f"{verify}.safetensors", "-o", tmp_path / f"{verify}.bpk", "--verify", verify
        )
        assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "fast.safetensors").read_bytes() == (tmp_path / "full.safetensors").read_bytes()
    assert read_bpk(tmp_path / "fast.bpk").tensors == read_bpk(tmp_path / "full.bpk").tensors
    assert read_bpk(tmp_path / "full.bpk").tensors == read_bpk(source).tensors


def test_verify_full_catches_what_verify_tensor_catches(tmp_path: Path) -> None:
    source, good, bad = _mnist_good_and_corrupted(tmp_path)

    def piece(reader: BurnpackReader, name: str, transposed: bool) -> tuple[FromSource, str, int]:
        return FromSource(reader, name, transposed), name, 0

    with BurnpackReader(source) as src, SafetensorsReader(good) as ok, SafetensorsReader(bad) as corrupt:
        verify_full([piece(src, "fc1.weight", True), piece(src, "conv2.conv.weight", False)], ok)
        verify_full([piece(src, "fc2.bias", False)], corrupt)  # untouched tensors still pass
        for name, transposed in (("fc1.weight", True), ("conv2.conv.weight", False)):
            with pytest.raises(VerificationError, match=name):
                verify_full([piece(src, name, transposed)], corrupt)
        with pytest.raises(VerificationError):  # a transpose that was not done
            verify_full([piece(src, "fc2.weight", False)], ok)


def test_unknown_hash_or_verify_choices_are_usage_errors(tmp_path: Path) -> None:
    source = _copy(MNIST_WEB, tmp_path)
    for option in (("--hash", "md5"), ("--verify", "none")):
        proc = run_cli("convert", source, *option)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    with pytest.raises(UsageError, match="--hash"):
        convert(ConvertRequest(source=source, hash_name="md5"))
    assert dir_listing(tmp_path) == [source.name]


def test_many_small_tensors_convert_both_ways_and_come_back_to_the_same_files(tmp_path: Path) -> None:
    """Thousands of small tensors (the table-bound case bench/'s `small` times): norms renamed, Linears
    transposed, tensors of other dtypes and buffers among them, every one back where it was."""
    torch.manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for i in range(1500):
        tensors[f"blocks.{i}.norm.weight"] = torch.randn(16)
        tensors[f"blocks.{i}.norm.bias"] = torch.randn(16)
        if i % 100 == 0:
            tensors[f"blocks.{i}.proj.weight"] = torch.randn(8, 16)
            tensors[f"blocks.{i}.proj.bias"] = torch.randn(8)
            tensors[f"blocks.{i}.steps"] = torch.arange(3, dtype=torch.int64)
            tensors[f"blocks.{i}.mask"] = torch.tensor([True, False])
    source = tmp_path / "small.safetensors"
    save_file(tensors, source, metadata={"format": "pt"})

    first = _convert(source, tmp_path / "small.bpk")
    assert first.tensors["blocks.7.norm.gamma"].data == tensors["blocks.7.norm.weight"].numpy().tobytes()
    proj = tensors["blocks.100.proj.weight"].numpy()
    assert first.tensors["blocks.100.proj.weight"].data == np.ascontiguousarray(proj.T).tobytes()
    back = tmp_path / "back.safetensors"
    _convert(tmp_path / "small.bpk", back)
    assert {name: t.numpy().tobytes() for name, t in load_file(back).items()} == {
        name: t.numpy().tobytes() for name, t in tensors.items()
    }
    _convert(back, tmp_path / "again.bpk")  # the way there again: the same file, byte for byte
    assert _section(tmp_path / "again.bpk") == _section(tmp_path / "small.bpk")
    assert read_bpk(tmp_path / "again.bpk").tensors == first.tensors


def _cyclic_garbage_of_a_conversion(directory: Path, count: int) -> int:
    """Objects left in reference cycles by converting a checkpoint of `count` small tensors both ways."""
    tensors = {f"blocks.{i}.norm.{leaf}": torch.randn(8) for i in range(count // 2) for leaf in ("weight", "bias")}
    source = directory / f"n{count}.safetensors"
    save_file(tensors, source, metadata={"format": "pt"})
    gc.collect()
    gc.disable()
    try:
        convert(ConvertRequest(source=source, dest=directory / f"n{count}.bpk"))
        convert(ConvertRequest(source=directory / f"n{count}.bpk", dest=directory / f"n{count}.back.safetensors"))
        return gc.collect()
    finally:
        gc.enable()


def test_a_conversion_leaves_no_more_cycles_for_more_tensors(tmp_path: Path) -> None:
    """`syncd convert` turns the cycle collector off (cli/main.py): that holds only while what a conversion
    leaves in reference cycles does not grow with its tensors."""
    few = _cyclic_garbage_of_a_conversion(tmp_path, 200)
    many = _cyclic_garbage_of_a_conversion(tmp_path, 4000)
    assert many <= few + 20, (few, many)


@pytest.mark.parametrize("at", [0, 2, 4])
def test_an_empty_tensor_whose_offsets_lie_in_or_at_another_tensor_converts(tmp_path: Path, at: int) -> None:
    """Burn writes an empty tensor's offsets where its writer's cursor stood: at another tensor's start, even
    inside its bytes when the order differs. It takes no byte: nothing overlaps."""
    source = tmp_path / "empty.bpk"
    tensors = {"a": descriptor("U8", [4], 0, 4), "b": descriptor("U8", [0], at, at)}
    source.write_bytes(bpk_bytes(tensors, bytes([1, 2, 3, 4])))
    for output in ("empty.safetensors", "back.bpk"):
        result = convert(ConvertRequest(source=source, dest=tmp_path / output, layout="keep"))
        assert result.tensors == 2
    back = read_any(tmp_path / "empty.safetensors")
    assert back.tensors["a"].data == bytes([1, 2, 3, 4]) and back.tensors["b"].data == b""


def test_metadata_too_large_for_a_safetensors_header_is_refused_naming_the_source_before_writing(
    tmp_path: Path,
) -> None:
    """Burn allows 100 MiB of metadata; as JSON text (a newline escaped as two bytes) it can outgrow the 100 MB
    a safetensors reader accepts. Refused before a byte is written, naming the .bpk (it used to be refused
    when the written file was read back, naming the output)."""
    source = tmp_path / "notes.bpk"
    source.write_bytes(bpk_bytes({"w": descriptor("U8", [1], 0, 1)}, b"\x01", metadata={"notes": "\n" * (60 << 20)}))
    proc = run_cli("convert", source, "-o", tmp_path / "notes.safetensors")
    assert_one_line_error(proc, 1, str(source), "safetensors header would take")
    assert dir_listing(tmp_path) == ["notes.bpk"]
