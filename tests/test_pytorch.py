"""PyTorch's own checkpoints (`torch.save`: .pt, .pth, pytorch_model.bin), read without torch and without
running their pickle: real torch-written files through the real CLI, hostile pickles and zips built by hand,
each refused in one line with nothing executed."""

from __future__ import annotations

import _codecs
import argparse
import io
import json
import os
import pickle
import struct
import subprocess
import sys
import tarfile
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from convcheck import assert_one_line_error, dir_listing, read_any, read_bpk, run_cli
from daemonutil import DaemonRun, stop_cleanly
from safetensors.torch import load_file, save_file
from torch import nn

from syncd.engine.convert import ConvertRequest, convert
from syncd.errors import FormatError, VerificationError
from syncd.formats import open_checkpoint

pytestmark = pytest.mark.torch

# every dtype torch saves, with the dtype syncd reads it as; the rest is refused by name
READ_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e8m0fnu: "F8_E8M0",
    torch.complex64: "C64",
}
REFUSED_DTYPES = {
    torch.complex128: "ComplexDoubleStorage",
    torch.complex32: "complex32",
    torch.float8_e4m3fnuz: "float8_e4m3fnuz",
    torch.float8_e5m2fnuz: "float8_e5m2fnuz",
}


def tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.contiguous().reshape(-1)
    return t.numpy().tobytes() if t.dtype == torch.bool else t.view(torch.uint8).numpy().tobytes()


def sample(dtype: torch.dtype, shape: tuple[int, ...] = (3, 5)) -> torch.Tensor:
    """Values that differ element to element, in any dtype torch saves (bools as 0 and 1)."""
    numel = torch.Size(shape).numel()
    if dtype == torch.bool:
        return (torch.arange(numel) % 3 == 0).reshape(shape)
    raw = (torch.arange(numel * dtype.itemsize) * 37 % 251).to(torch.uint8)
    return raw.view(dtype).reshape(shape)


def assert_safetensors_equal(path: Path, expected: dict[str, torch.Tensor]) -> None:
    got = load_file(path)
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert tensor_bytes(got[name]) == tensor_bytes(tensor), name


# ---------------------------------------------------------------------------------------------- dtypes, views


def test_every_dtype_torch_saves_is_read_bit_for_bit(tmp_path: Path) -> None:
    state = {str(dtype).removeprefix("torch."): sample(dtype) for dtype in READ_DTYPES}
    source = tmp_path / "dtypes.pt"
    torch.save(state, source)
    with open_checkpoint(source) as reader:
        for name, tensor in state.items():
            assert reader.read(name) == tensor_bytes(tensor), name
    proc = run_cli("convert", source, "-o", tmp_path / "dtypes.safetensors", "--layout", "keep")
    assert proc.returncode == 0, proc.stderr
    assert_safetensors_equal(tmp_path / "dtypes.safetensors", state)
    written = read_any(tmp_path / "dtypes.safetensors")
    assert {n: t.dtype for n, t in written.tensors.items()} == {
        str(d).removeprefix("torch."): st for d, st in READ_DTYPES.items()
    }


def test_a_checkpoint_saved_without_crcs_is_read(tmp_path: Path) -> None:
    """torch's `compute_crc32 = False` (a faster save) writes 0 as every entry's CRC, and torch reads the file;
    syncd refused it as damaged. A CRC that is there is still checked."""
    from torch.utils.serialization import config

    state = {"fc.weight": torch.randn(3, 4), "fc.bias": torch.randn(3)}
    config.save.compute_crc32 = False  # (torch's config module cannot be monkeypatched back)
    try:
        torch.save(state, tmp_path / "nocrc.pt")
    finally:
        config.save.compute_crc32 = True
    with zipfile.ZipFile(tmp_path / "nocrc.pt") as archive:
        assert {info.CRC for info in archive.infolist()} == {0}
    with open_checkpoint(tmp_path / "nocrc.pt") as reader:
        assert reader.read("fc.weight") == tensor_bytes(state["fc.weight"])
    torch.save(state, tmp_path / "crc.pt")
    data = bytearray((tmp_path / "crc.pt").read_bytes())
    at = data.index(b"byteorder") + len(b"byteorder")
    pkl = data.index(b"little", at)
    data[pkl : pkl + 6] = b"LITTLE"  # the byteorder record, changed under its CRC
    (tmp_path / "damaged.pt").write_bytes(bytes(data))
    with pytest.raises(FormatError, match="does not match its CRC: damaged"):
        open_checkpoint(tmp_path / "damaged.pt")


@pytest.mark.parametrize("dtype", sorted(REFUSED_DTYPES, key=str))
def test_a_dtype_neither_format_holds_is_refused_by_name(tmp_path: Path, dtype: torch.dtype) -> None:
    source = tmp_path / "odd.pt"
    torch.save({"ok": torch.zeros(2), "odd": torch.zeros(2, dtype=dtype)}, source)
    assert_one_line_error(run_cli("convert", source), 1, str(source), REFUSED_DTYPES[dtype], "neither")
    assert dir_listing(tmp_path) == ["odd.pt"]


@pytest.mark.parametrize(
    ("view", "flag"),
    [(lambda z: z.conj(), "conj"), (lambda z: z.conj().imag, "neg")],
    ids=["conj", "neg"],
)
def test_a_lazy_conjugate_or_negative_view_is_refused_not_written_as_its_stored_bytes(
    tmp_path: Path, view: Callable[[torch.Tensor], torch.Tensor], flag: str
) -> None:
    """torch saves x.conj() and x.conj().imag as their storage plus a flag that negates it when read: the stored
    bytes alone would be the wrong values."""
    source = tmp_path / "lazy.pt"
    tensor = view(torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64))
    assert tensor.is_conj() or tensor.is_neg()
    torch.save({"ok": torch.ones(2), "lazy": tensor}, source)
    for output in ("lazy.safetensors", "lazy.bpk"):
        assert_one_line_error(run_cli("convert", source, "-o", tmp_path / output), 1, str(source), f"({flag})")
    assert dir_listing(tmp_path) == ["lazy.pt"]
    resolved = tmp_path / "resolved.pt"
    torch.save({"ok": torch.ones(2), "lazy": tensor.resolve_conj().resolve_neg()}, resolved)
    assert run_cli("convert", resolved, "-o", tmp_path / "resolved.safetensors").returncode == 0
    assert_safetensors_equal(
        tmp_path / "resolved.safetensors", {"ok": torch.ones(2), "lazy": tensor.resolve_conj().resolve_neg()}
    )


def test_a_sequential_with_gaps_keeps_its_indices_in_safetensors_and_closes_them_in_burnpack(tmp_path: Path) -> None:
    """nn.Sequential(Linear, ReLU, Linear) saves `0.*` and `2.*`: PyTorch loads the .safetensors by those names;
    Burn's PytorchStore (and so the .bpk) numbers a Vec's items 0..n-1."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    source = tmp_path / "seq.pt"
    torch.save(model.state_dict(), source)
    assert run_cli("convert", source, "-o", tmp_path / "seq.safetensors").returncode == 0
    again = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    again.load_state_dict(load_file(tmp_path / "seq.safetensors"))  # strict: every name as saved
    assert all(torch.equal(again.state_dict()[k], v) for k, v in model.state_dict().items())
    assert run_cli("convert", source, "-o", tmp_path / "seq.bpk").returncode == 0
    assert sorted(read_any(tmp_path / "seq.bpk").tensors) == ["0.bias", "0.weight", "1.bias", "1.weight"]


@pytest.mark.parametrize("shape", [(1 << 20, 1 << 12), (1 << 31, 1 << 31)], ids=["16GiB", "2^64B"])
def test_an_expanded_view_standing_for_far_more_than_its_file_is_refused_before_a_byte_is_written(
    tmp_path: Path, shape: tuple[int, int]
) -> None:
    """x.expand() repeats 4 bytes: a 1.5 KiB file stands for gigabytes (or more than 2^64 bytes) of values,
    which a format without strides must write out."""
    source = tmp_path / "expanded.pt"
    torch.save({"ok": torch.ones(2), "w": torch.zeros(1).expand(*shape)}, source)
    for output in ("expanded.safetensors", "expanded.bpk"):
        assert_one_line_error(run_cli("convert", source, "-o", tmp_path / output), 1, str(source), "expanded views")
    assert dir_listing(tmp_path) == ["expanded.pt"]


def test_a_bool_view_of_other_bytes_is_refused_naming_the_file_and_the_tensor(tmp_path: Path) -> None:
    source = tmp_path / "bools.pt"
    torch.save({"b": torch.tensor([0, 2, 1], dtype=torch.uint8).view(torch.bool)}, source)
    assert_one_line_error(run_cli("convert", source), 1, str(source), "tensor 'b'", "other than 0 or 1")
    assert dir_listing(tmp_path) == ["bools.pt"]


def views() -> dict[str, torch.Tensor]:
    """Tensors over shared storages: tied, transposed, sliced, strided, expanded, permuted, overlapping."""
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    cube = torch.arange(60, dtype=torch.int16).reshape(3, 4, 5)
    return {
        "base": base,
        "tied": base,  # the same storage and window: a tied weight
        "transposed": base.t(),
        "rows": base[2:5],
        "columns": base[:, 3:6],
        "strided": base[::2, ::3],
        "expanded": torch.arange(4.0).expand(3, 4),
        "permuted": cube.permute(2, 0, 1),
        "overlap_a": base.view(-1)[10:30],
        "overlap_b": base.view(-1)[20:40],
        "scalar": base[1, 1],
        "empty": base[:, 8:],
    }


def test_views_and_shared_storages_are_read_and_written_contiguous(tmp_path: Path) -> None:
    state = views()
    source = tmp_path / "views.pt"
    torch.save(state, source)
    with open_checkpoint(source) as reader:
        for name, tensor in state.items():
            assert reader.read(name) == tensor_bytes(tensor), name
            assert reader.tensor(name).shape == tuple(tensor.shape), name
        assert not reader.is_window("transposed") and not reader.is_window("strided")
    out = tmp_path / "views.safetensors"
    proc = run_cli("convert", source, "-o", out, "--layout", "keep", "--verify", "full")
    assert proc.returncode == 0, proc.stderr
    assert_safetensors_equal(out, {name: t.contiguous() for name, t in state.items()})


def test_a_view_written_other_than_its_source_is_never_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A view is gathered and written outside the one pass, so the pass's checks do not cover it: it is read
    back and compared with its source gathered again. A gather that writes other bytes (here the first strip
    of every view with one byte flipped) fails the conversion, whatever the fast verification skips."""
    from syncd.engine.write import views as view_copies

    def flipped(self: view_copies.ViewPiece, sink: Any) -> None:
        for done, data in self.strips():
            if done == 0 and data:
                data[0] ^= 1
            sink.pwrite(data, self.at + done)

    monkeypatch.setattr(view_copies.ViewPiece, "fill", flipped)
    source = tmp_path / "views.pt"
    torch.save(views(), source)
    out = tmp_path / "views.safetensors"
    with pytest.raises(VerificationError, match=r"tensor '\w+' differs from its source"):
        convert(ConvertRequest(source=source, dest=out, layout="keep"))
    assert dir_listing(tmp_path) == ["views.pt"]


def test_views_that_are_linear_weights_are_transposed_going_to_burn(tmp_path: Path) -> None:
    """A Linear weight that is a view (a transpose, a slice of a larger storage) still becomes Burn's [in, out],
    and comes back as PyTorch saved it."""
    big = torch.randn(8, 12)
    state = {
        "fc.weight": big[:, :6].t(),  # [6, 8], strided
        "fc.bias": torch.randn(6),
        "head.weight": big[2:5],  # [3, 12], a row slice
        "head.bias": torch.randn(3),
        "tied.weight": big[2:5],  # the same window again
        "tied.bias": torch.randn(3),
    }
    source = tmp_path / "linear.pt"
    torch.save(state, source)
    bpk = tmp_path / "linear.bpk"
    proc = run_cli("convert", source, "-o", bpk, "--verify", "full")
    assert proc.returncode == 0, proc.stderr
    burn = read_bpk(bpk)
    for name in ("fc.weight", "head.weight", "tied.weight"):
        assert burn.tensors[name].data == tensor_bytes(state[name].t()), name
    back = tmp_path / "back.safetensors"
    assert run_cli("convert", bpk, "-o", back).returncode == 0
    assert_safetensors_equal(back, {n: t.contiguous() for n, t in state.items()})


# ---------------------------------------------------------------------------------------------- nesting


def test_nested_dicts_are_named_by_their_keys_joined_with_dots(tmp_path: Path) -> None:
    inner = {"weight": torch.randn(2, 2), "bias": torch.randn(2)}
    source = tmp_path / "nested.pth"
    torch.save({"encoder": {"layer": inner}, "scale": torch.ones(1), "note": "kept aside", 7: torch.zeros(1)}, source)
    with open_checkpoint(source) as reader:
        assert sorted(t.name for t in reader.tensors) == ["7", "encoder.layer.bias", "encoder.layer.weight", "scale"]
        assert reader.header.facts["left"] == ["note (str)"]


def training_checkpoint(model: nn.Module) -> dict:
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    return {
        "epoch": 3,
        "model_state_dict": model.state_dict(),
        "optimizer_state_dict": optimizer.state_dict(),
        "loss": 0.25,
    }


def small_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(fc1=nn.Linear(8, 16), norm=nn.LayerNorm(16), fc2=nn.Linear(16, 4)))


def test_a_training_checkpoint_is_read_from_its_usual_key_and_says_what_it_left(tmp_path: Path) -> None:
    model = small_mlp()
    source = tmp_path / "ckpt.pt"
    torch.save(training_checkpoint(model), source)
    proc = run_cli("convert", source, "-o", tmp_path / "ckpt.safetensors")
    assert proc.returncode == 0, proc.stderr
    assert "tensors taken from top-level key 'model_state_dict'" in proc.stdout
    assert "not converted: epoch (int 3), optimizer_state_dict (18 tensors), loss (float 0.25)" in proc.stdout
    assert_safetensors_equal(tmp_path / "ckpt.safetensors", model.state_dict())


def test_a_bytes_value_saved_with_the_default_pickle_protocol_is_read_and_said_not_converted(tmp_path: Path) -> None:
    """torch.save's default pickle protocol (2) writes bytes as `_codecs.encode(text, 'latin1')`: the whole
    checkpoint was refused for that call, which torch.load(weights_only=True) reads. Only that call is read:
    another encoding is refused."""
    source = tmp_path / "ckpt.pt"
    torch.save({"fc.weight": torch.randn(4, 3), "blob": bytes(range(256))}, source)
    with zipfile.ZipFile(source) as archive:
        assert b"_codecs" in archive.read("ckpt/data.pkl")
    proc = run_cli("convert", source, "-o", tmp_path / "ckpt.safetensors")
    assert proc.returncode == 0, proc.stderr
    assert "not converted: blob (bytes)" in proc.stdout
    other = tmp_path / "other.pt"
    other.write_bytes(with_pickle(tmp_path, pickle.dumps({"blob": _Reduce(_codecs.encode, ("abc", "utf-8"))}, 2)))
    refused = run_cli("convert", other, "-o", tmp_path / "other.safetensors")
    assert refused.returncode == 1
    assert "_codecs.encode with arguments other than a text and 'latin1'" in refused.stderr


def test_objects_of_other_classes_beside_the_weights_are_said_not_converted_and_never_made(tmp_path: Path) -> None:
    """timm's and torchvision's training scripts save `args` (an argparse.Namespace) beside the weights, and
    a metric as a numpy scalar: any such object refused the whole checkpoint. Beside the weights it is said not
    converted now, never built; among the weights, or holding tensors at their top, it is still refused."""
    model = small_mlp()
    source = tmp_path / "checkpoint.pth"
    saved = {
        "state_dict": model.state_dict(),
        "args": argparse.Namespace(lr=0.1, epochs=90),
        "best_acc1": np.float64(71.5),
        "ema": small_mlp(),  # a whole module pickled: its tensors counted, nothing built
    }
    torch.save(saved, source)
    proc = run_cli("convert", source, "-o", tmp_path / "checkpoint.safetensors")
    assert proc.returncode == 0, proc.stderr
    assert "not converted: args (argparse.Namespace), best_acc1 (numpy." in proc.stdout
    assert f"ema ({len(small_mlp().state_dict())} tensors)" in proc.stdout
    assert_safetensors_equal(tmp_path / "checkpoint.safetensors", model.state_dict())
    beside = tmp_path / "beside.pt"
    torch.save({**model.state_dict(), "args": argparse.Namespace(lr=0.1), "dtype": torch.float16}, beside)
    proc = run_cli("convert", beside, "-o", tmp_path / "beside.safetensors")
    assert proc.returncode == 0, proc.stderr
    assert "not converted: args (argparse.Namespace), dtype (torch.float16)" in proc.stdout
    odd_key = tmp_path / "odd_key.pt"  # named under its dict, as any other key
    torch.save({**model.state_dict(), "sub": {1.5: torch.ones(2)}}, odd_key)
    proc = run_cli("convert", odd_key, "-o", tmp_path / "odd_key.safetensors")
    assert proc.returncode == 0, proc.stderr
    assert "not converted: sub.1.5 (1 tensors)" in proc.stdout
    deeper = tmp_path / "deeper.pt"  # holding no tensor, deeper among them: said not converted too
    torch.save({"state_dict": {"fc": {"shape": torch.Size([4, 3])}, **model.state_dict()}}, deeper)
    proc = run_cli("convert", deeper, "-o", tmp_path / "deeper.safetensors")
    assert proc.returncode == 0, proc.stderr
    assert "not converted: fc.shape (torch.Size)" in proc.stdout
    assert_safetensors_equal(tmp_path / "deeper.safetensors", model.state_dict())
    for name, weights in (
        ("among.pt", {"state_dict": {"fc": {"inner": _Holder(torch.ones(2))}, **model.state_dict()}}),
        ("holding.pt", {**model.state_dict(), "extra": _Holder(torch.ones(2))}),
    ):
        torch.save(weights, tmp_path / name)
        refused = run_cli("convert", tmp_path / name, "-o", tmp_path / f"{name}.safetensors")
        assert_one_line_error(refused, 1, "refuses the global")
        assert not (tmp_path / f"{name}.safetensors").exists()


@pytest.mark.parametrize(
    ("value", "protocol"),
    [
        (torch.empty(4, device="meta"), 2),
        (np.ones(4, dtype=np.float32), 2),
        (np.frombuffer(bytes(16), dtype=np.float32), 5),  # read-only: numpy's _frombuffer at protocol 5
        (np.ma.masked_array(np.ones(4, dtype=np.float32)), 2),
    ],
    ids=["meta tensor", "numpy array", "read-only numpy array", "masked array"],
)
def test_a_tensor_syncd_cannot_build_among_the_weights_is_refused_never_left_out(
    tmp_path: Path, value: Any, protocol: int
) -> None:
    """A meta tensor (torch._utils._rebuild_meta_tensor_no_storage, no storage) or a numpy array beside the
    weights was taken for a value of some other class and said not converted: exit 0, the output a weight
    short."""
    source = tmp_path / "model.pt"
    torch.save({"fc.weight": torch.ones(4, 3), "fc.bias": value}, source, pickle_protocol=protocol)
    refused = run_cli("convert", source, "-o", tmp_path / "model.safetensors")
    assert_one_line_error(refused, 1, "refuses the global")
    assert not (tmp_path / "model.safetensors").exists()


def _peak_kib_of(*args: object) -> int:
    """The peak resident memory of `syncd ARGS`, in KiB, measured by a parent of its own."""
    code = (
        "import resource, subprocess, sys; subprocess.run(sys.argv[1:], capture_output=True); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    done = subprocess.run([sys.executable, "-c", code, sys.executable, "-m", "syncd", *map(str, args)], **_CAPTURED)
    return int(done.stdout)


_CAPTURED: dict[str, Any] = {"capture_output": True, "text": True, "timeout": 300, "check": True}


def test_a_text_encoded_again_and_again_is_charged_each_time(tmp_path: Path) -> None:
    """`_codecs.encode` makes a new bytes object each call: one memoized 8 MiB text encoded 20 times took
    160 MiB (2 GiB with more calls) against a budget that charged each call 64 bytes."""
    text = b"x" * (8 << 20)
    pickle_ = b"\x80\x02}q\x00(" + b"X" + struct.pack("<I", len(text)) + text + b"q\x010c_codecs\nencode\nq\x020"
    for i in range(20):
        key = f"k{i}".encode()
        pickle_ += b"X" + struct.pack("<I", len(key)) + key + b"h\x02h\x01X\x06\x00\x00\x00latin1\x86R"
    source = tmp_path / "model.pt"
    source.write_bytes(with_pickle(tmp_path, pickle_ + b"u."))
    assert_one_line_error(run_cli("inspect", source), 1, "builds more than 128 MiB of objects")


def test_a_global_named_again_and_again_is_one_placeholder(tmp_path: Path) -> None:
    """An unknown global is a placeholder: each STACK_GLOBAL made a new one, its name joined in full before it
    was cut (two memoized texts of megabytes copied each time) and charged 8 bytes: 5 pickle bytes per 250
    bytes of memory, 1.6 GiB from a 25 MB file."""
    module, name = b"m" * 150, b"n" * 150
    pickle_ = b"\x80\x04\x8c\x96" + module + b"\x94\x8c\x96" + name + b"\x9400("
    pickle_ += b"h\x00h\x01\x93" * 1_000_000 + b"1}."
    source = tmp_path / "model.pt"
    source.write_bytes(with_pickle(tmp_path, pickle_))
    assert _peak_kib_of("inspect", source) < 200 << 10


def test_objects_are_charged_what_they_take(tmp_path: Path) -> None:
    """Each placeholder (and tensor) built was charged 64 bytes and takes about 128: two million of them from a
    10 MB pickle took 283 MiB against the 128 MiB budget."""
    pickle_ = b"\x80\x02cx\ny\nq\x00)q\x01" + b"h\x00h\x01R" * 2_100_000 + b"."
    source = tmp_path / "model.pt"
    source.write_bytes(with_pickle(tmp_path, pickle_))
    assert _peak_kib_of("inspect", source) < 220 << 10


class _Holder:
    """A class of one's own holding a tensor."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def test_tensors_in_a_list_below_the_top_are_said_not_converted(tmp_path: Path) -> None:
    """Burn's store reads dicts only: tensors in a list (`encoder.layers: [t, t]`) are not converted. At the top
    that was said; one level down they went without a word, exit 0. A number down there is no tensor lost."""
    source = tmp_path / "ckpt.pt"
    torch.save({"encoder": {"norm": torch.ones(4), "layers": [torch.ones(2), torch.zeros(2)], "step": 3}}, source)
    with open_checkpoint(source) as reader:
        assert [t.name for t in reader.tensors] == ["encoder.norm"]
        assert reader.header.facts["left"] == ["encoder.layers (2 tensors)"]


def test_a_top_level_key_is_taken_as_asked_and_a_missing_one_is_refused(tmp_path: Path) -> None:
    model = small_mlp()
    source = tmp_path / "ckpt.pt"
    torch.save({"ema": model.state_dict(), "model": model.state_dict(), "step": 10}, source)
    out = tmp_path / "ema.safetensors"
    proc = run_cli("convert", source, "-o", out, "--top-level-key", "ema", "-v")
    assert proc.returncode == 0, proc.stderr
    assert "tensors taken from top-level key 'ema' (as asked)" in proc.stdout
    assert "not converted: model (6 tensors), step (int 10)" in proc.stdout
    assert_safetensors_equal(out, model.state_dict())
    line = assert_one_line_error(run_cli("convert", source, "--top-level-key", "opt"), 1, str(source))
    assert "top-level key 'opt' is not in this file (its keys: 'ema', 'model', 'step')" in line
    line = assert_one_line_error(run_cli("convert", source, "--top-level-key", "step"), 1, str(source))
    assert "top-level key 'step' is not a dict in this file" in line
    with open_checkpoint(source) as reader:  # without the key: the one usual key that holds tensors
        assert reader.header.facts["top_level_key"] == "model"
        assert reader.header.facts["left"] == ["ema (6 tensors)", "step (int 10)"]
    torch.save({"state_dict": model.state_dict(), "model": model.state_dict()}, source)
    with open_checkpoint(source) as reader:  # two usual keys hold tensors: nothing is guessed, all is read
        assert {t.name.split(".")[0] for t in reader.tensors} == {"state_dict", "model"}


def test_a_ddp_prefix_is_kept_and_a_remap_strips_it(tmp_path: Path) -> None:
    """The state dict of a real DistributedDataParallel model (one process, gloo)."""
    import torch.distributed as dist

    model = small_mlp()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        state = nn.parallel.DistributedDataParallel(model).state_dict()
    finally:
        dist.destroy_process_group()
    assert all(name.startswith("module.") for name in state)
    source = tmp_path / "ddp.pt"
    torch.save(state, source)
    kept = tmp_path / "kept.safetensors"
    assert run_cli("convert", source, "-o", kept).returncode == 0
    assert_safetensors_equal(kept, state)
    stripped = tmp_path / "stripped.safetensors"
    assert run_cli("convert", source, "-o", stripped, "--remap", r"^module\.=").returncode == 0
    assert_safetensors_equal(stripped, model.state_dict())


# ---------------------------------------------------------------------------------------------- acceptance


def plain_model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(
        OrderedDict(
            embed=nn.Embedding(20, 8),
            conv=nn.Conv1d(8, 8, 3),
            bn=nn.BatchNorm1d(8),
            fc=nn.Linear(8, 4),
        )
    )


def same_tensors(a: Path, b: Path) -> None:
    """Tensor by tensor: names, dtypes, shapes, bytes (the data order is each source's own: a torch.save
    keeps the state dict's, a safetensors file sorts by dtype and name)."""
    left, right = read_bpk(a), read_bpk(b)
    assert sorted(left.tensors) == sorted(right.tensors)
    for name, tensor in left.tensors.items():
        assert tensor == right.tensors[name], name


def test_a_state_dict_converts_to_the_same_bpk_as_its_safetensors(tmp_path: Path) -> None:
    state = plain_model().state_dict()
    torch.save(state, tmp_path / "model.pt")
    save_file(state, tmp_path / "model.safetensors")
    for name in ("model.pt", "model.safetensors"):
        proc = run_cli("convert", tmp_path / name, "-o", tmp_path / f"{name}.bpk")
        assert proc.returncode == 0, proc.stderr
    same_tensors(tmp_path / "model.pt.bpk", tmp_path / "model.safetensors.bpk")


def test_a_training_checkpoint_converts_to_the_same_bpk_as_its_safetensors(tmp_path: Path) -> None:
    model = small_mlp()
    torch.save(training_checkpoint(model), tmp_path / "ckpt.pt")
    save_file(model.state_dict(), tmp_path / "ckpt.safetensors")
    for name in ("ckpt.pt", "ckpt.safetensors"):
        proc = run_cli("convert", tmp_path / name, "-o", tmp_path / f"{name}.bpk")
        assert proc.returncode == 0, proc.stderr
    same_tensors(tmp_path / "ckpt.pt.bpk", tmp_path / "ckpt.safetensors.bpk")


def save_pytorch_model_bin(model: nn.Module, directory: Path) -> Path:
    """What `save_pretrained(directory, safe_serialization=False)` wrote (transformers 4): config.json and
    `torch.save(model.state_dict())` as pytorch_model.bin. transformers 5 writes only safetensors (the flag is
    ignored) but still loads this file, which the test checks."""
    model.config.save_pretrained(directory)
    torch.save(model.state_dict(), directory / "pytorch_model.bin")
    return directory / "pytorch_model.bin"


def test_a_pytorch_model_bin_converts_to_the_same_bpk_as_its_safetensors(tmp_path: Path) -> None:
    from hfsets import tiny_llama
    from transformers import LlamaForCausalLM

    model = tiny_llama()
    bin_dir, st_dir = tmp_path / "bin", tmp_path / "st"
    source = save_pytorch_model_bin(model, bin_dir)
    model.save_pretrained(st_dir)
    reloaded = LlamaForCausalLM.from_pretrained(bin_dir)  # the file is what transformers loads
    assert all(torch.equal(reloaded.state_dict()[k], v) for k, v in model.state_dict().items())
    proc = run_cli("convert", source)
    assert proc.returncode == 0, proc.stderr
    assert run_cli("convert", st_dir / "model.safetensors").returncode == 0
    same_tensors(bin_dir / "pytorch_model.bpk", st_dir / "model.bpk")
    back = tmp_path / "back.safetensors"
    assert run_cli("convert", bin_dir / "pytorch_model.bpk", "-o", back).returncode == 0
    assert_safetensors_equal(back, model.state_dict())


def test_inspect_reads_a_pt_and_its_hashes_follow_its_views(tmp_path: Path) -> None:
    state = views()
    source = tmp_path / "views.pt"
    torch.save(state, source)
    proc = run_cli("inspect", source, "--json", "--hash")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["format"] == "pytorch"
    import hashlib

    hashes = {row["name"]: row["sha256"] for row in doc["tensors"]}
    assert hashes == {name: hashlib.sha256(tensor_bytes(t)).hexdigest() for name, t in state.items()}


# ---------------------------------------------------------------------------------------------- hostile files


def torch_zip(entries: dict[str, bytes], compression: int = zipfile.ZIP_STORED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression) as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
    return buf.getvalue()


def real_entries(tmp_path: Path) -> dict[str, bytes]:
    """The entries of a real torch.save zip, to be edited."""
    torch.save({"w": torch.arange(6.0)}, tmp_path / "real.pt")
    with zipfile.ZipFile(tmp_path / "real.pt") as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def with_pickle(tmp_path: Path, data: bytes) -> bytes:
    entries = real_entries(tmp_path)
    entries["real/data.pkl"] = data
    return torch_zip(entries)


class _Reduce:
    """Pickles as a call of `func(*args)`: what an attacker puts in a checkpoint."""

    def __init__(self, func: object, args: tuple) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple:
        return self.func, self.args


def _hostile(tmp_path: Path, marker: Path) -> dict[str, bytes]:
    never_ends = b"\x80\x02" + b"N0" * 500_000  # no STOP, ever
    # a memo slot at index 2^32 - 1 (the C unpickler sizes its memo array by the index), read back 10,000 times
    memo_bomb = b"\x80\x02}q\x00X\x01\x00\x00\x00w]r\xff\xff\xff\xff(" + b"j\xff\xff\xff\xff" * 10_000 + b"es."
    laughs = b"\x80\x02}q\x00X\x01\x00\x00\x00w]q\x01(K\x01e0"
    for level in range(2, 12):  # each list holds the one before it 50 times: 50^10 paths to walk
        laughs += b"]q" + bytes([level]) + b"(" + (b"h" + bytes([level - 1])) * 50 + b"e0"
    laughs += b"h\x0bs."
    deep = b"\x80\x02}X\x01\x00\x00\x00w" + b"]" * 100_000 + b"a" * 99_999 + b"s."
    deep_key = b"\x80\x02}N" + b"\x85" * 1_000_000 + b"Ns."  # hashing it would recurse in C until a crash
    nested = torch_zip({"archive/data.pkl": b"\x80\x02}."})
    for level in range(10):
        nested = torch_zip({f"level{level}/inner.zip": nested})
    compressed = real_entries(tmp_path)
    compressed["real/data/0"] = bytes(1 << 20)
    entries = real_entries(tmp_path)
    big_endian = dict(entries, **{"real/byteorder": b"big"})
    short = dict(entries, **{"real/data/0": entries["real/data/0"][:8]})
    return {
        "os.system": with_pickle(tmp_path, pickle.dumps(_Reduce(os.system, (f"touch {marker}",)), protocol=2)),
        "builtins.eval": with_pickle(
            tmp_path, pickle.dumps(_Reduce(eval, (f"open({str(marker)!r}, 'w')",)), protocol=4)
        ),
        "unknown module": with_pickle(tmp_path, b"\x80\x02cmy_trainer.hooks\nPayload\n)R."),
        "never ends": with_pickle(tmp_path, never_ends),
        "memo bomb": with_pickle(tmp_path, memo_bomb),
        "billion laughs": with_pickle(tmp_path, laughs),
        "recursion bomb": with_pickle(tmp_path, deep),
        "deep dict key": with_pickle(tmp_path, deep_key),
        "10-deep zip": nested,
        "compressed": torch_zip(compressed, zipfile.ZIP_DEFLATED),
        "big-endian": torch_zip(big_endian),
        "short storage": torch_zip(short),
    }


HOSTILE_ERRORS = {
    "os.system": "refuses the global 'posix.system'",
    "builtins.eval": "refuses the global 'builtins.eval'",
    "unknown module": "refuses the global 'my_trainer.hooks.Payload'",
    "never ends": "ends without a STOP opcode",
    "memo bomb": "values nested more than 128 deep",  # the list holds itself 10,000 times
    "billion laughs": "values to look through for tensors",
    "recursion bomb": "nested more than 128 deep",
    "deep dict key": "a dict key of type tuple",
    "10-deep zip": "a zip with no data.pkl: not a torch.save checkpoint",
    "compressed": "is compressed (method 8)",
    "big-endian": "saved with byteorder 'big'",
    "short storage": "storage '0' holds 8 bytes, fewer than its 6 elements need",
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(HOSTILE_ERRORS))
def test_a_hostile_checkpoint_is_refused_in_one_line_and_runs_nothing(tmp_path: Path, case: str) -> None:
    marker = tmp_path / "pwned"
    source = tmp_path / "work" / "model.pt"
    source.parent.mkdir()
    source.write_bytes(_hostile(tmp_path, marker)[case])
    for command in ("convert", "inspect"):
        assert_one_line_error(run_cli(command, source), 1, str(source), HOSTILE_ERRORS[case])
    assert not marker.exists()
    assert dir_listing(source.parent) == ["model.pt"]


@pytest.mark.parametrize("case", ["os.system", "builtins.eval"])
def test_the_payloads_would_have_run_under_pickle(tmp_path: Path, case: str) -> None:
    """The control: the same data.pkl given to `pickle.loads` (in a child) does create the file, so the
    refusal above is what kept it from running."""
    marker = tmp_path / "pwned"
    blob = _hostile(tmp_path, marker)[case]
    with zipfile.ZipFile(io.BytesIO(blob)) as archive:
        data = archive.read("real/data.pkl")
    code = "import pickle, sys; pickle.loads(sys.stdin.buffer.read())"
    subprocess.run([sys.executable, "-c", code], input=data, capture_output=True, timeout=60)
    assert marker.exists()


def test_a_legacy_torch_save_is_named_for_what_it_is(tmp_path: Path) -> None:
    source = tmp_path / "old.bin"
    torch.save({"w": torch.zeros(2)}, source, _use_new_zipfile_serialization=False)
    assert_one_line_error(run_cli("convert", source), 1, str(source), "legacy format", "re-save it")


@pytest.mark.parametrize("how", ["scripted", "traced"])
def test_a_torchscript_archive_is_named_for_what_it_is(tmp_path: Path, how: str) -> None:
    """torch.jit.save's archive was refused as a zip with a compressed entry, as if the file were damaged."""
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    program = torch.jit.script(model) if how == "scripted" else torch.jit.trace(model, torch.randn(2, 3))
    source = tmp_path / "model.pt"
    torch.jit.save(program, source)
    for command in (["convert", source, "-o", tmp_path / "model.bpk"], ["inspect", source]):
        proc = run_cli(*command)
        assert_one_line_error(proc, 1, "a TorchScript archive (torch.jit.save), not a torch.save checkpoint")
    assert not (tmp_path / "model.bpk").exists()


def test_a_whole_pickled_model_is_refused_by_name(tmp_path: Path) -> None:
    source = tmp_path / "model.pt"
    torch.save(small_mlp(), source)
    assert_one_line_error(run_cli("convert", source), 1, "refuses the global 'torch.nn.modules.container.Sequential'")


def test_an_entry_larger_than_declared_is_refused(tmp_path: Path) -> None:
    """A directory entry claiming more bytes than lie before the next entry."""
    torch.save({"w": torch.arange(6.0)}, tmp_path / "real.pt")
    blob = bytearray((tmp_path / "real.pt").read_bytes())
    at = blob.find(b"PK\x01\x02")  # data.pkl's directory entry, the first
    blob[at + 20 : at + 28] = (10_000).to_bytes(4, "little") * 2
    source = tmp_path / "model.pt"
    source.write_bytes(bytes(blob))
    with pytest.raises(FormatError, match="runs past|overlaps|CRC"):
        open_checkpoint(source)


# ---------------------------------------------------------------------------------------------- the daemon


@pytest.mark.daemon
def test_a_pt_moved_in_with_the_bpk_syncd_convert_made_of_it_is_in_sync_and_the_bpk_no_source(
    make_daemon: Callable[..., DaemonRun], tmp_path: Path
) -> None:
    """`syncd convert ckpt.pt` made ckpt.bpk; both moved into a watch that takes .pt files. The .bpk is the .pt's
    output whichever of the two the daemon looks at first: never converted into a third file, ckpt.safetensors
    (which would go stale at the .pt's next save), and updated at that save."""
    run = make_daemon([{"path": "runs", "direction": "both", "include": ["*.pt", "*.bpk", "*.safetensors"]}])
    runs = run.watch_dir()
    staged = tmp_path / "staged"
    staged.mkdir()
    for i in range(6):
        torch.save(small_mlp().state_dict(), staged / f"ckpt{i}.pt")
        assert run_cli("convert", staged / f"ckpt{i}.pt", "-q").returncode == 0
    run.start()
    os.rename(staged, runs / "moved")
    moved = runs / "moved"
    run.wait_for("in_sync", [moved / f"ckpt{i}.pt" for i in range(6)])
    run.quiet(1.0)
    assert sorted(p.name for p in moved.iterdir() if p.suffix == ".safetensors") == [], run.log_text()
    assert {r["status"] for r in run.records()} == {"started", "in_sync"}, run.log_text()
    saved_again = {name: tensor + 1 for name, tensor in small_mlp().state_dict().items()}
    torch.save(saved_again, moved / "ckpt0.pt")
    run.wait_for("updated", [moved / "ckpt0.pt"])
    assert read_any(moved / "ckpt0.bpk").tensors["fc1.bias"].data == tensor_bytes(saved_again["fc1.bias"])
    stop_cleanly(run)


@pytest.mark.daemon
def test_a_watch_converts_pytorch_checkpoints_only_when_asked(make_daemon: Callable[..., DaemonRun]) -> None:
    run = make_daemon(
        [
            {"path": "plain"},  # the defaults: .bpk and .safetensors only, as before
            {"path": "torch", "direction": "pt->bpk"},  # *.pt, *.pth, pytorch_model*.bin, *.ckpt, *.pth.tar
            {"path": "named", "include": ["*.pt"], "top_level_key": "ema"},
        ]
    )
    plain, torch_dir, named = run.watch_dir("plain"), run.watch_dir("torch"), run.watch_dir("named")
    model = small_mlp()
    marker = run.root / "pwned"
    torch.save(model.state_dict(), plain / "ckpt.pt")
    torch.save(training_checkpoint(model), torch_dir / "ckpt.pt")
    torch.save(model.state_dict(), torch_dir / "pytorch_model.bin")
    torch.save({"state_dict": model.state_dict(), "epoch": 1}, torch_dir / "epoch=1-step=10.ckpt")  # Lightning's
    torch.save({"state_dict": model.state_dict(), "epoch": 1}, torch_dir / "model_best.pth.tar")  # timm's
    torch.save(model.state_dict(), torch_dir / "optimizer.bin")  # not a name the direction takes
    (torch_dir / "evil.pth").write_bytes(
        with_pickle(run.root, pickle.dumps(_Reduce(os.system, (f"touch {marker}",)), protocol=2))
    )
    torch.save({"ema": model.state_dict(), "step": 3}, named / "model.pt")
    run.start()
    lightning, timm = torch_dir / "epoch=1-step=10.ckpt", torch_dir / "model_best.pth.tar"
    run.wait_for(
        "converted", [torch_dir / "ckpt.pt", torch_dir / "pytorch_model.bin", named / "model.pt", lightning, timm]
    )
    run.wait_for("refused", [torch_dir / "evil.pth"])
    code, _ = run.stop()
    assert code == 0, run.stderr()
    assert not marker.exists()
    (refused,) = run.statuses("refused")
    assert "refuses the global 'posix.system'" in refused["error"]
    (ckpt,) = [r for r in run.statuses("converted") if r["source"] == str(torch_dir / "ckpt.pt")]
    assert ckpt["direction"] == "pt->bpk"
    assert "tensors taken from top-level key 'model_state_dict' (the one usual key holding tensors)" in ckpt["layout"]
    assert any(line.startswith("not converted: epoch (int 3), optimizer_state_dict") for line in ckpt["layout"])
    (ema,) = [r for r in run.statuses("converted") if r["source"] == str(named / "model.pt")]
    assert "tensors taken from top-level key 'ema' (as asked)" in ema["layout"]
    names = ("ckpt.bpk", "pytorch_model.bpk", "epoch=1-step=10.bpk", "model_best.bpk")
    for bpk in (*(torch_dir / name for name in names), named / "model.bpk"):
        same_tensors(bpk, torch_dir / "ckpt.bpk")
    assert dir_listing(plain) == ["ckpt.pt"]
    assert not (torch_dir / "optimizer.bpk").exists()


def _tar() -> bytes:
    """A tar archive of the members torch.save's oldest format holds."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as archive:
        for name in ("sys_info", "pickle", "storages", "tensors"):
            member = tarfile.TarInfo(name)
            member.size = 5
            archive.addfile(member, io.BytesIO(b"\x80\x02}q."))
    return out.getvalue()


@pytest.mark.parametrize(
    "content, said",
    [
        (b"", "0 bytes: too short for a torch.save zip"),
        (b"PK\x03", "3 bytes: too short for a torch.save zip"),
        (b"# notes\nnot weights\n", "not a torch.save checkpoint, which is a zip (looks like text)"),
        (_tar(), "not a torch.save checkpoint, which is a zip (looks like a tar archive"),
    ],
)
def test_a_pytorch_name_that_holds_no_checkpoint_is_named_for_what_it_is(
    tmp_path: Path, content: bytes, said: str
) -> None:
    source = tmp_path / "model.pth"
    source.write_bytes(content)
    assert_one_line_error(run_cli("convert", source), 1, str(source), said)


def test_a_safetensors_file_under_a_pytorch_name_is_read_for_what_it_is(tmp_path: Path) -> None:
    state = {"w": torch.arange(4.0)}
    source = tmp_path / "model.bin"
    save_file(state, source)
    out = tmp_path / "out.safetensors"
    assert run_cli("convert", source, "-o", out, "--layout", "keep").returncode == 0
    assert_safetensors_equal(out, state)


def save_sharded_bin(model: nn.Module, directory: Path, max_shard_size: int) -> Path:
    """What `save_pretrained(..., safe_serialization=False, max_shard_size=...)` wrote (transformers 4): torch.save
    shards `pytorch_model-0000k-of-0000N.bin` split by huggingface_hub's rule, and `pytorch_model.bin.index.json`
    (`metadata.total_size`, `weight_map`), rendered as transformers renders it."""
    from syncd.formats.shards import split_greedy

    state = model.state_dict()
    groups = split_greedy([(n, t.numel() * t.element_size()) for n, t in state.items()], max_shard_size)
    model.config.save_pretrained(directory)
    weight_map = {}
    for k, names in enumerate(groups):
        file = f"pytorch_model-{k + 1:05d}-of-{len(groups):05d}.bin"
        torch.save({n: state[n] for n in names}, directory / file)
        weight_map.update(dict.fromkeys(names, file))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    path = directory / "pytorch_model.bin.index.json"
    path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return path


def test_a_sharded_pytorch_model_bin_set_converts_as_one_model(tmp_path: Path) -> None:
    from hfsets import save_llama, tiny_llama
    from transformers import LlamaForCausalLM

    model = tiny_llama()
    bin_dir = tmp_path / "bin"
    index = save_sharded_bin(model, bin_dir, 40_000)
    assert len(list(bin_dir.glob("pytorch_model-*.bin"))) == 3
    reloaded = LlamaForCausalLM.from_pretrained(bin_dir)  # transformers still loads such a set
    assert all(torch.equal(reloaded.state_dict()[k], v) for k, v in model.state_dict().items())
    st_index = save_llama(tmp_path / "st", sharded=True)
    proc = run_cli("convert", index)
    assert proc.returncode == 0, proc.stderr
    assert run_cli("convert", st_index).returncode == 0
    same_tensors(bin_dir / "pytorch_model.bpk", tmp_path / "st" / "model.bpk")
    listing = run_cli("inspect", index, "--json")
    assert listing.returncode == 0, listing.stderr
    shards = {row["shard"] for row in json.loads(listing.stdout)["tensors"]}
    assert shards == {f"pytorch_model-0000{k}-of-00003.bin" for k in (1, 2, 3)}
    back = tmp_path / "back"  # the way back is safetensors (syncd writes no pickles): one file
    back.mkdir()
    assert run_cli("convert", bin_dir / "pytorch_model.bpk", "-o", back).returncode == 0
    assert_safetensors_equal(back / "pytorch_model.safetensors", model.state_dict())


@pytest.mark.daemon
def test_the_daemon_converts_a_sharded_bin_set_once_through_its_index(
    make_daemon: Callable[..., DaemonRun], tmp_path: Path
) -> None:
    from hfsets import tiny_llama

    run = make_daemon([{"path": "runs", "direction": "pt->bpk"}])
    runs = run.watch_dir("runs")
    run.start()
    model = tiny_llama()
    index = save_sharded_bin(model, runs / "llama", 40_000)
    run.wait_for("converted", [index])
    code, _ = run.stop()
    assert code == 0, run.stderr()
    assert [r["source"] for r in run.statuses("converted")] == [str(index)]  # no shard on its own
    reference = tmp_path / "reference.bpk"
    assert run_cli("convert", index, "-o", reference).returncode == 0
    same_tensors(runs / "llama" / "pytorch_model.bpk", reference)


@pytest.mark.parametrize("output", ["back.pt", "back.pth", "pytorch_model.bin"])
def test_a_pytorch_output_is_a_usage_error(tmp_path: Path, output: str) -> None:
    source = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(2)}, source)
    assert_one_line_error(run_cli("convert", source, "-o", tmp_path / output), 2, "syncd writes no pickles")
    assert dir_listing(tmp_path) == ["model.safetensors"]


@pytest.mark.slow
def test_a_model_with_an_optimizers_state_has_room_for_its_storages(tmp_path: Path) -> None:
    """60,000 parameters saved with Adam's state make 240,000 storages, each an entry of the zip: refused as
    more entries than a checkpoint may have (200,064). Read now (this one holds no tensor, which is what is
    said, not the number of its entries)."""
    import zipfile as zf

    path = tmp_path / "adam.pt"
    with zf.ZipFile(path, "w", zf.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", pickle.dumps({"step": 1}, protocol=2))
        archive.writestr("archive/byteorder", "little")
        archive.writestr("archive/version", "3\n")
        for i in range(240_004):
            archive.writestr(f"archive/data/{i}", b"")
    with pytest.raises(FormatError, match="holds no tensors under string keys"):
        open_checkpoint(path)


def test_a_string_made_four_times_larger_by_one_wide_character_is_priced_at_that_width(tmp_path: Path) -> None:
    """40 MiB of ASCII after one emoji is 160 MiB as a str: a 95 MB `.pt` of such text took 563 MiB (two at
    once pass the unit's MemoryMax). Refused past the budget; the same text without the emoji is read."""
    for emoji in ("", "\N{GRINNING FACE}"):
        path = tmp_path / f"note{len(emoji)}.pt"
        torch.save({"note": emoji + "x" * (40 << 20), "w": torch.zeros(2)}, path)
        if not emoji:
            with open_checkpoint(path) as reader:
                assert [t.name for t in reader.tensors] == ["w"]
            continue
        with pytest.raises(FormatError, match="builds more than 128 MiB of objects"):
            open_checkpoint(path)
