"""The values the adapters layer works on and hands back: tensor references, plan entries, module kinds."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

from syncd.errors import AmbiguousLayoutError

# Layout names: which side of a Linear weight is [out], norm parameter names... A file is in one layout (a
# converter never mixes them inside one file); each target format is written in its own (engine/targets.py).
PYTORCH = "pytorch"
BURN = "burn"
KEEP = "keep"  # to_layout only: copy names and shapes as they are
AUTO = "auto"  # source_layout only: decide from the tensors
# source_layout of a plan whose file holds nothing that differs between the layouts (only convs, buffers,
# embeddings...): it reads the same either way, so the plan is the identity.
NEUTRAL = "neutral"

LAYOUTS = (PYTORCH, BURN)
TARGET_LAYOUTS = (BURN, PYTORCH, KEEP)
SOURCE_LAYOUTS = (AUTO, PYTORCH, BURN)
# what `--layout` and a watch's `layout:` accept: a source layout, or keep (convert the container only)
LAYOUT_CHOICES = (AUTO, PYTORCH, BURN, KEEP)

# Module kinds a module map may name (docs/burn-adapters.md#module-kinds lists their parameters on both sides).
LINEAR = "Linear"
# A Linear whose PyTorch weight is stored [in, out] (transformers' Conv1D, GPT-2 family): Burn's Linear is
# [in, out] too (docs/burn-adapters.md#linear), so its weight is never transposed, in either direction.
LINEAR_IN_OUT = "LinearInOut"
EMBEDDING = "Embedding"
BATCH_NORM = "BatchNorm"
LAYER_NORM = "LayerNorm"
GROUP_NORM = "GroupNorm"
INSTANCE_NORM = "InstanceNorm"
RMS_NORM = "RmsNorm"
PRELU = "PRelu"
OTHER = "Other"
# Modules whose PyTorch form packs several Burn parameters into one tensor (docs/burn-adapters.md#packed-modules;
# docs/burn-adapters.md#ambiguous-cases item 6): split going to Burn, joined coming back.
MULTI_HEAD_ATTENTION = "MultiHeadAttention"
LSTM = "Lstm"
GRU = "Gru"
RNN = "Rnn"
PACKED_KINDS = (MULTI_HEAD_ATTENTION, LSTM, GRU, RNN)
CONV_KINDS = ("Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d")
MAP_KINDS = (
    LINEAR,
    LINEAR_IN_OUT,
    EMBEDDING,
    *CONV_KINDS,
    BATCH_NORM,
    LAYER_NORM,
    GROUP_NORM,
    INSTANCE_NORM,
    RMS_NORM,
    PRELU,
    *PACKED_KINDS,
    OTHER,
)

# Kinds only inference produces: the tensors show the treatment but not the exact module type.
NORM = "Norm"  # an affine norm: LayerNorm, GroupNorm or InstanceNorm (or, from gamma alone, RmsNorm)
CONV = "Conv"  # any Conv*/ConvTranspose*: rank >= 3 weight, same in both layouts
UNKNOWN = "Unknown"  # the tensors do not decide; a module map must (see ModuleKind.options)

NORM_KINDS = frozenset({NORM, BATCH_NORM, LAYER_NORM, GROUP_NORM, INSTANCE_NORM, RMS_NORM})
# Kinds a syncd-made file may record in its `syncd.kinds` metadata (what it was converted with).
RECORDED_KINDS = frozenset({*MAP_KINDS, NORM, CONV})

# Where a module's kind came from, strongest first (evidence in a stated order).
BY_MAP = "module map"
BY_DEFINITION = "model definition"
BY_RECORD = "recorded in the file"
BY_CONFIG = "config.json"
BY_NAME = "name"
BY_SHAPE = "shapes"


class TensorRef(NamedTuple):
    """One tensor of a table: all the adapters ever look at (never bytes). A named tuple: a table is made of
    one per tensor, which `tensor_ref` makes without a Python frame (a third of a frozen dataclass's cost)."""

    name: str
    dtype: str
    shape: tuple[int, ...]


tensor_ref = partial(tuple.__new__, TensorRef)  # tensor_ref((name, dtype, shape))


@dataclass(frozen=True)
class ModelDefinition:
    """The module kinds the model's own definition gives (its class built by the convert layer): module path,
    as the file names it, -> kind. Modules of types Burn's adapters do not know are not in it."""

    kinds: dict[str, str]
    source: str  # e.g. "model definition LlamaForCausalLM (transformers 5.24.0)"
    written: tuple[str, ...] = ()  # the tensor names save_pretrained writes, in its order


@dataclass(frozen=True)
class FileContext:
    """What a checkpoint's surroundings say about it, gathered by the convert layer (the adapters do no I/O).

    metadata: the file's own metadata (`format: pt` says PyTorch layout); recorded_layout / recorded_kinds:
    what a syncd-made file says it was converted with (`syncd.layout`, `syncd.kinds`); config: the parsed
    `config.json` beside the checkpoint, if any (`model_type` / `architectures` select a known architecture).
    """

    metadata: dict[str, str] = field(default_factory=dict)
    recorded_layout: str | None = None
    recorded_kinds: dict[str, str] = field(default_factory=dict)
    config: dict[str, Any] | None = None
    notes: tuple[str, ...] = ()  # what the convert layer found while gathering (e.g. an unreadable config.json)
    definition: ModelDefinition | None = None  # the module types of the model config.json names, if built
    gamma_beta: frozenset[str] = frozenset()  # norms a syncd-made file records as named gamma/beta in PyTorch
    # the format the file is in ("burnpack", "safetensors", "pytorch"): Burn's own format is written by Burn,
    # whose names (gamma, beta, alpha) then show its layout; in the others a PyTorch module may use them too
    container: str | None = None


class PlanEntry(NamedTuple):
    """How one output tensor is made: from one source tensor, or from rows `rows` of it (a piece of a
    PyTorch packed tensor going to Burn), or from `parts` laid end to end (Burn's pieces joined back into
    the packed tensor, docs/burn-adapters.md#packed-modules). A named tuple: a plan holds one per tensor,
    which `plan_entry` makes without a Python frame (a third of a frozen dataclass's cost)."""

    source: str  # source tensor name (a joined entry: its first part's)
    target: str  # output tensor name
    transpose: bool  # 2-D transpose [a, b] -> [b, a] of the bytes (of the row range, when `rows` is given)
    shape: tuple[int, ...]  # output shape
    rows: tuple[int, int] | None = None  # only rows r0:r1 along the source's first dimension
    parts: tuple[PlanEntry, ...] = ()  # joined: each part's output, in order, is a slice of this one's

    @property
    def pieces(self) -> tuple[PlanEntry, ...]:
        """What the output is made of, in output order: the parts of a join, else this entry alone."""
        return self.parts or (self,)

    @property
    def sources(self) -> list[str]:
        return [piece.source for piece in self.pieces]

    @property
    def is_piecewise(self) -> bool:
        """Made of a row range or of several tensors (the engine's one-pass writer handles these)."""
        return self.rows is not None or bool(self.parts)


plan_entry = partial(tuple.__new__, PlanEntry)  # plan_entry((source, target, transpose, shape, rows, parts))


@dataclass
class AdapterPlan:
    """What the converter does to every tensor, and why."""

    entries: list[PlanEntry]  # in source data order (the order of the input list), dropped tensors left out
    dropped: list[str]  # source tensors with no slot on the target side; the converter carries them in metadata
    source_layout: str  # "pytorch" | "burn" | "neutral" (nothing layout-dependent) | "keep"
    target_layout: str  # "pytorch" | "burn" | "keep"
    decisions: list[str]  # human lines: the file's layout first, then one per module (layers decided alike: one)
    kinds: dict[str, str] = field(default_factory=dict)  # module path -> kind ("" is the root module)
    packed: frozenset[str] = frozenset()  # source tensors of packed MHA/RNN modules (all Linears in Burn)
    # what a user must see even without -v (also among `decisions`): kinds taken on a naming convention alone,
    # index gaps a Burn Vec cannot load, rules that matched nothing
    notes: list[str] = field(default_factory=list)
    guessed: dict[str, str] = field(default_factory=dict)  # module path -> why, for kinds a convention alone decided
    # norms whose PyTorch parameters are named gamma/beta (converting to Burn): recorded for the way back
    gamma_beta: frozenset[str] = frozenset()

    @property
    def is_identity(self) -> bool:
        """True when every tensor keeps its name and shape and nothing is dropped."""
        return not self.dropped and all(
            e.source == e.target and not e.transpose and not e.is_piecewise for e in self.entries
        )


class LayoutAmbiguityError(AmbiguousLayoutError):
    """AmbiguousLayoutError with what would settle it. `str(error)` stays one line (the CLI prints it);
    `details` (per-module reasons, then the suggestion) is for the log / --verbose."""

    def __init__(self, message: str, *, suggestion: str, undecided: list[str], details: str) -> None:
        super().__init__(message)
        self.suggestion = suggestion  # module-map YAML that would settle it (valid YAML; comments name alternatives)
        self.undecided = undecided  # the module paths concerned ("(root)" for tensors without a '.')
        self.details = details
