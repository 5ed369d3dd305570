"""Tiny `transformers` models of many families, saved with save_pretrained, and the Burn layout each tensor must
have, computed from the live module tree (the type of the module that owns the tensor), never from syncd.

`tiny_config(model_type)` shrinks a family's default config (hidden 32, 1 layer, small vocab) by setting
whichever of the usual size attributes the config has; `OVERRIDES` holds what a family names differently.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers as hf
from torch import nn
from transformers.models.auto import modeling_auto

# Size attributes families use, shrunk where a config has them.
TINY: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "intermediate_size": 48,
    "max_position_embeddings": 64,
    "d_model": 32,
    "encoder_layers": 1,
    "decoder_layers": 1,
    "encoder_attention_heads": 2,
    "decoder_attention_heads": 2,
    "encoder_ffn_dim": 48,
    "decoder_ffn_dim": 48,
    "n_embd": 32,
    "n_layer": 1,
    "n_head": 2,
    "n_positions": 64,
    "n_inner": 48,
    "num_layers": 1,
    "num_heads": 2,
    "d_ff": 48,
    "d_kv": 16,
    "ffn_dim": 48,
    "embedding_size": 32,
    "image_size": 32,
    "patch_size": 8,
    "num_channels": 3,
    "head_dim": 16,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "decoder_start_token_id": 0,
}

# What a family's config calls differently, or needs to stay consistent at this size.
OVERRIDES: dict[str, dict[str, Any]] = {
    "whisper": {"num_mel_bins": 16, "max_source_positions": 32, "max_target_positions": 32},
    "phi3": {"pad_token_id": 0},
    "gemma2": {"head_dim": 16},
    "mamba": {"state_size": 4, "expand": 2, "conv_kernel": 2},
    "mamba2": {"num_heads": 4, "head_dim": 16, "state_size": 4, "n_groups": 1, "expand": 2, "conv_kernel": 2},
    "convnext": {"hidden_sizes": [8, 16], "depths": [1, 1], "num_stages": 2},
    "resnet": {"hidden_sizes": [8, 16], "depths": [1, 1], "embedding_size": 8},
    "regnet": {"hidden_sizes": [8, 16], "depths": [1, 1], "embedding_size": 8, "groups_width": 8},
    "poolformer": {"hidden_sizes": [8, 16], "depths": [1, 1], "num_encoder_blocks": 2},
    "mobilevit": {"hidden_sizes": [16, 16, 16], "neck_hidden_sizes": [8, 8, 8, 8, 8, 8, 16]},
    "mobilebert": {"embedding_size": 16, "intra_bottleneck_size": 16, "true_hidden_size": 16},
    "wav2vec2": {"conv_dim": [8, 8], "conv_stride": [5, 2], "conv_kernel": [10, 3], "num_conv_pos_embeddings": 4},
    "hubert": {"conv_dim": [8, 8], "conv_stride": [5, 2], "conv_kernel": [10, 3], "num_conv_pos_embeddings": 4},
    "falcon": {"new_decoder_architecture": False, "num_kv_heads": 2},
    "bloom": {"n_head": 2},
    "deberta": {"relative_attention": True, "pos_att_type": ["c2p", "p2c"]},
    "deberta-v2": {"relative_attention": True, "pos_att_type": ["c2p", "p2c"]},
    "blenderbot": {"max_position_embeddings": 64},
}

# Model types of the sweep: every family here has a small config; the first nine are in syncd's
# architectures table, the rest are not.
SWEEP_TYPES = (
    "bert",
    "gpt2",
    "llama",
    "t5",
    "whisper",
    "vit",
    "resnet",
    "convnext",
    "mamba",
    "roberta",
    "distilbert",
    "albert",
    "electra",
    "gpt_neox",
    "gptj",
    "opt",
    "bloom",
    "falcon",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "phi",
    "phi3",
    "stablelm",
    "starcoder2",
    "mpt",
    "codegen",
    "xglm",
    "bart",
    "mbart",
    "pegasus",
    "marian",
    "blenderbot",
    "deberta",
    "deberta-v2",
    "mobilebert",
    "convbert",
    "ctrl",
    "biogpt",
    "olmo",
    "cohere",
    "persimmon",
    "mamba2",
    "deit",
    "beit",
    "dinov2",
    "regnet",
    "poolformer",
    "wav2vec2",
    "hubert",
    "esm",  # save_pretrained writes its LayerNorms' gamma/beta
    "siglip",  # its vision head holds a torch nn.MultiheadAttention (in_proj packed)
)

# The model class built for a type: its sequence-to-sequence or language-model head where it has one, else its
# image classifier, else its base model.
_CLASS_TABLES = (
    modeling_auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES,
    modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
    modeling_auto.MODEL_MAPPING_NAMES,
)


def tiny_config(model_type: str) -> hf.PretrainedConfig:
    """The family's config built with the tiny sizes it has (through its constructor, so that what it derives
    from them, such as per-layer lists, follows)."""
    config_class = hf.CONFIG_MAPPING[model_type]
    default = config_class()
    derived = {key for key in TINY if isinstance(getattr(config_class, key, None), property)}  # computed
    sizes = {key: value for key, value in TINY.items() if hasattr(default, key) and key not in derived}
    return config_class(**{**sizes, **OVERRIDES.get(model_type, {})})


def model_class(model_type: str) -> type[nn.Module]:
    for table in _CLASS_TABLES:
        name = table.get(model_type)
        if isinstance(name, str) and hasattr(hf, name):
            return getattr(hf, name)
    raise LookupError(model_type)


def build(model_type: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    config = tiny_config(model_type)
    config.architectures = None
    model = model_class(model_type)(config)
    model.eval()
    return model


# ---------------------------------------------------------------------------------------------------------
# the layout each tensor's module type dictates (burn-store's PyTorchToBurnAdapter keys on the module's type)

TORCH_NORMS: tuple[type[nn.Module], ...] = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.RMSNorm,
)


def saved_owners(model: nn.Module) -> dict[str, str]:
    """Name in the save_pretrained file -> the name of the same tensor in the module tree (transformers writes
    some under older names, and a tied weight once): matched by the storage the tensors share."""
    from transformers.core_model_loading import revert_weight_conversion

    state = model.state_dict()
    by_pointer: dict[int, list[str]] = {}
    for name, value in state.items():
        by_pointer.setdefault(value.data_ptr(), []).append(name)
    owners = {}
    for saved, value in revert_weight_conversion(model, dict(state)).items():
        candidates = by_pointer.get(value.data_ptr(), [])
        owners[saved] = saved if saved in candidates else (candidates[0] if candidates else saved)
    return owners


def is_norm(module: nn.Module) -> bool:
    """A torch norm, or a model's own class named a norm (LlamaRMSNorm, T5LayerNorm, NoNorm) holding a weight
    (and a bias): Burn's ports use their RmsNorm / LayerNorm for these."""
    if isinstance(module, TORCH_NORMS):
        return True
    if isinstance(module, nn.Embedding | nn.Linear):  # a subclass named so (InklingNormedEmbedding) is no norm
        return False
    own = {name for name, _ in module.named_parameters(recurse=False)}
    return "norm" in type(module).__name__.lower() and own in ({"weight"}, {"weight", "bias"})


def expected_burn(
    model: nn.Module, tensors: dict[str, tuple[tuple[int, ...], bytes]]
) -> dict[str, tuple[tuple[int, ...], bytes]]:
    """Burn name -> (shape, bytes) for every tensor of a save_pretrained file (name -> (shape, bytes))."""
    owners = saved_owners(model)
    expected = {}
    for name, (shape, data) in tensors.items():
        path, _, leaf = name.rpartition(".")
        owner_path = owners.get(name, name).rpartition(".")[0]
        module = model.get_submodule(owner_path) if owner_path else model
        burn_name = name
        attention = _attention_owning(model, owner_path)
        if attention is not None:
            expected.update(_burn_attention(attention[0], attention[1], name, shape, data))
            continue
        if isinstance(module, nn.Linear) and leaf == "weight":
            shape, data = shape[::-1], _transposed(data, shape)
        elif is_norm(module) and leaf in ("weight", "bias"):
            burn_name = f"{path}.{'gamma' if leaf == 'weight' else 'beta'}"
        elif isinstance(module, nn.PReLU) and leaf == "weight":
            burn_name = f"{path}.alpha"
        elif leaf == "num_batches_tracked" and isinstance(module, nn.modules.batchnorm._BatchNorm):
            continue  # no Burn slot: carried in metadata
        # nn.Embedding, convolutions, transformers' Conv1D (already [in, out]) and every other type: as stored
        expected[burn_name] = (shape, data)
    return expected


def _attention_owning(model: nn.Module, owner_path: str) -> tuple[str, nn.MultiheadAttention] | None:
    """(its path, the module) if the tensor's owner is an nn.MultiheadAttention or its out_proj."""
    for path in (owner_path, owner_path.rpartition(".")[0] if owner_path.endswith("out_proj") else None):
        if path is not None:
            module = model.get_submodule(path) if path else model
            if isinstance(module, nn.MultiheadAttention):
                return path, module
    return None


def _burn_attention(
    path: str, module: nn.MultiheadAttention, name: str, shape: tuple[int, ...], data: bytes
) -> dict[str, tuple[tuple[int, ...], bytes]]:
    """Burn's MultiHeadAttention (attention/mha.rs): in_proj's rows q, k, v become the Linears query, key and
    value, out_proj the Linear output; each Linear's weight transposed (docs/burn-adapters.md#packed-modules)."""
    prefix = f"{path}." if path else ""
    leaf: str = name[len(prefix) :]
    if leaf.startswith("out_proj."):
        part = leaf.removeprefix("out_proj.")
        return {
            f"{prefix}output.{part}": (shape[::-1], _transposed(data, shape)) if part == "weight" else (shape, data)
        }
    rows = module.embed_dim
    width = len(data) // shape[0]  # bytes per row of in_proj (a bias row is one element)
    split: dict[str, tuple[tuple[int, ...], bytes]] = {}
    for i, target in enumerate(("query", "key", "value")):
        chunk = data[i * rows * width : (i + 1) * rows * width]
        if leaf == "in_proj_weight":
            split[f"{prefix}{target}.weight"] = ((shape[1], rows), _transposed(chunk, (rows, shape[1])))
        else:
            split[f"{prefix}{target}.bias"] = ((rows,), chunk)
    return split


def _transposed(data: bytes, shape: tuple[int, ...]) -> bytes:
    rows, cols = shape
    itemsize = len(data) // max(1, rows * cols)
    return np.frombuffer(data, dtype=f"V{itemsize}").reshape(shape).T.copy().tobytes()


def save(model: nn.Module, directory: Path) -> Path:
    model.save_pretrained(directory)
    return directory / "model.safetensors"
