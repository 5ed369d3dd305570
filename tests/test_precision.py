"""Precision: which tensors are cast (HalfPrecisionAdapter's module kinds) and the casts, checked against torch."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from syncd.adapters import TensorRef, plan_conversion
from syncd.adapters.precision import HALF_KINDS, plan_casts
from syncd.engine.cast import cast_chunk
from syncd.errors import UnsupportedError

pytestmark = pytest.mark.torch


def special_values() -> np.ndarray:
    rng = np.random.default_rng(0)
    values = np.concatenate(
        [
            rng.standard_normal(10_000).astype(np.float32) * 10,
            np.array(
                [
                    0.0,
                    -0.0,
                    np.inf,
                    -np.inf,
                    np.nan,
                    1e-8,
                    -1e-8,
                    6e-5,
                    65504.0,
                    65519.0,
                    3.38e38,
                    1.0 + 2**-8,
                    1.0 + 3 * 2**-8,
                    1.0 + 2**-9,
                ],
                dtype=np.float32,
            ),
            np.frombuffer(rng.bytes(4000), dtype=np.float32),  # every bit pattern class, NaNs included
        ]
    )
    return values[~(np.abs(values) > 65504) | ~np.isfinite(values)]  # what F16 can hold (or inf/nan)


@pytest.mark.parametrize(("dtype", "torch_dtype"), [("F16", torch.float16), ("BF16", torch.bfloat16)])
def test_casts_down_as_torch_rounds(dtype: str, torch_dtype: torch.dtype) -> None:
    values = special_values()
    ours = cast_chunk(values.tobytes(), "F32", dtype, "t")
    theirs = torch.from_numpy(values.copy()).to(torch_dtype).view(torch.int16).numpy().tobytes()
    ours_bits, theirs_bits = np.frombuffer(ours, "<u2"), np.frombuffer(theirs, "<u2")
    nan = np.isnan(values)
    assert np.array_equal(ours_bits[~nan], theirs_bits[~nan])
    back = np.frombuffer(cast_chunk(ours, dtype, "F32", "t"), "<f4")
    assert np.isnan(back[nan]).all()
    expected = torch.frombuffer(bytearray(ours), dtype=torch_dtype).float().numpy()
    assert np.array_equal(back[~nan], expected[~nan])  # widening is exact


def test_a_signaling_nan_is_quieted_as_half_and_torch_do() -> None:
    """numpy keeps a signaling NaN signaling when it narrows to F16 (0x7f800001 -> 0x7c01), and widening one
    back; Burn's `half` sets the quiet bit and keeps the top of the payload, as torch does narrowing
    (torch makes every NaN 0x7fffffff widening: `half`'s rule is Burn's, the one followed)."""
    narrow = np.array([0x7F800001, 0x7FA00000, 0xFF800001, 0x7F80E000, 0x7FC00000, 0x3F800000], dtype="<u4")
    ours = np.frombuffer(cast_chunk(narrow.tobytes(), "F32", "F16", "t"), "<u2")
    theirs = torch.from_numpy(narrow.view(np.float32).copy()).half().view(torch.int16).numpy().view("<u2")
    assert (
        [hex(v) for v in ours]
        == [hex(v) for v in theirs]
        == ["0x7e00", "0x7f00", "0xfe00", "0x7e07", "0x7e00", "0x3c00"]
    )
    wide = np.frombuffer(
        cast_chunk(np.array([0x7C01, 0xFD00, 0x7E00, 0x3C00], "<u2").tobytes(), "F16", "F32", "t"), "<u4"
    )
    assert [hex(v) for v in wide] == ["0x7fc02000", "0xffe00000", "0x7fc00000", "0x3f800000"]


@pytest.mark.parametrize(("dtype", "value"), [("F16", 70000.0), ("F16", -1e6), ("BF16", 3.4e38)])
def test_overflow_is_refused_naming_the_tensor(dtype: str, value: float) -> None:
    data = np.array([1.0, value, 2.0], dtype=np.float32).tobytes()
    expected = re.escape(f"tensor 'blocks.0.w' holds {abs(value):g}, beyond {dtype}")
    with pytest.raises(UnsupportedError, match=expected) as info:
        cast_chunk(data, "F32", dtype, "blocks.0.w", "m.safetensors")
    assert str(info.value).startswith("m.safetensors: ") and "\n" not in str(info.value)


def test_infinities_are_not_overflow() -> None:
    data = np.array([np.inf, -np.inf], dtype=np.float32).tobytes()
    assert np.isinf(np.frombuffer(cast_chunk(data, "F32", "F16", "t"), "<f2")).all()


def table() -> list[TensorRef]:
    f32 = "F32"
    return [
        TensorRef("emb.weight", f32, (10, 4)),
        TensorRef("fc.weight", f32, (3, 4)),
        TensorRef("fc.bias", f32, (3,)),
        TensorRef("ln.weight", f32, (4,)),
        TensorRef("ln.bias", f32, (4,)),
        TensorRef("bn.weight", f32, (4,)),
        TensorRef("bn.bias", f32, (4,)),
        TensorRef("bn.running_mean", f32, (4,)),
        TensorRef("bn.running_var", f32, (4,)),
        TensorRef("bn.num_batches_tracked", "I64", ()),
        TensorRef("conv.weight", f32, (2, 3, 3, 3)),
        TensorRef("rope.inv_freq", f32, (4,)),
        TensorRef("fc2.weight", "F64", (3, 4)),
        TensorRef("fc2.bias", "F64", (3,)),
    ]


def test_casts_follow_half_precision_adapters_kinds() -> None:
    from syncd.adapters import ModuleMap

    modules = ModuleMap.from_dict({"modules": {"emb": "Embedding"}}, source="test")
    plan = plan_conversion(table(), to_layout="burn", source_layout="pytorch", module_map=modules)
    casts = plan_casts(table(), plan.kinds, "f16")
    # BatchNorm (running_var underflows), a parameter-free buffer's module, F64 and integers stay as they are
    assert casts == {
        name: "F16" for name in ("emb.weight", "fc.weight", "fc.bias", "ln.weight", "ln.bias", "conv.weight")
    }
    assert set(plan_casts(table(), plan.kinds, "bf16").values()) == {"BF16"}
    assert "BatchNorm" not in HALF_KINDS


def test_gpt2_conv1d_is_cast_as_the_linear_it_is_in_burn() -> None:
    """transformers' Conv1D stores its weight [in, out] as Burn's Linear does; in Burn it is a Linear, which
    HalfPrecisionAdapter casts (a GPT-2 came out with every attention and MLP weight still F32)."""
    conv1d = [
        TensorRef("h.0.mlp.c_fc.weight", "F32", (8, 32)),
        TensorRef("h.0.mlp.c_fc.bias", "F32", (32,)),
        TensorRef("h.0.mlp.fc.weight", "F32", (32, 8)),
        TensorRef("h.0.mlp.fc.bias", "F32", (32,)),
    ]
    plan = plan_conversion(conv1d, to_layout="burn", source_layout="pytorch")
    assert plan.kinds["h.0.mlp.c_fc"] == "LinearInOut"
    assert plan_casts(conv1d, plan.kinds, "f16") == {t.name: "F16" for t in conv1d}
    half = [TensorRef(t.name, "F16", t.shape) for t in conv1d]
    assert plan_casts(half, plan.kinds, "f32") == {t.name: "F32" for t in conv1d}


def test_f32_restores_only_half_tensors() -> None:
    half = [
        TensorRef("fc.weight", "F16", (3, 4)),
        TensorRef("fc.bias", "BF16", (3,)),
        TensorRef("bn.running_var", "F16", (3,)),
    ]
    kinds = {"fc": "Linear", "bn": "BatchNorm"}
    assert plan_casts(half, kinds, "f32") == {"fc.weight": "F32", "fc.bias": "F32"}
    with pytest.raises(ValueError, match="not one of f16, bf16, f32"):
        plan_casts(half, kinds, "f8")


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize(("dtype", "torch_dtype"), [("F16", torch.float16), ("BF16", torch.bfloat16)])
def test_cast_copy_writes_and_verifies_a_real_file(
    tmp_path, monkeypatch: pytest.MonkeyPatch, transpose: bool, dtype: str, torch_dtype: torch.dtype
) -> None:
    import os

    from safetensors.torch import load_file, save_file

    from syncd.engine import cast
    from syncd.errors import VerificationError
    from syncd.formats.safetensors import SafetensorsReader, write_safetensors
    from syncd.formats.table import TensorSpec

    monkeypatch.setattr(cast, "CHUNK_BYTES", 1000)  # many strips, a partial last one
    weight = torch.randn(37, 23)
    save_file({"fc.weight": weight}, tmp_path / "in.safetensors")
    out_path = tmp_path / "out.safetensors"
    with SafetensorsReader(tmp_path / "in.safetensors") as reader:
        copy = cast.CastCopy(reader, "fc.weight", "F32", dtype, transpose)
        shape = (23, 37) if transpose else (37, 23)
        spec = TensorSpec("fc.weight", dtype, shape, 37 * 23 * 2, copy.fill)
        fd = os.open(out_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            write_safetensors(fd, [spec])
        finally:
            os.close(fd)
        with SafetensorsReader(out_path) as output:
            copy.verify(output, "fc.weight")
        expected = (weight.T if transpose else weight).contiguous().to(torch_dtype)
        assert torch.equal(load_file(out_path)["fc.weight"], expected)
        # a flipped byte in the output is caught
        data = bytearray(out_path.read_bytes())
        data[-3] ^= 0x40
        out_path.write_bytes(bytes(data))
        with SafetensorsReader(out_path) as output, pytest.raises(VerificationError, match="cast source"):
            copy.verify(output, "fc.weight")
