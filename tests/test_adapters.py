"""Layout adapters on real tensor tables: the shared fixture/corpus headers and real torch state_dicts.

The headers are read here with a few lines of struct/json/cbor2 (not the project's format readers) so that
these tests stand on their own.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import cbor2
import pytest
import torch
import yaml
from conftest import CORPUS, FIXTURES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from syncd.adapters import (
    AdapterPlan,
    FileContext,
    LayoutAmbiguityError,
    ModuleMap,
    TensorRef,
    apply_plan,
    plan_conversion,
)
from syncd.adapters.plan import _index_template, _index_templates, collapse_by_index
from syncd.errors import AmbiguousLayoutError, ConfigError, SyncdError, UnsupportedError, UsageError
from syncd.formats.dtypes import SAFETENSORS_TO_DTYPE

pytestmark = pytest.mark.torch

# ---------------------------------------------------------------------------------------------------------
# tables from real files and real modules


def safetensors_table(path: Path) -> list[TensorRef]:
    """8-byte LE header length, JSON header; tensors in data order."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    header.pop("__metadata__", None)
    ordered = sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])
    return [TensorRef(name, SAFETENSORS_TO_DTYPE[d["dtype"]], tuple(d["shape"])) for name, d in ordered]


def burnpack_table(path: Path) -> list[TensorRef]:
    """10-byte header (magic, version, metadata size), CBOR metadata; tensors in data order."""
    data = path.read_bytes()
    magic, _version, size = struct.unpack("<IHI", data[:10])
    assert magic == 0x4255524E
    tensors = cbor2.loads(data[10 : 10 + size])["tensors"]
    ordered = sorted(tensors.items(), key=lambda item: item[1]["data_offsets"][0])
    return [TensorRef(name, _burn_dtype(d["dtype"]), tuple(d["shape"])) for name, d in ordered]


def _burn_dtype(raw: object) -> str:
    if isinstance(raw, dict):  # {"Bool": "U8"} and the like (docs/burn-format.md#dtypes)
        ((variant, store),) = raw.items()
        return f"{variant}({store})"
    return str(raw)


def file_table(path: Path) -> list[TensorRef]:
    return burnpack_table(path) if path.suffix == ".bpk" else safetensors_table(path)


_TORCH_DTYPES = {torch.float32: "F32", torch.int64: "I64", torch.float16: "F16", torch.bfloat16: "BF16"}


def torch_table(module: nn.Module) -> list[TensorRef]:
    return [TensorRef(k, _TORCH_DTYPES[v.dtype], tuple(v.shape)) for k, v in module.state_dict().items()]


def shapes_of(tensors: list[TensorRef]) -> dict[str, tuple[int, ...]]:
    return {t.name: t.shape for t in tensors}


def renamed(plan: AdapterPlan) -> dict[str, str]:
    return {e.source: e.target for e in plan.entries if e.source != e.target}


def transposed(plan: AdapterPlan) -> set[str]:
    return {e.source for e in plan.entries if e.transpose}


def map_of(**kinds: str) -> ModuleMap:
    return ModuleMap.from_dict({"modules": {path.replace("__", "."): kind for path, kind in kinds.items()}})


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)


class Cnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 26 * 26, 10)


class Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.query, self.key, self.value, self.output = (nn.Linear(d, d) for _ in range(4))


class Block(nn.Module):
    """A transformer-ish block holding every module kind that names alone cannot settle."""

    def __init__(self, vocab: int = 50, d: int = 16) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d)
        self.norm = nn.LayerNorm(d)
        self.attn = Attention(d)
        self.ff = nn.Module()
        self.ff.up = nn.Linear(d, 4 * d, bias=False)
        self.ff.down = nn.Linear(4 * d, d, bias=False)
        self.act = nn.PReLU()
        self.gn = nn.GroupNorm(4, d)
        self.inorm = nn.InstanceNorm2d(d, affine=True)
        self.rms = nn.RMSNorm(d)


BLOCK_MAP = """
modules:
  "tok_emb": Embedding
  "ff.*": Linear
  "act": PReLU
  "rms": RmsNorm
"""


# ---------------------------------------------------------------------------------------------------------
# the fixtures named in fixtures/README.md


def test_mnist_web_bpk_to_pytorch_transposes_linears_and_renames_norms() -> None:
    source = burnpack_table(FIXTURES / "burn" / "mnist_web.bpk")
    plan = plan_conversion(source, to_layout="pytorch")

    assert (plan.source_layout, plan.target_layout) == ("burn", "pytorch")
    assert transposed(plan) == {"fc1.weight", "fc2.weight", "fc3.weight"}  # fc2 is square: follows the file
    assert renamed(plan) == {
        f"conv{i}.norm.{burn}": f"conv{i}.norm.{torch_name}"
        for i in (1, 2)
        for burn, torch_name in (("gamma", "weight"), ("beta", "bias"))
    }
    out = shapes_of(apply_plan(source, plan))
    assert out["fc1.weight"] == (128, 1600) and out["fc3.weight"] == (10, 128)
    assert out["conv1.norm.running_mean"] == (64,) and out["conv2.conv.weight"] == (64, 64, 3, 3)
    assert plan.dropped == []
    assert [e.source for e in plan.entries] == [t.name for t in source]  # data order kept
    assert plan.kinds["conv1.norm"] == "BatchNorm" and plan.kinds["fc2"] == "Linear"
    assert any("fc1: Linear (bias [128] matches dim 1 -> burn layout)" in line for line in plan.decisions)
    # going to PyTorch the BatchNorm counter is not invented, only reported
    assert not any(name.endswith("num_batches_tracked") for name in out)
    assert any("num_batches_tracked" in line and "starts it at 0" in line for line in plan.decisions)


def test_pytorch_mnist_to_burn_gives_exactly_the_burn_names_of_the_readme() -> None:
    source = safetensors_table(FIXTURES / "pytorch" / "mnist.safetensors")
    plan = plan_conversion(source, to_layout="burn")

    source_shapes = shapes_of(source)
    expected = {f"conv{i}.{leaf}": source_shapes[f"conv{i}.{leaf}"] for i in (1, 2, 3) for leaf in ("weight", "bias")}
    expected |= {"fc1.weight": (11616, 32), "fc1.bias": (32,), "fc2.weight": (32, 10), "fc2.bias": (10,)}
    for norm, channels in (("norm1", 24), ("norm2", 10)):
        expected |= {f"{norm}.{leaf}": (channels,) for leaf in ("gamma", "beta", "running_mean", "running_var")}
    assert shapes_of(apply_plan(source, plan)) == expected
    assert plan.dropped == ["norm1.num_batches_tracked", "norm2.num_batches_tracked"]
    assert plan.source_layout == "pytorch"
    assert transposed(plan) == {"fc1.weight", "fc2.weight"}


def test_pytorch_multi_layer_to_burn() -> None:
    source = safetensors_table(FIXTURES / "pytorch" / "multi_layer.safetensors")
    out = shapes_of(apply_plan(source, plan := plan_conversion(source, to_layout="burn")))
    assert out["fc1.weight"] == (256, 16)
    assert {"norm1.gamma", "norm1.beta"} <= set(out) and "norm1.weight" not in out
    assert plan.dropped == ["norm1.num_batches_tracked"]


@pytest.mark.parametrize(
    ("path", "back"),
    [("burn/mnist_web.bpk", "burn"), ("pytorch/mnist.safetensors", "pytorch")],
)
def test_fixture_round_trip_restores_names_and_shapes(path: str, back: str) -> None:
    source = file_table(FIXTURES / path)
    there = plan_conversion(source, to_layout="pytorch" if back == "burn" else "burn")
    returned = apply_plan(apply_plan(source, there), plan_conversion(apply_plan(source, there), to_layout=back))
    assert returned == [t for t in source if t.name not in there.dropped]


def test_keep_is_the_identity() -> None:
    source = safetensors_table(FIXTURES / "pytorch" / "mnist.safetensors")
    plan = plan_conversion(source, to_layout="keep")
    assert plan.is_identity and plan.dropped == [] and plan.source_layout == "keep"
    assert apply_plan(source, plan) == source


def test_converting_to_the_layout_the_file_is_in_is_the_identity() -> None:
    source = burnpack_table(FIXTURES / "burn" / "mnist_web.bpk")
    plan = plan_conversion(source, to_layout="burn")
    assert plan.is_identity and plan.source_layout == "burn"
    assert any("already in burn layout" in line for line in plan.decisions)


# ---------------------------------------------------------------------------------------------------------
# real torch modules


def test_torch_mlp_to_burn() -> None:
    plan = plan_conversion(torch_table(Mlp()), to_layout="burn")
    assert shapes_of(apply_plan(torch_table(Mlp()), plan)) == {
        "fc1.weight": (4, 8),
        "fc1.bias": (8,),
        "fc2.weight": (8, 3),
        "fc2.bias": (3,),
    }
    assert "fc1: Linear (bias [8] matches dim 0 -> pytorch layout) -> transpose weight [8, 4] -> [4, 8]" in (
        plan.decisions
    )


def test_torch_cnn_with_batchnorm_to_burn_and_back() -> None:
    source = torch_table(Cnn())
    plan = plan_conversion(source, to_layout="burn")
    burn = apply_plan(source, plan)
    assert plan.dropped == ["bn.num_batches_tracked"]
    assert {"bn.gamma", "bn.beta", "bn.running_mean", "bn.running_var"} <= set(shapes_of(burn))
    assert plan.kinds == {"conv": "Conv", "bn": "BatchNorm", "head": "Linear"}
    back = plan_conversion(burn, to_layout="pytorch")
    assert [t.name for t in apply_plan(burn, back)] == [t.name for t in source if t.name != "bn.num_batches_tracked"]


def test_transformer_block_refuses_with_a_suggestion_that_settles_it() -> None:
    source = torch_table(Block())
    with pytest.raises(AmbiguousLayoutError) as caught:
        plan_conversion(source, to_layout="burn")
    error = caught.value
    assert "\n" not in str(error)
    # the names settle tok_emb (Embedding), act (PRelu) and rms (a norm); ff.up / ff.down say nothing
    assert str(error).startswith("cannot convert to burn layout: the tensors do not decide what 2 module(s) are")
    assert yaml.safe_load(error.suggestion)["modules"] == {"**.up": "Linear", "**.down": "Linear"}
    assert set(error.undecided) == {"ff.up", "ff.down"}
    assert "ff.up: 2-D weight [64, 16] without bias" in error.details
    # The suggestion is a valid module map; with it the block converts.
    plan = plan_conversion(source, to_layout="burn", module_map=ModuleMap.from_yaml_text(error.suggestion))
    assert plan.source_layout == "pytorch"
    assert plan.kinds["tok_emb"] == "Embedding" and plan.kinds["act"] == "PRelu" and plan.kinds["rms"] == "RmsNorm"
    assert any(
        line.startswith("tok_emb: Embedding (2-D weight [50, 16] without bias, named '*_emb')")
        for line in plan.decisions
    )


def test_transformer_block_to_burn_with_a_module_map() -> None:
    source = torch_table(Block())
    plan = plan_conversion(source, to_layout="burn", module_map=ModuleMap.from_yaml_text(BLOCK_MAP))
    out = shapes_of(apply_plan(source, plan))
    # square q/k/v/output projections follow the layout the LayerNorm/GroupNorm names show
    assert {f"attn.{p}.weight" for p in ("query", "key", "value", "output")} <= transposed(plan)
    assert {"ff.up.weight", "ff.down.weight"} <= transposed(plan) and out["ff.up.weight"] == (16, 64)
    assert out["tok_emb.weight"] == (50, 16) and "tok_emb.weight" not in transposed(plan)
    assert renamed(plan) == {
        "norm.weight": "norm.gamma",
        "norm.bias": "norm.beta",
        "act.weight": "act.alpha",  # Burn's own adapter leaves PRelu alone; Burn calls it alpha
        "gn.weight": "gn.gamma",
        "gn.bias": "gn.beta",
        "inorm.weight": "inorm.gamma",  # Burn's adapter skips InstanceNorm; we rename it
        "inorm.bias": "inorm.beta",
        "rms.weight": "rms.gamma",
    }
    assert plan.kinds["act"] == "PRelu" and plan.kinds["inorm"] == "Norm" and plan.kinds["ff.up"] == "Linear"
    # and back: the same map (kinds do not depend on the side) restores every name and shape
    burn = apply_plan(source, plan)
    back = plan_conversion(burn, to_layout="pytorch", module_map=ModuleMap.from_yaml_text(BLOCK_MAP))
    assert back.source_layout == "burn" and apply_plan(burn, back) == source


def test_square_linears_alone_need_the_layout() -> None:
    source = torch_table(Attention(8))
    with pytest.raises(AmbiguousLayoutError) as caught:
        plan_conversion(source, to_layout="burn")
    message = str(caught.value)
    assert "--layout pytorch|burn" in message and "query.weight [8, 8]" in message and "\n" not in message
    assert "layout: pytorch" in caught.value.suggestion

    stated = plan_conversion(source, to_layout="burn", source_layout="pytorch")
    assert transposed(stated) == {f"{p}.weight" for p in ("query", "key", "value", "output")}
    assert plan_conversion(source, to_layout="burn", source_layout="burn").is_identity
    from_map = plan_conversion(source, to_layout="burn", module_map=ModuleMap.from_dict({"layout": "pytorch"}))
    assert transposed(from_map) == transposed(stated)
    assert "pytorch (--layout)" in stated.decisions[0]


def test_lone_weights_pass_when_the_source_is_already_in_the_target_layout() -> None:
    # The LayerNorm shows pytorch layout; going to pytorch nothing depends on the undecided kinds.
    plan = plan_conversion(torch_table(Block()), to_layout="pytorch")
    assert plan.is_identity and plan.kinds["ff.up"] == "Unknown"


def test_instance_norm_with_running_stats_drops_them_going_to_burn() -> None:
    model = nn.Sequential(nn.Conv2d(3, 6, 3), nn.InstanceNorm2d(6, affine=True, track_running_stats=True))
    source = torch_table(model)
    # unmapped, running stats look like a BatchNorm; the map says what it is
    unmapped = plan_conversion(source, to_layout="burn")
    assert unmapped.kinds["1"] == "BatchNorm"
    assert any("InstanceNorm tracking them: map it so" in line for line in unmapped.decisions), unmapped.decisions
    plan = plan_conversion(source, to_layout="burn", module_map=ModuleMap.from_dict({"modules": {1: "InstanceNorm2d"}}))
    assert plan.dropped == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    assert renamed(plan) == {"1.weight": "1.gamma", "1.bias": "1.beta"}


def bert_like(norm: str, layout: str) -> list[TensorRef]:
    """A dense layer [32 -> 48] with its bias and a norm over 48 named gamma/beta, in `layout`."""
    weight = (48, 32) if layout == "pytorch" else (32, 48)
    return [
        TensorRef("enc.dense.weight", "F32", weight),
        TensorRef("enc.dense.bias", "F32", (48,)),
        TensorRef(f"enc.{norm}.gamma", "F32", (48,)),
        TensorRef(f"enc.{norm}.beta", "F32", (48,)),
    ]


def test_gamma_and_beta_of_a_module_named_LayerNorm_show_no_layout() -> None:
    """transformers' BERT-era PyTorch files spell them so (and save_pretrained writes ESM's so): the file's
    other evidence decides, and going to Burn the names are already Burn's."""
    to_burn = plan_conversion(bert_like("LayerNorm", "pytorch"), to_layout="burn")
    assert to_burn.source_layout == "pytorch"
    assert transposed(to_burn) == {"enc.dense.weight"} and renamed(to_burn) == {}
    to_pytorch = plan_conversion(bert_like("LayerNorm", "burn"), to_layout="pytorch")
    assert to_pytorch.source_layout == "burn" and transposed(to_pytorch) == {"enc.dense.weight"}
    names = {"enc.LayerNorm.gamma": "enc.LayerNorm.weight", "enc.LayerNorm.beta": "enc.LayerNorm.bias"}
    assert renamed(to_pytorch) == names


def test_gamma_and_beta_of_a_norm_named_otherwise_still_show_burn_layout() -> None:
    with pytest.raises(AmbiguousLayoutError, match=r"pytorch from enc.dense; burn from enc.norm\)"):
        plan_conversion(bert_like("norm", "pytorch"), to_layout="burn")


def test_modules_differing_in_their_indices_and_decided_alike_share_one_decision_line() -> None:
    linear, norm = "Linear (shapes) -> transpose", "RmsNorm (names) -> rename weight->gamma"
    lines = [("embed", "Embedding -> unchanged")]
    lines += [(f"layers.{i}.q", linear) for i in (0, 1, 10, 11, 2, 3, 5)]  # in name order, as planned
    lines += [(f"layers.{i}.norm", norm) for i in range(3)] + [("layers.4.q", "Linear (module map) -> transpose")]
    lines += [("head.0", linear), ("blocks.0.1.conv", linear), ("blocks.0.2.conv", linear), ("v.01", linear)]
    lines += [(f"moe.{i}.experts.{j}.w1", linear) for i in range(2) for j in range(8)]
    lines += [("odd.0.e.0", linear), ("odd.1.e.1", linear), ("a.{}.b", linear), ("c.{x}", linear)]
    assert collapse_by_index(lines) == [
        "embed: Embedding -> unchanged",
        f"layers.{{0..3,5,10,11}}.q: {linear}",  # runs of three or more as ranges
        f"layers.{{0..2}}.norm: {norm}",
        "layers.4.q: Linear (module map) -> transpose",  # decided otherwise: a line of its own
        f"head.0: {linear}",  # alone in its group: as it was
        f"blocks.0.{{1,2}}.conv: {linear}",
        f"v.01: {linear}",  # a leading zero: a name, not an index
        f"moe.{{0,1}}.experts.{{0..7}}.w1: {linear}",  # every combination is a module
        f"odd.0.e.0: {linear}",  # {0,1} x {0,1} would claim two modules that are not there
        f"odd.1.e.1: {linear}",
        f"a.{{}}.b: {linear}",  # braces of its own: as it is
        f"c.{{x}}: {linear}",
    ]
    assert collapse_by_index([("a.0", "x"), ("a.1", "x")]) == ["a.{0,1}: x"]


def test_index_templates_of_many_labels_read_as_each_label_alone() -> None:
    # the segments of all labels are read at once; every label comes out as _index_template reads it alone
    labels = ["a.0", "0", "", ".", "a..1", "b.01.2", "c.²", "d.10.e.3", "x.3y", "007", "0.0", "f.", ".9"]
    assert _index_templates(labels) == [_index_template(label) for label in labels]
    for odd in (["a.1", "b\n.2"], ["a.1", "b.{}.2"], ["a.}.1"], []):  # taken one by one
        assert _index_templates(odd) == [_index_template(label) for label in odd]
    assert collapse_by_index([("a.0\nb.1", "x"), ("a.0", "x"), ("a.1", "x")]) == ["a.0\nb.1: x", "a.{0,1}: x"]


# ---------------------------------------------------------------------------------------------------------
# conflicts, contradictions, refusals


def test_conflicting_layout_names_are_refused_listing_both_sides() -> None:
    # a PyTorch file and a Burn file glued together: their norm names show both layouts
    burn = [TensorRef(f"burn.{t.name}", t.dtype, t.shape) for t in burnpack_table(FIXTURES / "burn" / "mnist_web.bpk")]
    mixed = safetensors_table(FIXTURES / "pytorch" / "mnist.safetensors") + burn
    with pytest.raises(AmbiguousLayoutError) as caught:
        plan_conversion(mixed, to_layout="burn")
    message = str(caught.value)
    assert message.startswith("conflicting layout evidence (pytorch from norm1, norm2; burn from burn.conv1.norm")
    assert "\n" not in message
    assert '"burn.conv1.norm": Other' in caught.value.suggestion
    assert "burn.conv1.norm: burn (gamma/beta names)" in caught.value.details
    # mapping the odd modules as Other settles the layout: they pass through untouched; the Burn Linears are
    # then [in, out] layers of a pytorch file, kept, except the square one, which nothing decides
    first = yaml.safe_load(caught.value.suggestion)["modules"]
    with pytest.raises(AmbiguousLayoutError) as again:
        plan_conversion(mixed, to_layout="burn", module_map=ModuleMap.from_dict({"modules": first}))
    assert again.value.undecided == ["burn.fc2"]
    both = {**first, **yaml.safe_load(again.value.suggestion)["modules"]}
    settled = plan_conversion(mixed, to_layout="burn", module_map=ModuleMap.from_dict({"modules": both}))
    assert settled.kinds["burn.conv1.norm"] == "Other" and settled.kinds["burn.fc1"] == "LinearInOut"
    assert not {"burn.conv1.norm.gamma", "burn.fc1.weight"} & (transposed(settled) | set(renamed(settled)))


def test_names_outrank_a_bias_matching_dim_1() -> None:
    # PyTorch norms beside Linears whose bias matches dim 1: in a pytorch-layout file those are [in, out]
    # (transformers' Conv1D, or Burn-layout layers), which Burn keeps as they are: never transposed.
    mixed = safetensors_table(FIXTURES / "pytorch" / "mnist.safetensors") + burnpack_table(
        CORPUS / "bpk" / "ldos-project_asterinas__mlp_weights.bpk"
    )
    plan = plan_conversion(mixed, to_layout="burn")
    assert plan.source_layout == "pytorch" and plan.kinds["model.0"] == "LinearInOut"
    assert not {"model.0.weight", "model.2.weight", "model.4.weight"} & transposed(plan)
    assert transposed(plan) == {"fc1.weight", "fc2.weight"}
    assert plan.decisions[0] == "source layout: pytorch (shown by names of norm1, norm2)"
    back = plan_conversion(
        apply_plan(mixed, plan),
        to_layout="pytorch",
        context=FileContext(recorded_layout="burn", recorded_kinds=plan.kinds),
    )
    assert apply_plan(apply_plan(mixed, plan), back) == [t for t in mixed if t.name not in plan.dropped]


def test_a_stated_layout_that_the_tensors_contradict_is_refused() -> None:
    source = safetensors_table(FIXTURES / "pytorch" / "mnist.safetensors")
    with pytest.raises(AmbiguousLayoutError, match=r"source layout burn \(--layout\) contradicts the tensors: norm1"):
        plan_conversion(source, to_layout="pytorch", source_layout="burn")
    with pytest.raises(AmbiguousLayoutError, match=r"layout: in .*contradicts"):
        plan_conversion(source, to_layout="burn", module_map=ModuleMap.from_dict({"layout": "burn"}))


def test_packed_pytorch_tensors_are_split_going_to_burn_and_joined_coming_back() -> None:
    model = nn.Module()
    model.attn = nn.MultiheadAttention(8, 2)
    model.rnn = nn.LSTM(4, 3)
    source = torch_table(model)
    plan = plan_conversion(source, to_layout="burn")
    pieces = {e.target: (e.source, e.rows, e.transpose, e.shape) for e in plan.entries}
    assert pieces["attn.key.weight"] == ("attn.in_proj_weight", (8, 16), True, (8, 8))
    assert pieces["attn.value.bias"] == ("attn.in_proj_bias", (16, 24), False, (8,))
    assert pieces["attn.output.weight"] == ("attn.out_proj.weight", None, True, (8, 8))
    assert pieces["rnn.cell_gate.input_transform.weight"] == ("rnn.weight_ih_l0", (6, 9), True, (4, 3))
    assert pieces["rnn.output_gate.hidden_transform.bias"] == ("rnn.bias_hh_l0", (9, 12), False, (3,))
    assert plan.kinds["attn"] == "MultiHeadAttention" and plan.kinds["rnn"] == "Lstm"
    back = plan_conversion(
        apply_plan(source, plan),
        to_layout="pytorch",
        context=FileContext(recorded_layout="burn", recorded_kinds=plan.kinds),
    )
    assert apply_plan(apply_plan(source, plan), back) == source
    assert plan_conversion(source, to_layout="pytorch").is_identity  # packed names show pytorch layout
    assert plan_conversion(source, to_layout="keep").is_identity


def test_transposing_an_opaque_dtype_is_unsupported() -> None:
    source = [
        TensorRef(t.name, "QFloat", t.shape) if t.name == "fc1.weight" else t
        for t in burnpack_table(FIXTURES / "burn" / "mnist_web.bpk")
    ]
    with pytest.raises(UnsupportedError, match="cannot transpose a QFloat tensor"):
        plan_conversion(source, to_layout="pytorch")
    assert plan_conversion(source, to_layout="burn").is_identity


@pytest.mark.parametrize("to_layout", ["keep", "burn"])
def test_duplicate_names_are_refused(to_layout: str) -> None:
    source = torch_table(Mlp())
    with pytest.raises(SyncdError, match="duplicate tensor names in the source: fc1.bias"):
        plan_conversion([*source, source[1]], to_layout=to_layout)


def test_unknown_layout_names_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="unknown target layout 'onnx'"):
        plan_conversion([], to_layout="onnx")
    with pytest.raises(UsageError, match="unknown source layout 'keep'"):
        plan_conversion([], to_layout="burn", source_layout="keep")


def test_a_map_that_does_not_fit_the_tensors_is_a_config_error() -> None:
    source = safetensors_table(FIXTURES / "pytorch" / "mnist.safetensors")
    with pytest.raises(ConfigError, match=r"modules.'conv\*': maps 'conv1' to Linear, which needs a rank-2 weight"):
        plan_conversion(source, to_layout="burn", module_map=map_of(**{"conv*": "Linear"}))
    with pytest.raises(ConfigError, match=r"maps 'norm1' to LayerNorm, but it has norm1.num_batches_tracked"):
        plan_conversion(source, to_layout="burn", module_map=map_of(norm1="LayerNorm"))


# ---------------------------------------------------------------------------------------------------------
# the module map itself


def test_module_map_globs_work_segment_by_segment() -> None:
    mm = ModuleMap.from_yaml_text(
        """
        modules:
          "encoder.layers.*.attn.query": Linear
          "**.norm": LayerNorm
          "blocks.[!0].proj": Linear
          "x?": Embedding
        """
    )
    kind = {
        p: (r.kind if (r := mm.lookup(p)) else None)
        for p in (
            "encoder.layers.3.attn.query",
            "encoder.layers.3.4.attn.query",
            "norm",
            "a.b.norm",
            "a.norm.x",
            "blocks.1.proj",
            "blocks.0.proj",
            "xy",
            "x.y",
        )
    }
    assert kind == {
        "encoder.layers.3.attn.query": "Linear",
        "encoder.layers.3.4.attn.query": None,  # '*' does not cross a '.'
        "norm": "LayerNorm",  # '**' may stand for zero segments
        "a.b.norm": "LayerNorm",
        "a.norm.x": None,
        "blocks.1.proj": "Linear",
        "blocks.0.proj": None,
        "xy": "Embedding",
        "x.y": None,
    }


def test_module_map_exact_path_beats_globs_then_first_glob_wins() -> None:
    mm = ModuleMap.from_dict(
        {"modules": {"**.norm": "LayerNorm", "final.*": "Other", "final.norm": "RmsNorm", "**": "GroupNorm"}}
    )
    assert mm.lookup("final.norm").kind == "RmsNorm"  # exact wins although listed after two matching globs
    assert mm.lookup("x.norm").kind == "LayerNorm"  # first matching glob
    assert mm.lookup("final.x").kind == "Other"
    assert mm.lookup("whatever").kind == "GroupNorm"


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({"modules": {"fc1": "Lineer"}}, "modules['fc1']: expected a module kind, one of Linear,"),
        ({"modules": {"fc1": 3}}, "modules['fc1']: expected a module kind, one of Linear,"),
        ({"modules": {"a..b": "Linear"}}, "modules['a..b']: empty path segment"),
        ({"modules": ["fc1"]}, "modules: expected a mapping"),
        ({"layout": "tensorflow"}, "layout: expected one of pytorch, burn, got 'tensorflow'"),
        ({"modles": {}}, "unknown key 'modles' in module map"),
        (["fc1"], "a module map must be a mapping"),
    ],
)
def test_module_map_errors_name_the_key(data: object, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        ModuleMap.from_dict(data, source="daemon.yaml: watch[0].module_map")
    assert fragment in str(caught.value)
    assert str(caught.value).startswith("daemon.yaml: watch[0].module_map: ")


def test_module_map_from_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "map.yaml"
    path.write_text(BLOCK_MAP + "layout: PyTorch\n")
    mm = ModuleMap.from_yaml_file(path)
    assert mm.layout == "pytorch" and mm.lookup("ff.up").kind == "Linear" and mm.lookup("act").kind == "PRelu"
    path.write_text("modules: [unclosed\n")
    with pytest.raises(ConfigError) as caught:
        ModuleMap.from_yaml_file(path)
    # one line, as check-config says it: PyYAML's own text is four, with the line copied and a caret
    assert str(caught.value) == f"{path}: invalid YAML at line 2: expected ',' or ']', but got '<stream end>'"
    for text, said in (
        ("modules:\n  a: \x07\n", "invalid YAML: special characters are not allowed: character #x0007 at position 14"),
        (b"modules:\n  a: \xff\n", "not UTF-8 text (invalid start byte at byte 14)"),
    ):
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(ConfigError) as caught:
            ModuleMap.from_yaml_file(path)
        assert str(caught.value) == f"{path}: {said}"
    with pytest.raises(ConfigError, match="cannot read module map"):
        ModuleMap.from_yaml_file(tmp_path / "absent.yaml")


def test_unused_map_patterns_are_reported() -> None:
    source = torch_table(Mlp())
    plan = plan_conversion(source, to_layout="burn", module_map=map_of(fc3="Linear", fc1="Linear"))
    assert "module map: pattern 'fc3' matched no module" in plan.decisions


# ---------------------------------------------------------------------------------------------------------
# every corpus file: plans, or is refused for a stated reason

# One row per corpus file. "plan": the source layout the plan finds and the counts of Transposed, Renamed and
# Dropped tensors; "ambiguous": a fragment of the one-line AmbiguousLayoutError. No corpus file holds what the
# adapters refuse as unsupported (packed MHA/RNN tensors, QFloat Linears: tested above). F8 and other dtypes
# Burn lacks are for the format layer to refuse; to the adapters those files are buffers.
#
# file (after its last '__')               | to      | outcome   | layout / error               | T R D | why
CORPUS_TABLE = """
mlp_weights.bpk                          | pytorch | plan      | burn                         | 3 0 0 | bias == dim 1
model.bpk                                | pytorch | plan      | burn                         | 3 4 0 | gamma/beta norms
model.numpy.safetensors                  | burn    | plan      | neutral                      | 0 0 0 | test data
model.with_metadata.safetensors          | burn    | plan      | neutral                      | 0 0 0 | test data
sharded_model-00005-of-00006.safetensors | burn    | plan      | neutral                      | 0 0 0 | test data
samples_overall.safetensors              | burn    | plan      | neutral                      | 0 0 0 | test data
mnist.safetensors                        | burn    | plan      | pytorch                      | 2 4 2 | = fixture mnist
batch_norm2d.safetensors                 | burn    | plan      | pytorch                      | 0 2 1 | BatchNorm
boolean.safetensors                      | burn    | plan      | neutral                      | 0 0 0 | a buffer
buffer.safetensors                       | burn    | plan      | neutral                      | 0 0 0 | a buffer
complex_nested.safetensors               | burn    | plan      | pytorch                      | 2 6 3 | BN + Linear
conv1d.safetensors                       | burn    | plan      | neutral                      | 0 0 0 | convolutions
conv2d.safetensors                       | burn    | plan      | neutral                      | 0 0 0 | convolutions
embedding.safetensors                    | burn    | plan      | neutral                      | 0 0 0 | named embed
enum_depthwise_false.safetensors         | burn    | plan      | neutral                      | 0 0 0 | convolutions
enum_depthwise_true.safetensors          | burn    | plan      | neutral                      | 0 0 0 | convolutions
group_norm.safetensors                   | burn    | plan      | pytorch                      | 0 2 0 | weight/bias norm
integer.safetensors                      | burn    | plan      | neutral                      | 0 0 0 | a buffer
key_remap.safetensors                    | burn    | plan      | neutral                      | 0 0 0 | convolutions
key_remap_chained.safetensors            | burn    | plan      | pytorch                      | 0 6 3 | BatchNorm
layer_norm.safetensors                   | burn    | plan      | pytorch                      | 0 2 0 | weight/bias norm
linear.safetensors                       | burn    | plan      | pytorch                      | 2 0 0 | fc2 named fc*
linear_with_bias.safetensors             | burn    | plan      | pytorch                      | 1 0 0 | bias == dim 0
missing_module_field.safetensors         | burn    | plan      | neutral                      | 0 0 0 | convolutions
multi_layer.safetensors                  | burn    | plan      | pytorch                      | 1 2 1 | BN + Linear
non_contiguous_indexes.safetensors       | burn    | plan      | neutral                      | 0 0 0 | convolutions
"""


def _parse_corpus_table() -> dict[str, tuple[str, str, str, tuple[int, ...]]]:
    rows = {}
    for line in CORPUS_TABLE.strip().splitlines():
        name, to_layout, outcome, expected, counts, _why = (cell.strip() for cell in line.split("|"))
        (path,) = (p for p in CORPUS.glob("*/*") if p.name.rpartition("__")[2] == name)
        rows[str(path.relative_to(CORPUS))] = (
            to_layout,
            outcome,
            expected,
            tuple(map(int, counts.split()[:3])) if counts != "-" else (),
        )
    return rows


CORPUS_OUTCOMES = _parse_corpus_table()


def test_the_outcome_table_covers_the_whole_corpus() -> None:
    on_disk = {str(p.relative_to(CORPUS)) for p in CORPUS.glob("*/*") if p.suffix in (".bpk", ".safetensors")}
    assert on_disk == set(CORPUS_OUTCOMES)


@pytest.mark.parametrize("name", sorted(CORPUS_OUTCOMES))
def test_corpus_file_plans_or_is_refused_for_a_stated_reason(name: str) -> None:
    to_layout, outcome, expected, counts = CORPUS_OUTCOMES[name]
    source = file_table(CORPUS / name)
    if outcome == "ambiguous":
        with pytest.raises(AmbiguousLayoutError) as caught:
            plan_conversion(source, to_layout=to_layout)
        assert expected in str(caught.value) and "\n" not in str(caught.value)
        assert caught.value.suggestion.startswith("# module map")
        return
    plan = plan_conversion(source, to_layout=to_layout)
    assert plan.source_layout == expected
    assert (len(transposed(plan)), len(renamed(plan)), len(plan.dropped)) == counts
    # and back again: the same names and shapes, less what has no slot on the way
    there = apply_plan(source, plan)
    back = plan_conversion(there, to_layout="burn" if to_layout == "pytorch" else "pytorch")
    assert apply_plan(there, back) == [t for t in source if t.name not in plan.dropped]


@pytest.mark.parametrize(
    ("name", "module", "kind"),
    [
        ("tracel-ai_burn__safetensors-tests__embedding.safetensors", "embed", "Embedding"),
        ("tracel-ai_burn__safetensors-tests__linear.safetensors", "fc2", "Linear"),
    ],
)
def test_names_settle_bias_free_matrices(name: str, module: str, kind: str) -> None:
    source = safetensors_table(CORPUS / "safetensors_py" / name)
    plan = plan_conversion(source, to_layout="burn")
    assert plan.kinds[module] == kind
    assert any(line.startswith(f"{module}: {kind} (2-D weight") and "named" in line for line in plan.decisions)
    if kind == "Linear":  # fc1's bias shows pytorch layout; the bias-free fc2 follows it
        assert transposed(plan) == {"fc1.weight", "fc2.weight"}
        assert shapes_of(apply_plan(source, plan))["fc2.weight"] == (3, 4)
    else:
        assert plan.is_identity


# ---------------------------------------------------------------------------------------------------------
# property: pytorch -> burn -> pytorch is the identity on names and shapes


_dim = st.integers(min_value=1, max_value=12)


@st.composite
def _layer(draw: st.DrawFn, anchor: bool = False) -> tuple[str, list[tuple[str, str, tuple[int, ...]]], str | None]:
    """(kind, [(leaf, dtype, shape)], kind a module map must state or None). Anchors show the layout."""
    choices = ["linear", "batchnorm", "layernorm"]
    if not anchor:
        choices += ["square", "linear_nobias", "embedding", "conv", "prelu", "rmsnorm"]
    kind = draw(st.sampled_from(choices))
    a, b = draw(_dim), draw(_dim)
    if kind == "linear":
        b = b if b != a else a + 1  # non-square: its bias shows the layout
        return kind, [("weight", "F32", (b, a)), ("bias", "F32", (b,))], None
    if kind == "square":
        return kind, [("weight", "F32", (a, a)), ("bias", "F32", (a,))], None
    if kind == "linear_nobias":
        return kind, [("weight", "F32", (b, a))], "Linear"
    if kind == "embedding":
        return kind, [("weight", "F32", (a, b))], "Embedding"
    if kind == "conv":
        return kind, [("weight", "F32", (b, a, 3, 3)), ("bias", "F32", (b,))], None
    if kind == "prelu":
        return kind, [("weight", "F32", (a,))], "PRelu"
    if kind == "rmsnorm":
        return kind, [("weight", "F32", (a,))], "RmsNorm"
    if kind == "layernorm":
        return kind, [("weight", "F32", (a,)), ("bias", "F32", (a,))], None
    stats = [("running_mean", "F32", (a,)), ("running_var", "F32", (a,)), ("num_batches_tracked", "I64", ())]
    return kind, [("weight", "F32", (a,)), ("bias", "F32", (a,)), *stats], None


@st.composite
def pytorch_tables(draw: st.DrawFn) -> tuple[list[TensorRef], dict[str, str]]:
    layers = draw(st.lists(_layer(), max_size=8))
    layers.insert(draw(st.integers(0, len(layers))), draw(_layer(anchor=True)))
    prefix = draw(st.sampled_from(["layers.{}", "l{}", "model.blocks.{}.inner"]))
    tensors, modules = [], {}
    for index, (_kind, params, mapped) in enumerate(layers):
        path = prefix.format(index)
        tensors += [TensorRef(f"{path}.{leaf}", dtype, shape) for leaf, dtype, shape in params]
        if mapped:
            modules[path] = mapped
    return tensors, modules


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pytorch_tables())
def test_pytorch_to_burn_and_back_is_the_identity(table: tuple[list[TensorRef], dict[str, str]]) -> None:
    source, modules = table
    module_map = ModuleMap.from_dict({"modules": modules})
    to_burn = plan_conversion(source, to_layout="burn", module_map=module_map)
    burn = apply_plan(source, to_burn)
    assert to_burn.source_layout == "pytorch"
    assert to_burn.dropped == [t.name for t in source if t.name.endswith(".num_batches_tracked")]
    norm_like = {path for path, kind in to_burn.kinds.items() if kind in ("BatchNorm", "Norm", "PRelu", "RmsNorm")}
    assert not [
        t.name for t in burn if t.name.rpartition(".")[0] in norm_like and t.name.endswith((".weight", ".bias"))
    ]
    to_pytorch = plan_conversion(burn, to_layout="pytorch", module_map=module_map)
    assert to_pytorch.source_layout == "burn"
    assert apply_plan(burn, to_pytorch) == [t for t in source if t.name not in to_burn.dropped]


def test_multi_dimensional_layer_norm_is_refused_not_guessed() -> None:
    model = nn.Module()
    model.ln = nn.LayerNorm((4, 5))
    source = torch_table(model)
    with pytest.raises(AmbiguousLayoutError) as caught:
        plan_conversion(source, to_layout="burn", source_layout="pytorch")
    assert yaml.safe_load(caught.value.suggestion)["modules"] == {"**.ln": "Other"}
    with pytest.raises(UnsupportedError, match=r"ln: LayerNorm tensors weight \[4, 5\], bias \[4, 5\] are not 1-D"):
        plan_conversion(source, to_layout="burn", module_map=map_of(ln="LayerNorm"))
    assert plan_conversion(source, to_layout="burn", module_map=map_of(ln="Other")).source_layout == "neutral"


def test_globs_skip_modules_without_layer_tensors_but_exact_paths_do_not() -> None:
    model = Mlp()
    model.register_buffer("steps", torch.zeros(3))  # a root-level buffer: module "" with no layer tensors
    source = torch_table(model)
    plan = plan_conversion(source, to_layout="burn", module_map=map_of(**{"**": "Linear"}))
    assert plan.kinds == {"fc1": "Linear", "fc2": "Linear", "": "Other"}
    assert [e.target for e in plan.entries if e.source == "steps"] == ["steps"]
    with pytest.raises(ConfigError, match=r"maps 'steps' to Linear, but it has none of its tensors"):
        plan_conversion(
            [*source, TensorRef("steps.count", "I64", ())], to_layout="burn", module_map=map_of(steps="Linear")
        )


@pytest.mark.parametrize(
    ("recorded", "tensors", "kind"),
    [
        ("Linear", {"fc.bias": (16,)}, "Other"),  # its weight gone: "bias without weight"
        ("Linear", {"fc.weight": (4, 3, 2), "fc.bias": (4,)}, "Conv"),
        ("Embedding", {"fc.weight": (8,)}, "Other"),  # a lone 1-D weight, in a burn-layout file
        ("Conv", {"fc.weight": (4, 8), "fc.bias": (8,)}, "Linear"),
        ("BatchNorm", {"fc.gamma": (4, 4), "fc.beta": (4, 4), "fc.running_mean": (4,)}, "Unknown"),
    ],
)
def test_a_recorded_kind_the_tensors_cannot_be_is_passed_over(
    recorded: str, tensors: dict[str, tuple[int, ...]], kind: str
) -> None:
    """A file's syncd.kinds is as untrusted as the rest of it: a kind whose tensors are not there, or not of its
    shapes, is ignored and the names and shapes decide, as for a module map's statement (a Linear recorded for
    a module without its weight once reached the steps that transpose the weight: KeyError)."""
    table = [TensorRef(name, "F32", shape) for name, shape in tensors.items()]
    context = FileContext(recorded_layout="burn", recorded_kinds={"fc": recorded})
    try:
        plan = plan_conversion(table, to_layout="pytorch", source_layout="burn", context=context)
    except AmbiguousLayoutError as exc:
        assert kind == "Unknown" and exc.undecided == ["fc"]
    else:
        assert plan.kinds["fc"] == kind
        assert "recorded in the file" not in " ".join(plan.decisions)


def test_a_recorded_kind_that_fits_is_taken() -> None:
    table = [TensorRef("fc.weight", "F32", (4, 3)), TensorRef("fc.bias", "F32", (3,))]
    context = FileContext(recorded_layout="burn", recorded_kinds={"fc": "LinearInOut"})
    plan = plan_conversion(table, to_layout="pytorch", source_layout="burn", context=context)
    assert plan.kinds["fc"] == "LinearInOut" and "recorded in the file (syncd.kinds)" in " ".join(plan.decisions)


def test_a_lone_gamma_held_beside_child_modules_is_suggested_as_other() -> None:
    """timm ConvNeXt's layer scale is the block's own `gamma` (`stages.0.blocks.0.gamma`), beside the block's
    conv, norm and MLP: no norm holds child modules, so Other is suggested first. RmsNorm was, and used as
    printed it renamed the layer scale `weight`, which load_state_dict(strict=True) refused."""
    block = "stages.0.blocks.0"
    table = [
        TensorRef(f"{block}.gamma", "F32", (8,)),
        TensorRef(f"{block}.conv_dw.weight", "F32", (8, 1, 7, 7)),
        TensorRef(f"{block}.conv_dw.bias", "F32", (8,)),
        TensorRef(f"{block}.norm.gamma", "F32", (8,)),
        TensorRef(f"{block}.norm.beta", "F32", (8,)),
        TensorRef(f"{block}.mlp.fc1.weight", "F32", (8, 32)),
        TensorRef(f"{block}.mlp.fc1.bias", "F32", (32,)),
    ]
    with pytest.raises(LayoutAmbiguityError) as refused:
        plan_conversion(table, to_layout="pytorch", context=FileContext(container="burnpack"))
    printed = refused.value.suggestion
    assert yaml.safe_load(printed)["modules"] == {"stages.*.blocks.*": "Other"}, printed
    assert "Other  # or RmsNorm" in printed  # the comment names the other choice, not the one made
    plan = plan_conversion(
        table, to_layout="pytorch", module_map=ModuleMap.from_dict(yaml.safe_load(printed), source="printed")
    )
    assert f"{block}.gamma" not in renamed(plan)
    assert renamed(plan)[f"{block}.norm.gamma"] == f"{block}.norm.weight"
