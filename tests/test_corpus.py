"""`syncd convert` on the real-world corpus: every file converts and comes back unchanged, or is refused for a stated
reason.

The corpus (tests/data/corpus, see its MANIFEST.md) was written by Burn, PyTorch and numpy, never by syncd. Each file
is copied into a temporary directory first (the corpus is read-only). The table below is the expected outcome per
file; a file added to the corpus without a row fails `test_every_corpus_file_has_an_expected_outcome`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import CORPUS
from convcheck import assert_one_line_error, dir_listing, read_any, run_cli

from syncd.engine.convert import ConvertRequest, convert

CONVERTS, REFUSED = "converts", "refused"

# file -> (outcome, detail): for CONVERTS the source layout syncd must find; for REFUSED a fragment of the
# one-line error. The bias-free 2-D weights of embedding/linear are settled by their names (`embed`, `fc2`); the
# refusal of genuinely ambiguous files and the printed map that settles them are tested in test_models.py.
EXPECTED: dict[str, tuple[str, str]] = {
    "bpk/tracel-ai_burn__mnist-inference-web__model.bpk": (CONVERTS, "burn"),
    "bpk/ldos-project_asterinas__mlp_weights.bpk": (CONVERTS, "burn"),
    "safetensors_py/FluxML_SafeTensors.jl__model.numpy.safetensors": (CONVERTS, "neutral"),
    "safetensors_py/FluxML_SafeTensors.jl__model.with_metadata.safetensors": (
        REFUSED,
        "Burn has no dtype for F8_E4M3",
    ),
    "safetensors_py/FluxML_SafeTensors.jl__sharded_model-00005-of-00006.safetensors": (
        REFUSED,
        "Burn has no dtype for F8_E4M3",
    ),
    "safetensors_py/huggingface_safetensors__samples_overall.safetensors": (CONVERTS, "neutral"),
    "safetensors_py/tracel-ai_burn__import-model-weights__mnist.safetensors": (CONVERTS, "pytorch"),
    "safetensors_py/tracel-ai_burn__safetensors-tests__batch_norm2d.safetensors": (CONVERTS, "pytorch"),
    "safetensors_py/tracel-ai_burn__safetensors-tests__boolean.safetensors": (CONVERTS, "neutral"),
    "safetensors_py/tracel-ai_burn__safetensors-tests__buffer.safetensors": (CONVERTS, "neutral"),
    "safetensors_py/tracel-ai_burn__safetensors-tests__complex_nested.safetensors": (CONVERTS, "pytorch"),
    "safetensors_py/tracel-ai_burn__safetensors-tests__conv1d.safetensors": (CONVERTS, "neutral"),
    "safetensors_py/tracel-ai_burn__safetensors-tests__conv2d.safetensors": (CONVERTS, "neutral"),
    "safetensors_py/tracel-ai_burn__safetensors-tests__embedding.safetensors": (CONVERTS, "neutral"),
    "safetensors_py/tracel-ai_burn__safetensors-tests__enum_depthwise_false.safetensors": (CONVERTS, "neutral"),
    "safetensors_py/tracel-ai_burn__safetensors-tests__enum_depthwise_true.safetensors": (CONVERTS, "neutral"),
    "safetensors_py/tracel-ai_burn__safetensors-tests__group_norm.safetensors": (CONVERTS, "pytorch"),
    "safetensors_py/tracel-ai_burn__safetensors-tests__integer.safetensors": (CONVERTS, "neutral"),
    "safetensors_py/tracel-ai_burn__safetensors-tests__key_remap.safetensors": (CONVERTS, "neutral"),
    "safetensors_py/tracel-ai_burn__safetensors-tests__key_remap_chained.safetensors": (CONVERTS, "pytorch"),
    "safetensors_py/tracel-ai_burn__safetensors-tests__layer_norm.safetensors": (CONVERTS, "pytorch"),
    "safetensors_py/tracel-ai_burn__safetensors-tests__linear.safetensors": (CONVERTS, "pytorch"),
    "safetensors_py/tracel-ai_burn__safetensors-tests__linear_with_bias.safetensors": (CONVERTS, "pytorch"),
    "safetensors_py/tracel-ai_burn__safetensors-tests__missing_module_field.safetensors": (CONVERTS, "neutral"),
    "safetensors_py/tracel-ai_burn__safetensors-tests__multi_layer.safetensors": (CONVERTS, "pytorch"),
    "safetensors_py/tracel-ai_burn__safetensors-tests__non_contiguous_indexes.safetensors": (CONVERTS, "neutral"),
}


def _by_outcome(outcome: str) -> list[str]:
    return [name for name, (kind, _) in EXPECTED.items() if kind == outcome]


def _copy(name: str, directory: Path) -> Path:
    source = directory / Path(name).name
    shutil.copyfile(CORPUS / name, source)
    return source


def _other(source: Path, directory: Path, tag: str) -> Path:
    return directory / f"{tag}{'.safetensors' if source.suffix == '.bpk' else '.bpk'}"


def _assert_same(original: Path, back: Path) -> None:
    """bpk: same tensors (dtype as stored, shape, bytes) and param_ids, in the same data order; safetensors: same
    tensors (name, dtype, shape, bytes)."""
    before, after = read_any(original), read_any(back)
    assert after.tensors == before.tensors  # for burnpacks Tensor includes the param_id
    if original.suffix == ".bpk":
        assert after.param_ids() == before.param_ids()
        assert after.order == before.order


def test_every_corpus_file_has_an_expected_outcome() -> None:
    found = {str(p.relative_to(CORPUS)) for sub in ("bpk", "safetensors_py") for p in (CORPUS / sub).iterdir()}
    assert found == set(EXPECTED)


@pytest.mark.parametrize("name", _by_outcome(CONVERTS))
def test_corpus_file_converts_and_round_trips(tmp_path: Path, name: str) -> None:
    source = _copy(name, tmp_path)
    middle = _other(source, tmp_path, "converted")
    result = convert(ConvertRequest(source=source, dest=middle))
    assert result.source_layout == EXPECTED[name][1]
    converted = read_any(middle)
    if result.source_layout == "pytorch":  # Burn has no slot for the BatchNorm counters: carried, not written
        assert not [n for n in converted.tensors if n.endswith("num_batches_tracked")]
    if middle.suffix == ".safetensors":
        assert converted.metadata["format"] == "pt"

    back = tmp_path / f"back{source.suffix}"
    convert(ConvertRequest(source=middle, dest=back))
    _assert_same(source, back)


@pytest.mark.parametrize("name", _by_outcome(REFUSED))
def test_corpus_file_is_refused_for_a_stated_reason(tmp_path: Path, name: str) -> None:
    source = _copy(name, tmp_path)
    for layout in ("auto", "keep"):  # no layout choice gives Burn an F8 dtype
        proc = run_cli("convert", source, "--layout", layout)
        assert_one_line_error(proc, 1, str(source), EXPECTED[name][1])
    assert dir_listing(tmp_path) == [source.name]
