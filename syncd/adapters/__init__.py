"""Layout adapters: pure functions over tensor tables (names, dtypes, shapes; never bytes, never files).

Burn and PyTorch store the same model with different names and shapes (burn-compat.md §3.2, §3.5): a Burn
Linear weight is [in, out] where PyTorch has [out, in]; Burn norms call their parameters gamma/beta where
PyTorch says weight/bias; Burn PRelu says alpha; PyTorch BatchNorm carries num_batches_tracked, which Burn has
no slot for (§4). This package decides, from a file's tensor table, what the converter must do:

    plan = plan_conversion(tensors, to_layout="burn")      # tensors: list[TensorRef] in data order
    for entry in plan.entries:                              # PlanEntry(source, target, transpose, shape)
        ...                                                 # copy bytes, transposing 2-D data if asked
    plan.dropped                                            # carry these in metadata (no slot on the target)

API
---
``TensorRef(name: str, dtype: str, shape: tuple[int, ...])``
``PlanEntry(source: str, target: str, transpose: bool, shape: tuple[int, ...])``
``AdapterPlan(entries, dropped, source_layout, target_layout, decisions, kinds)``, ``.is_identity``
    entries in source data order, dropped tensors left out; source_layout "pytorch" | "burn" | "neutral"
    (the file has nothing that differs between layouts) | "keep"; kinds: module path -> kind.
``plan_conversion(tensors, *, to_layout, source_layout="auto", module_map=None) -> AdapterPlan``
    to_layout "burn" | "pytorch" | "keep"; source_layout "auto" | "pytorch" | "burn".
``apply_plan(tensors, plan) -> list[TensorRef]``: the table the plan produces.
``ModuleMap.from_yaml_file(path)``, ``ModuleMap.from_yaml_text(text, source=...)``,
``ModuleMap.from_dict(data, source=...)``: a module map (see `syncd.adapters.modulemap` for the YAML form and
    glob rules: an exact module path beats every glob, else the first matching glob in map order wins).

Errors (syncd.errors):
* AmbiguousLayoutError where the tensors do not decide, raised as its subclass ``LayoutAmbiguityError``:
  one-line message; ``.suggestion`` the module-map YAML that would settle it; ``.details`` the per-module
  reasons followed by that YAML; ``.undecided`` the module paths concerned.
* UnsupportedError for what the target cannot take: PyTorch packed MHA/RNN tensors going to Burn,
  transposing a QFloat or sub-byte tensor, norm parameters that are not 1-D.
* ConfigError for a bad module map, or one whose kind does not fit the tensors it matches (exact paths;
  a glob that sweeps over a module holding no adaptable tensors leaves it alone).
* SyncdError for duplicate source or output names; UsageError for an unknown layout name.

Rules, in order
---------------
1. ``to_layout="keep"``: identity, nothing renamed, transposed or dropped.
2. Module = name minus its last segment. Leaves weight, bias, gamma, beta, alpha, running_mean, running_var,
   num_batches_tracked are adapted; tensors with other leaves always pass through unchanged.
3. Kind: a module-map match wins; otherwise inference —
   running stats siblings -> BatchNorm; 1-D alpha -> PRelu; 1-D gamma(+beta) -> a norm; rank >= 3 weight ->
   a convolution (no transform, ConvTranspose too); 2-D weight + 1-D bias fitting one of its dims -> Linear;
   1-D weight + 1-D bias of the same length, no running stats -> a norm (LayerNorm/GroupNorm/InstanceNorm,
   all renamed; Burn's adapter skips InstanceNorm, we do not). Undecided, never guessed: a 2-D weight with no
   bias (Linear or Embedding), a lone 1-D weight (RmsNorm/LayerNorm -> gamma, or PRelu -> alpha), anything
   else unexpected (suggested as Other).
4. Layout evidence: a non-square Linear with bias (bias == dim 0 -> pytorch, == dim 1 -> burn); norm/PRelu
   names (weight/bias/num_batches_tracked -> pytorch, gamma/beta/alpha -> burn); PyTorch packed names ->
   pytorch. All evidence must agree (else AmbiguousLayoutError listing both sides). Square Linears and
   bias-free Linears take the file's layout. Metadata (e.g. `producer`) is never evidence.
5. ``source_layout`` "pytorch"/"burn" (or the map's ``layout:``; the argument wins) states the layout; evidence
   that contradicts it is refused (map such modules as Other to leave them unchanged).
6. Source layout == target, or nothing layout-dependent in the file: identity (undecided kinds do not matter).
   Otherwise every adaptable module must have a kind, and a file with a Linear needs a known layout.
7. Transforms between layouts: Linear weight transpose (rank 2); norm weight/bias <-> gamma/beta for BatchNorm,
   LayerNorm, GroupNorm, InstanceNorm, RmsNorm; PRelu weight <-> alpha; going to Burn, BatchNorm
   num_batches_tracked (and InstanceNorm running stats) are dropped and listed in ``dropped``; going to
   PyTorch, num_batches_tracked is not invented (the converter restores it from metadata; decisions say so).
   Embedding, Conv*, Other: unchanged. Output names must be unique.
"""

from syncd.adapters.model import (
    AUTO,
    BURN,
    KEEP,
    LAYOUT_CHOICES,
    MAP_KINDS,
    NEUTRAL,
    PYTORCH,
    AdapterPlan,
    FileContext,
    LayoutAmbiguityError,
    PlanEntry,
    TensorRef,
)
from syncd.adapters.modulemap import MapProblem, ModuleMap, parse_module_map
from syncd.adapters.plan import apply_plan, plan_conversion

__all__ = [
    "AUTO",
    "BURN",
    "KEEP",
    "LAYOUT_CHOICES",
    "MAP_KINDS",
    "NEUTRAL",
    "PYTORCH",
    "AdapterPlan",
    "FileContext",
    "LayoutAmbiguityError",
    "MapProblem",
    "ModuleMap",
    "PlanEntry",
    "TensorRef",
    "apply_plan",
    "parse_module_map",
    "plan_conversion",
]
