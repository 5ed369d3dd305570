"""Sharded and unsharded `save_pretrained` checkpoints of small transformers models, made on the spot (no
downloads): the real files Hugging Face users have, at a size a test can afford."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SHARD_SIZE = "40KB"  # splits the Llama below into 3 shards


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def save_llama(directory: Path, *, sharded: bool, seed: int = 0) -> Path:
    """`save_pretrained` of the tiny Llama into `directory`; returns the index (sharded) or the one file."""
    model = tiny_llama(seed)
    if sharded:
        model.save_pretrained(directory, max_shard_size=SHARD_SIZE)
        return directory / "model.safetensors.index.json"
    model.save_pretrained(directory)
    return directory / "model.safetensors"


# What the module map of a Llama says (its projections have no bias, so the tensors alone cannot tell a
# Linear from an Embedding, nor an RmsNorm from a PRelu).
LLAMA_MODULES = {
    "modules": {
        "**.embed_tokens": "Embedding",
        "**.*_proj": "Linear",
        "lm_head": "Linear",
        "**.*norm": "RmsNorm",
    }
}
