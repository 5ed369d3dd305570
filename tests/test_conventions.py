"""Never a wrong file: a convention may refuse, never mislead; remap rules see the source's names, as in Burn;
an nn.Sequential with gaps in its indices is named, with the flag that closes them.

Every case runs the real CLI on files real torch/transformers models wrote; the expected tensors come from the
model's own modules (nn.Linear -> transposed, norms renamed, ...), never from syncd's planner.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers as hf
import yaml
from conftest import REPO
from convcheck import assert_one_line_error, read_bpk, read_safetensors, run_cli, transposed
from safetensors.torch import load_file, save_file
from torch import nn

from syncd.adapters import FileContext, LayoutAmbiguityError, ModelDefinition, TensorRef, plan_conversion

HIDE = {"with transformers": (), "without transformers": ("transformers",)}


def _bits(value: torch.Tensor) -> bytes:
    return value.detach().contiguous().numpy().tobytes()


# ---------------------------------------------------------------------------------------------------------
# a causal LM whose output head is named like an embedding (GPT-NeoX saves it as `embed_out`)


@pytest.fixture(scope="module")
def neox(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, nn.Module]:
    """A GPT-NeoX causal LM (not in syncd's architectures table) saved with save_pretrained: its head is written
    as `embed_out.weight`, [vocab, hidden] like the input embedding beside it."""
    torch.manual_seed(5)
    config = hf.GPTNeoXConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    model = hf.GPTNeoXForCausalLM(config)
    directory = tmp_path_factory.mktemp("neox")
    model.save_pretrained(directory)
    return directory, model


@pytest.mark.parametrize("alone", [False, True], ids=["beside its config.json", "alone"])
@pytest.mark.parametrize("hide", HIDE.values(), ids=HIDE.keys())
def test_an_output_head_named_embed_is_transposed_as_the_linear_it_is(
    neox: tuple[Path, nn.Module], tmp_path: Path, hide: tuple[str, ...], alone: bool
) -> None:
    """Alone (no config.json naming a causal LM), `embed_out` was an Embedding by the `embed*` convention: kept
    [vocab, hidden], exit 0. No name decides it (word2vec's `embed_out` is an Embedding, test below): alone, it is
    refused, and the map it prints, used as printed, gives the head as the Linear it is."""
    directory, model = neox
    source = directory / "model.safetensors"
    flags: list[object] = []
    if alone:
        source = Path(shutil.copy(source, tmp_path / "model.safetensors"))
        refused = run_cli("convert", source, "-o", tmp_path / "neox.bpk", hide=hide)
        assert refused.returncode == 1 and "embed_out (Embedding or Linear?)" in refused.stderr, refused.stderr
        (tmp_path / "map.yaml").write_text(refused.stderr.partition("\n")[2])
        assert yaml.safe_load((tmp_path / "map.yaml").read_text())["modules"]["**.embed_out"] == "Linear"
        flags = ["--modules", tmp_path / "map.yaml"]
    assert "embed_out.weight" in read_safetensors(source).tensors  # what save_pretrained wrote
    done = run_cli("convert", source, "-o", tmp_path / "neox.bpk", "--json", *flags, hide=hide)
    if done.returncode != 0:  # a refusal is allowed only as one line naming the module and the map that settles it
        line = assert_one_line_error(done, 1, "embed_out", "module map")
        pytest.fail(f"refused instead of converting: {line}")
    burn = read_bpk(tmp_path / "neox.bpk").tensors
    head = model.get_output_embeddings().weight
    assert isinstance(model.get_output_embeddings(), nn.Linear)
    assert burn["embed_out.weight"].shape == (16, 64)  # Burn's Linear: [in, out]
    assert burn["embed_out.weight"].data == transposed(_bits(head), (64, 16), 4)
    embedding = model.get_input_embeddings().weight
    assert burn["gpt_neox.embed_in.weight"].shape == (64, 16)  # an Embedding is never transposed
    assert burn["gpt_neox.embed_in.weight"].data == _bits(embedding)
    decisions = json.loads(done.stdout)["decisions"]
    # alone: the printed map; without transformers: the head beside the model's embedding in a *ForCausalLM
    evidence = "module map" if alone else "model definition" if not hide else "ForCausalLM"
    assert any("embed_out" in line and evidence in line for line in decisions), decisions
    # what a convention alone decided is in the output itself, so a wrong guess can be found afterwards
    guessed = json.loads(read_bpk(tmp_path / "neox.bpk").metadata.get("syncd.guessed", "{}"))
    by_convention = ["gpt_neox.embed_in"] if alone else ["embed_out", "gpt_neox.embed_in"] if hide else []
    assert sorted(guessed) == by_convention


def test_word2vecs_embed_out_beside_embed_in_is_suggested_as_the_embedding_it_is(tmp_path: Path) -> None:
    """Skip-gram models hold two nn.Embedding tables, `embed_in` and `embed_out`: taken by name for GPT-NeoX's
    head, `embed_out` came out transposed, exit 0. Refused, its printed map keeps it an Embedding."""

    class SkipGram(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_in, self.embed_out = nn.Embedding(50, 8), nn.Embedding(50, 8)

    model = SkipGram()
    torch.save(model.state_dict(), tmp_path / "sgns.pt")
    refused = run_cli("convert", tmp_path / "sgns.pt", "-o", tmp_path / "sgns.bpk")
    assert refused.returncode == 1 and "embed_out (Embedding or Linear?)" in refused.stderr, refused.stderr
    (tmp_path / "map.yaml").write_text(refused.stderr.partition("\n")[2])
    done = run_cli("convert", tmp_path / "sgns.pt", "-o", tmp_path / "sgns.bpk", "--modules", tmp_path / "map.yaml")
    assert done.returncode == 0, done.stderr
    burn = read_bpk(tmp_path / "sgns.bpk").tensors
    for name, value in model.state_dict().items():
        assert burn[name].shape == (50, 8) and burn[name].data == _bits(value)


# ---------------------------------------------------------------------------------------------------------
# remap rules written as a Burn user writes them: on the source's names, before weight/bias become gamma/beta


class WithBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.BatchNorm1d(8)
        self.fc = nn.Linear(8, 4)


@pytest.fixture
def batchnorm(tmp_path: Path) -> Path:
    torch.manual_seed(7)
    model = WithBatchNorm()
    model.train()
    for _ in range(3):  # running stats and the counter away from their initial values
        model.norm1(torch.randn(16, 8))
    source = tmp_path / "bn.safetensors"
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, source)
    return source


BURN_RULE = r"^norm1\.(weight|bias|running_mean|running_var)$=bn.$1"


def test_a_rule_copied_from_burn_code_moves_the_whole_batchnorm_and_comes_back_exactly(
    batchnorm: Path, tmp_path: Path
) -> None:
    done = run_cli("convert", batchnorm, "-o", tmp_path / "bn.bpk", "--remap", BURN_RULE)
    assert done.returncode == 0, done.stderr
    burn = read_bpk(tmp_path / "bn.bpk").tensors
    assert sorted(burn) == ["bn.beta", "bn.gamma", "bn.running_mean", "bn.running_var", "fc.bias", "fc.weight"]
    source = read_safetensors(batchnorm).tensors
    assert burn["bn.gamma"].data == source["norm1.weight"].data
    assert burn["bn.running_var"].data == source["norm1.running_var"].data
    back = run_cli("convert", tmp_path / "bn.bpk", "-o", tmp_path / "back.safetensors")  # no rules: carried
    assert back.returncode == 0, back.stderr
    assert read_safetensors(tmp_path / "back.safetensors").tensors == source


def test_a_rule_set_that_splits_a_module_is_refused_naming_both_sides(batchnorm: Path, tmp_path: Path) -> None:
    done = run_cli("convert", batchnorm, "-o", tmp_path / "bn.bpk", "--remap", r"^norm1\.(running_\w+)$=bn.$1")
    line = assert_one_line_error(done, 1, str(batchnorm), "'norm1'", "norm1.running_mean", "norm1.weight", "'bn'")
    assert "split" in line
    assert not (tmp_path / "bn.bpk").exists()


def test_a_rule_on_burns_names_is_applied_to_a_bpk_source(batchnorm: Path, tmp_path: Path) -> None:
    assert run_cli("convert", batchnorm, "-o", tmp_path / "bn.bpk").returncode == 0
    done = run_cli(
        "convert", tmp_path / "bn.bpk", "-o", tmp_path / "x.safetensors", "--remap", r"^norm1\.(gamma|beta)$=n.$1"
    )
    # gamma/beta move, the running stats stay: the BatchNorm would be split, so nothing is written
    assert_one_line_error(done, 1, "'norm1'", "norm1.gamma", "norm1.running_mean")
    done = run_cli("convert", tmp_path / "bn.bpk", "-o", tmp_path / "y.safetensors", "--remap", r"^norm1\.=n.")
    assert done.returncode == 0, done.stderr
    assert sorted(read_safetensors(tmp_path / "y.safetensors").tensors) == [
        "fc.bias",
        "fc.weight",
        "n.bias",
        "n.num_batches_tracked",
        "n.running_mean",
        "n.running_var",
        "n.weight",
    ]


# ---------------------------------------------------------------------------------------------------------
# an nn.Sequential MLP with activations between its Linears: fc.0, fc.2, fc.4


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


@pytest.fixture
def mlp(tmp_path: Path) -> Path:
    torch.manual_seed(11)
    source = tmp_path / "mlp.safetensors"
    save_file({k: v.detach().clone().contiguous() for k, v in Mlp().state_dict().items()}, source)
    return source


def test_gaps_in_a_sequentials_indices_are_named_with_the_flag_that_closes_them(mlp: Path, tmp_path: Path) -> None:
    done = run_cli("convert", mlp, "-o", tmp_path / "gaps.bpk")
    assert done.returncode == 0, done.stderr
    notes = [line for line in done.stdout.splitlines() if "--map-indices-contiguous" in line]
    assert len(notes) == 1 and "fc.0, fc.2, fc.4" in notes[0], done.stdout
    as_json = run_cli("convert", mlp, "-o", tmp_path / "gaps2.bpk", "--json")
    assert any("--map-indices-contiguous" in line for line in json.loads(as_json.stdout)["decisions"])
    # --no-map-indices-contiguous: the indices stay as they are in the file
    kept = run_cli("convert", mlp, "-o", tmp_path / "gaps3.bpk", "--no-map-indices-contiguous")
    assert kept.returncode == 0, kept.stderr
    assert sorted(read_bpk(tmp_path / "gaps3.bpk").tensors) == sorted(read_safetensors(mlp).tensors)


def test_with_the_flag_the_names_a_burn_vec_expects_and_back_bit_exact(mlp: Path, tmp_path: Path) -> None:
    done = run_cli("convert", mlp, "-o", tmp_path / "mlp.bpk", "--map-indices-contiguous")
    assert done.returncode == 0, done.stderr
    assert "--map-indices-contiguous" not in done.stdout  # nothing left to say
    burn = read_bpk(tmp_path / "mlp.bpk").tensors
    assert sorted(burn) == [f"fc.{i}.{leaf}" for i in range(3) for leaf in ("bias", "weight")]
    source = read_safetensors(mlp).tensors
    for new, old in ((0, 0), (1, 2), (2, 4)):
        weight = source[f"fc.{old}.weight"]
        assert burn[f"fc.{new}.weight"].data == transposed(weight.data, weight.shape, 4)
        assert burn[f"fc.{new}.bias"].data == source[f"fc.{old}.bias"].data
    back = run_cli("convert", tmp_path / "mlp.bpk", "-o", tmp_path / "back.safetensors")
    assert back.returncode == 0, back.stderr
    assert read_safetensors(tmp_path / "back.safetensors").tensors == source
    assert "--map-indices-contiguous" not in back.stdout  # PyTorch's Sequential has its gaps: nothing to say


def test_a_renamed_bpk_keeps_its_names_in_burns_layout_and_the_way_back_still_restores_them(
    mlp: Path, tmp_path: Path
) -> None:
    """A .bpk whose indices syncd made contiguous, converted again but not to PyTorch's layout (cast, a
    container change, remap rules): the output has the file's names, which Burn loads, not the gaps back."""
    assert run_cli("convert", mlp, "-o", tmp_path / "mlp.bpk", "--map-indices-contiguous").returncode == 0
    burn = read_bpk(tmp_path / "mlp.bpk").tensors
    source = read_safetensors(mlp).tensors
    cast = run_cli("convert", tmp_path / "mlp.bpk", "-o", tmp_path / "half.bpk", "--precision", "f16")
    kept = run_cli("convert", tmp_path / "mlp.bpk", "-o", tmp_path / "kept.safetensors", "--layout", "keep")
    moved = run_cli("convert", tmp_path / "mlp.bpk", "-o", tmp_path / "moved.bpk", "--remap", r"^fc\.=layers.")
    for done in (cast, kept, moved):
        assert done.returncode == 0, done.stderr
        assert "note:" not in done.stdout, done.stdout  # the rule matched the file's names; no gaps
    assert sorted(read_bpk(tmp_path / "half.bpk").tensors) == sorted(burn)
    assert read_safetensors(tmp_path / "kept.safetensors").tensors == burn
    assert read_bpk(tmp_path / "moved.bpk").tensors == {f"layers.{k[3:]}": v for k, v in burn.items()}
    for name in ("half.bpk", "kept.safetensors", "moved.bpk"):  # each way back gives the PyTorch names again
        layout = ["--layout", "burn"] if name.endswith(".safetensors") else []
        back = run_cli("convert", tmp_path / name, "-o", tmp_path / f"{name}.back.safetensors", *layout)
        assert back.returncode == 0, back.stderr
        assert sorted(read_safetensors(tmp_path / f"{name}.back.safetensors").tensors) == sorted(source)
    assert read_safetensors(tmp_path / "moved.bpk.back.safetensors").tensors == source


def test_a_renamed_files_packed_attention_is_split_under_the_module_the_file_has(tmp_path: Path) -> None:
    """A .pt's Sequential renumbered (its indices made contiguous) into a PyTorch-layout .bpk, then converted to
    Burn's layout: the attention's query/key/value/output pieces went under the original index (2) while the
    rest of the layer kept the file's (1), one layer split across two Vec entries, exit 0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.TransformerEncoderLayer(16, 2, 32, batch_first=True))
    torch.save(model.state_dict(), tmp_path / "m.pt")
    assert run_cli("convert", tmp_path / "m.pt", "-o", tmp_path / "keep.bpk", "--layout", "keep").returncode == 0
    done = run_cli("convert", tmp_path / "keep.bpk", "-o", tmp_path / "burn.bpk", "--layout", "pytorch")
    assert done.returncode == 0, done.stderr
    names = sorted(read_bpk(tmp_path / "burn.bpk").tensors)
    assert {name.split(".")[0] for name in names} == {"0", "1"} and "1.self_attn.query.weight" in names, names
    moved = run_cli(
        "convert", tmp_path / "burn.bpk", "-o", tmp_path / "moved.bpk", "--remap", r"^1\.self_attn\.=1.attn."
    )
    assert moved.returncode == 0, moved.stderr
    for name in ("burn.bpk", "moved.bpk"):
        back = run_cli("convert", tmp_path / name, "-o", tmp_path / f"{name}.safetensors")
        assert back.returncode == 0, back.stderr
        restored = load_file(tmp_path / f"{name}.safetensors")
        model.load_state_dict(restored, strict=True)
        assert all(torch.equal(restored[k], v) for k, v in torch.load(tmp_path / "m.pt").items())


# ---------------------------------------------------------------------------------------------------------
# syncd modules: the exact map, from the model's definition, for a daemon without transformers


def test_syncd_modules_prints_the_exact_map_and_a_daemon_without_transformers_plans_the_same(
    neox: tuple[Path, nn.Module], tmp_path: Path
) -> None:
    directory, _ = neox
    printed = run_cli("modules", directory)
    assert printed.returncode == 0, printed.stderr
    data = yaml.safe_load(printed.stdout)
    assert data["modules"]["embed_out"] == "Linear" and data["modules"]["gpt_neox.embed_in"] == "Embedding"
    assert data["modules"]["gpt_neox.layers.0.input_layernorm"] == "LayerNorm"
    written = run_cli("modules", directory / "config.json", "-o", tmp_path / "map.yaml")
    assert written.returncode == 0 and written.stdout.startswith(f"wrote {tmp_path / 'map.yaml'}: ")
    assert yaml.safe_load((tmp_path / "map.yaml").read_text()) == data
    (tmp_path / "map.yaml").write_text("modules:\n  embed_out: Linear  # checked by hand\n")
    again = run_cli("modules", directory, "-o", tmp_path / "map.yaml")  # a map of one's own is kept
    assert_one_line_error(again, 3, str(tmp_path / "map.yaml"), "file already exists; pass --overwrite")
    assert "checked by hand" in (tmp_path / "map.yaml").read_text()
    assert run_cli("modules", directory, "-o", tmp_path / "map.yaml", "--overwrite").returncode == 0
    assert yaml.safe_load((tmp_path / "map.yaml").read_text()) == data
    source = directory / "model.safetensors"
    beside = run_cli("modules", source)  # a checkpoint named: the config saved beside it
    assert beside.returncode == 0, beside.stderr
    assert yaml.safe_load(beside.stdout) == data
    mapped = run_cli(
        "convert", source, "-o", tmp_path / "mapped.bpk", "--modules", tmp_path / "map.yaml", hide=("transformers",)
    )
    assert mapped.returncode == 0, mapped.stderr
    assert "naming convention" not in mapped.stdout  # the map decided every module: nothing guessed
    defined = run_cli("convert", source, "-o", tmp_path / "defined.bpk")
    assert defined.returncode == 0, defined.stderr
    assert read_bpk(tmp_path / "mapped.bpk").tensors == read_bpk(tmp_path / "defined.bpk").tensors


def test_syncd_modules_says_in_one_line_why_it_cannot(neox: tuple[Path, nn.Module], tmp_path: Path) -> None:
    directory, _ = neox
    hidden = run_cli("modules", directory, hide=("transformers",))
    assert_one_line_error(hidden, 1, str(directory / "config.json"), "pip install 'syncd[transformers]'")
    missing = run_cli("modules", tmp_path)
    assert_one_line_error(missing, 1, str(tmp_path / "config.json"), "not found")
    (tmp_path / "config.json").write_text('{"model_type": "no-such-family"}')
    unknown = run_cli("modules", tmp_path / "config.json", "-o", tmp_path / "map.yaml")
    assert_one_line_error(unknown, 1, "no model type 'no-such-family'")
    assert not (tmp_path / "map.yaml").exists()
    (tmp_path / "mine.json").write_text("{not json")
    broken = run_cli("modules", tmp_path / "mine.json")  # named, not beside anything
    assert_one_line_error(broken, 1, str(tmp_path / "mine.json"), "not JSON")
    assert "beside" not in broken.stderr
    (tmp_path / "model.bpk").write_bytes(b"\xa1" * 64)
    (tmp_path / "config.json").unlink()
    alone = run_cli("modules", tmp_path / "model.bpk")  # not read as a config: no config.json beside it
    assert_one_line_error(alone, 1, str(tmp_path / "model.bpk"), "no config.json beside it")  # the file typed


def test_the_models_definition_joins_burns_attention_pieces_back_into_its_multihead_attention() -> None:
    """A Burn file beside the config of a model whose `attn` is an nn.MultiheadAttention: its query/key/value
    Linears are joined back into in_proj_weight by the module's type, with no map or record."""
    table = [
        TensorRef(f"blocks.0.attn.{field}.{leaf}", "F32", (8, 8) if leaf == "weight" else (8,))
        for field in ("query", "key", "value", "output")
        for leaf in ("weight", "bias")
    ]
    table += [TensorRef("blocks.0.norm.gamma", "F32", (8,)), TensorRef("blocks.0.norm.beta", "F32", (8,))]
    alone = plan_conversion(table, to_layout="pytorch")
    assert not any(e.parts for e in alone.entries)  # names alone never join them
    definition = ModelDefinition({"blocks.0.attn": "MultiHeadAttention", "blocks.0.norm": "LayerNorm"}, "model X")
    plan = plan_conversion(table, to_layout="pytorch", context=FileContext(definition=definition))
    joined = {e.target: e for e in plan.entries}["blocks.0.attn.in_proj_weight"]
    assert [p.source for p in joined.parts] == [f"blocks.0.attn.{f}.weight" for f in ("query", "key", "value")]
    assert plan.kinds["blocks.0.attn"] == "MultiHeadAttention"


def test_only_a_model_class_named_in_architectures_is_ever_built(tmp_path: Path) -> None:
    """`architectures` comes from a file in a watched directory: a name that is no model class (transformers'
    `pipeline` would fetch from the hub) is not called; the base model of model_type is built instead."""
    config = hf.GPTNeoXConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    config.architectures = ["pipeline"]
    config.save_pretrained(tmp_path)
    done = run_cli("modules", tmp_path)
    assert done.returncode == 0, done.stderr
    assert "model definition GPTNeoXModel (transformers" in done.stdout.splitlines()[0]


def test_syncd_no_model_definition_skips_building_it(neox: tuple[Path, nn.Module], tmp_path: Path) -> None:
    """The definition costs the transformers import on each `syncd convert`; the variable skips it, and the
    conventions and the rest of the file decide (as without transformers)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), SYNCD_NO_MODEL_DEFINITION="1")
    source = neox[0] / "model.safetensors"
    argv = [sys.executable, "-m", "syncd", "convert", source, "-o", tmp_path / "x.bpk", "--json"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    decisions = json.loads(done.stdout)["decisions"]
    assert not any("model definition" in line for line in decisions), decisions
    assert any("naming convention alone" in line for line in decisions)


def test_a_map_that_states_every_module_spares_building_the_definition_and_one_that_does_not_builds_it(
    neox: tuple[Path, nn.Module], tmp_path: Path
) -> None:
    """The definition ranks below the user's map: with a rule for every module it could decide nothing, so the
    transformers import (seconds per `syncd convert`) is not paid; the output is the one the definition gives."""
    directory, _ = neox
    written = run_cli("modules", directory, "-o", tmp_path / "map.yaml")
    assert written.returncode == 0, written.stderr
    whole = yaml.safe_load((tmp_path / "map.yaml").read_text())
    source = directory / "model.safetensors"

    def convert(name: str, *args: object) -> list[str]:
        done = run_cli("convert", source, "-o", tmp_path / name, "--json", *args)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)["decisions"]

    decisions = convert("mapped.bpk", "--modules", tmp_path / "map.yaml")
    assert "model definition not built: the module map states every module" in decisions
    assert not any(line.startswith("module types from the model definition") for line in decisions)
    assert any(line.startswith("module types from the model definition") for line in convert("defined.bpk"))
    assert read_bpk(tmp_path / "mapped.bpk").tensors == read_bpk(tmp_path / "defined.bpk").tensors
    partial = {"modules": {k: v for k, v in whole["modules"].items() if k != "embed_out"}}  # the head left out
    (tmp_path / "partial.yaml").write_text(yaml.safe_dump(partial))
    decisions = convert("partial.bpk", "--modules", tmp_path / "partial.yaml")
    assert any(line.startswith("module types from the model definition") for line in decisions), decisions
    assert read_bpk(tmp_path / "partial.bpk").tensors == read_bpk(tmp_path / "defined.bpk").tensors


def test_a_pt_file_gets_contiguous_indices_by_default_as_burns_pytorchstore_does(tmp_path: Path) -> None:
    torch.manual_seed(13)
    source = tmp_path / "mlp.pt"
    state = {k: v.detach().clone() for k, v in Mlp().state_dict().items()}
    torch.save(state, source)
    done = run_cli("convert", source, "-o", tmp_path / "mlp.bpk")
    assert done.returncode == 0, done.stderr
    assert "--map-indices-contiguous" not in done.stdout
    assert sorted(read_bpk(tmp_path / "mlp.bpk").tensors) == [
        f"fc.{i}.{leaf}" for i in range(3) for leaf in ("bias", "weight")
    ]
    back = run_cli("convert", tmp_path / "mlp.bpk", "-o", tmp_path / "back.safetensors")
    assert back.returncode == 0, back.stderr
    assert {k: v.data for k, v in read_safetensors(tmp_path / "back.safetensors").tensors.items()} == {
        k: v.contiguous().numpy().tobytes() for k, v in state.items()
    }


def test_names_that_misled_a_bias_free_weight_into_the_wrong_kind() -> None:
    """A model's own top-level `query` (EoMT's learned queries, an nn.Embedding) was taken for an attention's
    query Linear and transposed; LUKE's `entity_embedding_dense` and Gemma3n's `embedding_projection`, Linears,
    for embeddings by their first word, and kept [out, in]. Exit 0 each, with only a note."""
    from syncd.adapters import LayoutAmbiguityError, TensorRef, plan_conversion
    from syncd.adapters.evidence import matrix_name_kind

    assert matrix_name_kind("query") is None  # undecided: refused with the map that settles it
    assert matrix_name_kind("encoder.layers.0.attention.query") == ("Linear", "query")
    assert matrix_name_kind("luke.entity_embeddings.entity_embedding_dense") == ("Linear", "*_dense")
    assert matrix_name_kind("embedding_projection") == ("Linear", "*_projection")
    table = [
        TensorRef("query.weight", "F32", (10, 32)),
        TensorRef("encoder.proj.weight", "F32", (32, 64)),
        TensorRef("encoder.proj.bias", "F32", (32,)),
    ]
    with pytest.raises(LayoutAmbiguityError, match="query"):
        plan_conversion(table, to_layout="burn")


# ---------------------------------------------------------------------------------------------------------
# a Burn-layout GPT-2: its Conv1D-named Linears may be transformers' Conv1D or nanoGPT's nn.Linear


_TINY_GPT2 = hf.GPT2Config(
    vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
)


def _burn_layout_gpt2(path: Path) -> dict[str, torch.Tensor]:
    """A tiny transformers GPT-2 as Burn stores its port (Linears [in, out], which is how Conv1D stores them;
    LayerNorms gamma/beta) in a .bpk with nothing of syncd's in it; returns the PyTorch state dict."""
    from formatgen import bytes_spec, write_bpk

    torch.manual_seed(7)
    state = {k: v for k, v in hf.GPT2Model(_TINY_GPT2).state_dict().items() if not k.endswith(".attn.bias")}
    burn_names = {".ln_1.weight": ".ln_1.gamma", ".ln_1.bias": ".ln_1.beta", ".ln_2.weight": ".ln_2.gamma"}
    burn_names |= {".ln_2.bias": ".ln_2.beta", "ln_f.weight": "ln_f.gamma", "ln_f.bias": "ln_f.beta"}

    def burn_name(name: str) -> str:
        return next((name.replace(a, b) for a, b in burn_names.items() if name.endswith(a)), name)

    arrays = {burn_name(k): v.contiguous().numpy() for k, v in state.items()}
    write_bpk(path, [bytes_spec(k, "F32", a.shape, a.tobytes()) for k, a in arrays.items()])
    return state


def test_a_burn_layout_gpt2_is_refused_not_transposed_and_its_printed_map_gives_the_right_file(
    tmp_path: Path,
) -> None:
    """Going to PyTorch, `h.0.attn.c_attn` [in, out] may be transformers' Conv1D (kept) or nanoGPT's nn.Linear
    (transposed): every Conv1D weight came back transposed, exit 0. It is refused, the map it prints settling
    it, and used as printed that map gives the file GPT2Model loads."""
    state = _burn_layout_gpt2(tmp_path / "gpt2.bpk")
    done = run_cli("convert", tmp_path / "gpt2.bpk", "-o", tmp_path / "gpt2.safetensors")
    assert done.returncode == 1, done.stdout
    first, _, suggestion = done.stderr.partition("\n")
    assert "c_attn (Linear or LinearInOut?)" in first and "c_fc (Linear or LinearInOut?)" in first, first
    assert not (tmp_path / "gpt2.safetensors").exists()
    assert yaml.safe_load(suggestion)["modules"]["**.c_attn"] == "LinearInOut"  # transformers' is suggested first
    (tmp_path / "map.yaml").write_text(suggestion)
    done = run_cli(
        "convert", tmp_path / "gpt2.bpk", "-o", tmp_path / "gpt2.safetensors", "--modules", tmp_path / "map.yaml"
    )
    assert done.returncode == 0, done.stderr
    back = load_file(tmp_path / "gpt2.safetensors")
    assert back.keys() == state.keys()
    assert all(torch.equal(back[name], value) for name, value in state.items())
    hf.GPT2Model(_TINY_GPT2).load_state_dict(back, strict=True)


def test_a_bpk_whose_layout_nothing_shows_is_suggested_as_burn_layout() -> None:
    """OLMo's bias-free Linears and weightless norms show no layout: the map printed said `layout: pytorch`
    first, and used as printed it kept a Burn file's Linears untransposed. Burn writes .bpk in its own layout."""
    table = [TensorRef("model.layers.0.mlp.up_proj.weight", "F32", (32, 48))]
    for container, likelier in (("burnpack", "burn"), ("safetensors", "pytorch")):
        to = "pytorch" if likelier == "burn" else "burn"
        with pytest.raises(LayoutAmbiguityError) as refused:
            plan_conversion(table, to_layout=to, context=FileContext(container=container))
        assert yaml.safe_load(refused.value.suggestion)["layout"] == likelier


def test_a_bpk_kept_in_pytorchs_layout_is_read_as_pytorchs_both_ways(tmp_path: Path) -> None:
    """`--layout keep` writes a PyTorch file's tensors into a .bpk as they are, recording no layout; bias-free
    Linears show none. Its refusal suggested `layout: burn` (Burn writes .bpk so), and the map used as printed
    transposed every Linear, exit 0. The `format: pt` it carries from its source says PyTorch's."""
    torch.manual_seed(1)
    weights = {"blocks.0.attn.out_proj.weight": torch.randn(8, 4), "blocks.0.mlp.fc1.weight": torch.randn(16, 8)}
    save_file(weights, tmp_path / "m.safetensors", metadata={"format": "pt"})
    assert run_cli("convert", tmp_path / "m.safetensors", "-o", tmp_path / "m.bpk", "--layout", "keep").returncode == 0
    back = run_cli("convert", tmp_path / "m.bpk", "-o", tmp_path / "back.safetensors")
    assert back.returncode == 0, back.stderr
    assert all(torch.equal(load_file(tmp_path / "back.safetensors")[k], v) for k, v in weights.items())
    burn = run_cli("convert", tmp_path / "m.bpk", "-o", tmp_path / "burn.bpk")
    assert burn.returncode == 0, burn.stderr
    tensors = read_bpk(tmp_path / "burn.bpk").tensors
    assert {k: t.shape for k, t in tensors.items()} == {k: tuple(v.T.shape) for k, v in weights.items()}
    assert all(tensors[k].data == _bits(v.T) for k, v in weights.items())
