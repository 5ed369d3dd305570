"""Evidence beyond a module's own tensors: the known-architectures table and naming conventions.

The order, strongest first: a module map or --layout; the decisions a syncd-made file records;
the `config.json` beside the checkpoint matched against `architectures.yaml`; the `format: pt` metadata key;
naming conventions shared across model families; then the shapes. This module holds the table and the
conventions; `infer.py` and `plan.py` apply them in that order.
"""

from __future__ import annotations

import fnmatch
import functools
from dataclasses import dataclass
from typing import Any

from syncd.adapters.model import EMBEDDING, LINEAR, OTHER, PRELU, PYTORCH, RMS_NORM
from syncd.adapters.modulemap import ModuleMap

TABLE_FILE = "architectures.yaml"

# Naming conventions shared across families, matched case-insensitively against a module's last
# path segment. They settle only what the tensors leave open (a bias-free 2-D weight, a lone 1-D weight or
# gamma); a module whose tensors contradict its name keeps what its tensors say.
# Also Meta's own Llama and Mistral names (attention.wq/wk/wv/wo, feed_forward.w1/w2/w3, kept by Mixtral's
# experts.N.w1/w2/w3), T5's feed-forward wi/wo, and a mixture of experts' router (`mlp.gate`, `router`,
# `shared_expert_gate`): each an nn.Linear, or a weight its model applies with F.linear.
LINEAR_NAMES = (
    "*_proj",
    "proj",
    "*_projection",  # Gemma3n's embedding_projection: a Linear, whatever its first word says
    "*_dense",  # LUKE's entity_embedding_dense, likewise
    "*qkv*",
    "lm_head",
    "fc*",
    "dense",
    "query",
    "key",
    "value",
    "wq",
    "wk",
    "wv",
    "wo",
    "wi",
    "wi_?",
    "w1",
    "w2",
    "w3",
    "gate",
    "*_gate",
    "router",
)
# transformers' Conv1D layers (GPT-2, OpenAI GPT, ImageGPT, CLVP), which nanoGPT and other ports name the same
# for nn.Linear layers: in Burn's layout both are [in, out], so going to PyTorch the name decides nothing.
CONV1D_NAMES = frozenset({"c_attn", "q_attn", "c_proj", "c_fc"})
EMBEDDING_NAMES = ("emb", "embed*", "*_emb", "*embedding*", "wte", "wpe", "shared")
NORM_NAMES = ("ln", "ln_*", "*_ln", "*norm*", "*rms*")
PRELU_NAMES = ("*prelu*", "act", "act?", "activation")
# timm's LayerScale (`blocks.0.ls1.gamma`): a 1-D multiplier, no norm; Burn has no such module, so it stays
# as it is in both directions (never renamed one way and refused the other).
LAYER_SCALE_NAMES = ("ls", "ls?", "*layer_scale*", "*layerscale*")


@dataclass(frozen=True)
class Architecture:
    family: str
    module_map: ModuleMap
    matched_by: str  # e.g. "model_type 'gpt2'"


def _last_segment(path: str) -> str:
    return path.rpartition(".")[2].lower()


def _named(path: str, patterns: tuple[str, ...]) -> str | None:
    last = _last_segment(path)
    return next((p for p in patterns if fnmatch.fnmatchcase(last, p)), None)


# An attention's projections, named so inside it; a model's own top-level `query` is its learned queries, an
# Embedding (EoMT, VideoMT: `self.query = nn.Embedding(num_queries, hidden)`).
_ATTENTION_NAMES = frozenset({"query", "key", "value"})
# Named so by no convention: GPT-NeoX's (Pythia's) output head is an nn.Linear `embed_out`, word2vec's
# skip-gram models an nn.Embedding `embed_out` beside `embed_in`; `embed*` took the head for an Embedding.
UNDECIDED_NAMES = frozenset({"embed_out"})


def matrix_name_kind(path: str) -> tuple[str, str] | None:
    """(kind, pattern) a bias-free 2-D weight's module name says, Linear names first (`embed_proj` projects)."""
    if _last_segment(path) in UNDECIDED_NAMES:
        return None
    for kind, patterns in ((LINEAR, LINEAR_NAMES), (EMBEDDING, EMBEDDING_NAMES)):
        pattern = _named(path, patterns)
        if pattern in _ATTENTION_NAMES and "." not in path:
            return None
        if pattern is not None:
            return kind, pattern
    return None


def vector_name_kind(path: str, leaf: str) -> tuple[str, str] | None:
    """(kind, pattern) the name of a module holding a lone 1-D weight or gamma says."""
    choices = [(OTHER, LAYER_SCALE_NAMES), (RMS_NORM, NORM_NAMES)]
    if leaf == "weight":
        choices.append((PRELU, PRELU_NAMES))
    for kind, patterns in choices:
        pattern = _named(path, patterns)
        if pattern is not None:
            return kind, pattern
    return None


def suggested_matrix_kind(path: str) -> tuple[str, ...]:
    """Options for a bias-free 2-D weight no convention names, the likelier first (for the suggestion only):
    position/bias tables are embeddings (T5's relative_attention_bias), anything else most often a Linear."""
    last = _last_segment(path)
    if any(hint in last for hint in ("emb", "bias", "position", "pos", "table", "token")):
        return (EMBEDDING, LINEAR)
    return (LINEAR, EMBEDDING)


# Model classes whose only language-modeling head sits at the top of the module tree beside the backbone
# holding the input embedding (decoder-only models, as transformers builds them).
DECODER_LM_CLASSES = ("ForCausalLM", "LMHeadModel")


def decoder_lm_class(config: dict[str, Any] | None) -> str | None:
    """The decoder-only language-model class config.json names (`GPTNeoXForCausalLM`), or None."""
    classes = (config or {}).get("architectures")
    if not isinstance(classes, list):
        return None
    return next((c for c in classes if isinstance(c, str) and c.endswith(DECODER_LM_CLASSES)), None)


def metadata_layout(metadata: dict[str, str]) -> str | None:
    """`format: pt` is what Hugging Face and safetensors' torch API write: PyTorch layout. Nothing else in a
    file's metadata is taken as layout evidence (Burn's `producer` says nothing about its adapters)."""
    return PYTORCH if metadata.get("format") == "pt" else None


@functools.lru_cache(maxsize=1)
def known_architectures() -> dict[str, tuple[frozenset[str], frozenset[str], ModuleMap]]:
    """family -> (model_types, architecture class names, module map), from the shipped YAML table."""
    # here, both: only a checkpoint with a config.json beside it needs the table (resources brings tempfile...)
    from importlib import resources

    import yaml

    text = resources.files("syncd.adapters").joinpath(TABLE_FILE).read_text(encoding="utf-8")
    table = yaml.safe_load(text)
    families = {}
    for family, entry in table.items():
        source = f"known architecture {family!r} ({TABLE_FILE})"
        families[family] = (
            frozenset(entry.get("model_types", [family])),
            frozenset(entry.get("architectures", [])),
            ModuleMap.from_dict({"modules": entry["modules"]}, source=source),
        )
    return families


def architecture_for(config: dict[str, Any] | None) -> tuple[Architecture | None, str | None]:
    """(the known architecture config.json names, or None; a note for the decisions, or None)."""
    if not config:
        return None, None
    model_type = config.get("model_type")
    classes = config.get("architectures") or []
    classes = [c for c in classes if isinstance(c, str)] if isinstance(classes, list) else []
    for family, (types, names, module_map) in known_architectures().items():
        if isinstance(model_type, str) and model_type in types:
            return Architecture(family, module_map, f"model_type {model_type!r}"), None
        found = next((c for c in classes if c in names), None)
        if found is not None:
            return Architecture(family, module_map, f"architectures {found!r}"), None
    described = f"model_type {model_type!r}" if isinstance(model_type, str) else f"architectures {classes[:3]}"
    return None, f"config.json: {described} is not in the known-architectures table; names and shapes decide"
