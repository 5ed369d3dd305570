"""The store options applied to real plans (syncd/engine/options.py): filter, remap, contiguous indices, casts, undo."""

from __future__ import annotations

import pytest
from hfsets import LLAMA_MODULES, tiny_llama

from syncd.adapters import ModuleMap, TensorRef, plan_conversion
from syncd.adapters.keys import NameCollisionError, TensorFilter, compile_rule
from syncd.engine.options import NothingLeftError, StoreOptions, apply_options, undo_renames
from syncd.errors import SyncdError

pytestmark = pytest.mark.torch

DTYPES = {"torch.float32": "F32"}


def llama_table() -> list[TensorRef]:
    return [TensorRef(k, DTYPES[str(v.dtype)], tuple(v.shape)) for k, v in tiny_llama().state_dict().items()]


def plan_to_burn(refs: list[TensorRef]):
    modules = ModuleMap.from_dict(LLAMA_MODULES, source="test")
    return plan_conversion(refs, to_layout="burn", module_map=modules)


LLAMA_PORT = (
    (r"^lm_head\.", "output."),
    (r"^model\.", ""),
    (r"^embed_tokens\.", "tok_embeddings."),
    (r"^layers\.(\d+)\.input_layernorm\.", "layers.$1.attention_norm."),
    (r"^layers\.(\d+)\.post_attention_layernorm\.", "layers.$1.ffn_norm."),
    (r"\.mlp\.down_proj\.", ".feed_forward.w2."),
    (r"\.mlp\.gate_proj\.", ".feed_forward.swiglu.linear_inner."),
    (r"\.mlp\.up_proj\.", ".feed_forward.swiglu.linear_outer."),
    (r"\.self_attn\.([qkvo])_proj\.", ".attention.w$1."),
)


def test_remap_on_the_source_names_then_the_adapter_and_undone_before_planning_back() -> None:
    refs = llama_table()
    plan = plan_to_burn(refs)
    options = StoreOptions(remap=tuple(compile_rule(p, r) for p, r in LLAMA_PORT))
    applied = apply_options(plan, refs, {r.name: r.name for r in refs}, options)
    names = {e.source: e.target for e in applied.entries}
    # the rules matched `input_layernorm.weight` as in the file; the adapter then made its leaf `gamma`
    assert names["model.layers.1.input_layernorm.weight"] == "layers.1.attention_norm.gamma"
    assert names["model.layers.0.self_attn.k_proj.weight"] == "layers.0.attention.wk.weight"
    assert names["model.norm.weight"] == "norm.gamma" and names["lm_head.weight"] == "output.weight"
    assert all(e.transpose for e in applied.entries if "_proj" in e.source or e.source == "lm_head.weight")
    # the converted file has the port's names; what it carries takes them back to the originals
    converted = [TensorRef(e.target, "F32", e.shape) for e in applied.entries]
    back_refs, real = undo_renames(converted, applied.renames)
    back = plan_conversion(back_refs, to_layout="pytorch", module_map=ModuleMap.from_dict(LLAMA_MODULES, source="t"))
    final = apply_options(back, back_refs, real, StoreOptions(), to_layout="pytorch")
    assert {e.target for e in final.entries} == {r.name for r in refs}
    assert final.restored["layers.1.attention_norm.gamma"] == "model.layers.1.input_layernorm.gamma"


def test_filter_matches_the_files_names_and_lists_what_it_left_out() -> None:
    refs = llama_table()
    plan = plan_to_burn(refs)
    options = StoreOptions(tensors=TensorFilter.of(include=[r"^model\."], exclude=[r"layers\.1\."]))
    applied = apply_options(plan, refs, {r.name: r.name for r in refs}, options)
    assert "lm_head.weight" in applied.left_out and "model.layers.1.mlp.up_proj.weight" in applied.left_out
    assert all(e.source.startswith("model.") and ".layers.1." not in e.source for e in applied.entries)
    assert len(applied.entries) + len(applied.left_out) == len(refs)


def test_a_filter_that_leaves_no_tensor_is_refused_and_a_table_of_none_is_not() -> None:
    """An output of no tensor from a source that had some is no checkpoint: the filter's own words say why.
    A source with no tensor to begin with is not the filter's doing: planned as it was."""
    refs = llama_table()
    options = StoreOptions(tensors=TensorFilter.of(include=["nomatch"], exclude=["^lm_head"]))
    with pytest.raises(NothingLeftError, match=r"^the tensor filter leaves no tensor \(include: nomatch; exclude"):
        apply_options(plan_to_burn(refs), refs, {r.name: r.name for r in refs}, options)
    assert apply_options(plan_to_burn([]), [], {}, options).entries == []
    # a BatchNorm's counter alone has no slot in Burn's layout: carried in metadata, it left a .bpk of no tensor
    norm = [TensorRef(f"bn.{leaf}", "F32", (4,)) for leaf in ("weight", "bias", "running_mean", "running_var")]
    norm.append(TensorRef("bn.num_batches_tracked", "I64", ()))
    counter = StoreOptions(tensors=TensorFilter.of(include=["num_batches_tracked"]))
    with pytest.raises(NothingLeftError, match=r"only 1 with no slot there \(as bn.num_batches_tracked\)"):
        apply_options(plan_to_burn(norm), norm, {r.name: r.name for r in norm}, counter)


def test_collision_is_refused_before_anything() -> None:
    refs = llama_table()
    options = StoreOptions(remap=(compile_rule(r"\.(q|k)_proj\.", ".qk."),))
    with pytest.raises(
        NameCollisionError,
        match="'model.layers.0.self_attn.q_proj.weight' and 'model.layers.0.self_attn.k_proj.weight'",
    ):
        apply_options(plan_to_burn(refs), refs, {r.name: r.name for r in refs}, options)


def test_casts_pick_half_precision_kinds() -> None:
    refs = llama_table()
    applied = apply_options(plan_to_burn(refs), refs, {r.name: r.name for r in refs}, StoreOptions(precision="bf16"))
    assert set(applied.casts) == {r.name for r in refs} and set(applied.casts.values()) == {"BF16"}
    assert applied.notes == []
    half = [TensorRef(r.name, "BF16", r.shape) for r in refs]  # f16 asked of a BF16 file: nothing is F32
    applied = apply_options(plan_to_burn(half), half, {r.name: r.name for r in half}, StoreOptions(precision="f16"))
    assert applied.casts == {}
    assert [note.split(":")[:2] for note in applied.notes] == [["note", " --precision f16 cast no tensor"]]


def test_contiguous_indices_on_a_sequential() -> None:
    refs = [
        TensorRef(f"features.{i}.{leaf}", "F32", (4, 4) if leaf == "weight" else (4,))
        for i in (0, 2, 5)
        for leaf in ("weight", "bias")
    ]
    plan = plan_conversion(refs, to_layout="burn", source_layout="pytorch")
    applied = apply_options(plan, refs, {r.name: r.name for r in refs}, StoreOptions(map_indices_contiguous=True))
    assert [e.target for e in applied.entries] == [
        f"features.{i}.{leaf}" for i in (0, 1, 2) for leaf in ("weight", "bias")
    ]
    assert applied.renames == {
        "features.1.weight": "features.2.weight",
        "features.1.bias": "features.2.bias",
        "features.2.weight": "features.5.weight",
        "features.2.bias": "features.5.bias",
    }


def test_a_rule_that_renames_a_parameter_the_adapter_renames_is_refused() -> None:
    refs = llama_table()
    options = StoreOptions(remap=(compile_rule(r"\.norm\.weight$", ".norm.scale"),))
    with pytest.raises(SyncdError, match="'model.norm.weight' to 'model.norm.scale'"):
        apply_options(plan_to_burn(refs), refs, {r.name: r.name for r in refs}, options)


def test_a_rule_written_for_burns_names_on_a_pytorch_file_is_noted() -> None:
    refs = llama_table()
    options = StoreOptions(remap=(compile_rule(r"\.gamma$", ".scale"),))
    applied = apply_options(plan_to_burn(refs), refs, {r.name: r.name for r in refs}, options)
    assert applied.renames == {}
    assert applied.notes == [
        "note: remap rule '\\.gamma$' matched no tensor name (rules see the source's names, as in Burn)"
    ]


def test_a_rule_is_noted_only_if_it_matches_no_name_the_rules_before_it_left() -> None:
    # docs/store-options.md's Llama rules: the second sees `embed_tokens.weight`, which the first made
    refs = llama_table()
    rules = (compile_rule(r"^model\.", ""), compile_rule(r"^embed_tokens\.", "tok_embeddings."))
    applied = apply_options(plan_to_burn(refs), refs, {r.name: r.name for r in refs}, StoreOptions(remap=rules))
    assert applied.renames["tok_embeddings.weight"] == "model.embed_tokens.weight"
    assert applied.notes == []
    rules = (*rules, compile_rule(r"^model\.norm\.", "norm."))  # nothing is left under model. for it
    applied = apply_options(plan_to_burn(refs), refs, {r.name: r.name for r in refs}, StoreOptions(remap=rules))
    assert applied.notes == [
        "note: remap rule '^model\\.norm\\.' matched no tensor name (rules see the source's names, as in Burn)"
    ]


def test_contiguous_indices_default_to_what_burns_store_for_the_source_format_does() -> None:
    # SafetensorsStore keeps indices as they are, PytorchStore makes them contiguous; an explicit choice wins
    for source, contiguous in (("safetensors", False), ("burnpack", False), ("pytorch", True)):
        assert StoreOptions().for_conversion(source, "burnpack").map_indices_contiguous is contiguous
    explicit = StoreOptions(map_indices_contiguous=False)
    assert explicit.for_conversion("pytorch", "burnpack").map_indices_contiguous is False
    assert StoreOptions(map_indices_contiguous=True).for_conversion("safetensors", "burnpack").map_indices_contiguous


def test_a_safetensors_output_keeps_a_pytorch_checkpoints_indices_unless_asked() -> None:
    # PyTorch loads the state dict by its names: Burn's PytorchStore default is for a model Burn loads
    assert StoreOptions().for_conversion("pytorch", "safetensors").map_indices_contiguous is False
    assert StoreOptions(map_indices_contiguous=True).for_conversion("pytorch", "safetensors").map_indices_contiguous
