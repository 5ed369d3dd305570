"""Layout adapters: pure functions over tensor tables (names, dtypes, shapes; never bytes, never files).

Burn and PyTorch store the same model with different names and shapes (docs/burn-adapters.md#module-kinds): a Burn
Linear weight is [in, out] where PyTorch has [out, in]; Burn norms call their parameters gamma/beta where
PyTorch says weight/bias; Burn PRelu says alpha; PyTorch BatchNorm carries num_batches_tracked, which Burn has
no slot for (docs/burn-adapters.md#keys-without-a-counterpart). This package decides, from a file's tensor table, what
the converter must do:

    plan = plan_conversion(tensors, to_layout="burn")      # tensors: list[TensorRef] in data order
    for entry in plan.entries:                              # PlanEntry(source, target, transpose, shape)
        ...                                                 # copy bytes, transposing 2-D data if asked
    plan.dropped                                            # carry these in metadata (no slot on the target)

API
---
``TensorRef(name: str, dtype: str, shape: tuple[int, ...])``, a named tuple (`tensor_ref((name, dtype, shape))`
makes one without a Python frame, for whole tables)
``PlanEntry(source: str, target: str, transpose: bool, shape: tuple[int, ...], rows=None, parts=())``
    `rows` (r0, r1): the output is only those rows of the source's first dimension (a piece of a PyTorch packed
    tensor going to Burn); `parts`: the output is these entries' outputs end to end (Burn's pieces joined back
    into the packed tensor; `source` is then the first part's). ``entry.pieces`` / ``entry.sources`` list them.
``AdapterPlan(entries, dropped, source_layout, target_layout, decisions, kinds, packed, notes)``, ``.is_identity``
    entries in source data order, dropped tensors left out; source_layout "pytorch" | "burn" | "neutral"
    (the file has nothing that differs between layouts) | "keep"; kinds: module path -> kind.
``plan_conversion(tensors, *, to_layout, source_layout="auto", module_map=None, context=None) -> AdapterPlan``
    to_layout "burn" | "pytorch" | "keep"; source_layout "auto" | "pytorch" | "burn"; context a
    ``FileContext(metadata, recorded_layout, recorded_kinds, config, notes)``: what the file's surroundings say
    (its metadata, its `syncd.layout` / `syncd.kinds` record, the parsed config.json beside it), gathered by
    the convert layer (`syncd.engine.context`); the adapters do no I/O.
``apply_plan(tensors, plan) -> list[TensorRef]``: the table the plan produces.
``ModuleMap.from_yaml_file(path)``, ``ModuleMap.from_yaml_text(text, source=...)``,
``ModuleMap.from_dict(data, source=...)``: a module map (see `syncd.adapters.modulemap` for the YAML form and
    glob rules: an exact module path beats every glob, else the first matching glob in map order wins).

Errors (syncd.errors):
* AmbiguousLayoutError where the tensors do not decide, raised as its subclass ``LayoutAmbiguityError``:
  one-line message; ``.suggestion`` the module-map YAML that would settle it; ``.details`` the per-module
  reasons followed by that YAML; ``.undecided`` the module paths concerned.
* UnsupportedError for what the target cannot take: PyTorch packed tensors Burn has no slot for (MHA
  bias_k/bias_v or kdim/vdim projections, RNN layers l1+ or proj_size;
  docs/burn-adapters.md#keys-without-a-counterpart), transposing a QFloat or sub-byte tensor, norm parameters that are
  not 1-D.
* ConfigError for a bad module map, or one whose kind does not fit the tensors it matches (exact paths;
  a glob that sweeps over a module holding no adaptable tensors leaves it alone).
* SyncdError for duplicate source or output names; UsageError for an unknown layout name.

Rules, in order
---------------
0. Packed modules (packed.py, docs/burn-adapters.md#packed-modules) are found first and their tensors taken out of
   the rules below: PyTorch's by their names (`in_proj_weight`, `weight_ih_l0`... -> MultiHeadAttention, and
   Lstm / Gru / Rnn by weight_hh_l0's rows over its columns); Burn's split ones by a module map or the file's
   `syncd.kinds` (query/key/value/output Linears) or by Burn's own gate names (`input_gate.input_transform`...).
   Their names are strong layout evidence; converting, PyTorch's are split by rows into Burn's Linears
   (transposed) and Burn's joined back in PyTorch's chunk order.
1. ``to_layout="keep"``: identity, nothing renamed, transposed or dropped.
2. Module = name minus its last segment. Leaves weight, bias, gamma, beta, alpha, running_mean, running_var,
   num_batches_tracked are adapted; tensors with other leaves always pass through unchanged.
3. Kind, strongest evidence first, each decision line saying where it came from:
   a. the module map (exact path, else first matching glob);
   a'. the model's own definition (``FileContext.definition``: module path -> the kind of the module's type,
      built by the convert layer from the class config.json names, where transformers is installed; a kind
      that does not fit the module's tensors is passed over);
   b. the kinds a syncd-made file recorded (`syncd.kinds`);
   c. config.json's `model_type` / `architectures` matched in `architectures.yaml` (one module map per
      family; a rule that does not fit a module's tensors is passed over);
   d. the tensors: running stats siblings -> BatchNorm; 1-D alpha -> PRelu; 1-D gamma+beta -> a norm; rank >= 3
      weight -> a convolution; 2-D weight + 1-D bias fitting one of its dims -> Linear; 1-D weight + bias of the
      same length -> a norm (LayerNorm/GroupNorm/InstanceNorm, all renamed);
   e. naming conventions (evidence.py) for what the tensors leave open: a bias-free 2-D weight (`*_proj`,
      `*qkv*`, `fc*`, `dense`, `*_dense`, `query` (not at the top)... -> Linear; `embed*`, `*_emb`,
      `*embedding*`, `wte`, `wpe`, `shared` -> Embedding), a lone 1-D weight or gamma (`*norm*`, `ln_*` ->
      RmsNorm; `ls1`, `*layer_scale*` -> Other,
      a LayerScale; `act`, `*prelu*` -> PRelu); a lone 1-element weight is a PRelu. A convention never
      overrules the rest of the file: in a decoder-only language model (config.json's `*ForCausalLM`,
      `*LMHeadModel`), a bias-free [vocab, hidden] weight at the top of the module tree beside an embedding
      of the same shape inside it is the output head, a Linear, whatever its name (GPT-NeoX's `embed_out`);
      two such candidates are undecided. Every kind taken on a convention alone is listed in one
      ``plan.notes`` line (also among the decisions), so a wrong guess can be found afterwards;
   f. the file's layout (rule 4): in a pytorch-layout file a shape-inferred Linear whose bias matches dim 1 is
      a LinearInOut (transformers' Conv1D, [in, out]) and a lone gamma is no norm (Other); in a burn-layout
      file a lone 1-D weight is no norm (Other). Where LinearInOut layers exist, a square Linear with bias that
      only its shapes decided is undecided (Linear or LinearInOut).
   Anything still undecided is refused, never guessed; the suggestion is the fewest globs that settle it.
4. Layout: --layout, else the map's ``layout:``, else the file's `syncd.layout` record; else strong evidence
   (`format: pt` metadata -> pytorch; norm/PRelu names: weight/bias/num_batches_tracked -> pytorch,
   gamma/beta/alpha -> burn; PyTorch packed names -> pytorch), which must agree; else weak evidence (a
   non-square Linear's bias: == dim 0 -> pytorch, == dim 1 -> burn), which must agree. Name and metadata
   evidence outrank a bias's dimension; what contradicts a stated or strong layout is refused (map such
   modules as Other), except the LinearInOut case of 3f. Square and bias-free Linears take the file's layout.
5. Source layout == target, or nothing layout-dependent in the file: identity (undecided kinds do not matter).
   Otherwise every adaptable module must have a kind, and a file with a Linear needs a known layout.
6. Transforms between layouts: Linear weight transpose (rank 2); LinearInOut never transposed; norm
   weight/bias <-> gamma/beta for BatchNorm, LayerNorm, GroupNorm, InstanceNorm, RmsNorm; PRelu weight <->
   alpha; going to Burn, BatchNorm num_batches_tracked (and InstanceNorm running stats) are dropped and listed
   in ``dropped``; going to PyTorch, num_batches_tracked is not invented (the converter restores it from
   metadata; decisions say so). Embedding, Conv*, Other: unchanged. Output names must be unique.
   ``plan.kinds`` (module path -> kind) is what the converter records in `syncd.kinds`.
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
    ModelDefinition,
    PlanEntry,
    TensorRef,
    tensor_ref,
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
    "ModelDefinition",
    "ModuleMap",
    "PlanEntry",
    "TensorRef",
    "apply_plan",
    "parse_module_map",
    "plan_conversion",
    "tensor_ref",
]
