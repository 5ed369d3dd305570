"""Real architectures convert with no configuration, tensor by tensor right, and come back bit-exact.

Every model is built from a small config with random weights (no downloads). Each test saves it as its users
do (`save_pretrained`, which writes config.json and `format: pt`; or a bare `save_file(state_dict)`), converts
with no flags, checks every tensor of the .bpk against what its *module type* says Burn expects (Linear
transposed, norms gamma/beta, PReLU alpha, Conv1D / Embedding / convolutions / other parameters unchanged,
BatchNorm counters carried), converts back with no flags and reloads strictly, comparing every tensor bit for
bit.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers as hf
import yaml
from convcheck import Checkpoint, Tensor, read_bpk, read_safetensors, run_cli, transposed
from daemonutil import wait_until
from hfsweep import build, tiny_config
from safetensors.torch import save_file
from torch import nn

from syncd.adapters import FileContext, LayoutAmbiguityError, ModuleMap, TensorRef, plan_conversion
from syncd.engine import definition
from syncd.engine.convert import ConvertRequest, convert
from syncd.engine.definition import BUILD_MEMORY_BYTES, module_budget
from syncd.errors import UnsupportedError

pytestmark = pytest.mark.torch

hf.logging.set_verbosity_error()


# ---------------------------------------------------------------------------------------------------------
# the models: small configs, random weights


def _bert() -> nn.Module:
    config = hf.BertConfig(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=12,
    )
    return hf.BertModel(config)


def _gpt2() -> nn.Module:
    config = hf.GPT2Config(
        vocab_size=40, n_positions=12, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
    )
    return hf.GPT2LMHeadModel(config)


def _llama(tied: bool, dtype: torch.dtype = torch.float32) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        config = hf.LlamaConfig(
            vocab_size=40,
            hidden_size=16,
            intermediate_size=24,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            tie_word_embeddings=tied,
            bos_token_id=0,
            eos_token_id=0,
        )
        return hf.LlamaForCausalLM(config).to(dtype)

    return build


def _t5() -> nn.Module:
    config = hf.T5Config(
        vocab_size=40,
        d_model=16,
        d_kv=8,
        d_ff=24,
        num_layers=1,
        num_heads=2,
        relative_attention_num_buckets=8,
        decoder_start_token_id=0,
    )
    return hf.T5ForConditionalGeneration(config)


def _whisper() -> nn.Module:
    config = hf.WhisperConfig(
        vocab_size=40,
        num_mel_bins=8,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=24,
        decoder_ffn_dim=24,
        max_source_positions=8,
        max_target_positions=8,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        decoder_start_token_id=0,
    )
    return hf.WhisperModel(config)


def _vit() -> nn.Module:
    config = hf.ViTConfig(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=24,
        image_size=8,
        patch_size=4,
        num_labels=3,
    )
    return hf.ViTForImageClassification(config)


def _resnet() -> nn.Module:
    config = hf.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)
    model = hf.ResNetForImageClassification(config)
    _move_running_stats(model)
    return model


def _convnext() -> nn.Module:
    config = hf.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=3)
    return hf.ConvNextForImageClassification(config)


def _mamba() -> nn.Module:
    config = hf.MambaConfig(vocab_size=40, hidden_size=16, state_size=4, num_hidden_layers=1, expand=2, conv_kernel=3)
    return hf.MambaForCausalLM(config)


HF_MODELS: dict[str, Callable[[], nn.Module]] = {
    "bert": _bert,
    "gpt2": _gpt2,
    "llama-untied": _llama(tied=False),
    "llama-tied-bf16": _llama(tied=True, dtype=torch.bfloat16),
    "t5": _t5,
    "whisper": _whisper,
    "vit": _vit,
    "resnet": _resnet,
    "convnext": _convnext,
    "mamba": _mamba,
}


class LayerScale(nn.Module):
    """timm's LayerScale: a per-channel multiplier named `gamma` (no norm, no Burn module)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.randn(dim))


class _TimmAttention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)


class _TimmMlp(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)


class _TimmBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1, self.attn, self.ls1 = nn.LayerNorm(dim), _TimmAttention(dim), LayerScale(dim)
        self.norm2, self.mlp, self.ls2 = nn.LayerNorm(dim), _TimmMlp(dim), LayerScale(dim)


class TimmViT(nn.Module):
    """The parameter names of timm's VisionTransformer with init_values set (LayerScale)."""

    def __init__(self, dim: int = 16, depth: int = 2, classes: int = 3) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, 5, dim))
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(3, dim, 4, 4)
        self.blocks = nn.ModuleList(_TimmBlock(dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)


class PlainNet(nn.Module):
    """A plain torch model: an Embedding, BatchNorm, GroupNorm, PReLUs (per channel and single), Linears."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(30, 8)
        self.conv = nn.Conv1d(8, 8, 3)
        self.bn = nn.BatchNorm1d(8)
        self.gn = nn.GroupNorm(2, 8)
        self.prelu = nn.PReLU(8)
        self.act = nn.PReLU()
        self.fc = nn.Linear(8, 4)
        self.out = nn.Linear(4, 4, bias=False)  # nothing names it: the one genuinely ambiguous module


def _plain_sequential() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.PReLU(4),  # unnamed and per channel: RmsNorm or PReLU? After a norm, the suggestion says PReLU
        nn.Conv2d(4, 4, 3),
        nn.GroupNorm(2, 4),
        nn.PReLU(),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 5),
    )


def _plain() -> nn.Module:
    model = PlainNet()
    _move_running_stats(model)
    return model


def _sequential() -> nn.Module:
    model = _plain_sequential()
    _move_running_stats(model)
    return model


def _move_running_stats(model: nn.Module) -> None:
    """Running stats and counters away from their defaults, so that carrying them is checked."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.running_mean.uniform_(-1, 1)
                module.running_var.uniform_(0.5, 2)
                module.num_batches_tracked.fill_(7)


# ---------------------------------------------------------------------------------------------------------
# what Burn expects, from the module types (docs/burn-adapters.md#module-kinds)

_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm, nn.RMSNorm)


def _is_norm(module: nn.Module) -> bool:
    # transformers' own norms (LlamaRMSNorm, T5LayerNorm, MambaRMSNorm) are not torch classes
    return isinstance(module, _NORMS) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def file_names(model: nn.Module) -> dict[str, str]:
    """Name in a save_pretrained file -> name in the model: transformers 5 saves some models (ViT) under their
    older checkpoint names, so the owning module is found through its own reverse mapping."""
    from transformers.core_model_loading import revert_weight_conversion

    state = model.state_dict()
    by_pointer: dict[int, list[str]] = {}
    for name, value in state.items():
        by_pointer.setdefault(value.data_ptr(), []).append(name)
    names = {}
    for saved, value in revert_weight_conversion(model, dict(state)).items():
        candidates = by_pointer[value.data_ptr()]
        names[saved] = saved if saved in candidates else candidates[0]
    return names


def expected_burn(
    model: nn.Module, source: Checkpoint, names: dict[str, str] | None = None
) -> dict[str, tuple[tuple[int, ...], bytes]]:
    """Burn name -> (shape, bytes) for every tensor of a PyTorch-layout file, from the module that owns it."""
    expected = {}
    for name, tensor in source.tensors.items():
        path, _, leaf = name.rpartition(".")
        owner = (names or {}).get(name, name).rpartition(".")[0]
        module = model.get_submodule(owner) if owner else model
        burn_name, shape, data = name, tensor.shape, tensor.data
        if isinstance(module, nn.Linear) and leaf == "weight":
            shape, data = shape[::-1], transposed(data, shape, len(data) // max(1, _numel(shape)))
        elif _is_norm(module) and leaf in ("weight", "bias"):
            burn_name = f"{path}.{'gamma' if leaf == 'weight' else 'beta'}"
        elif isinstance(module, nn.PReLU):
            burn_name = f"{path}.alpha"
        elif leaf == "num_batches_tracked":
            continue  # no Burn slot: carried in metadata (docs/burn-adapters.md#keys-without-a-counterpart)
        # Embedding, Conv*, transformers' Conv1D ([in, out] is Burn's Linear layout) and anything else: as stored
        expected[burn_name] = (shape, data)
    return expected


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def assert_burn_layout(model: nn.Module, source: Path, bpk: Path, names: dict[str, str] | None = None) -> None:
    assert_bpk_holds(bpk, expected_burn(model, read_safetensors(source), names))


def assert_bpk_holds(bpk: Path, expected: dict[str, tuple[tuple[int, ...], bytes]]) -> None:
    found = {name: (t.shape, t.data) for name, t in read_bpk(bpk).tensors.items()}
    assert sorted(found) == sorted(expected)
    wrong = [name for name in expected if found[name] != expected[name]]
    assert not wrong, f"tensors not as their module types say: {wrong}"


def save_bare(build: Callable[[], nn.Module], path: Path, seed: int) -> nn.Module:
    """A freshly built model with seeded random weights, saved as a bare `save_file(state_dict)` at `path`."""
    torch.manual_seed(seed)
    model = build()
    save_file(_bare_state(model), path)
    return model


def assert_same_state(original: nn.Module, reloaded: nn.Module) -> None:
    ours, theirs = original.state_dict(), reloaded.state_dict()
    assert sorted(ours) == sorted(theirs)
    for name, value in ours.items():
        other = theirs[name]
        assert value.dtype == other.dtype and value.shape == other.shape, name
        assert _bits(value) == _bits(other), name


def _bits(value: torch.Tensor) -> bytes:
    return value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _bare_state(model: nn.Module) -> dict[str, torch.Tensor]:
    # tied weights share memory, which save_file refuses: each gets its own copy, as a user would
    return {name: value.detach().clone().contiguous() for name, value in model.state_dict().items()}


# ---------------------------------------------------------------------------------------------------------
# save_pretrained: config.json beside the weights, `format: pt` in them


@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_save_pretrained_converts_with_no_flags_and_reloads_bit_exact(tmp_path: Path, name: str) -> None:
    torch.manual_seed(13)
    model = HF_MODELS[name]()
    saved = tmp_path / "saved"
    model.save_pretrained(saved)
    source = saved / "model.safetensors"

    to_burn = convert(ConvertRequest(source=source))
    assert to_burn.source_layout == "pytorch"
    assert any(line.startswith("config.json model_type") for line in to_burn.decisions), to_burn.decisions
    assert_burn_layout(model, source, saved / "model.bpk", file_names(model))

    back = tmp_path / "back"
    back.mkdir()
    shutil.copy(saved / "config.json", back / "config.json")
    returned = convert(ConvertRequest(source=saved / "model.bpk", dest=back / "model.safetensors"))
    assert returned.decisions[0] == "source layout: burn (recorded in the file: syncd.layout)"
    assert read_safetensors(back / "model.safetensors").tensors == read_safetensors(source).tensors
    assert read_safetensors(back / "model.safetensors").metadata["format"] == "pt"
    assert_same_state(model, type(model).from_pretrained(back, dtype=next(model.parameters()).dtype))


def test_a_round_trip_names_norms_gamma_beta_where_the_pytorch_file_did(tmp_path: Path) -> None:
    """ESM's save_pretrained writes its LayerNorms' parameters as gamma/beta (transformers' loader takes both
    spellings). The .bpk records which norms were so named, and the way back names them so again: the same
    file, tensor for tensor (it came back with weight/bias)."""
    model = build("esm", 5)
    saved = tmp_path / "saved"
    model.save_pretrained(saved)
    source = saved / "model.safetensors"
    assert any(name.endswith("LayerNorm.gamma") for name in read_safetensors(source).tensors)
    convert(ConvertRequest(source=source))
    recorded = json.loads(read_bpk(saved / "model.bpk").metadata["syncd.gamma_beta"])
    assert recorded and all(path.endswith("LayerNorm") for path in recorded)
    back = tmp_path / "back"
    back.mkdir()
    returned = convert(ConvertRequest(source=saved / "model.bpk", dest=back / "model.safetensors"))
    assert read_safetensors(back / "model.safetensors").tensors == read_safetensors(source).tensors
    assert any("as its PyTorch source named them" in line for line in returned.decisions), returned.decisions


def test_a_config_without_architectures_gives_the_base_models_types_under_the_heads_prefix(tmp_path: Path) -> None:
    """A config made in code names no class (`architectures` null), so the base model is built; the weights of
    the model with a head name it with its prefix (`luke.`). Its bias-free Linear named like an embedding
    (`entity_embedding_dense`) was then decided by that name, kept [out, in], exit 0."""
    torch.manual_seed(0)
    config = hf.LukeConfig(
        vocab_size=96,
        entity_vocab_size=50,
        hidden_size=32,
        entity_emb_size=256,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=48,
        max_position_embeddings=64,
        num_labels=3,
    )
    model = hf.LukeForEntityClassification(config)
    assert config.architectures is None
    config.save_pretrained(tmp_path)
    save_file(_bare_state(model), tmp_path / "model.safetensors", metadata={"format": "pt"})
    result = convert(ConvertRequest(source=tmp_path / "model.safetensors"))
    assert any("module types from the model definition LukeModel" in line for line in result.decisions)
    dense = model.luke.entity_embeddings.entity_embedding_dense.weight.detach()
    found = read_bpk(tmp_path / "model.bpk").tensors["luke.entity_embeddings.entity_embedding_dense.weight"]
    assert (found.shape, found.data) == ((256, 32), transposed(dense.numpy().tobytes(), (32, 256), 4))


def test_gpt2_conv1d_is_kept_and_the_decisions_name_their_sources(tmp_path: Path) -> None:
    torch.manual_seed(1)
    model = _gpt2()
    model.save_pretrained(tmp_path)
    # with transformers importable the model's own definition decides; without it, the architectures table
    for hide, evidence in (((), "model definition GPT2LMHeadModel (transformers "), (("transformers",), None)):
        done = run_cli("convert", tmp_path / "model.safetensors", "-v", "--overwrite", hide=hide)
        assert done.returncode == 0, done.stderr
        lines = [line.strip() for line in done.stdout.splitlines()]
        assert (
            "source layout: pytorch (shown by format: pt metadata; names of transformer.h.0.ln_1, "
            "transformer.h.0.ln_2, transformer.ln_f)" in lines
        )
        assert "config.json model_type 'gpt2': known architecture gpt2" in lines
        decided_by = evidence or "config.json model_type 'gpt2'"
        assert any(
            line.startswith(f"transformer.h.0.mlp.c_fc: LinearInOut ({decided_by}")
            and line.endswith("-> unchanged: weight stays [in, out] (Burn's Linear layout)")
            for line in lines
        ), lines
        if hide:
            assert (
                "model definition not used: transformers is not installed (pip install 'syncd[transformers]')" in lines
            )
        c_fc = model.transformer.h[0].mlp.c_fc.weight
        assert read_bpk(tmp_path / "model.bpk").tensors["transformer.h.0.mlp.c_fc.weight"].shape == tuple(c_fc.shape)


def test_a_config_describing_a_huge_model_is_not_built_past_what_the_checkpoint_holds(tmp_path: Path) -> None:
    """config.json lies in a watched directory: one claiming 100,000 layers would take minutes and gigabytes to
    build even on the meta device (10,000 took a minute and 1.1 GiB). The build stops at the module budget
    the checkpoint's tensor count allows, and the other evidence decides, as for a model it cannot build."""
    honest, hostile = tmp_path / "honest", tmp_path / "hostile"
    _bert().save_pretrained(honest)
    shutil.copytree(honest, hostile)
    config = json.loads((hostile / "config.json").read_text())
    (hostile / "config.json").write_text(json.dumps({**config, "num_hidden_layers": LAYERS}))
    expected = convert(ConvertRequest(source=honest / "model.safetensors"))
    result = convert(ConvertRequest(source=hostile / "model.safetensors"))
    budget = module_budget(expected.tensors)
    assert f"model definition not used: config.json describes a model of more than {budget} modules" in result.decisions
    assert read_bpk(hostile / "model.bpk").tensors == read_bpk(honest / "model.bpk").tensors


LAYERS = 100_000


# Families whose experts transformers 5 holds fused ([experts, out, in], applied with F.linear) and writes back
# per expert on save (Mixtral's experts.N.w1/w2/w3, Qwen's experts.N.gate_proj/up_proj/down_proj).
EXPERTS_WRITTEN_BACK = [
    "deepseek_v2",
    "deepseek_v4",
    "flex_olmo",
    "hunyuan_v1_moe",
    "minimax",
    "minimax_m2",
    "mixtral",
    "olmoe",
    "phimoe",
    "qwen2_moe",
    "qwen3_moe",
    "solar_open",
]


def test_a_config_json_whose_model_takes_gigabytes_to_build_is_given_up_and_the_conversion_goes_on(
    tmp_path: Path,
) -> None:
    """A config.json lies in a watched directory: ConvNeXt's depths are summed into a CPU list in its
    `__init__`, meta device or not, so one number took 1.6 GiB of syncd's memory (VideoMAE's image size
    likewise, in plain Python). The build runs apart, under a memory limit; past it, the other evidence decides."""
    save_file(
        {"classifier.weight": torch.randn(2, 8), "classifier.bias": torch.randn(2)}, tmp_path / "model.safetensors"
    )
    config = {
        "model_type": "convnext",
        "architectures": ["ConvNextForImageClassification"],
        "depths": [30_000_000, 1, 1, 1],
        "hidden_sizes": [8, 8, 8, 8],
        "num_labels": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = convert(ConvertRequest(source=tmp_path / "model.safetensors"))
    assert f"model definition not used: building it took more than {BUILD_MEMORY_BYTES >> 20} MiB" in result.decisions
    assert result.status == "published"


def test_a_refusal_says_why_the_config_json_beside_it_was_passed_over(tmp_path: Path) -> None:
    """A T5 whose config.json was cut short (a save interrupted) is refused for modules its tensors do not
    decide; the refusal named the tensors only, never the config.json that would have decided them."""
    build("t5", 0).save_pretrained(tmp_path)
    text = (tmp_path / "config.json").read_text()
    (tmp_path / "config.json").write_text(text[: len(text) // 2])
    refused = run_cli("convert", tmp_path / "model.safetensors")
    assert refused.returncode == 1
    first = refused.stderr.splitlines()[0]
    assert "the tensors do not decide" in first and "(config.json beside it not used: not JSON (" in first


def test_the_model_definition_imports_nothing_from_the_directory_syncd_is_run_in(tmp_path: Path) -> None:
    """The process building the definition was started with `python -c`, which puts the current directory first
    on the path: a transformers.py in a downloaded model's directory, where a user runs `syncd convert`, ran."""
    directory = tmp_path / "gpt2"
    build("gpt2", 0).save_pretrained(directory)
    marker = tmp_path / "ran"
    (directory / "transformers.py").write_text(f"open({str(marker)!r}, 'w').close()\nraise ImportError('planted')\n")
    done = run_cli("convert", "model.safetensors", "-o", tmp_path / "out.bpk", "-v", cwd=directory)
    assert done.returncode == 0, done.stderr
    assert not marker.exists()
    assert "module types from the model definition GPT2LMHeadModel" in done.stdout


def test_a_definition_process_that_exits_is_reaped_not_left_a_zombie(tmp_path: Path) -> None:
    """The process building definitions exits on its own once idle; nothing waited for it until the next build,
    so a daemon kept a zombie child for hours. Here it is killed rather than left idle for a minute."""
    config = {**tiny_config("gpt2").to_dict(), "name_or_path": str(tmp_path)}  # a config not built before here
    found, note = definition.definition_for(config)
    assert found is not None, note
    child = definition._BUILDER._proc
    assert child is not None
    started = _start_time(child.pid)
    os.kill(child.pid, signal.SIGKILL)
    # reaped: gone from /proc (a zombie stays there until its parent waits for it), or its pid taken anew
    wait_until(lambda: _start_time(child.pid) != started, 30, "the killed child reaped")


def test_a_definition_being_built_dies_with_syncd_even_by_sigkill(tmp_path: Path) -> None:
    """syncd stopped while its child builds a definition left the child running, reparented to init, for as long
    as the build took, with nobody watching its memory and time (a daemon under a shell or in a container).
    The build here (100,000 layers, up to the budget of any checkpoint) runs for 17 s and more before its memory
    limit stops it; killed with its parent, the child is gone long before."""
    sizes = {"hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 2, "num_key_value_heads": 2}
    config = {
        **hf.LlamaConfig(vocab_size=96, num_hidden_layers=100_000, **sizes).to_dict(),
        "architectures": ["LlamaForCausalLM"],
        "name_or_path": str(tmp_path),
    }
    script = (
        "import json, sys, threading, time\n"
        "from syncd.engine import definition\n"
        "threading.Thread(target=definition.definition_for, args=(json.loads(sys.argv[1]),), daemon=True).start()\n"
        "while not definition._BUILDER._last_used: time.sleep(0.01)\n"  # started: the build is asked for next
        "print(definition._BUILDER._proc.pid, flush=True)\n"
        "threading.Event().wait()\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script, json.dumps(config)], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    started = _start_time(child)
    parent.kill()
    parent.wait()
    wait_until(lambda: _start_time(child) != started, 10, "the child gone with its parent")


def test_a_build_whose_process_died_is_tried_again_at_the_next_conversion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every outcome was kept for the daemon's life: once the OOM killer took the build's process, that model
    went without its definition at every later save until syncd was restarted."""
    builder = definition._Builder()
    monkeypatch.setattr(definition, "_BUILDER", builder)
    sizes = {"hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 2, "num_key_value_heads": 2}
    config = {
        **hf.LlamaConfig(vocab_size=96, num_hidden_layers=3_000, **sizes).to_dict(),
        "architectures": ["LlamaForCausalLM"],
        "name_or_path": str(tmp_path),
    }
    outcome: list[tuple[object, str | None]] = []
    building = threading.Thread(target=lambda: outcome.append(definition.definition_for(config)))
    building.start()
    wait_until(lambda: builder._last_used, 60, "the build's process started")
    assert builder._proc is not None
    os.kill(builder._proc.pid, signal.SIGKILL)
    building.join()
    assert outcome[0][0] is None and "model definition not used" in str(outcome[0][1])
    found, note = definition.definition_for(config)
    assert found is not None, note


def _start_time(pid: int) -> str | None:
    """When the process `pid` started (clock ticks since boot), None once no process has that pid."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[19]
    except FileNotFoundError:
        return None


# Mixtral 8x7B's own config: 32 layers of 8 experts of 4096 x 14336, 47 billion parameters
MIXTRAL_8X7B = {
    "model_type": "mixtral",
    "architectures": ["MixtralForCausalLM"],
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
}


def test_the_experts_of_a_full_size_model_are_found_within_a_bounded_memory() -> None:
    """Which saved names are experts' Linears is found by reverting transformers' weight conversions on a probe
    state dict; a probe of CPU tensors made the conversions copy every expert's weight: 24 GiB for Mixtral
    8x7B's config, killed by the kernel (or, under a limit, the experts not found). Built here under a 2 GiB
    data limit."""
    script = (
        "import json, resource, sys; "
        "resource.setrlimit(resource.RLIMIT_DATA, (2 << 30, resource.RLIM_INFINITY)); "
        "from syncd.engine.definition import definition_for; "
        "found, note = definition_for(json.loads(sys.argv[1]), 995); "
        "print(json.dumps({'note': note, 'kinds': found.kinds if found else {}}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps(MIXTRAL_8X7B)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    reply = json.loads(done.stdout)
    assert reply["note"] is None
    experts = {path: kind for path, kind in reply["kinds"].items() if ".experts." in path}
    assert {
        f"model.layers.{i}.block_sparse_moe.experts.{e}.w{w}" for i in (0, 31) for e in (0, 7) for w in (1, 2, 3)
    } <= set(experts)
    assert set(experts.values()) == {"Linear"}


@pytest.mark.parametrize("model_type", EXPERTS_WRITTEN_BACK)
def test_experts_written_back_on_save_convert_as_linears_by_the_models_definition(
    model_type: str, tmp_path: Path
) -> None:
    """No module of these models' trees holds the per-expert names their files hold; their weight
    conversions say those are the Linears they merged, so they convert with no flags. Checked by computing
    experts with Burn's Linear (y = x @ weight, weight [in, out]) from the converted tensors against the
    model's own experts module. Which saved tensor is which expert's gate, up or down is found by its values
    (each slice of the fused parameters is unique at random init), not by a naming rule."""
    model = build(model_type, 3)
    model.set_experts_implementation("eager")  # the grouped kernels refuse some tiny shapes on the CPU
    model.save_pretrained(tmp_path)
    convert(ConvertRequest(source=tmp_path / "model.safetensors"))
    saved = {name: _f32(t) for name, t in read_safetensors(tmp_path / "model.safetensors").tensors.items()}
    burn = read_bpk(tmp_path / "model.bpk").tensors
    experts = next(m for m in model.modules() if type(m).__name__.endswith("Experts"))
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
    inner = down.shape[2]
    x = torch.randn(5, gate_up.shape[2])

    def burn_weight(value: torch.Tensor) -> torch.Tensor:
        names = [name for name, t in saved.items() if t is not None and t.shape == value.shape and t.equal(value)]
        assert len(names) == 1, (model_type, value.shape, names)
        found = _f32(burn[names[0]])
        assert found is not None
        return found

    for expert in range(min(4, gate_up.shape[0])):
        gate = burn_weight(gate_up[expert][:inner])
        up = burn_weight(gate_up[expert][inner:])
        with torch.no_grad():
            theirs = experts(x, torch.full((5, 1), expert), torch.ones(5, 1))
            both = x @ torch.cat([gate, up], dim=1)
            if hasattr(experts, "_apply_gate"):  # DeepSeek-V4's clamped SwiGLU
                hidden = experts._apply_gate(both)
            else:
                hidden = experts.act_fn(both[:, :inner]) * both[:, inner:]
            ours = hidden @ burn_weight(down[expert])
        assert torch.allclose(theirs, ours, atol=1e-5), (model_type, expert)
    # the router (transformers 5: a module of its own applying F.linear to its weight; HunYuan's: an
    # nn.Linear `wg` in it): Burn's Linear too
    router = next(
        m
        for n, m in model.named_modules()
        if n.endswith(("mlp.gate", "mlp.router", "gate.wg")) and hasattr(m, "weight")
    )
    with torch.no_grad():
        logits = torch.nn.functional.linear(x, router.weight)
    assert torch.allclose(logits, x @ burn_weight(router.weight.detach()), atol=1e-6), model_type


# refused without transformers, and a module of each that no convention names
NAMES_DO_NOT_DECIDE = {"deepseek_v2": "kv_a_proj_with_mqa"}  # (DeepSeek-V4: wgate; HunYuan-MoE: gate.wg)


# each way the names decide (w1/w2/w3 with `gate`; gate_proj... with `gate` and `shared_expert_gate`; a router
# subclassing nn.Linear) and a refusal; the other families were checked alike (tests run in CI cost minutes)
@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "phimoe", "deepseek_v2"])
def test_experts_convert_without_transformers_as_with_it(model_type: str, tmp_path: Path) -> None:
    """Without transformers (the daemon's own install) the names decide: Mixtral's experts.N.w1/w2/w3 (Meta's own
    w1/w2/w3), Qwen's gate_proj/up_proj/down_proj, each router `gate`: Linears. The file is then the very file
    the model's definition gives (whose experts and router the test above computes). Where a name decides
    nothing the conversion is refused, and with the map it prints every other tensor is that file's."""
    model = build(model_type, 3)
    model.save_pretrained(tmp_path)
    source = tmp_path / "model.safetensors"
    convert(ConvertRequest(source=source, dest=tmp_path / "defined.bpk"))
    named = run_cli("convert", source, "-o", tmp_path / "named.bpk", hide=("transformers",))
    defined = read_bpk(tmp_path / "defined.bpk").tensors
    if model_type not in NAMES_DO_NOT_DECIDE:
        assert named.returncode == 0, named.stderr
        assert read_bpk(tmp_path / "named.bpk").tensors == defined
        return
    assert named.returncode != 0 and NAMES_DO_NOT_DECIDE[model_type] in named.stderr.splitlines()[0], named.stderr
    printed = named.stderr.split("\n", 1)[1]  # after the error line: the map that settles it
    (tmp_path / "map.yaml").write_text(printed)
    mapped = ModuleMap.from_dict({"modules": yaml.safe_load(printed)["modules"]})
    done = run_cli(
        "convert", source, "-o", tmp_path / "named.bpk", "--modules", tmp_path / "map.yaml", hide=("transformers",)
    )
    assert done.returncode == 0, done.stderr
    converted = read_bpk(tmp_path / "named.bpk").tensors
    unmapped = [name for name in defined if mapped.lookup(name.rpartition(".")[0]) is None]
    assert len(unmapped) > len(defined) // 2
    assert {name: converted[name] for name in unmapped} == {name: defined[name] for name in unmapped}


def _f32(tensor: Tensor) -> torch.Tensor | None:
    if tensor.dtype != "F32":
        return None
    return torch.frombuffer(bytearray(tensor.data), dtype=torch.float32).reshape(tensor.shape)


# ---------------------------------------------------------------------------------------------------------
# bare save_file(state_dict): names and shapes only; the genuinely ambiguous refuse with a map that settles them

# model -> the map a refusal prints (None: converts with no flags)
BARE_REFUSALS: dict[str, dict[str, str] | None] = {
    "bert": None,
    "gpt2": {"**.c_proj": "LinearInOut"},  # attn.c_proj is square: Linear and Conv1D look alike
    "llama-untied": None,
    "llama-tied-bf16": None,
    # T5 names its attention's projections q, k, v, o: no convention says Linear (its wi, wo do)
    "t5": {
        "**.[koqv]": "Linear",
        "**.relative_attention_bias": "Embedding",
    },
    "whisper": None,
    "vit": None,
    "resnet": None,
    "convnext": None,
    "mamba": None,
    "timm-vit-layerscale": None,
    "plain": {"**.out": "Linear"},
    "plain-sequential": {"2": "PRelu"},
}
BARE_MODELS: dict[str, Callable[[], nn.Module]] = {
    **HF_MODELS,
    "timm-vit-layerscale": TimmViT,
    "plain": _plain,
    "plain-sequential": _sequential,
}


@pytest.mark.parametrize("name", sorted(BARE_MODELS))
def test_bare_state_dict_converts_or_prints_the_map_that_settles_it(tmp_path: Path, name: str) -> None:
    source = tmp_path / "weights.safetensors"
    model = save_bare(BARE_MODELS[name], source, seed=7)

    mapping = None
    try:
        convert(ConvertRequest(source=source))
    except LayoutAmbiguityError as refused:
        suggested = yaml.safe_load(refused.suggestion)
        assert suggested == {"modules": BARE_REFUSALS[name]}, refused.suggestion
        (tmp_path / "map.yaml").write_text(refused.suggestion)  # applied exactly as printed
        mapping = ModuleMap.from_yaml_file(tmp_path / "map.yaml")
        convert(ConvertRequest(source=source, module_map=mapping))
    else:
        assert BARE_REFUSALS[name] is None
    assert_burn_layout(model, source, tmp_path / "weights.bpk")

    back = tmp_path / "back.safetensors"
    convert(ConvertRequest(source=tmp_path / "weights.bpk", dest=back))  # no map: the .bpk records its kinds
    assert read_safetensors(back).tensors == read_safetensors(source).tensors
    fresh = BARE_MODELS[name]()
    fresh.load_state_dict(read_torch(back), strict=True)
    assert_same_state(model, fresh)


def read_torch(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


# ---------------------------------------------------------------------------------------------------------
# the cases of the issue


def test_gpt2_split_file_with_format_pt_round_trips_exactly(tmp_path: Path) -> None:
    """One shard holding only h.0.mlp.c_fc: its bias matches dim 1, but `format: pt` says PyTorch layout, so it
    is a Conv1D kept [in, out], and the way back keeps it too."""
    torch.manual_seed(3)
    model = _gpt2()
    state = {k: v.clone() for k, v in model.state_dict().items() if ".mlp.c_fc." in k}
    source = tmp_path / "model-00002-of-00002.safetensors"
    save_file(state, source, metadata={"format": "pt"})
    result = convert(ConvertRequest(source=source))
    assert result.source_layout == "pytorch"
    assert any("c_fc: LinearInOut" in line for line in result.decisions)
    assert_burn_layout(model, source, source.with_suffix(".bpk"))
    back = tmp_path / "back.safetensors"
    convert(ConvertRequest(source=source.with_suffix(".bpk"), dest=back))
    assert read_safetensors(back).tensors == read_safetensors(source).tensors


def test_a_format_pt_file_is_never_taken_for_burn_layout(tmp_path: Path) -> None:
    # Linears whose bias matches dim 1 would say burn layout; the metadata outranks them
    table = [TensorRef("fc.weight", "F32", (4, 6)), TensorRef("fc.bias", "F32", (6,))]
    plan = plan_conversion(table, to_layout="burn", context=FileContext(metadata={"format": "pt"}))
    assert plan.source_layout == "pytorch" and plan.kinds == {"fc": "LinearInOut"} and plan.is_identity
    with pytest.raises(LayoutAmbiguityError, match=r"source layout burn \(--layout\) contradicts the tensors"):
        plan_conversion(
            table, to_layout="pytorch", source_layout="burn", context=FileContext(metadata={"format": "pt"})
        )
    # without it, the shapes are all there is
    assert plan_conversion(table, to_layout="burn").source_layout == "burn"


def test_a_norm_named_gamma_by_its_name_alone_never_shows_burn_layout() -> None:
    """x-transformers' RMSNorm holds `gamma`, as Burn's RmsNorm does: in a file of bias-free Linears with no
    metadata that was all that showed a layout, so a PyTorch file was read as Burn's and no Linear was
    transposed (exit 0). Nothing else showing it, the conversion is refused, saying what would settle it."""
    table = [
        TensorRef("attn.norm.gamma", "F32", (16,)),
        TensorRef("attn.qkv_proj.weight", "F32", (48, 16)),
        TensorRef("attn.out_proj.weight", "F32", (16, 16)),
        TensorRef("final_norm.gamma", "F32", (16,)),
    ]
    safetensors = FileContext(container="safetensors")
    for to_layout in ("burn", "pytorch"):
        with pytest.raises(LayoutAmbiguityError, match="nothing shows whether the file is in pytorch or burn"):
            plan_conversion(table, to_layout=to_layout, context=safetensors)
    with pytest.raises(LayoutAmbiguityError, match="whether the gamma, beta or alpha of these modules are Burn's"):
        plan_conversion([table[0], table[3]], to_layout="pytorch", context=safetensors)
    # in Burn's own format the names are Burn's (a Llama saved by Burn as .bpk, no record: as before)
    bpk = plan_conversion(table, to_layout="pytorch", context=FileContext(container="burnpack"))
    assert bpk.source_layout == "burn" and {e.target for e in bpk.entries} >= {"attn.norm.weight"}
    # a LayerNorm of its own with gamma and beta, a Snake activation's alpha: no more Burn's than a lone gamma
    for module in (["ln.gamma", "ln.beta"], ["act.alpha"]):
        tensors = [TensorRef(name, "F32", (16,)) for name in module] + [table[2]]
        with pytest.raises(LayoutAmbiguityError, match="nothing shows whether the file is in pytorch or burn"):
            plan_conversion(tensors, to_layout="burn", context=FileContext(container="safetensors"))
        assert (
            plan_conversion(tensors, to_layout="pytorch", context=FileContext(container="burnpack")).source_layout
            == "burn"
        )
    # anything else that shows the layout settles it, and the norms' names must agree
    biased = [*table, TensorRef("attn.qkv_proj.bias", "F32", (48,))]
    assert plan_conversion(biased, to_layout="burn", context=safetensors).source_layout == "pytorch"
    stated = plan_conversion(table, to_layout="pytorch", source_layout="burn", context=safetensors)
    assert [e.target for e in stated.entries if "norm" in e.target] == ["attn.norm.weight", "final_norm.weight"]


def test_weight_and_bias_names_of_a_module_of_ones_own_never_show_pytorch_layout_alone_in_a_bpk() -> None:
    """The mirror case in Burn's own format: a Burn model with a hand-written RMSNorm whose parameter is
    `weight` (Burn's norms say gamma) was read as PyTorch's, and its Linears went to PyTorch untransposed,
    exit 0. Nothing else showing the layout, it is refused; `--layout burn` converts it, the module kept."""
    table = [
        TensorRef("fc.weight", "F32", (4, 4)),
        TensorRef("fc.bias", "F32", (4,)),
        TensorRef("norm.weight", "F32", (4,)),
        TensorRef("affine.weight", "F32", (4,)),
        TensorRef("affine.bias", "F32", (4,)),
    ]
    bpk = FileContext(container="burnpack")
    with pytest.raises(LayoutAmbiguityError, match="nothing shows whether the file is in pytorch or burn"):
        plan_conversion(table, to_layout="pytorch", context=bpk)
    stated = plan_conversion(table, to_layout="pytorch", source_layout="burn", context=bpk)
    assert {e.source for e in stated.entries if e.transpose} == {"fc.weight"}
    assert {e.target for e in stated.entries} == {t.name for t in table}  # its own module's names kept
    # in a .safetensors the names are PyTorch's, as before; in a .bpk, shapes or running stats still show it
    assert plan_conversion(table, to_layout="burn", context=FileContext(container="safetensors")).source_layout == (
        "pytorch"
    )
    biased = [*table[2:], TensorRef("head.weight", "F32", (5, 4)), TensorRef("head.bias", "F32", (5,))]
    assert plan_conversion(biased, to_layout="burn", context=bpk).source_layout == "pytorch"
    stats = [TensorRef(f"bn.{leaf}", "F32", (4,)) for leaf in ("weight", "bias", "running_mean", "running_var")]
    assert plan_conversion([*stats, *table[:2]], to_layout="burn", context=bpk).source_layout == "pytorch"


def test_a_bias_matching_dim_1_never_shows_burn_layout_alone_in_a_pytorch_container() -> None:
    """transformers' Conv1D (GPT-2's layers) keeps its weight [in, out] with a bias matching dim 1, as Burn's
    Linear does: a PyTorch .safetensors of Conv1D layers and a bias-free nn.Linear, without `format: pt`, was
    read as Burn's and the Linear left [out, in], exit 0. Nothing else showing the layout, it is refused."""
    table = [
        TensorRef("c_fc.weight", "F32", (8, 16)),
        TensorRef("c_fc.bias", "F32", (16,)),
        TensorRef("out_proj.weight", "F32", (8, 8)),
    ]
    for container in ("safetensors", "pytorch"):
        with pytest.raises(LayoutAmbiguityError, match="nothing shows whether the file is in pytorch or burn"):
            plan_conversion(table, to_layout="burn", context=FileContext(container=container))
    # in Burn's own format it is Burn's Linear (named otherwise than Conv1D's layers: see test_conventions.py)
    fc = [
        TensorRef("fc" + t.name.removeprefix("c_fc"), t.dtype, t.shape) if t.name.startswith("c_fc") else t
        for t in table
    ]
    bpk = plan_conversion(fc, to_layout="pytorch", context=FileContext(container="burnpack"))
    assert bpk.source_layout == "burn" and bpk.kinds["fc"] == "Linear"
    # a Linear whose bias shows pytorch layout settles it, and the Conv1D layers are no conflict
    head = [TensorRef("head.weight", "F32", (5, 8)), TensorRef("head.bias", "F32", (5,))]
    mixed = plan_conversion([*table, *head], to_layout="burn", context=FileContext(container="safetensors"))
    assert mixed.source_layout == "pytorch"
    assert (mixed.kinds["c_fc"], mixed.kinds["head"], mixed.kinds["out_proj"]) == ("LinearInOut", "Linear", "Linear")
    transposed = {e.source for e in mixed.entries if e.transpose}
    assert transposed == {"head.weight", "out_proj.weight"}


def test_a_burn_saved_bpk_whose_only_evidence_is_its_norms_gamma_converts(tmp_path: Path) -> None:
    """Burn's own Llama saved as .bpk (RmsNorm gamma, bias-free Linears [in, out], no record of syncd's): its
    names are Burn's, as they were before names of a .safetensors stopped deciding alone."""
    from formatgen import bytes_spec, write_bpk

    weight = bytes(range(48)) * 4  # [16, 3] F32 as Burn stores a Linear(16 -> 3): [in, out]
    write_bpk(
        tmp_path / "llama.bpk",
        [
            bytes_spec("layers.0.norm.gamma", "F32", (3,), bytes(12)),
            bytes_spec("layers.0.q_proj.weight", "F32", (16, 3), weight),
        ],
    )
    result = convert(ConvertRequest(source=tmp_path / "llama.bpk", dest=tmp_path / "llama.safetensors"))
    assert result.source_layout == "burn"
    out = read_safetensors(tmp_path / "llama.safetensors").tensors
    assert out["layers.0.q_proj.weight"].shape == (3, 16) and "layers.0.norm.weight" in out


def test_layer_scale_gamma_is_left_as_it_is_in_both_directions() -> None:
    burn_side = [TensorRef("blocks.0.norm1.gamma", "F32", (8,)), TensorRef("blocks.0.ls1.gamma", "F32", (8,))]
    torch_side = [TensorRef("blocks.0.norm1.weight", "F32", (8,)), TensorRef("blocks.0.ls1.gamma", "F32", (8,))]
    to_torch = plan_conversion(burn_side, to_layout="pytorch")
    to_burn = plan_conversion(torch_side, to_layout="burn")
    assert [e.target for e in to_torch.entries] == [t.name for t in torch_side]
    assert [e.target for e in to_burn.entries] == [t.name for t in burn_side]
    # unnamed, a lone gamma in a pytorch-layout file is no norm parameter: unchanged, never renamed
    unnamed = [
        TensorRef("norm.weight", "F32", (8,)),
        TensorRef("norm.bias", "F32", (8,)),
        TensorRef("scale.gamma", "F32", (8,)),
    ]
    assert plan_conversion(unnamed, to_layout="burn").kinds["scale"] == "Other"


# ---------------------------------------------------------------------------------------------------------
# PyTorch's packed tensors (docs/burn-adapters.md#packed-modules): MHA in_proj and RNN gates split into Burn's Linears


class _Attention(nn.Module):
    """An nn.MultiheadAttention inside a model, beside a plain Linear."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, bias=bias)
        self.head = nn.Linear(8, 3)


PACKED_MODELS: dict[str, Callable[[], nn.Module]] = {
    "nn.Transformer": lambda: nn.Transformer(
        d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=24, batch_first=True
    ),
    "mha": lambda: _Attention(bias=True),
    "mha-no-bias": lambda: _Attention(bias=False),
    "lstm": lambda: nn.LSTM(4, 3),
    "bigru": lambda: nn.GRU(4, 3, bidirectional=True),
    "rnn": lambda: nn.RNN(5, 3),
    "lstm-no-bias": lambda: nn.LSTM(4, 3, bias=False),
}

# PyTorch's chunk order -> Burn's fields (docs/burn-adapters.md#packed-modules), written out here independently of syncd
_GATES = {
    "LSTM": ("input_gate", "forget_gate", "cell_gate", "output_gate"),
    "GRU": ("reset_gate", "update_gate", "new_gate"),
    "RNN_TANH": ("gate",),
}


def _packed_burn(model: nn.Module) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Burn name -> tensor for every packed module of `model`, and the PyTorch names they replace."""
    burn: dict[str, torch.Tensor] = {}
    replaced: set[str] = set()
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        state = {f"{prefix}{k}": v for k, v in module.state_dict().items()}
        if isinstance(module, nn.MultiheadAttention):
            w, e = module.in_proj_weight.detach(), module.embed_dim
            for k, name in enumerate(("query", "key", "value")):  # rows q, k, v; each Linear [in, out]
                burn[f"{prefix}{name}.weight"] = w[k * e : (k + 1) * e].T
                if module.in_proj_bias is not None:
                    burn[f"{prefix}{name}.bias"] = module.in_proj_bias.detach()[k * e : (k + 1) * e]
            burn[f"{prefix}output.weight"] = module.out_proj.weight.detach().T
            if module.out_proj.bias is not None:
                burn[f"{prefix}output.bias"] = module.out_proj.bias.detach()
            replaced |= set(state)
        elif isinstance(module, nn.RNNBase):
            burn.update(_gates_burn(module, prefix))
            replaced |= set(state)
    return {name: value.contiguous() for name, value in burn.items()}, replaced


def _gates_burn(module: nn.RNNBase, prefix: str) -> dict[str, torch.Tensor]:
    gates = _GATES[module.mode]
    hidden = module.hidden_size
    burn = {}
    for suffix, field in (("", "forward"), ("_reverse", "reverse"))[: 2 if module.bidirectional else 1]:
        within = f"{prefix}{field}." if module.bidirectional else prefix
        for k, gate in enumerate(gates):
            rows = slice(k * hidden, (k + 1) * hidden)
            for side, transform in (("ih", "input_transform"), ("hh", "hidden_transform")):
                burn[f"{within}{gate}.{transform}.weight"] = getattr(module, f"weight_{side}_l0{suffix}")[rows].T
                if module.bias:
                    burn[f"{within}{gate}.{transform}.bias"] = getattr(module, f"bias_{side}_l0{suffix}")[rows]
    return {name: value.detach() for name, value in burn.items()}


def _torch_bytes(value: torch.Tensor) -> tuple[tuple[int, ...], bytes]:
    return tuple(value.shape), value.detach().contiguous().numpy().tobytes()


def assert_packed_burn_layout(model: nn.Module, source: Path, bpk: Path) -> None:
    """Every .bpk tensor as Burn's modules hold it: packed modules split per docs/burn-adapters.md#packed-modules, the
    rest as their module types say."""
    packed, replaced = _packed_burn(model)
    expected = {
        name: value for name, value in expected_burn(model, read_safetensors(source)).items() if name not in replaced
    }
    expected.update({name: _torch_bytes(value) for name, value in packed.items()})
    assert_bpk_holds(bpk, expected)


@pytest.mark.parametrize("name", sorted(PACKED_MODELS))
def test_packed_modules_convert_with_no_flags_and_come_back_bit_exact(tmp_path: Path, name: str) -> None:
    source = tmp_path / "packed.safetensors"
    model = save_bare(PACKED_MODELS[name], source, seed=2)
    to_burn = convert(ConvertRequest(source=source))
    assert to_burn.source_layout == "pytorch"
    assert_packed_burn_layout(model, source, tmp_path / "packed.bpk")

    back = tmp_path / "back.safetensors"
    convert(ConvertRequest(source=tmp_path / "packed.bpk", dest=back, verify="full"))  # no map, no flag
    assert read_safetensors(back).tensors == read_safetensors(source).tensors
    fresh = PACKED_MODELS[name]()
    fresh.load_state_dict(read_torch(back), strict=True)
    assert_same_state(model, fresh)
    for key, value in model.state_dict().items():
        assert torch.equal(value, fresh.state_dict()[key]), key


def test_the_chunk_order_is_pytorchs(tmp_path: Path) -> None:
    """Each chunk of rows holds its own constant: a gate or projection taken from the wrong rows shows."""
    lstm, attn = nn.LSTM(2, 3), nn.MultiheadAttention(4, 2)
    with torch.no_grad():
        for tensor in (lstm.weight_ih_l0, lstm.weight_hh_l0, lstm.bias_ih_l0, lstm.bias_hh_l0):
            tensor.copy_(torch.arange(4).repeat_interleave(3).reshape(12, *[1] * (tensor.dim() - 1)).expand_as(tensor))
        attn.in_proj_weight.copy_(torch.arange(3).repeat_interleave(4)[:, None].expand(12, 4) + 10.0)
        attn.in_proj_bias.copy_(torch.arange(3).repeat_interleave(4) + 20.0)
    state = {f"rnn.{k}": v for k, v in lstm.state_dict().items()}
    state |= {f"attn.{k}": v for k, v in attn.state_dict().items()}
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "m.safetensors")
    convert(ConvertRequest(source=tmp_path / "m.safetensors"))
    burn = {
        name: torch.frombuffer(bytearray(t.data), dtype=torch.float32).reshape(t.shape)
        for name, t in read_bpk(tmp_path / "m.bpk").tensors.items()
    }
    for k, gate in enumerate(("input_gate", "forget_gate", "cell_gate", "output_gate")):  # i, f, g, o
        for leaf in ("input_transform.weight", "hidden_transform.weight", "input_transform.bias"):
            assert torch.all(burn[f"rnn.{gate}.{leaf}"] == k), (gate, leaf)
    for k, field in enumerate(("query", "key", "value")):
        assert torch.all(burn[f"attn.{field}.weight"] == 10 + k) and torch.all(burn[f"attn.{field}.bias"] == 20 + k)
    convert(ConvertRequest(source=tmp_path / "m.bpk", dest=tmp_path / "back.safetensors"))
    back = read_safetensors(tmp_path / "back.safetensors")
    assert back.tensors == read_safetensors(tmp_path / "m.safetensors").tensors


@pytest.mark.slow
@pytest.mark.parametrize(
    ("build", "tensor", "why"),
    [
        (lambda: nn.LSTM(4, 3, num_layers=2), "bias_hh_l1", "layers l1\\+ need separate Burn modules"),
        (lambda: nn.LSTM(4, 3, proj_size=2), "weight_hr_l0", "a projection \\(proj_size\\)"),
        (lambda: nn.MultiheadAttention(8, 2, kdim=4, vdim=4), "k_proj_weight", "no separate q/k/v projections"),
        (lambda: nn.MultiheadAttention(8, 2, add_bias_kv=True), "bias_k", "no bias_k/bias_v"),
    ],
    ids=["lstm-layer-1", "lstm-proj-size", "mha-kdim-vdim", "mha-bias-kv"],
)
def test_packed_tensors_without_a_burn_slot_are_refused_naming_the_tensor(
    tmp_path: Path, build: Callable, tensor: str, why: str
) -> None:
    source = tmp_path / "packed.safetensors"
    model = save_bare(build, source, seed=2)
    with pytest.raises(
        UnsupportedError,
        match=f"tensor '{tensor}': .*{why}.*; map .* as Other to leave its "
        "tensors unchanged, or convert with --layout keep",
    ):
        convert(ConvertRequest(source=source))
    assert not (tmp_path / "packed.bpk").exists()
    done = run_cli("convert", source)
    assert done.returncode != 0 and len(done.stderr.strip().splitlines()) == 1 and tensor in done.stderr
    convert(ConvertRequest(source=source, layout="keep"))  # the advice works
    back = tmp_path / "back.safetensors"
    convert(ConvertRequest(source=source.with_suffix(".bpk"), dest=back, layout="keep"))
    fresh = build()
    fresh.load_state_dict(read_torch(back), strict=True)
    assert_same_state(model, fresh)


@pytest.mark.daemon
def test_the_sync_log_records_each_decision_with_its_source(tmp_path: Path) -> None:
    """The daemon converts a save_pretrained directory dropped into a watch; its log line says where each
    decision came from (the model's definition, config.json, names, metadata) and the way back needs nothing
    either."""
    from daemonutil import DaemonRun

    torch.manual_seed(4)
    model = _gpt2()
    model.save_pretrained(tmp_path / "saved")
    with DaemonRun(tmp_path / "daemon") as run:
        runs = run.watch_dir("runs")
        shutil.copy(tmp_path / "saved" / "config.json", runs / "config.json")  # the config lands first
        run.start()
        shutil.copy(tmp_path / "saved" / "model.safetensors", tmp_path / "model.safetensors")
        os.rename(tmp_path / "model.safetensors", runs / "model.safetensors")
        run.wait_for("converted", [runs / "model.safetensors"])
        (record,) = run.statuses("converted", runs / "model.safetensors")
    layout = record["layout"]
    assert layout[0] == "pytorch -> burn"
    assert "config.json model_type 'gpt2': known architecture gpt2" in layout
    assert any(line.startswith("source layout: pytorch (shown by format: pt metadata") for line in layout)
    assert "module types from the model definition GPT2LMHeadModel (transformers " + hf.__version__ + ")" in layout
    assert any(line.startswith("transformer.wte: Embedding (model definition GPT2LMHeadModel") for line in layout)
    assert_burn_layout(model, tmp_path / "saved" / "model.safetensors", runs / "model.bpk")


@pytest.mark.parametrize(
    ("make", "note"),
    [
        (lambda path: path.write_text("{not json"), "config.json beside it not used: not JSON"),
        (lambda path: path.write_text("[1, 2]"), "config.json beside it not used: not a JSON object"),
        (lambda path: os.mkfifo(path), "config.json beside it not used: not a regular file"),
        (lambda path: path.symlink_to(path.parent / "elsewhere.json"), "config.json beside it not used:"),
        (
            lambda path: path.write_text('{"model_type": "no-such-family"}'),
            "config.json: model_type 'no-such-family' is not in",
        ),
    ],
    ids=["bad-json", "not-an-object", "fifo", "symlink", "unknown-family"],
)
def test_an_unusable_config_json_is_noted_and_names_and_shapes_decide(
    tmp_path: Path, make: Callable, note: str
) -> None:
    (tmp_path / "elsewhere.json").write_text('{"model_type": "gpt2"}')
    make(tmp_path / "config.json")
    torch.manual_seed(5)
    model = _bert()
    save_file(_bare_state(model), tmp_path / "weights.safetensors", metadata={"format": "pt"})
    result = convert(ConvertRequest(source=tmp_path / "weights.safetensors"))
    assert any(line.startswith(note) for line in result.decisions), result.decisions
    assert_burn_layout(model, tmp_path / "weights.safetensors", tmp_path / "weights.bpk")


def _burn_attention_table(prefix: str = "blocks.0.attn") -> list[TensorRef]:
    """A Burn MultiHeadAttention's tensors (docs/burn-adapters.md#packed-modules), beside a LayerNorm that shows burn
    layout."""
    table = [
        TensorRef(f"{prefix}.{field}.{leaf}", "F32", (8, 8) if leaf == "weight" else (8,))
        for field in ("query", "key", "value", "output")
        for leaf in ("weight", "bias")
    ]
    return [*table, TensorRef("blocks.0.norm.gamma", "F32", (8,)), TensorRef("blocks.0.norm.beta", "F32", (8,))]


def test_query_key_value_names_alone_are_never_joined_a_map_or_record_joins_them() -> None:
    """A PyTorch custom attention has query/key/value/output Linears too: only recorded or mapped evidence
    makes them one packed nn.MultiheadAttention."""
    table = _burn_attention_table()
    alone = plan_conversion(table, to_layout="pytorch")
    assert not any(e.parts for e in alone.entries)
    assert alone.kinds["blocks.0.attn.query"] == "Linear"
    mapped = plan_conversion(
        table, to_layout="pytorch", module_map=ModuleMap.from_dict({"modules": {"**.attn": "MultiHeadAttention"}})
    )
    recorded = plan_conversion(
        table, to_layout="pytorch", context=FileContext(recorded_kinds={"blocks.0.attn": "MultiHeadAttention"})
    )
    for plan in (mapped, recorded):
        targets = {e.target: e for e in plan.entries}
        joined = targets["blocks.0.attn.in_proj_weight"]
        assert (
            joined.shape == (24, 8)
            and [p.source for p in joined.parts]
            == ["blocks.0.attn.query.weight", "blocks.0.attn.key.weight", "blocks.0.attn.value.weight"]
            and all(p.transpose for p in joined.parts)
        )
        assert targets["blocks.0.attn.out_proj.weight"].transpose
        assert plan.kinds["blocks.0.attn"] == "MultiHeadAttention"
    assert any(line.startswith("blocks.0.attn: MultiHeadAttention (module map '**.attn')") for line in mapped.decisions)


def test_burn_gate_names_are_evidence_of_themselves() -> None:
    """Burn's GateController names are Burn's own: a Burn-native LSTM (no record, no map) is joined."""
    gates = ("input_gate", "forget_gate", "cell_gate", "output_gate")
    table = [
        TensorRef(f"rnn.{gate}.{transform}.{leaf}", "F32", shape)
        for gate in gates
        for transform, shape in (("input_transform", (4, 3)), ("hidden_transform", (3, 3)))
        for leaf in ("weight",)
    ]
    plan = plan_conversion(table, to_layout="pytorch")
    assert plan.source_layout == "burn" and plan.kinds == {"rnn": "Lstm"}
    assert [(e.target, e.shape) for e in plan.entries] == [("rnn.weight_ih_l0", (12, 4)), ("rnn.weight_hh_l0", (12, 3))]


def test_a_map_stating_a_packed_kind_that_the_tensors_do_not_fit_is_refused() -> None:
    from syncd.errors import ConfigError

    table = _burn_attention_table()[:-4]  # no value, no output
    with pytest.raises(ConfigError, match="blocks.0.attn: mapped as MultiHeadAttention, but it has no blocks.0.attn"):
        plan_conversion(
            table,
            to_layout="pytorch",
            module_map=ModuleMap.from_dict({"modules": {"blocks.0.attn": "MultiHeadAttention"}}),
        )
    torch_side = [TensorRef(k, "F32", tuple(v.shape)) for k, v in nn.GRU(4, 3).state_dict().items()]
    with pytest.raises(ConfigError, match="maps '\\(root\\)' to Lstm, but its tensors are those of a Gru"):
        plan_conversion(torch_side, to_layout="burn", module_map=ModuleMap.from_dict({"modules": {"": "Lstm"}}))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "precision", "dtype"),
    [("mha", "f16", torch.float16), ("lstm", "bf16", torch.bfloat16), ("bigru", "f16", torch.float16)],
)
def test_a_packed_module_is_cast_piece_by_piece_and_joined_back(
    tmp_path: Path, name: str, precision: str, dtype: torch.dtype
) -> None:
    """Burn's HalfPrecisionAdapter casts the Linears a packed module is split into
    (docs/burn-adapters.md#half-precision): every split piece is the cast of its rows, and `--precision f32` joins the
    cast pieces back into the packed tensors, each value the original rounded once."""
    source = tmp_path / "packed.safetensors"
    model = save_bare(PACKED_MODELS[name], source, seed=4)
    done = run_cli("convert", source, "--precision", precision)
    assert done.returncode == 0, done.stderr
    packed, replaced = _packed_burn(model)
    expected = {k: v for k, v in expected_burn(model, read_safetensors(source)).items() if k not in replaced}
    burn = read_bpk(tmp_path / "packed.bpk").tensors
    assert set(burn) == set(expected) | set(packed)
    for key, value in packed.items():
        assert burn[key].dtype == ("F16" if dtype == torch.float16 else "BF16"), key
        assert burn[key].data == _bits(value.to(dtype)), key

    back = run_cli(
        "convert",
        tmp_path / "packed.bpk",
        "-o",
        tmp_path / "back.safetensors",
        "--precision",
        "f32",
        "--verify",
        "full",
    )
    assert back.returncode == 0, back.stderr
    fresh = PACKED_MODELS[name]()
    fresh.load_state_dict(read_torch(tmp_path / "back.safetensors"), strict=True)
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value.to(dtype).to(torch.float32)), key


def _save_as_set(state: dict[str, torch.Tensor], directory: Path, split: list[list[str]]) -> Path:
    """`state` saved as a sharded set, as save_pretrained lays one out: the shards (`split`: the names each
    holds), then the index."""
    from syncd.formats.shards import render_index, shard_file_names

    directory.mkdir()
    weight_map = {}
    for file, names in zip(shard_file_names(len(split)), split, strict=True):
        save_file({name: state[name] for name in names}, directory / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    total = sum(value.numel() * value.element_size() for value in state.values())
    index = directory / "model.safetensors.index.json"
    index.write_bytes(render_index({"total_size": total}, weight_map))
    return index


@pytest.mark.slow
def test_a_packed_module_in_a_sharded_set_is_split_and_joined_both_ways(tmp_path: Path) -> None:
    """nn.MultiheadAttention in a set whose shards cut the model apart (the attention's in_proj in one shard,
    its out_proj in the other): one .bpk equal to the single file's; back as the same set byte for byte, as
    one file, and split anew with --shard-size."""
    torch.manual_seed(5)
    state = _bare_state(_Attention(bias=True))
    save_file(state, tmp_path / "single.safetensors")
    first = ["attn.in_proj_weight", "attn.in_proj_bias"]
    index = _save_as_set(state, tmp_path / "set", [first, [name for name in state if name not in first]])
    done = run_cli("convert", index, "-o", tmp_path / "set.bpk")
    assert done.returncode == 0, done.stderr
    assert run_cli("convert", tmp_path / "single.safetensors").returncode == 0
    converted = read_bpk(tmp_path / "set.bpk").tensors
    assert converted == read_bpk(tmp_path / "single.bpk").tensors
    assert {"attn.query.weight", "attn.key.bias", "attn.output.weight"} <= converted.keys()
    back = run_cli("convert", tmp_path / "set.bpk", "-o", tmp_path / "back.safetensors")
    assert back.returncode == 0, back.stderr
    original = read_safetensors(tmp_path / "single.safetensors").tensors
    assert read_safetensors(tmp_path / "back.safetensors").tensors == original
    (tmp_path / "set-back").mkdir()
    assert run_cli("convert", tmp_path / "set.bpk", "-o", tmp_path / "set-back").returncode == 0
    assert sorted(os.listdir(tmp_path / "set-back")) == sorted(os.listdir(index.parent))
    assert all(
        (tmp_path / "set-back" / name).read_bytes() == (index.parent / name).read_bytes()
        for name in os.listdir(index.parent)
    )
    (tmp_path / "split").mkdir()
    split = run_cli("convert", tmp_path / "single.bpk", "-o", tmp_path / "split", "--shard-size", "200")
    assert split.returncode == 0, split.stderr
    shards = sorted((tmp_path / "split").glob("*.safetensors"))
    assert len(shards) > 2
    joined = {name: t for shard in shards for name, t in read_safetensors(shard).tensors.items()}
    assert joined == original


@pytest.mark.daemon
def test_convert_v_and_the_sync_log_show_each_packed_decision_and_its_evidence(tmp_path: Path) -> None:
    from daemonutil import DaemonRun

    model = save_bare(lambda: nn.LSTM(4, 3), tmp_path / "lstm.safetensors", seed=6)
    done = run_cli("convert", tmp_path / "lstm.safetensors", "-v")
    assert done.returncode == 0, done.stderr
    split = (
        "(root): Lstm (PyTorch weight_hh_l0 [12, 3]: 4 chunk(s) of 3 rows) -> split the rows i, f, g, o of "
        "weight/bias_ih_l0, _hh_l0 into input_gate, forget_gate, cell_gate, output_gate"
    )
    assert any(line.strip().startswith(split) for line in done.stdout.splitlines()), done.stdout
    back = run_cli("convert", tmp_path / "lstm.bpk", "-o", tmp_path / "back.safetensors", "-v")
    assert back.returncode == 0, back.stderr
    assert "(root): Lstm (recorded in the file (syncd.kinds)) -> join input_gate" in back.stdout

    with DaemonRun(tmp_path / "daemon") as run:
        runs = run.watch_dir("runs")
        run.start()
        save_file(_bare_state(model), tmp_path / "staged.safetensors")
        os.rename(tmp_path / "staged.safetensors", runs / "lstm.safetensors")
        run.wait_for("converted", [runs / "lstm.safetensors"])
        (record,) = run.statuses("converted", runs / "lstm.safetensors")
    assert record["layout"][0] == "pytorch -> burn"
    assert any(line.startswith(split) for line in record["layout"]), record["layout"]
    assert read_bpk(runs / "lstm.bpk").tensors == read_bpk(tmp_path / "lstm.bpk").tensors


class _Stacked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(4, 3, num_layers=2)
        self.head = nn.Linear(3, 2)


def test_a_packed_module_mapped_as_other_is_left_as_it_is_both_ways(tmp_path: Path) -> None:
    """The refusal's other advice: the stacked LSTM keeps PyTorch's tensors, the rest converts."""
    source = tmp_path / "stacked.safetensors"
    model = save_bare(_Stacked, source, seed=8)
    (tmp_path / "map.yaml").write_text('modules:\n  "rnn": Other\n')
    convert(ConvertRequest(source=source, module_map=ModuleMap.from_yaml_file(tmp_path / "map.yaml")))
    burn = read_bpk(tmp_path / "stacked.bpk").tensors
    assert burn["rnn.weight_ih_l1"].data == read_safetensors(source).tensors["rnn.weight_ih_l1"].data
    assert burn["head.weight"].shape == (3, 2)
    back = tmp_path / "back.safetensors"
    convert(ConvertRequest(source=tmp_path / "stacked.bpk", dest=back))  # no map: the .bpk records its kinds
    fresh = _Stacked()
    fresh.load_state_dict(read_torch(back), strict=True)
    assert_same_state(model, fresh)


def test_a_burn_file_comes_back_with_its_order_and_param_ids_after_a_join_and_a_split(tmp_path: Path) -> None:
    """A Burn-native .bpk (param ids, no syncd record) joined by a module map into PyTorch's in_proj, then split
    again with no map: the same tensors, data order and param ids (carried under the pieces' own names)."""
    from formatgen import bytes_spec, write_bpk

    source = tmp_path / "t.safetensors"
    save_bare(PACKED_MODELS["nn.Transformer"], source, seed=9)
    convert(ConvertRequest(source=source, dest=tmp_path / "made.bpk"))
    made = read_bpk(tmp_path / "made.bpk")
    native = tmp_path / "native.bpk"
    write_bpk(
        native,
        [
            bytes_spec(
                name, made.tensors[name].dtype, made.tensors[name].shape, made.tensors[name].data, param_id=1000 + 7 * i
            )
            for i, name in enumerate(reversed(made.order))
        ],
    )
    attention = ModuleMap.from_dict(
        {"modules": {"**.self_attn": "MultiHeadAttention", "**.multihead_attn": "MultiHeadAttention"}}
    )
    convert(ConvertRequest(source=native, dest=tmp_path / "torch.safetensors", module_map=attention))
    fresh = PACKED_MODELS["nn.Transformer"]()
    fresh.load_state_dict(read_torch(tmp_path / "torch.safetensors"), strict=True)
    convert(ConvertRequest(source=tmp_path / "torch.safetensors", dest=tmp_path / "again.bpk"))
    first, again = read_bpk(native), read_bpk(tmp_path / "again.bpk")
    assert again.tensors == first.tensors and again.order == first.order
    assert again.param_ids() == first.param_ids()


# Remap rules from nn.TransformerEncoder's names to Burn's TransformerEncoder fields
# (docs/burn-adapters.md#transformer-norms: self_attn -> mha, linear1/linear2 -> pwff.linear_inner/linear_outer, norms
# by norm_first), as docs/store-options.md gives them.
ENCODER_RULES = (r"\.self_attn\.=.mha.", r"\.linear1\.=.pwff.linear_inner.", r"\.linear2\.=.pwff.linear_outer.")
NORM_RULES = {
    False: (r"\.norm1\.=.norm_1.", r"\.norm2\.=.norm_2."),  # post-norm: norm_k <-> normk
    True: (r"\.norm1\.=.norm_2.", r"\.norm2\.=.norm_1."),  # pre-norm: Burn applies norm_2 before attention
}


def _burn_encoder_names(layers: int) -> set[str]:
    """The record of Burn's TransformerEncoder (docs/burn-adapters.md#transformer-norms), written out from its
    fields."""
    fields = [f"mha.{p}.{leaf}" for p in ("query", "key", "value", "output") for leaf in ("weight", "bias")]
    fields += [f"pwff.{p}.{leaf}" for p in ("linear_inner", "linear_outer") for leaf in ("weight", "bias")]
    fields += [f"{n}.{leaf}" for n in ("norm_1", "norm_2") for leaf in ("gamma", "beta")]
    return {f"layers.{i}.{name}" for i in range(layers) for name in fields}


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_transformer_encoder_with_the_readmes_rules_has_burns_names_and_comes_back(
    tmp_path: Path, norm_first: bool
) -> None:
    def build() -> nn.Module:
        layer = nn.TransformerEncoderLayer(16, 2, 24, batch_first=True, norm_first=norm_first)
        return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    source = tmp_path / "encoder.safetensors"
    model = save_bare(build, source, seed=3)
    rules = [arg for rule in (*ENCODER_RULES, *NORM_RULES[norm_first]) for arg in ("--remap", rule)]
    done = run_cli("convert", source, "-o", tmp_path / "encoder.bpk", *rules)
    assert done.returncode == 0, done.stderr
    burn = read_bpk(tmp_path / "encoder.bpk").tensors
    assert set(burn) == _burn_encoder_names(2)
    assert burn["layers.1.pwff.linear_inner.weight"].shape == (16, 24)  # Burn's Linear: [d_model, d_ff]
    first = "norm_2" if norm_first else "norm_1"  # the norm Burn applies first is PyTorch's norm1 either way
    norm1 = model.layers[1].norm1.weight.detach().numpy().tobytes()
    assert burn[f"layers.1.{first}.gamma"].data == norm1
    query = model.layers[0].self_attn.in_proj_weight.detach()[:16].T.contiguous().numpy().tobytes()
    assert burn["layers.0.mha.query.weight"].data == query

    back = run_cli("convert", tmp_path / "encoder.bpk", "-o", tmp_path / "back.safetensors")  # no rules
    assert back.returncode == 0, back.stderr
    assert read_safetensors(tmp_path / "back.safetensors").tensors == read_safetensors(source).tensors
