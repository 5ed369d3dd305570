"""PyTorch's packed tensors and Burn's separate ones: nn.MultiheadAttention's in_proj and the gate matrices
of nn.LSTM / nn.GRU / nn.RNN (docs/burn-adapters.md#packed-modules; what Burn has no slot for: its
#keys-without-a-counterpart).

PyTorch packs the query/key/value projections of an attention into one `in_proj_weight` [3E, E] (rows q, k,
v) and the gates of a recurrent layer into `weight_ih_l0` [kH, in] / `weight_hh_l0` [kH, H] (k = 4 for LSTM in
the order i, f, g, o; 3 for GRU in the order r, z, n; 1 for RNN). Burn holds one Linear per projection or gate,
[in, out] like every Burn Linear.

Going to Burn, a packed tensor is split by rows: a row range of a C-contiguous tensor is a contiguous byte
range, so each piece is a PlanEntry with `rows`, transposed as any Linear weight. Coming back the pieces are
joined: a PlanEntry with `parts`, each transposed back, laid end to end in PyTorch's chunk order.

Which modules are packed: on the PyTorch side the names say it (`in_proj_weight`, `weight_ih_l0`...). On the
Burn side, `query`/`key`/`value`/`output` are the names of any attention module (a PyTorch custom attention has
them too), so those are joined only when the file records the module as a MultiHeadAttention (`syncd.kinds`)
or a module map says so. Burn's gate names (`input_gate.input_transform`...) belong to its GateController and
are evidence by themselves.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from syncd.adapters.infer import Evidence, KindSources, split_name
from syncd.adapters.model import (
    BURN,
    BY_DEFINITION,
    BY_MAP,
    BY_NAME,
    BY_RECORD,
    GRU,
    LSTM,
    MULTI_HEAD_ATTENTION,
    OTHER,
    PACKED_KINDS,
    PYTORCH,
    RNN,
    PlanEntry,
    TensorRef,
)
from syncd.errors import ConfigError, UnsupportedError
from syncd.formats.dtypes import ITEMSIZE

# Burn's fields in PyTorch's chunk order (docs/burn-adapters.md#packed-modules):
# LSTM i, f, g, o; GRU r, z, n; RNN one gate.
GATES = {
    LSTM: ("input_gate", "forget_gate", "cell_gate", "output_gate"),
    GRU: ("reset_gate", "update_gate", "new_gate"),
    RNN: ("gate",),
}
_KIND_BY_CHUNKS = {len(gates): kind for kind, gates in GATES.items()}
_ALL_GATES = frozenset(gate for gates in GATES.values() for gate in gates)
_TRANSFORMS = {"ih": "input_transform", "hh": "hidden_transform"}  # PyTorch's ih/hh -> GateController's Linears
# PyTorch tensors that pack several Burn parameters into one (MHA in_proj, RNN gates,
# docs/burn-adapters.md#packed-modules): their names exist only on the PyTorch side.
PACKED_PYTORCH_LEAF = re.compile(
    r"in_proj_(?:weight|bias)|[qkv]_proj_weight|bias_[kv]|(?:weight|bias)_(?:ih|hh|hr)_l\d+(?:_reverse)?"
)
QKV = ("query", "key", "value")  # rows of in_proj, in order (docs/burn-adapters.md#packed-modules)
_MHA_FIELDS = frozenset((*QKV, "output"))
_TRANSFORM_FIELDS = frozenset(_TRANSFORMS.values())
_CANDIDATE_FIELDS = _MHA_FIELDS | _TRANSFORM_FIELDS  # segments[-2] of the names _burn_candidates looks at
_MHA_LEAF = re.compile(r"in_proj_(?:weight|bias)|[qkv]_proj_weight|bias_[kv]")
_MHA_SPLIT = ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias")
_RNN_LAYER_0 = re.compile(r"(weight|bias)_(ih|hh)_l0(_reverse)?")
_DIRECTIONS = (("", "forward"), ("_reverse", "reverse"))  # PyTorch suffix -> Burn's BiLstm/BiGru field


@dataclass
class PackedModule:
    """One packed module: its tensors by name relative to `path`, which side's names they have, and why."""

    path: str
    kind: str | None  # None: PyTorch packed names that fit no kind (refused when converting)
    side: str  # PYTORCH (packed names) or BURN (split names)
    tensors: dict[str, TensorRef] = field(default_factory=dict)
    reason: str = ""
    by: str = BY_NAME
    entries: list[PlanEntry] = field(default_factory=list)  # BURN side: the joins, worked out when found

    @property
    def label(self) -> str:
        return self.path or "(root)"

    def evidence(self) -> Evidence:
        what = "PyTorch packed tensors" if self.side == PYTORCH else f"{self.kind} split into Burn's fields"
        return Evidence(self.path, self.side, f"{what} ({', '.join(self.tensors)})")


def find_packed(tensors: Sequence[TensorRef], sources: KindSources) -> list[PackedModule]:
    """Every packed module of the table: PyTorch's by their names, Burn's by names, record or module map."""
    found = _pytorch_packed(tensors, sources)
    taken = {t.name for module in found for t in module.tensors.values()}
    return found + _burn_packed([t for t in tensors if t.name not in taken] if taken else tensors, sources)


def packed_entries(module: PackedModule) -> tuple[list[PlanEntry], str]:
    """The output entries of a packed module converted to the other side, and the decision's action."""
    both = any(rel.endswith("_reverse") or rel.startswith("reverse.") for rel in module.tensors)
    directions = "; _l0 <-> forward, _l0_reverse <-> reverse (bidirectional)" if both else ""
    if module.side == BURN:
        return module.entries, f"join {_chunk_words(module.kind, into_burn=False)}, weights transposed back{directions}"
    try:
        entries = _split_mha(module) if module.kind == MULTI_HEAD_ATTENTION else _split_rnn(module)
    except UnsupportedError as refused:
        raise UnsupportedError(
            f"{refused.message}; map {module.path!r} as Other to leave its tensors unchanged, or convert with "
            "--layout keep"
        ) from None
    return entries, f"split {_chunk_words(module.kind, into_burn=True)}, weights transposed{directions}"


_CHUNKS = {MULTI_HEAD_ATTENTION: "q, k, v", LSTM: "i, f, g, o", GRU: "r, z, n", RNN: "(one chunk)"}


def _chunk_words(kind: str | None, *, into_burn: bool) -> str:
    if kind == MULTI_HEAD_ATTENTION:
        fields, packed = "query, key, value", "in_proj_weight/in_proj_bias rows q, k, v"
        return (
            f"{packed} into {fields}, out_proj into output"
            if into_burn
            else (f"{fields} into {packed}, output into out_proj")
        )
    gates = ", ".join(GATES.get(kind or "", ()))
    packed = f"the rows {_CHUNKS.get(kind or '', '')} of weight/bias_ih_l0, _hh_l0"
    linears = f"{gates} (input_transform, hidden_transform)"
    return f"{packed} into {linears}" if into_burn else f"{linears} into {packed}"


def _full(path: str, rel: str) -> str:
    return f"{path}.{rel}" if path else rel


# ---------------------------------------------------------------------------------------------------------
# the PyTorch side: packed names


def _pytorch_packed(tensors: Sequence[TensorRef], sources: KindSources) -> list[PackedModule]:
    leaves = {t.name.rpartition(".")[2] for t in tensors}  # a model has a few dozen: each is matched once
    packed_leaves = {leaf for leaf in leaves if PACKED_PYTORCH_LEAF.fullmatch(leaf)}
    if not packed_leaves:  # (most tables: nothing packed, told without splitting every name)
        return []
    names = [split_name(t.name) for t in tensors]
    paths = dict.fromkeys(path for path, leaf in names if leaf in packed_leaves)
    by_name = {t.name: t for t in tensors}
    by_path: dict[str, dict[str, TensorRef]] = {path: {} for path in paths}  # one pass, not one per module
    for (path, leaf), tensor in zip(names, tensors, strict=True):
        if path in by_path:
            by_path[path][leaf] = tensor
    modules = []
    for path, own in by_path.items():
        if _mapped_other(path, sources):
            continue  # left unchanged as stated: the other rules see them as plain tensors
        packed = {leaf: t for leaf, t in own.items() if PACKED_PYTORCH_LEAF.fullmatch(leaf)}
        kind: str | None
        if any(_MHA_LEAF.fullmatch(leaf) for leaf in packed):
            out_proj = {f"out_proj.{leaf}": by_name.get(_full(path, f"out_proj.{leaf}")) for leaf in ("weight", "bias")}
            packed.update({rel: t for rel, t in out_proj.items() if t is not None})
            kind, reason = MULTI_HEAD_ATTENTION, "PyTorch in_proj names"
            if not all(_MHA_LEAF.fullmatch(leaf) or leaf.startswith("out_proj.") for leaf in packed):
                kind, reason = None, "attention and recurrent packed tensors in one module"
        else:
            kind, reason = _rnn_kind(packed)
        module = PackedModule(path, kind, PYTORCH, packed, reason)
        _check_stated(module, sources)
        modules.append(module)
    return modules


def _mapped_other(path: str, sources: KindSources) -> bool:
    """Whether the module map, else the file's record, says to leave this module's tensors unchanged."""
    rule = sources.module_map.lookup(path) if sources.module_map is not None else None
    stated = rule.kind if rule is not None else sources.recorded.get(path)
    return stated == OTHER


def _rnn_kind(packed: dict[str, TensorRef]) -> tuple[str | None, str]:
    """k from weight_hh_l0 [kH, H]: 4 an LSTM, 3 a GRU, 1 an RNN."""
    hh = packed.get("weight_hh_l0")
    if hh is None or len(hh.shape) != 2 or hh.shape[1] == 0 or hh.shape[0] % hh.shape[1]:
        return None, "no weight_hh_l0 [kH, H] to count the gates by"
    chunks = hh.shape[0] // hh.shape[1]
    kind = _KIND_BY_CHUNKS.get(chunks)
    if kind is None:
        return None, f"weight_hh_l0 {list(hh.shape)} holds {chunks} chunks: no LSTM (4), GRU (3) or RNN (1)"
    return kind, f"PyTorch weight_hh_l0 {list(hh.shape)}: {chunks} chunk(s) of {hh.shape[1]} rows"


def _check_stated(module: PackedModule, sources: KindSources) -> None:
    """A module map stating another kind than the packed names show is wrong: say so (a record is ours)."""
    rule = sources.module_map.lookup(module.path) if sources.module_map is not None else None
    if rule is not None and rule.kind in PACKED_KINDS and module.kind is not None and rule.kind != module.kind:
        raise ConfigError(
            f"modules.{rule.pattern!r}: maps {module.label!r} to {rule.kind}, but its tensors are those of a "
            f"{module.kind} ({module.reason})",
            sources.module_map.source if sources.module_map is not None else "module map",
        )


def _refuse(name: str, why: str) -> UnsupportedError:
    return UnsupportedError(f"tensor '{name}': {why}")


def _split_mha(module: PackedModule) -> list[PlanEntry]:
    """docs/burn-adapters.md#packed-modules: in_proj rows q, k, v -> query, key, value (each a Linear, transposed);
    out_proj -> output. bias_k/bias_v and the separate q/k/v_proj_weight (kdim/vdim) have no Burn slot."""
    for rel, tensor in module.tensors.items():
        if rel not in _MHA_SPLIT:
            raise _refuse(
                tensor.name,
                "Burn's MultiHeadAttention has no slot for it (no bias_k/bias_v, no "
                "separate q/k/v projections for kdim/vdim)",
            )
    weight = module.tensors.get("in_proj_weight")
    out_weight = module.tensors.get("out_proj.weight")
    if weight is None or out_weight is None:
        missing = "in_proj_weight" if weight is None else "out_proj.weight"
        raise _refuse(next(iter(module.tensors.values())).name, f"its attention has no {missing} beside it")
    width = _chunk_rows(weight, 3, "in_proj_weight [3E, E]")
    entries = _row_pieces(module, weight, [f"{f}.weight" for f in QKV], width, transpose=True)
    bias = module.tensors.get("in_proj_bias")
    if bias is not None:
        _chunk_rows(bias, 3, "in_proj_bias [3E]", width)
        entries += _row_pieces(module, bias, [f"{f}.bias" for f in QKV], width, transpose=False)
    entries.append(_whole(module, out_weight, "output.weight", transpose=True))
    out_bias = module.tensors.get("out_proj.bias")
    if out_bias is not None:
        entries.append(_whole(module, out_bias, "output.bias", transpose=False))
    return entries


def _split_rnn(module: PackedModule) -> list[PlanEntry]:
    """docs/burn-adapters.md#packed-modules: each chunk of rows of weight_ih_l0 / weight_hh_l0 (and their biases) is one
    gate's input_transform / hidden_transform Linear, transposed; `_l0_reverse` is BiLstm/BiGru's `reverse`. Layers l1+
    and proj_size's weight_hr_l* have no Burn slot."""
    for rel, tensor in module.tensors.items():
        if not _RNN_LAYER_0.fullmatch(rel):
            raise _refuse(tensor.name, _no_rnn_slot(rel))
    if module.kind is None:
        raise _refuse(next(iter(module.tensors.values())).name, f"cannot split it: {module.reason}")
    hidden = module.tensors["weight_hh_l0"].shape[1]
    chunks = len(GATES[module.kind])
    bidirectional = any(rel.endswith("_reverse") for rel in module.tensors)
    entries = []
    for suffix, field_name in _DIRECTIONS if bidirectional else _DIRECTIONS[:1]:
        for param in ("weight", "bias"):
            for side, transform in _TRANSFORMS.items():
                packed = _direction_tensor(module, f"{param}_{side}_l0{suffix}", param == "weight")
                if packed is None:
                    continue
                _chunk_rows(
                    packed, chunks, f"{param}_{side}_l0 [{chunks}H{', ...' if param == 'weight' else ''}]", hidden
                )
                within = f"{field_name}." if bidirectional else ""
                targets = [f"{within}{gate}.{transform}.{param}" for gate in GATES[module.kind]]
                entries += _row_pieces(module, packed, targets, hidden, transpose=param == "weight")
    return entries


def _no_rnn_slot(rel: str) -> str:
    if "_hr_" in rel:
        return "a projection (proj_size) has no slot in Burn's Lstm"
    if re.search(r"_l\d+", rel):
        return "Burn's Lstm/Gru/Rnn is one layer: layers l1+ need separate Burn modules"
    return "not a parameter of a one-layer LSTM/GRU/RNN"


def _direction_tensor(module: PackedModule, rel: str, required: bool) -> TensorRef | None:
    tensor = module.tensors.get(rel)
    pair = rel.replace("_ih_", "_hh_") if "_ih_" in rel else rel.replace("_hh_", "_ih_")
    if tensor is None and (required or pair in module.tensors):
        present = module.tensors.get(pair) or next(iter(module.tensors.values()))
        raise _refuse(present.name, f"its recurrent layer has no {_full(module.path, rel)} beside it")
    return tensor


def _chunk_rows(tensor: TensorRef, chunks: int, expected: str, width: int | None = None) -> int:
    """The rows of one chunk of a packed tensor (its first dimension in `chunks` equal parts)."""
    shape = tensor.shape
    rows = shape[0] // chunks if shape else 0
    fits = bool(shape) and shape[0] == rows * chunks and (width is None or rows == width)
    if expected.startswith("in_proj_weight"):
        fits = fits and len(shape) == 2 and rows == shape[1]
    if not fits or len(shape) > 2:
        raise _refuse(tensor.name, f"shape {list(shape)} is not {expected}")
    if tensor.dtype not in ITEMSIZE:
        raise _refuse(tensor.name, f"cannot split a {tensor.dtype} tensor (no fixed element size)")
    return rows


def _row_pieces(
    module: PackedModule, tensor: TensorRef, targets: list[str], rows: int, *, transpose: bool
) -> list[PlanEntry]:
    piece = (rows, *tensor.shape[1:])
    shape = piece[::-1] if transpose else piece
    return [
        PlanEntry(tensor.name, _full(module.path, target), transpose, shape, rows=(k * rows, (k + 1) * rows))
        for k, target in enumerate(targets)
    ]


def _whole(module: PackedModule, tensor: TensorRef, target: str, *, transpose: bool) -> PlanEntry:
    if transpose and (len(tensor.shape) != 2 or tensor.dtype not in ITEMSIZE):
        raise _refuse(
            tensor.name,
            f"a Linear weight must be 2-D with a fixed element size, not {tensor.dtype} {list(tensor.shape)}",
        )
    shape = tensor.shape[::-1] if transpose else tensor.shape
    return PlanEntry(tensor.name, _full(module.path, target), transpose, shape)


# ---------------------------------------------------------------------------------------------------------
# the Burn side: split names, joined only on evidence


def _burn_packed(tensors: Sequence[TensorRef], sources: KindSources) -> list[PackedModule]:
    candidates = _burn_candidates(tensors)
    if not candidates:
        return []
    by_name = {t.name: t for t in tensors}
    modules: list[PackedModule] = []
    taken: set[TensorRef] = set()
    for root, candidate in candidates.items():
        module = _burn_module(root, candidate, by_name, sources)
        if module is not None and not taken & set(module.tensors.values()):
            taken |= set(module.tensors.values())
            modules.append(module)
    return modules


def _burn_candidates(tensors: Sequence[TensorRef]) -> dict[str, str]:
    """Module paths that may be a split packed module: root -> "mha" | "rnn"."""
    found: dict[str, str] = {}
    for tensor in tensors:
        # the field before the leaf, without splitting the whole name: most names are no candidate
        if tensor.name.rpartition(".")[0].rpartition(".")[2] not in _CANDIDATE_FIELDS:
            continue
        segments = tensor.name.split(".")
        if len(segments) >= 3 and segments[-2] in _TRANSFORM_FIELDS and segments[-3] in _ALL_GATES:
            root = segments[:-3]
            if root and root[-1] in ("forward", "reverse"):
                found.setdefault(".".join(root[:-1]), "rnn")
            found.setdefault(".".join(root), "rnn")
        if len(segments) >= 2 and segments[-2] in _MHA_FIELDS:
            found.setdefault(".".join(segments[:-2]), "mha")
    return found


def _burn_module(root: str, candidate: str, by_name: dict[str, TensorRef], sources: KindSources) -> PackedModule | None:
    """The packed module at `root`, if the evidence says so and the tensors fit (a map that does not fit is
    an error; a record or names that do not fit leave the tensors to the other rules)."""
    stated, by, reason, origin = _stated_burn_kind(root, sources)
    if stated is not None and stated not in PACKED_KINDS:
        return None  # the map or the record says it is something else
    if stated is None and candidate == "mha":
        return None  # query/key/value names alone are not enough (see the module docstring)
    module = PackedModule(root, stated, BURN, by=by, reason=reason)
    try:
        if stated == MULTI_HEAD_ATTENTION:
            module.entries = _join_mha(module, by_name)
        else:
            module.entries = _join_rnn(module, by_name, stated)
    except UnsupportedError as misfit:
        if by == BY_MAP:
            raise ConfigError(f"{module.label}: mapped as {stated}, but {misfit.message}", origin) from None
        return None
    return module


def _stated_burn_kind(root: str, sources: KindSources) -> tuple[str | None, str, str, str]:
    module_map = sources.module_map
    rule = module_map.lookup(root) if module_map is not None else None
    if rule is not None and module_map is not None:
        return rule.kind, BY_MAP, f"module map {rule.pattern!r}", module_map.source
    defined = sources.definition.kinds.get(root) if sources.definition is not None else None
    if defined in PACKED_KINDS and sources.definition is not None:  # nn.MultiheadAttention, nn.LSTM... by type
        return defined, BY_DEFINITION, sources.definition.source, ""
    recorded = sources.recorded.get(root)
    if recorded is not None:
        return recorded, BY_RECORD, "recorded in the file (syncd.kinds)", ""
    return None, BY_NAME, "", ""


def _join_mha(module: PackedModule, by_name: dict[str, TensorRef]) -> list[PlanEntry]:
    weights = _present(module, by_name, [f"{f}.weight" for f in QKV], required=True)
    entries = [_joined(module, weights, "in_proj_weight", transpose=True)]
    biases = _present(module, by_name, [f"{f}.bias" for f in QKV], required=False)
    if biases:
        entries.append(_joined(module, biases, "in_proj_bias", transpose=False))
    (out_weight,) = _present(module, by_name, ["output.weight"], required=True)
    entries.append(_whole(module, out_weight, "out_proj.weight", transpose=True))
    out_bias = _present(module, by_name, ["output.bias"], required=False)
    if out_bias:
        entries.append(_whole(module, out_bias[0], "out_proj.bias", transpose=False))
    return entries


def _join_rnn(module: PackedModule, by_name: dict[str, TensorRef], stated: str | None) -> list[PlanEntry]:
    """Gates in PyTorch's chunk order, each input_transform / hidden_transform Linear transposed back."""
    bidirectional = any(_full(module.path, f"forward.{g}.input_transform.weight") in by_name for g in _ALL_GATES)
    kind = stated or _gate_kind(_full(module.path, "forward") if bidirectional else module.path, by_name)
    if kind not in GATES:
        raise UnsupportedError(f"its gates are not those of Burn's Lstm, Gru or Rnn ({module.label})")
    module.kind = kind
    if not module.reason:
        module.reason = f"Burn's {kind} gate names ({', '.join(GATES[kind])})"
    entries = []
    for suffix, field_name in _DIRECTIONS if bidirectional else _DIRECTIONS[:1]:
        within = f"{field_name}." if bidirectional else ""
        for param in ("weight", "bias"):
            for side, transform in _TRANSFORMS.items():
                rels = [f"{within}{gate}.{transform}.{param}" for gate in GATES[kind]]
                found = _present(module, by_name, rels, required=param == "weight")
                if found:
                    entries.append(_joined(module, found, f"{param}_{side}_l0{suffix}", transpose=param == "weight"))
    return entries


def _gate_kind(prefix: str, by_name: dict[str, TensorRef]) -> str | None:
    present = {gate for gate in _ALL_GATES if _full(prefix, f"{gate}.input_transform.weight") in by_name}
    return next((kind for kind, gates in GATES.items() if present == set(gates)), None)


def _present(
    module: PackedModule, by_name: dict[str, TensorRef], rels: list[str], *, required: bool
) -> list[TensorRef]:
    """The tensors at these relative names: all of them, or (not required) none; taken into the module."""
    found = [by_name.get(_full(module.path, rel)) for rel in rels]
    if any(t is None for t in found) and (required or any(t is not None for t in found)):
        missing = next(rel for rel, t in zip(rels, found, strict=True) if t is None)
        raise UnsupportedError(f"it has no {_full(module.path, missing)}")
    present = [t for t in found if t is not None]
    module.tensors.update({rel: t for rel, t in zip(rels, found, strict=True) if t is not None})
    return present


def _joined(module: PackedModule, tensors: list[TensorRef], target: str, *, transpose: bool) -> PlanEntry:
    """One PyTorch tensor from Burn's pieces, end to end along the first dimension
    (docs/burn-adapters.md#packed-modules)."""
    shapes = {t.shape for t in tensors}
    dtypes = {t.dtype for t in tensors}
    rank = 2 if transpose else 1
    if len(shapes) != 1 or len(dtypes) != 1 or len(tensors[0].shape) != rank or tensors[0].dtype not in ITEMSIZE:
        listed = ", ".join(f"{t.name} {t.dtype} {list(t.shape)}" for t in tensors)
        raise UnsupportedError(f"its pieces of {target} differ or are not {rank}-D: {listed}")
    parts = tuple(_whole(module, t, target, transpose=transpose) for t in tensors)
    piece = parts[0].shape
    return PlanEntry(
        tensors[0].name, _full(module.path, target), False, (piece[0] * len(parts), *piece[1:]), parts=parts
    )
