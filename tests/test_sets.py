"""Sharded checkpoints, key remapping, filters and precision end to end: real save_pretrained sets,
the real CLI and the real daemon, from_pretrained on what comes back."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from convcheck import run_cli
from daemonutil import REPO, DaemonRun, scratch_files, wait_until
from formatgen import specs_from_reader, write_bpk
from hfsets import LLAMA_MODULES, save_llama
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from syncd.adapters import ModuleMap
from syncd.engine.convert import ConvertRequest, ConvertResult, convert, source_digest
from syncd.engine.hashing import SOURCE_HASH_KEYS
from syncd.errors import SyncdError
from syncd.formats.burnpack import BurnpackReader
from syncd.formats.shards import split_greedy

pytestmark = pytest.mark.torch

ORIGINAL_FILES = [
    "model-00001-of-00003.safetensors",
    "model-00002-of-00003.safetensors",
    "model-00003-of-00003.safetensors",
    "model.safetensors.index.json",
]
PORT_RULES = [
    r"^lm_head\.=output.",
    r"^model\.=",
    r"^embed_tokens\.=tok_embeddings.",
    r"^layers\.(\d+)\.input_layernorm\.=layers.$1.attention_norm.",
    r"^layers\.(\d+)\.post_attention_layernorm\.=layers.$1.ffn_norm.",
    r"\.mlp\.down_proj\.=.feed_forward.w2.",
    r"\.mlp\.gate_proj\.=.feed_forward.swiglu.linear_inner.",
    r"\.mlp\.up_proj\.=.feed_forward.swiglu.linear_outer.",
    r"\.self_attn\.([qkvo])_proj\.=.attention.w$1.",
]


def syncd(*args: str | Path, ok: bool = True) -> subprocess.CompletedProcess[str]:
    """`syncd ARGS`, which must succeed (`ok`) or fail with one line."""
    result = run_cli(*args, timeout=300)
    if ok:
        assert result.returncode == 0, result.stderr
    else:
        assert result.returncode != 0 and len(result.stderr.splitlines()) == 1, result.stderr
    return result


@pytest.fixture(scope="module")
def saves(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("saves")
    modules = root / "llama.yaml"
    modules.write_text(yaml.safe_dump(LLAMA_MODULES))
    return {
        "sharded": save_llama(root / "sharded", sharded=True),
        "single": save_llama(root / "single", sharded=False),
        "modules": modules,
    }


def fresh_set(saves: dict[str, Path], where: Path) -> Path:
    shutil.copytree(saves["sharded"].parent, where)
    return where / saves["sharded"].name


def tensors_of(bpk: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    with BurnpackReader(bpk) as reader:
        return {t.name: (t.dtype, t.shape, reader.read(t.name)) for t in reader.tensors}


def single_bpk(saves: dict[str, Path], tmp_path: Path, *extra: str) -> Path:
    out = tmp_path / "single.bpk"
    syncd("convert", saves["single"], "-o", out, "--modules", saves["modules"], *extra)
    return out


def assert_state_reloads(directory: Path, original: Path) -> None:
    for name in ("config.json", "generation_config.json"):
        shutil.copy(original.parent / name, directory / name)
    reloaded = LlamaForCausalLM.from_pretrained(directory).state_dict()
    expected = LlamaForCausalLM.from_pretrained(original.parent).state_dict()
    assert reloaded.keys() == expected.keys()
    assert all(torch.equal(reloaded[k], expected[k]) for k in expected)


def test_sharded_set_converts_to_one_bpk_and_back_to_the_same_files(saves: dict[str, Path], tmp_path: Path) -> None:
    index = fresh_set(saves, tmp_path / "set")
    assert len(json.loads(index.read_text())["weight_map"]) > 3 and len(list(index.parent.glob("model-*"))) == 3
    result = syncd("convert", index.parent, "--modules", saves["modules"])  # the directory stands for its index
    assert f"-> {index.parent / 'model.bpk'}" in result.stdout
    bpk = index.parent / "model.bpk"
    assert tensors_of(bpk) == tensors_of(single_bpk(saves, tmp_path))  # planned over all shards together

    back = tmp_path / "back"
    back.mkdir()
    syncd("convert", bpk, "-o", back, "--modules", saves["modules"])
    assert sorted(p.name for p in back.iterdir()) == ORIGINAL_FILES
    for name in ORIGINAL_FILES:
        assert (back / name).read_bytes() == (index.parent / name).read_bytes(), name
    assert_state_reloads(back, saves["sharded"])


def test_the_index_file_itself_is_a_source_and_a_bpk_beside_it_goes_back_beside_it(
    saves: dict[str, Path], tmp_path: Path
) -> None:
    index = fresh_set(saves, tmp_path / "set")
    syncd("convert", index, "--modules", saves["modules"])
    bpk = tmp_path / "elsewhere" / "model.bpk"
    bpk.parent.mkdir()
    shutil.move(index.parent / "model.bpk", bpk)
    syncd("convert", bpk, "--modules", saves["modules"])
    for name in ORIGINAL_FILES:
        assert (bpk.parent / name).read_bytes() == (index.parent / name).read_bytes()
    # existing files are never replaced: a second run refuses before writing anything
    again = syncd("convert", bpk, "--modules", saves["modules"], ok=False)
    assert "already exists" in again.stderr and scratch_files(bpk.parent) == []


@pytest.mark.slow
def test_shard_size_splits_anew_and_none_writes_one_file(saves: dict[str, Path], tmp_path: Path) -> None:
    bpk = single_bpk(saves, tmp_path)
    split = tmp_path / "split"
    split.mkdir()
    syncd("convert", bpk, "-o", split, "--shard-size", "20KB", "--modules", saves["modules"])
    index = json.loads((split / "single.safetensors.index.json").read_text())
    with BurnpackReader(bpk) as reader:  # HF's greedy rule over the tensors in the .bpk's order
        groups = split_greedy([(t.name, t.nbytes) for t in reader.tensors], 20_000)
    assert sorted(set(index["weight_map"].values())) == [
        f"single-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)
    ]
    assert set(index["metadata"]) == {"total_size"}
    assert index["metadata"]["total_size"] == sum(
        t.numel() * 4 for f in split.glob("single-*.safetensors") for t in load_file(f).values()
    )
    os.rename(split / "single.safetensors.index.json", split / "model.safetensors.index.json")
    index_text = (split / "model.safetensors.index.json").read_text().replace("single-", "model-")
    (split / "model.safetensors.index.json").write_text(index_text)
    for f in split.glob("single-*"):
        f.rename(split / f.name.replace("single-", "model-"))
    assert_state_reloads(split, saves["sharded"])

    sharded_bpk = tmp_path / "from_set.bpk"
    syncd("convert", saves["sharded"], "-o", sharded_bpk, "--modules", saves["modules"])
    one = tmp_path / "one"
    one.mkdir()
    syncd("convert", sharded_bpk, "-o", one / "model.safetensors", "--modules", saves["modules"])
    syncd(
        "convert",
        sharded_bpk,
        "-o",
        tmp_path / "none.safetensors",
        "--shard-size",
        "none",
        "--modules",
        saves["modules"],
    )
    assert sorted(p.name for p in one.iterdir()) == ["model.safetensors"]
    assert (tmp_path / "none.safetensors").read_bytes() == (one / "model.safetensors").read_bytes()
    assert_state_reloads(one, saves["sharded"])


@pytest.mark.parametrize("source", ["single.bpk", "set.bpk filtered to one shard"])
def test_an_index_named_by_o_is_written_for_one_shard_too(saves: dict[str, Path], tmp_path: Path, source: str) -> None:
    """`-o NAME.safetensors.index.json` gets that index, a set of one shard too (as the daemon writes one with
    a watch's shard_size), its shard named after it: it wrote one plain file under another name and no index.
    A directory or a .safetensors name still gets one file where the model fits one shard."""
    if source == "single.bpk":
        bpk, options = single_bpk(saves, tmp_path), ["--shard-size", "5GB"]
    else:
        bpk, options = set_bpk(saves, tmp_path / "work"), ["--include", "embed_tokens"]
    named, directory = tmp_path / "named", tmp_path / "directory"
    named.mkdir()
    directory.mkdir()
    syncd("convert", bpk, "-o", named / "foo.safetensors.index.json", *options)
    syncd("convert", bpk, "-o", directory, *options)
    (one_file,) = directory.iterdir()
    assert one_file.suffix == ".safetensors"
    shard = "foo-00001-of-00001.safetensors"  # a fresh split and a carried set alike: named after the index
    assert sorted(p.name for p in named.iterdir()) == sorted([shard, "foo.safetensors.index.json"])
    index = json.loads((named / "foo.safetensors.index.json").read_text())
    tensors = load_file(named / shard)
    assert index["weight_map"] == dict.fromkeys(tensors, shard)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in tensors.values())
    assert {k: v.tolist() for k, v in tensors.items()} == {k: v.tolist() for k, v in load_file(one_file).items()}


def test_a_safetensors_set_converted_to_safetensors_is_written_as_the_same_set(
    saves: dict[str, Path], tmp_path: Path
) -> None:
    """A set written as safetensors (to cast it, rename or filter its tensors) keeps its shards, as a .bpk made
    from it carries them back: it was written as one shard under whatever name -o gave, or one plain file."""
    index = fresh_set(saves, tmp_path / "set")
    same, named, cast = tmp_path / "same", tmp_path / "named", tmp_path / "cast"
    for directory in (same, named, cast):
        directory.mkdir()
    modules = ("--modules", saves["modules"])
    syncd("convert", index, "--to", "safetensors", "-o", same, *modules)
    assert sorted(p.name for p in same.iterdir()) == ORIGINAL_FILES
    for name in ORIGINAL_FILES:  # what save_pretrained wrote, byte for byte
        assert (same / name).read_bytes() == (index.parent / name).read_bytes(), name

    syncd("convert", index, "-o", named / "foo.safetensors.index.json", *modules)
    original = json.loads(index.read_text())["weight_map"]
    renamed = json.loads((named / "foo.safetensors.index.json").read_text())["weight_map"]
    assert renamed == {name: shard.replace("model-", "foo-") for name, shard in original.items()}

    syncd("convert", index, "--to", "safetensors", "-o", cast, "--precision", "bf16", *modules)
    cast_index = json.loads((cast / "model.safetensors.index.json").read_text())
    assert cast_index["weight_map"] == original
    tensors = {name: load_file(cast / shard)[name] for name, shard in cast_index["weight_map"].items()}
    originals = {name: load_file(index.parent / shard)[name] for name, shard in original.items()}
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert all(torch.equal(tensors[k], originals[k].to(torch.bfloat16)) for k in originals)
    assert cast_index["metadata"]["total_size"] == sum(t.numel() * 2 for t in tensors.values())

    one = tmp_path / "one.safetensors"  # one file, still, when -o names one
    syncd("convert", index, "-o", one, *modules)
    assert load_file(one).keys() == originals.keys()


def test_an_index_named_by_o_makes_a_set_of_a_file_that_carries_none(tmp_path: Path) -> None:
    """`-o NAME.safetensors.index.json` of a checkpoint that carries no set, without --shard-size, is that index
    and one shard named after it: it wrote one safetensors file (or, from a .pt, a .bpk) under the index's
    name. With --shard-size none (one plain file) the name asking for a set is a one-line usage error."""
    torch.manual_seed(0)
    weights = {"fc.weight": torch.randn(4, 3), "fc.bias": torch.randn(4)}
    torch.save(weights, tmp_path / "m.pt")
    syncd("convert", tmp_path / "m.pt", "-o", tmp_path / "m.bpk")
    for source, stem in ((tmp_path / "m.bpk", "model"), (tmp_path / "m.pt", "other")):
        out = tmp_path / f"out-{source.suffix[1:]}"
        out.mkdir()
        syncd("convert", source, "-o", out / f"{stem}.safetensors.index.json")
        shard = f"{stem}-00001-of-00001.safetensors"
        assert sorted(p.name for p in out.iterdir()) == sorted([shard, f"{stem}.safetensors.index.json"])
        index = json.loads((out / f"{stem}.safetensors.index.json").read_text())
        assert index["weight_map"] == dict.fromkeys(weights, shard)
        got = load_file(out / shard)
        assert got.keys() == weights.keys() and all(torch.equal(got[k], weights[k]) for k in weights)
        syncd("convert", out / f"{stem}.safetensors.index.json", "-o", tmp_path / f"back-{stem}.bpk")
    none = tmp_path / "none"
    none.mkdir()
    refused = syncd(
        "convert", tmp_path / "m.bpk", "-o", none / "x.safetensors.index.json", "--shard-size", "none", ok=False
    )
    assert refused.returncode == 2 and "--shard-size none writes one plain file" in refused.stderr
    assert str(none / "x.safetensors.index.json") in refused.stderr and not list(none.iterdir())


def empty_bpk(where: Path) -> Path:
    """A .bpk of no tensor, made by `syncd convert` from a safetensors file of none."""
    save_file({}, where / "empty.safetensors", metadata={"format": "pt"})
    syncd("convert", where / "empty.safetensors", "-o", where / "empty.bpk")
    return where / "empty.bpk"


def test_a_set_of_no_tensor_is_refused_and_one_file_of_none_written(tmp_path: Path) -> None:
    """A set lists at least one tensor: --shard-size or an index named by -o on a source of none wrote an index
    with an empty weight_map, which syncd itself then refused to read. Now a one-line usage error naming the
    source, nothing written; one plain file of no tensor is still written."""
    bpk = empty_bpk(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    for options in (["--shard-size", "1KB"], ["--shard-size", "1KB", "--overwrite"]):
        refused = syncd("convert", bpk, "-o", out, *options, ok=False)
        assert refused.returncode == 2 and refused.stderr.startswith(f"syncd: {bpk}: no tensor to put in a set")
    refused = syncd("convert", bpk, "-o", out / "e.safetensors.index.json", ok=False)
    assert refused.returncode == 2 and "no tensor to put in a set" in refused.stderr
    assert not list(out.iterdir())
    syncd("convert", bpk, "-o", out)
    assert [p.name for p in out.iterdir()] == ["empty.safetensors"] and load_file(out / "empty.safetensors") == {}


@pytest.mark.daemon
def test_a_watchs_shard_size_on_a_bpk_of_no_tensor_is_an_error_line(saves: dict[str, Path], tmp_path: Path) -> None:
    """In a watch with shard_size, a .bpk of no tensor is an error line naming it (it wrote an index listing
    nothing, which no reader takes for a set); the daemon runs on and converts the next file."""
    (tmp_path / "made").mkdir()
    empty = empty_bpk(tmp_path / "made")
    bpk = single_bpk(saves, tmp_path)
    with DaemonRun(tmp_path / "d", watches=[{**ONE_DIRECTION, "shard_size": "1GB"}]) as run:
        run.start()
        runs = run.watch_dir("runs")
        saved_as_a_trainer_saves(empty, runs / "empty.bpk")
        run.wait_for("error", [runs / "empty.bpk"])
        (error,) = run.statuses("error")
        assert error["error"].startswith(f"{runs / 'empty.bpk'}: no tensor to put in a set"), run.log_text()
        assert sorted(p.name for p in runs.iterdir()) == ["empty.bpk"]
        saved_as_a_trainer_saves(bpk, runs / "model.bpk")
        run.wait_for("converted", [runs / "model.bpk"])
        assert run.running() and "Traceback" not in run.stderr()


def test_sets_under_two_index_names_in_one_directory_keep_their_own_shards(
    saves: dict[str, Path], tmp_path: Path
) -> None:
    """A carried set written under an index of another name gets shards named after that index, as
    save_pretrained names them: the carried `model-0000N-of-0000M` names were kept, so a second filtered set
    written beside the first (--overwrite) replaced its shards, and the first index listed tensors its shards
    no longer held."""
    bpk = set_bpk(saves, tmp_path / "work")
    out = tmp_path / "out"
    out.mkdir()
    syncd("convert", bpk, "-o", out / "a.safetensors.index.json", "--include", r"layers\.0\.")
    syncd("convert", bpk, "-o", out / "b.safetensors.index.json", "--include", r"layers\.1\.", "--overwrite")
    for stem, layer in (("a", "layers.0."), ("b", "layers.1.")):
        index = json.loads((out / f"{stem}.safetensors.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert shards and all(s.startswith(f"{stem}-0000") and s.endswith(".safetensors") for s in shards)
        held = {name: shard for shard in shards for name in load_file(out / shard)}
        assert held == index["weight_map"] and all(layer in name for name in held)
        syncd("convert", out / f"{stem}.safetensors.index.json", "-o", tmp_path / f"{stem}.bpk")
    assert not list(out.glob("model*"))


def test_shard_size_with_one_safetensors_file_named_is_refused_not_dropped(
    saves: dict[str, Path], tmp_path: Path
) -> None:
    bpk = single_bpk(saves, tmp_path)
    result = syncd("convert", bpk, "-o", tmp_path / "one.safetensors", "--shard-size", "20KB", ok=False)
    assert result.returncode == 2 and "--shard-size splits the output into a set" in result.stderr
    assert not (tmp_path / "one.safetensors").exists()


def test_a_set_is_never_written_in_burns_layout(saves: dict[str, Path], tmp_path: Path) -> None:
    """A set holds what save_pretrained writes: PyTorch's layout, `format: pt`, no syncd record. A Burn-layout
    .bpk split with --layout keep was such a set, and its next conversion took it for PyTorch's, exit 0, every
    Linear transposed. A PyTorch set keeps its layout when re-split so."""
    bpk = single_bpk(saves, tmp_path)
    (tmp_path / "out").mkdir()
    refused = syncd("convert", bpk, "-o", tmp_path / "out", "--layout", "keep", "--shard-size", "20KB", ok=False)
    assert refused.returncode == 2 and "a sharded set is written in PyTorch's layout" in refused.stderr
    assert not list((tmp_path / "out").iterdir())
    resplit = tmp_path / "resplit"
    resplit.mkdir()
    syncd("convert", saves["sharded"], "-o", resplit, "--to", "safetensors", "--layout", "keep", "--shard-size", "40KB")
    got = {k: v for path in resplit.glob("*.safetensors") for k, v in load_file(path).items()}
    want = {k: v for path in saves["sharded"].parent.glob("*.safetensors") for k, v in load_file(path).items()}
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    # a .bpk kept in PyTorch's layout (--layout keep) records no layout, but carries the `format: pt` of its
    # source: it was refused as Burn's
    kept = tmp_path / "kept.bpk"
    syncd("convert", saves["sharded"], "-o", kept, "--layout", "keep")
    again = tmp_path / "again"
    again.mkdir()
    syncd("convert", kept, "-o", again, "--layout", "keep", "--shard-size", "40KB")
    got = {k: v for path in again.glob("*.safetensors") for k, v in load_file(path).items()}
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_file_split_into_a_set_takes_its_stem(tmp_path: Path) -> None:
    """model.safetensors split by --shard-size is model-0000N-of-0000M.safetensors and model.safetensors.index.json
    (it was model.safetensors-00001-of-00003.safetensors)."""
    rng = np.random.default_rng(0)
    source = tmp_path / "model.safetensors"
    save_file(
        {f"layers.{i}.weight": torch.from_numpy(rng.standard_normal((8, 8), dtype=np.float32)) for i in range(3)},
        source,
    )
    split = tmp_path / "split"
    split.mkdir()
    syncd("convert", source, "-o", split, "--to", "safetensors", "--layout", "keep", "--shard-size", "300")
    assert sorted(p.name for p in split.iterdir()) == [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "model.safetensors.index.json",
    ]


def test_remap_to_a_burn_port_and_back(saves: dict[str, Path], tmp_path: Path) -> None:
    index = fresh_set(saves, tmp_path / "set")
    remap = [arg for rule in PORT_RULES for arg in ("--remap", rule)]
    syncd("convert", index, "--modules", saves["modules"], *remap)
    names = set(tensors_of(index.parent / "model.bpk"))
    assert {
        "tok_embeddings.weight",
        "layers.1.attention_norm.gamma",
        "layers.0.ffn_norm.gamma",
        "norm.gamma",
        "layers.0.attention.wq.weight",
        "layers.1.feed_forward.swiglu.linear_inner.weight",
        "output.weight",
        "layers.0.feed_forward.w2.weight",
    } <= names
    assert not any(n.startswith("model.") or "_proj" in n for n in names)
    plain = tensors_of(single_bpk(saves, tmp_path))
    remapped = tensors_of(index.parent / "model.bpk")
    assert sorted(v for v in plain.values()) == sorted(v for v in remapped.values())
    back = tmp_path / "back"
    back.mkdir()
    syncd("convert", index.parent / "model.bpk", "-o", back, "--modules", saves["modules"])  # carried renames
    for name in ORIGINAL_FILES:
        assert (back / name).read_bytes() == (index.parent / name).read_bytes()


def test_a_bpk_of_a_set_remapped_on_its_way_back_is_written_as_that_set_under_the_new_names(
    saves: dict[str, Path], tmp_path: Path
) -> None:
    """The .bpk carries its set's layout, which names the tensors as the set did; rules applied on the way back
    rename them. The layout is written under the new names, each tensor in its shard (it was an internal
    error: the layout named none of the tensors written)."""
    index = fresh_set(saves, tmp_path / "set")
    syncd("convert", index, "--modules", saves["modules"])
    back = tmp_path / "back"
    back.mkdir()
    rule = r"^model\.layers\.(\d+)\.=model.blocks.$1."
    syncd("convert", index.parent / "model.bpk", "-o", back, "--modules", saves["modules"], "--remap", rule)
    assert sorted(p.name for p in back.iterdir()) == ORIGINAL_FILES
    original = json.loads(index.read_text())["weight_map"]
    renamed = {name.replace("model.layers.", "model.blocks.", 1): shard for name, shard in original.items()}
    assert json.loads((back / "model.safetensors.index.json").read_text())["weight_map"] == renamed
    for shard in ORIGINAL_FILES[:-1]:
        before, after = load_file(index.parent / shard), load_file(back / shard)
        assert {name.replace("model.layers.", "model.blocks.", 1) for name in before} == set(after)
        assert all(
            torch.equal(after[name.replace("model.layers.", "model.blocks.", 1)], t) for name, t in before.items()
        )


def test_a_carried_set_that_does_not_name_every_tensor_is_refused_in_one_line(
    saves: dict[str, Path], tmp_path: Path
) -> None:
    """A .bpk whose carried layout leaves a tensor out (edited, or written by another tool) is not written as
    that set with a tensor in no shard: the line says how to write it instead, and nothing is written."""
    index = fresh_set(saves, tmp_path / "set")
    syncd("convert", index, "--modules", saves["modules"])
    with BurnpackReader(index.parent / "model.bpk") as reader:
        metadata, scalars = dict(reader.header.metadata), reader.header.scalars
        layout = json.loads(metadata["syncd.shards"])
        left_out = layout["files"][0][1].pop(0)
        metadata["syncd.shards"] = json.dumps(layout)
        write_bpk(tmp_path / "edited.bpk", specs_from_reader(reader), metadata=metadata, scalars=scalars)
    back = tmp_path / "back"
    back.mkdir()
    refused = syncd("convert", tmp_path / "edited.bpk", "-o", back, "--modules", saves["modules"], ok=False)
    assert f"does not name 1 of the tensors written (e.g. '{left_out}')" in refused.stderr
    assert "--shard-size" in refused.stderr and list(back.iterdir()) == []
    syncd("convert", tmp_path / "edited.bpk", "-o", back, "--modules", saves["modules"], "--shard-size", "none")
    assert left_out in load_file(back / "edited.safetensors")


@pytest.mark.slow
def test_remap_collision_and_bad_rules_are_refused_in_one_line_with_nothing_written(
    saves: dict[str, Path], tmp_path: Path
) -> None:
    index = fresh_set(saves, tmp_path / "set")
    before = sorted(p.name for p in index.parent.iterdir())
    collide = syncd("convert", index, "--modules", saves["modules"], "--remap", r"\.(q|k)_proj\.=.qk.", ok=False)
    assert (
        "'model.layers.0.self_attn.k_proj.weight' and 'model.layers.0.self_attn.q_proj.weight' would both"
        in collide.stderr
        or "would both be named" in collide.stderr
    )
    assert collide.returncode == 1
    for bad in (["--remap", "(unclosed=x"], ["--remap", r"^(a)=$2"], ["--include", "[x"], ["--exclude", "(?P<"]):
        result = syncd("convert", index, "--modules", saves["modules"], *bad, ok=False)
        assert result.returncode == 2
    assert sorted(p.name for p in index.parent.iterdir()) == before


def set_back(bpk: Path, directory: Path, *args: object) -> dict[str, torch.Tensor]:
    """Convert `bpk` back into a set of shards in a new `directory`; returns every tensor of its shards."""
    directory.mkdir()
    syncd("convert", bpk, "-o", directory, *args)
    written: dict[str, torch.Tensor] = {}
    for shard in directory.glob("model-*.safetensors"):
        written.update(load_file(shard))
    return written


def test_a_filtered_sets_index_claims_no_parameter_count_it_cannot_know(tmp_path: Path) -> None:
    """transformers' total_parameters is `num_parameters()`: parameters, not buffers (BatchNorm's running_mean,
    running_var, num_batches_tracked), which a file cannot tell apart. A filtered set recounted it from every
    tensor kept: a tiny ResNet without its classifier said more than the whole model. It is dropped where a
    filter left tensors out, kept as it was where none was."""
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)
    model = ResNetForImageClassification(config)
    model.save_pretrained(tmp_path / "set", max_shard_size="4KB")
    index = tmp_path / "set" / "model.safetensors.index.json"
    original = json.loads(index.read_text())["metadata"]
    assert original["total_parameters"] == model.num_parameters()
    syncd("convert", index, "-o", tmp_path / "m.bpk")
    whole, filtered = tmp_path / "whole", tmp_path / "filtered"
    whole.mkdir()
    filtered.mkdir()
    syncd("convert", tmp_path / "m.bpk", "-o", whole)
    assert json.loads((whole / "model.safetensors.index.json").read_text())["metadata"] == original
    syncd("convert", tmp_path / "m.bpk", "-o", filtered, "--exclude", "^classifier")
    metadata = json.loads((filtered / "model.safetensors.index.json").read_text())["metadata"]
    written = {k: v for shard in filtered.glob("model-*.safetensors") for k, v in load_file(shard).items()}
    assert metadata == {"total_size": sum(t.numel() * t.element_size() for t in written.values())}


def test_filter_both_ways(saves: dict[str, Path], tmp_path: Path) -> None:
    index = fresh_set(saves, tmp_path / "set")
    result = syncd("convert", index, "--modules", saves["modules"], "--exclude", r"^lm_head\.", "-v")
    assert "left out by the tensor filter: lm_head.weight" in result.stdout
    bpk = index.parent / "model.bpk"
    assert "lm_head.weight" not in tensors_of(bpk)
    back = tmp_path / "back"
    written = set_back(bpk, back, "--modules", saves["modules"])
    original = LlamaForCausalLM.from_pretrained(index.parent).state_dict()
    assert set(written) == set(original) - {"lm_head.weight"}
    index_back = json.loads((back / "model.safetensors.index.json").read_text())
    # total_parameters dropped: a file cannot tell parameters from buffers (test_a_filtered_sets_index_...)
    assert index_back["metadata"] == {"total_size": sum(t.numel() * 4 for t in written.values())}
    assert set(index_back["weight_map"]) == set(written)
    # a whole set's .bpk filtered on the way back: the same
    filtered_back = tmp_path / "filtered-back"
    written = set_back(set_bpk(saves, tmp_path / "whole"), filtered_back, "--exclude", r"^lm_head\.")
    assert set(written) == set(original) - {"lm_head.weight"}
    index_back = json.loads((filtered_back / "model.safetensors.index.json").read_text())
    assert index_back["metadata"] == {"total_size": sum(t.numel() * 4 for t in written.values())}
    # and on the way back: only the attention of layer 0
    only = tmp_path / "only.safetensors"
    syncd("convert", bpk, "-o", only, "--modules", saves["modules"], "--include", r"layers\.0\.self_attn")
    assert sorted(load_file(only)) == sorted(k for k in original if "layers.0.self_attn" in k)


@pytest.mark.parametrize(
    ("source", "output", "options", "said"),
    [
        ("set.bpk", "out", ["--include", "nomatch"], "include: nomatch"),
        ("set.bpk", "out", ["--shard-size", "20KB", "--include", "nomatch"], "include: nomatch"),
        ("set.bpk", "out/one.safetensors", ["--exclude", "."], "exclude: ."),
        (
            "single",
            "out/model.bpk",
            ["--include", "nomatch", "--exclude", "lm_head"],
            "include: nomatch; exclude: lm_head",
        ),
    ],
)
def test_a_filter_that_leaves_no_tensor_is_refused_naming_the_source(
    saves: dict[str, Path], tmp_path: Path, source: str, output: str, options: list[str], said: str
) -> None:
    """A filter that keeps none of the source's tensors: no output, one line naming the source. A set output
    stopped on an internal error (an empty list of shards), one file was published holding no tensor, exit 0."""
    path = set_bpk(saves, tmp_path / "work") if source == "set.bpk" else saves["single"]
    (tmp_path / "out").mkdir()
    result = syncd("convert", path, "-o", tmp_path / output, "--modules", saves["modules"], *options, ok=False)
    assert result.returncode == 1
    assert result.stderr == f"syncd: {path}: the tensor filter leaves no tensor ({said}); nothing written\n"
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.daemon
def test_a_watchs_filter_that_leaves_no_tensor_is_an_error_and_the_earlier_output_stays(
    saves: dict[str, Path], tmp_path: Path
) -> None:
    """A watch's filter that keeps none of a .bpk's tensors: an error line in the sync log, the good output
    of its earlier save left in place, the daemon running on. It replaced that output by one holding no
    tensor (one file), or logged a Python error and a traceback (a set)."""
    nothing = {"tensors": {"include": ["nomatch"]}}
    with single_output_published(saves, tmp_path) as (run, bpk):
        runs = run.watch_dir("runs")
        good = set_files(runs)
        restarted_with(run, {**ONE_DIRECTION, **nothing})
        saved_as_a_trainer_saves(bpk, runs / "model.bpk")
        run.wait_for("error", [runs / "model.bpk"])
        restarted_with(run, {**ONE_DIRECTION, **nothing, "shard_size": "20KB"})
        saved_as_a_trainer_saves(bpk, runs / "model.bpk")
        wait_until(lambda: len(run.statuses("error")) == 2, 60, "the set's error")
        for error in run.statuses("error"):
            assert error["error"] == (
                f"{runs / 'model.bpk'}: the tensor filter leaves no tensor (include: nomatch); nothing written"
            ), run.log_text()
        assert set_files(runs) == good
        assert run.running() and "Traceback" not in run.stderr()


@pytest.mark.slow
@pytest.mark.parametrize(("precision", "dtype"), [("f16", torch.float16), ("bf16", torch.bfloat16)])
def test_precision_both_ways(saves: dict[str, Path], tmp_path: Path, precision: str, dtype: torch.dtype) -> None:
    index = fresh_set(saves, tmp_path / "set")
    syncd("convert", index, "--modules", saves["modules"], "--precision", precision)
    bpk = index.parent / "model.bpk"
    with BurnpackReader(bpk) as reader:
        assert {t.dtype for t in reader.tensors} == {precision.upper()}
        assert json.loads(reader.header.metadata["syncd.precision"])["dtype"] == precision.upper()
    original = LlamaForCausalLM.from_pretrained(index.parent).state_dict()
    # back without asking: the cast is lossy, so the tensors stay half
    half = tmp_path / "half"
    written = set_back(bpk, half, "--modules", saves["modules"])
    assert all(written[k].dtype == dtype and torch.equal(written[k], original[k].to(dtype)) for k in original)
    index_back = json.loads((half / "model.safetensors.index.json").read_text())
    assert index_back["metadata"]["total_size"] == sum(t.numel() * 2 for t in written.values())
    # back asking for f32: F32 again, holding the half values exactly
    full = tmp_path / "full"
    restored = set_back(bpk, full, "--modules", saves["modules"], "--precision", "f32")
    assert all(
        restored[k].dtype == torch.float32 and torch.equal(restored[k], original[k].to(dtype).float()) for k in original
    )
    assert (full / "model.safetensors.index.json").read_bytes() == index.read_bytes()


def test_overflowing_cast_is_refused_naming_the_tensor(saves: dict[str, Path], tmp_path: Path) -> None:
    model = LlamaForCausalLM.from_pretrained(saves["sharded"].parent)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 5] = 1e6
    model.save_pretrained(tmp_path / "big", max_shard_size="40KB")
    result = syncd("convert", tmp_path / "big", "--modules", saves["modules"], "--precision", "f16", ok=False)
    assert "tensor 'model.layers.1.mlp.up_proj.weight' holds 1e+06, beyond F16" in result.stderr
    assert not (tmp_path / "big" / "model.bpk").exists() and scratch_files(tmp_path / "big") == []
    syncd("convert", tmp_path / "big", "--modules", saves["modules"], "--precision", "bf16")  # bf16 holds it


def test_contiguous_indices_on_the_cli(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    seq = torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2)
    )
    save_file({f"fc.{k}": v for k, v in seq.state_dict().items()}, tmp_path / "seq.safetensors")
    syncd("convert", tmp_path / "seq.safetensors", "--map-indices-contiguous")
    assert sorted(tensors_of(tmp_path / "seq.bpk")) == [
        f"fc.{i}.{leaf}" for i in range(3) for leaf in ("bias", "weight")
    ]
    syncd("convert", tmp_path / "seq.bpk", "-o", tmp_path / "back.safetensors")
    back = load_file(tmp_path / "back.safetensors")
    assert back.keys() == {f"fc.{k}" for k in seq.state_dict()}
    assert all(torch.equal(back[f"fc.{k}"], v) for k, v in seq.state_dict().items())


@pytest.mark.slow
def test_memory_stays_flat_over_a_set_of_shards(tmp_path: Path) -> None:
    """Six shards of 64 MiB (8 MiB tensors) convert, and come back, within the bound docs/performance.md states for
    single files: the shards are read one tensor at a time."""
    from safetensors.numpy import save_file

    from syncd.formats.shards import render_index

    rng = np.random.default_rng(0)
    directory = tmp_path / "big"
    directory.mkdir()
    weight_map = {}
    for shard in range(6):
        name = f"model-{shard + 1:05d}-of-00006.safetensors"
        tensors = {}
        for layer in range(shard * 4, shard * 4 + 4):
            tensors[f"layers.{layer}.fc.weight"] = rng.standard_normal((2048, 1024), dtype=np.float32)
            tensors[f"layers.{layer}.fc.bias"] = rng.standard_normal(2048, dtype=np.float32)
        save_file(tensors, directory / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    total = sum((directory / f).stat().st_size for f in set(weight_map.values()))
    (directory / "model.safetensors.index.json").write_bytes(render_index({"total_size": total}, weight_map))
    probe = (
        "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for args in (["convert", directory], ["convert", directory / "model.bpk", "-o", tmp_path / "back"]):
        if args[-1] == tmp_path / "back":
            (tmp_path / "back").mkdir()
        out = subprocess.run(
            [sys.executable, "-c", probe, sys.executable, "-m", "syncd", *map(str, args)],
            capture_output=True,
            text=True,
            env=env,
            check=True,
            timeout=600,
        )
        peak_mib = int(out.stdout.split()[-1]) / 1024
        assert peak_mib < 256, f"{args[0]} peaked at {peak_mib:.0f} MiB for a {total >> 20} MiB set"
    for name in weight_map.values():
        assert (tmp_path / "back" / name).read_bytes() == (directory / name).read_bytes()


# ------------------------------------------------------------------------------------------ one pass over a set


def _convert_set(index: Path, **options: object) -> ConvertResult:
    module_map = ModuleMap.from_dict(LLAMA_MODULES)
    return convert(ConvertRequest(source=index, module_map=module_map, **options))  # type: ignore[arg-type]


@pytest.mark.parametrize("hash_name", ["xxh3_128", "sha256"])
def test_a_set_records_the_hash_the_daemon_compares_it_with(
    saves: dict[str, Path], tmp_path: Path, hash_name: str
) -> None:
    """The one pass hashes the index's bytes and then every shard in the index's order, as source_digest
    (the daemon's in-sync check) does; and reports its progress up to every byte written."""
    index = fresh_set(saves, tmp_path / "set")
    seen: list[tuple[int, int]] = []
    result = _convert_set(index, hash_name=hash_name, progress=lambda done, total: seen.append((done, total)))
    with BurnpackReader(result.dest) as reader:
        recorded = reader.header.metadata[SOURCE_HASH_KEYS[hash_name]]
    assert recorded == source_digest(index, index.parent, hash_name)
    assert recorded != source_digest(index.parent / ORIGINAL_FILES[0], index.parent, hash_name)
    assert seen[-1][0] == seen[-1][1] == sum(len(data) for _, _, data in tensors_of(result.dest).values())


def test_the_audit_reads_a_set_back_in_full(saves: dict[str, Path], tmp_path: Path) -> None:
    index = fresh_set(saves, tmp_path / "set")
    syncd("convert", index, "--modules", saves["modules"], "--verify", "full", "-o", tmp_path / "full.bpk")
    assert tensors_of(tmp_path / "full.bpk") == tensors_of(single_bpk(saves, tmp_path))


def test_a_set_written_back_is_checked_and_reports_its_progress(saves: dict[str, Path], tmp_path: Path) -> None:
    """Each shard of an output set is written in its own pass and checked like one file (the audit too); the
    progress counts over the whole set."""
    index = fresh_set(saves, tmp_path / "set")
    bpk = _convert_set(index).dest
    back = tmp_path / "back"
    back.mkdir()
    seen: list[tuple[int, int]] = []
    _convert_set(bpk, dest=back, verify="full", progress=lambda done, total: seen.append((done, total)))
    for name in ORIGINAL_FILES:
        assert (back / name).read_bytes() == (index.parent / name).read_bytes(), name
    total = sum(len(data) for _, _, data in tensors_of(bpk).values())
    assert seen[-1] == (total, total)
    assert all(a[0] <= b[0] and a[1] == total for a, b in zip(seen, seen[1:], strict=False))


def test_a_pass_over_a_window_reads_only_that_part_of_the_source(tmp_path: Path) -> None:
    """A shard of an output set takes a part of its source: only the span of its tensors is read (and so
    hashed), nothing before or after it."""
    from safetensors.numpy import save_file

    from syncd.engine.hashing import new_hasher
    from syncd.engine.write.onepass import Move, OnePass
    from syncd.formats.safetensors import SafetensorsReader

    rng = np.random.default_rng(1)
    save_file({name: rng.standard_normal(1000, dtype=np.float32) for name in "abc"}, tmp_path / "src.safetensors")
    with SafetensorsReader(tmp_path / "src.safetensors") as reader:
        b = reader.tensor("b")
        fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT, 0o644)
        hasher = new_hasher("xxh3_128")
        OnePass(
            reader.fd,
            reader.file_size,
            reader.path,
            fd,
            str(tmp_path / "out"),
            [Move("b", b.offset, b.nbytes, 0)],
            hasher=hasher,
            window=(b.offset, b.offset + b.nbytes),
        ).run()
        os.close(fd)
        data = reader.read("b")
    assert (tmp_path / "out").read_bytes() == data
    expected = new_hasher("xxh3_128")
    expected.update(data)
    assert hasher.hexdigest() == expected.hexdigest()


def _rewrite(path: Path) -> None:
    """Same size, other bytes (the last 64: tensor data), past the file system's timestamp granularity."""
    time.sleep(0.05)
    with open(path, "r+b") as handle:
        handle.seek(-64, os.SEEK_END)
        handle.write(bytes(64))


@pytest.mark.parametrize(
    "culprit, change",
    [
        (ORIGINAL_FILES[0], _rewrite),  # the shard being read
        (ORIGINAL_FILES[2], _rewrite),  # a shard not read yet
        (ORIGINAL_FILES[2], lambda path: os.truncate(path, path.stat().st_size - 100)),
        (ORIGINAL_FILES[3], lambda path: path.write_bytes(path.read_bytes())),  # the index, even rewritten as it was
        (ORIGINAL_FILES[3], os.unlink),
    ],
    ids=["shard-being-read", "later-shard", "truncated-shard", "index-rewritten", "index-removed"],
)
def test_a_set_changed_while_it_converts_is_not_published(
    saves: dict[str, Path], tmp_path: Path, culprit: str, change: Callable[[Path], object]
) -> None:
    index = fresh_set(saves, tmp_path / "set")
    changed: list[bool] = []

    def meanwhile(done: int, total: int) -> None:
        if done and not changed:  # the first tensor bytes of the first shard have been written
            changed.append(True)
            change(index.parent / culprit)

    with pytest.raises(SyncdError) as info:
        _convert_set(index, progress=meanwhile)
    assert changed and str(index.parent / culprit) in str(info.value) and "\n" not in str(info.value)
    assert "changed" in str(info.value) or "removed" in str(info.value) or "truncated" in str(info.value)
    assert not (index.parent / "model.bpk").exists() and scratch_files(tmp_path) == []


def test_a_bpk_changed_while_its_set_is_written_publishes_no_shard(saves: dict[str, Path], tmp_path: Path) -> None:
    index = fresh_set(saves, tmp_path / "set")
    bpk = _convert_set(index).dest
    back = tmp_path / "back"
    back.mkdir()
    changed: list[bool] = []

    def meanwhile(done: int, total: int) -> None:
        if done and not changed:  # the first shard is being written
            changed.append(True)
            _rewrite(bpk)

    with pytest.raises(SyncdError, match="changed while it was being converted") as info:
        _convert_set(bpk, dest=back, progress=meanwhile)
    assert changed and str(bpk) in str(info.value) and os.listdir(back) == []


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_damaged_set_is_refused_in_one_line_naming_the_shard(
    saves: dict[str, Path], tmp_path: Path, damage: str
) -> None:
    index = fresh_set(saves, tmp_path / "set")
    shard = index.parent / ORIGINAL_FILES[1]
    if damage == "truncated":
        os.truncate(shard, shard.stat().st_size - 100)
    else:
        shard.unlink()
    result = syncd("convert", index, "--modules", saves["modules"], ok=False)
    assert result.returncode == 1 and str(shard) in result.stderr
    assert ("truncated" if damage == "truncated" else "no such file") in result.stderr.lower()
    assert not (index.parent / "model.bpk").exists() and scratch_files(tmp_path) == []


@pytest.mark.parametrize("sub", ["directory", "symlink"])
def test_a_sets_shards_in_a_subdirectory_are_never_written_through_a_symlink(tmp_path: Path, sub: str) -> None:
    """An index may name its shards in a subdirectory (`sub/m-1.safetensors`), and a .bpk carries those names:
    where `sub` beside the index is a symlink, the shards would land wherever it leads."""
    build = tmp_path / "build"
    (build / "sub").mkdir(parents=True)
    save_file({"a": torch.ones(4)}, build / "sub" / "m-1.safetensors")
    save_file({"b": torch.zeros(4)}, build / "sub" / "m-2.safetensors")
    weight_map = {"a": "sub/m-1.safetensors", "b": "sub/m-2.safetensors"}
    (build / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    runs, outside = tmp_path / "runs", tmp_path / "outside"
    runs.mkdir()
    outside.mkdir()
    convert(ConvertRequest(source=build / "model.safetensors.index.json", dest=runs / "model.bpk", layout="keep"))
    if sub == "symlink":
        (runs / "sub").symlink_to(outside, target_is_directory=True)
        with pytest.raises(SyncdError, match="resolves outside"):
            convert(ConvertRequest(source=runs / "model.bpk"))
        assert os.listdir(outside) == [] and scratch_files(runs, outside) == []
        assert sorted(os.listdir(runs)) == ["model.bpk", "sub"]
    else:
        (runs / "sub").mkdir()
        convert(ConvertRequest(source=runs / "model.bpk"))
        assert sorted(os.listdir(runs / "sub")) == ["m-1.safetensors", "m-2.safetensors"]


@pytest.mark.parametrize("name", ["../ev.safetensors.index.json", "/tmp/.safetensors.index.json"])
def test_a_bpk_naming_its_sets_index_outside_its_directory_is_refused(
    saves: dict[str, Path], tmp_path: Path, name: str
) -> None:
    """The set's layout a .bpk carries names the index it was converted from; a .bpk is anyone's file, and an
    index name leading elsewhere would be written there."""
    bpk = set_bpk(saves, tmp_path / "work")
    recorded = b'"index":"model.safetensors.index.json"'
    planted = f'"index":"{name}"'.encode()
    assert len(planted) == len(recorded) and bpk.read_bytes().count(recorded) == 1
    crafted = tmp_path / "a" / "b" / "model.bpk"
    crafted.parent.mkdir(parents=True)
    crafted.write_bytes(bpk.read_bytes().replace(recorded, planted))
    result = syncd("convert", crafted, ok=False)
    assert result.returncode == 1 and "names its index outside the set's directory" in result.stderr
    assert str(crafted) in result.stderr
    assert sorted(p.name for p in (tmp_path / "a").rglob("*")) == ["b", "model.bpk"]


def test_a_set_goes_where_o_says_or_is_refused_before_anything_is_written(
    saves: dict[str, Path], tmp_path: Path
) -> None:
    """A set is several files: `-o` is a directory, or the index's name. A name that is neither (a directory
    not made yet) used to be taken for a file name in the current directory, and the set written there."""
    bpk = set_bpk(saves, tmp_path / "work")
    missing = tmp_path / "not-made-yet"
    result = syncd("convert", bpk, "-o", missing, ok=False)
    assert result.returncode == 2 and "-o names no directory" in result.stderr and str(missing) in result.stderr
    assert not missing.exists() and sorted(p.name for p in bpk.parent.iterdir()) == ["model.bpk", "set"]
    named = tmp_path / "out" / "custom.safetensors.index.json"
    named.parent.mkdir()
    syncd("convert", bpk, "-o", named)
    shards = [f"custom-{n:05d}-of-00003.safetensors" for n in (1, 2, 3)]  # named after the index
    assert sorted(p.name for p in named.parent.iterdir()) == sorted([*shards, named.name])


def test_an_index_whose_text_the_bpk_cannot_hold_is_refused_naming_it(saves: dict[str, Path], tmp_path: Path) -> None:
    """An index not in save_pretrained's own formatting is carried as its text; 55 MB of trailing newlines
    (valid JSON) come to more metadata than a burnpack may hold, once escaped."""
    index = fresh_set(saves, tmp_path / "set")
    with open(index, "ab") as handle:
        handle.write(b"\n" * (55 << 20))
    result = syncd("convert", index, "-o", tmp_path / "out.bpk", "--modules", saves["modules"], ok=False)
    assert result.returncode == 1 and str(index) in result.stderr and "Metadata size" in result.stderr
    assert not (tmp_path / "out.bpk").exists() and scratch_files(tmp_path) == []


# ------------------------------------------------------------------------------------------ the daemon


@pytest.mark.daemon
def test_daemon_converts_a_set_once_when_its_index_lands_and_never_a_shard_alone(
    saves: dict[str, Path], tmp_path: Path
) -> None:
    with DaemonRun(tmp_path / "d", watches=[{"path": "runs", "modules": LLAMA_MODULES["modules"]}]) as run:
        run.start()
        runs = run.watch_dir("runs")
        index = save_llama(runs / "llama", sharded=True)  # save_pretrained itself writes into the watch
        run.wait_for("converted", [index])
        bpk = runs / "llama" / "model.bpk"
        assert tensors_of(bpk) == tensors_of(single_bpk(saves, tmp_path))
        run.quiet(1.5)
        sources = [r.get("source") for r in run.records()]
        assert sources.count(str(index)) == 1, run.log_text()
        assert not any(s and "-of-000" in s for s in sources)
        assert sorted(p.name for p in (runs / "llama").glob("*.bpk")) == ["model.bpk"]
        assert not list((runs / "llama").glob("model-*.bpk"))
        # its own output is not converted back (the set is there already)
        assert [r["status"] for r in run.records()] == ["started", "converted"], run.log_text()


@pytest.mark.daemon
def test_a_set_saved_again_shard_by_shard_is_converted_once_its_new_index_is_written(
    saves: dict[str, Path], tmp_path: Path
) -> None:
    """save_pretrained over an earlier save writes the shards one by one, then the index, the commit point.
    A shard closed before the others are written is not the new set: converted then, the output would be the
    new shard with the old ones, a model no save ever held."""
    with DaemonRun(tmp_path / "d", watches=[{"path": "runs", "modules": LLAMA_MODULES["modules"]}]) as run:
        run.start()
        runs = run.watch_dir("runs")
        index = save_llama(runs / "llama", sharded=True, seed=0)
        run.wait_for("converted", [index])
        epoch2 = save_llama(tmp_path / "epoch2", sharded=True, seed=1).parent
        for name in ORIGINAL_FILES[:1]:  # the first shard of the next save, closed; the others still to come
            shutil.copyfile(epoch2 / name, runs / "llama" / name)
        run.quiet(2.0)
        assert [r["status"] for r in run.records()] == ["started", "converted"], run.log_text()
        for name in [*ORIGINAL_FILES[1:], index.name]:
            shutil.copyfile(epoch2 / name, runs / "llama" / name)
        run.wait_for("updated", [index])
        expected = tmp_path / "expected.bpk"
        syncd("convert", epoch2 / index.name, "-o", expected, "--modules", saves["modules"])
        assert tensors_of(runs / "llama" / "model.bpk") == tensors_of(expected)
        assert [r["status"] for r in run.records()] == ["started", "converted", "updated"], run.log_text()


@pytest.mark.daemon
def test_daemon_waits_for_every_shard_the_index_lists(saves: dict[str, Path], tmp_path: Path) -> None:
    with DaemonRun(
        tmp_path / "d", watches=[{"path": "runs", "modules": LLAMA_MODULES["modules"]}], settle_seconds=0.2
    ) as run:
        run.start()
        target = run.watch_dir("runs") / "set"
        target.mkdir()
        source = saves["sharded"].parent
        shutil.copy(source / "model.safetensors.index.json", target / "model.safetensors.index.json")
        shutil.copy(source / "model-00001-of-00003.safetensors", target / "model-00001-of-00003.safetensors")
        run.quiet(1.5)
        assert run.statuses("converted") == [] and not (target / "model.bpk").exists()
        for name in ("model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"):
            shutil.copy(source / name, target / name)
        run.wait_for("converted", [target / "model.safetensors.index.json"])
        assert tensors_of(target / "model.bpk") == tensors_of(single_bpk(saves, tmp_path))


@pytest.mark.daemon
def test_daemon_applies_a_watchs_store_settings(saves: dict[str, Path], tmp_path: Path) -> None:
    rules = [[rule.split("=", 1)[0], rule.split("=", 1)[1]] for rule in PORT_RULES]
    watch = {
        "path": "runs",
        "modules": LLAMA_MODULES["modules"],
        "remap": rules,
        "precision": "bf16",
        "tensors": {"exclude": ["^lm_head"]},
    }
    with DaemonRun(tmp_path / "d", watches=[watch]) as run:
        run.start()
        index = save_llama(run.watch_dir("runs") / "llama", sharded=True)
        run.wait_for("converted", [index])
        converted = tensors_of(index.parent / "model.bpk")
        assert "layers.0.attention.wq.weight" in converted and "output.weight" not in converted
        assert {dtype for dtype, _, _ in converted.values()} == {"BF16"}
        record = run.statuses("converted", index)[0]
        assert "left out by the tensor filter: lm_head.weight" in record["layout"]


@pytest.mark.daemon
@pytest.mark.parametrize(("shard_size", "shards"), [("40KB", 3), ("1GB", 1)])
def test_a_watchs_shard_size_writes_a_set_and_keeps_it_up_to_date(
    saves: dict[str, Path], tmp_path: Path, shard_size: str, shards: int
) -> None:
    """A watch's shard_size: a .bpk's conversion is a save_pretrained set, with an index even for one shard
    (a destination whose name does not depend on the model's size), which transformers loads; the .bpk's
    next save updates it."""
    bpk = single_bpk(saves, tmp_path)
    (tmp_path / "again").mkdir()
    again = single_bpk(saves, tmp_path / "again", "--precision", "bf16")
    watch = {"path": "runs", "direction": "bpk->safetensors", "shard_size": shard_size}
    with DaemonRun(tmp_path / "d", watches=[watch]) as run:
        run.start()
        runs = run.watch_dir("runs")
        saved_as_a_trainer_saves(bpk, runs / "model.bpk")
        run.wait_for("converted", [runs / "model.bpk"])
        names = [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
        assert sorted(set_files(runs)) == [*names, "model.safetensors.index.json"], run.log_text()
        if shards > 1:  # what `convert --shard-size` writes
            assert set_files(runs) == converted_set_of(bpk, tmp_path / "expected", "--shard-size", shard_size)
        assert_state_reloads(runs, saves["sharded"])
        before = set_files(runs)
        saved_as_a_trainer_saves(again, runs / "model.bpk")
        run.wait_for("updated", [runs / "model.bpk"])
        if shards > 1:  # half the bytes in BF16: fewer shards, the others removed
            assert set_files(runs) == converted_set_of(again, tmp_path / "expected-again", "--shard-size", shard_size)
        else:
            assert sorted(set_files(runs)) == sorted(before)
            assert set_files(runs)[names[0]] != before[names[0]]
        removed = [] if shards == 1 else ["removed"] * 3  # the old layout's three shards (BF16: two now)
        assert [r["status"] for r in run.records()] == ["started", "converted", *removed, "updated"], run.log_text()


ONE_DIRECTION = {"path": "runs", "direction": "bpk->safetensors"}


@contextlib.contextmanager
def single_output_published(saves: dict[str, Path], tmp_path: Path) -> Iterator[tuple[DaemonRun, Path]]:
    """A running daemon whose watch (no shard_size) has converted a .bpk into runs/model.safetensors: (the
    daemon, the .bpk's bytes as a file outside the tree)."""
    bpk = single_bpk(saves, tmp_path)
    with DaemonRun(tmp_path / "d", watches=[ONE_DIRECTION]) as run:
        run.start()
        runs = run.watch_dir("runs")
        saved_as_a_trainer_saves(bpk, runs / "model.bpk")
        run.wait_for("converted", [runs / "model.bpk"])
        yield run, bpk


def restarted_with(run: DaemonRun, watch: dict) -> None:
    run.stop()
    run.write_config([watch])
    run.start()


@pytest.mark.daemon
def test_shard_size_turned_on_then_off_removes_the_earlier_output_it_replaces(
    saves: dict[str, Path], tmp_path: Path
) -> None:
    """A watch's output changes name when its shard_size is turned on (model.safetensors -> a set) or off. The
    earlier output left beside the new one would be stale, and from_pretrained takes model.safetensors before
    the index: the daemon's own earlier output is removed (`removed`) once the new one is published, each way
    (at the start-up scan: the .bpk's output is not at its new name yet). It was left, and loaded instead."""
    with single_output_published(saves, tmp_path) as (run, bpk):
        runs, watch = run.watch_dir("runs"), ONE_DIRECTION
        single = set_files(runs)
        assert list(single) == ["model.safetensors"]
        restarted_with(run, {**watch, "shard_size": "40KB"})
        run.wait_for("removed", [runs / "model.safetensors"])
        sharded = converted_set_of(bpk, tmp_path / "expected", "--shard-size", "40KB")
        assert set_files(runs) == sharded and len(sharded) == 4
        assert_state_reloads(runs, saves["sharded"])
        restarted_with(run, watch)
        run.wait_for("removed", [runs / name for name in sharded])
        assert set_files(runs) == single
        removed = [Path(r["source"]).name for r in run.records() if r["status"] == "removed"]
        assert removed[:2] == ["model.safetensors", "model.safetensors.index.json"], run.log_text()
        assert sorted(removed[2:]) == sorted(sharded)[:-1], run.log_text()  # the index goes first: no set is left
        assert not [r for r in run.records() if r["status"] in ("skipped", "warning", "error")], run.log_text()


@pytest.mark.daemon
def test_an_earlier_output_someone_changed_is_left_with_a_warning(saves: dict[str, Path], tmp_path: Path) -> None:
    """The single file the watch wrote before its shard_size was turned on, changed since: someone else's,
    left where it is, and said once."""
    with single_output_published(saves, tmp_path) as (run, _):
        runs, watch = run.watch_dir("runs"), ONE_DIRECTION
        with open(runs / "model.safetensors", "r+b") as edited:  # a user's edit in place
            edited.seek(-4, os.SEEK_END)
            edited.write(b"\x00\x00\x80\x3f")
        edit = (runs / "model.safetensors").read_bytes()
        restarted_with(run, {**watch, "shard_size": "40KB"})
        run.wait_for("warning", [runs / "model.bpk"])
        assert (runs / "model.safetensors").read_bytes() == edit
        assert "model.safetensors.index.json" in set_files(runs)
        warnings = [r for r in run.records() if r["status"] == "warning"]
        assert len(warnings) == 1 and "left model.safetensors" in warnings[0]["reason"], run.log_text()
        assert not [r for r in run.records() if r["status"] == "removed"], run.log_text()


@contextlib.contextmanager
def set_published_then_state_lost(saves: dict[str, Path], tmp_path: Path) -> Iterator[tuple[DaemonRun, dict, Path]]:
    """A daemon (stopped) whose watch published a .bpk as a set of three shards, its state directory then
    wiped: (the daemon, the set's files, the .bpk's next save, in BF16, as a file outside the tree)."""
    bpk = single_bpk(saves, tmp_path)
    (tmp_path / "again").mkdir()
    again = single_bpk(saves, tmp_path / "again", "--precision", "bf16")
    watch = {"path": "runs", "direction": "bpk->safetensors", "shard_size": "40KB"}
    with DaemonRun(tmp_path / "d", watches=[watch]) as run:
        run.start()
        runs = run.watch_dir("runs")
        saved_as_a_trainer_saves(bpk, runs / "model.bpk")
        run.wait_for("converted", [runs / "model.bpk"])
        published = set_files(runs)
        run.stop()
        shutil.rmtree(run.state_dir)
        yield run, published, again


@pytest.mark.daemon
def test_a_set_is_found_in_sync_without_the_state_and_stays_the_daemons_to_update(
    saves: dict[str, Path], tmp_path: Path
) -> None:
    """A set carries no syncd.source: with the state lost, the daemon converts the .bpk and compares, file by
    file. The same bytes: in sync, and its own from then on, so the next save updates it. (It was skipped as
    someone else's, for good.)"""
    with set_published_then_state_lost(saves, tmp_path) as (run, published, again):
        runs = run.watch_dir("runs")
        run.start()
        run.wait_for("in_sync", [runs / "model.bpk"])
        assert set_files(runs) == published
        saved_as_a_trainer_saves(again, runs / "model.bpk")
        run.wait_for("updated", [runs / "model.bpk"])
        assert set_files(runs) == converted_set_of(again, tmp_path / "expected", "--shard-size", "40KB")


@pytest.mark.daemon
def test_a_set_of_an_earlier_version_is_adopted_after_a_lost_state_and_updated(
    saves: dict[str, Path], tmp_path: Path
) -> None:
    """The .bpk saved again while the state was lost: its set, of the earlier version, is not this conversion,
    and with no record it is someone else's (skipped, at every save). `syncd retry --adopt` takes the files its
    index lists for the daemon's, and the shards named after it of an earlier layout: the set is updated, and
    no shard of an earlier layout is left."""
    with set_published_then_state_lost(saves, tmp_path) as (run, published, again):
        runs = run.watch_dir("runs")
        # a shard of an earlier layout, which a daemon killed between placing the index and removing it left
        shutil.copy(runs / "model-00001-of-00003.safetensors", runs / "model-00004-of-00004.safetensors")
        published = set_files(runs)
        saved_as_a_trainer_saves(again, runs / "model.bpk")
        run.start()
        run.wait_for("skipped", [runs / "model.bpk"])
        assert set_files(runs) == published
        (skipped,) = run.statuses("skipped", runs / "model.bpk")
        assert "it is a set: if it is syncd's output of an earlier version" in skipped["reason"], run.log_text()
        adopted = run_cli("retry", "-c", run.config_path, "--adopt")
        assert (
            adopted.stdout.splitlines()[0]
            == f"{runs / 'model.safetensors.index.json'}: adopted as the output of model.bpk"
        )
        run.wait_for("updated", [runs / "model.bpk"])
        assert set_files(runs) == converted_set_of(again, tmp_path / "expected", "--shard-size", "40KB")
        removed = sorted(Path(r["source"]).name for r in run.statuses("removed"))
        earlier = [*(f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)), "model-00004-of-00004.safetensors"]
        assert removed == earlier, run.log_text()  # BF16: two shards now


def test_output_directory_for_one_file(saves: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    result = syncd("convert", saves["sharded"], "-o", out, "--modules", saves["modules"])
    assert f"-> {out / 'model.bpk'}" in result.stdout and sorted(p.name for p in out.iterdir()) == ["model.bpk"]


def test_an_index_naming_no_shard_is_refused_as_an_index(tmp_path: Path) -> None:
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map": {"a": "b"}}\n')
    result = syncd("convert", index, ok=False)
    assert f"{index}: index names shard 'b', which is not a .safetensors file inside its directory" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [index.name]


def test_config_json_beside_the_set_needs_no_module_map(saves: dict[str, Path], tmp_path: Path) -> None:
    index = fresh_set(saves, tmp_path / "set")
    remap = [arg for rule in PORT_RULES for arg in ("--remap", rule)]
    syncd("convert", index, *remap)  # config.json (written by save_pretrained) settles the module kinds
    back = tmp_path / "back"
    back.mkdir()
    syncd("convert", index.parent / "model.bpk", "-o", back)  # the .bpk's own record settles them
    for name in ORIGINAL_FILES:
        assert (back / name).read_bytes() == (index.parent / name).read_bytes(), name


@pytest.mark.daemon
def test_daemon_turns_a_sets_bpk_back_into_its_shards_and_index(saves: dict[str, Path], tmp_path: Path) -> None:
    original = fresh_set(saves, tmp_path / "set")
    bpk = tmp_path / "model.bpk"
    syncd("convert", original, "-o", bpk, "--modules", saves["modules"])
    with DaemonRun(tmp_path / "d", watches=[{"path": "runs", "modules": LLAMA_MODULES["modules"]}]) as run:
        run.start()
        back = run.watch_dir("runs") / "back"
        back.mkdir()
        shutil.copy(bpk, back / "model.bpk.part")
        os.rename(back / "model.bpk.part", back / "model.bpk")  # as a trainer publishes: write, then rename
        run.wait_for("converted", [back / "model.bpk"])
        set_files = [name for name in ORIGINAL_FILES if name.endswith((".safetensors", ".index.json"))]
        assert sorted(p.name for p in back.iterdir()) == sorted(["model.bpk", *set_files]), run.log_text()
        for name in set_files:
            assert (back / name).read_bytes() == (original.parent / name).read_bytes(), name
        run.quiet(1.0)  # the shards and index it wrote are its own outputs: nothing converts them back
        assert [r["status"] for r in run.records()] == ["started", "converted"], run.log_text()


def set_bpk(saves: dict[str, Path], work: Path, *extra: str, shard_size: str | None = None) -> Path:
    """A .bpk carrying a sharded set's layout (`shard_size`: the set re-split at that size first), as
    `syncd convert` makes it from the set; `extra`: more options for that conversion."""
    work.mkdir(parents=True)
    index = fresh_set(saves, work / "set")
    if shard_size is not None:
        split, whole = work / "split", work / "whole" / "model.bpk"
        split.mkdir()
        whole.parent.mkdir()
        syncd("convert", index, "-o", whole, "--modules", saves["modules"])
        syncd("convert", whole, "-o", split, "--shard-size", shard_size, "--modules", saves["modules"])
        index = split / "model.safetensors.index.json"
    bpk = work / "model.bpk"
    syncd("convert", index, "-o", bpk, "--modules", saves["modules"], *extra)
    return bpk


def set_files(directory: Path) -> dict[str, bytes]:
    """The set's files in `directory` (its index and shards), by name."""
    return {p.name: p.read_bytes() for p in sorted(directory.glob("model*")) if p.name != "model.bpk"}


def converted_set(bpk: Path, work: Path) -> dict[str, bytes]:
    """What `syncd convert` writes from `bpk`: the set its layout says."""
    return converted_set_of(bpk, work)


def converted_set_of(bpk: Path, work: Path, *extra: str) -> dict[str, bytes]:
    """The same, from the .bpk named model.bpk (the set takes its name)."""
    (work / "in").mkdir(parents=True)
    shutil.copy(bpk, work / "in" / "model.bpk")
    (work / "out").mkdir()
    syncd("convert", work / "in" / "model.bpk", "-o", work / "out", *extra)
    return set_files(work / "out")


def saved_as_a_trainer_saves(data: Path, dest: Path) -> None:
    shutil.copy(data, dest.with_name(dest.name + ".part"))
    os.rename(dest.with_name(dest.name + ".part"), dest)


@contextlib.contextmanager
def set_published_by_a_daemon(bpk: Path, tmp_path: Path) -> Iterator[tuple[DaemonRun, Path]]:
    """A running daemon that has turned `bpk`, saved into runs/back, back into its set: (the daemon, back)."""
    with DaemonRun(tmp_path / "d", watches=[{"path": "runs", "modules": LLAMA_MODULES["modules"]}]) as run:
        run.start()
        back = run.watch_dir("runs") / "back"
        back.mkdir()
        saved_as_a_trainer_saves(bpk, back / "model.bpk")
        run.wait_for("converted", [back / "model.bpk"])
        yield run, back


@pytest.mark.daemon
@pytest.mark.parametrize("shard_size", [None, "60KB"], ids=["same-layout", "fewer-shards"])
def test_daemon_updates_the_set_it_wrote_at_the_bpks_next_save(
    saves: dict[str, Path], tmp_path: Path, shard_size: str | None
) -> None:
    """The set a .bpk went back to is the daemon's own: the .bpk's next save replaces each of its files (the
    index last), and shards the new layout no longer has are removed. (It was left stale: first silently,
    then as someone else's files.)"""
    first = set_bpk(saves, tmp_path / "first")
    second = set_bpk(saves, tmp_path / "second", "--precision", "bf16", shard_size=shard_size)
    with set_published_by_a_daemon(first, tmp_path) as (run, back):
        assert set_files(back) == converted_set(first, tmp_path / "expected-first")
        saved_as_a_trainer_saves(second, back / "model.bpk")
        run.wait_for("updated", [back / "model.bpk"])
        expected = converted_set(second, tmp_path / "expected-second")
        assert len(expected) == (3 if shard_size is None else 2) + 1
        assert set_files(back) == expected
        run.quiet(1.0)
        removed = [] if shard_size is None else ["removed"] * 3  # the three shards of the old layout
        assert [r["status"] for r in run.records()] == ["started", "converted", *removed, "updated"], run.log_text()


@pytest.mark.daemon
def test_a_shard_removed_from_its_set_is_written_again_at_the_next_save(saves: dict[str, Path], tmp_path: Path) -> None:
    """Someone deleted one shard of the daemon's set: what is left is still its own, and the next save writes
    the whole set again."""
    first = set_bpk(saves, tmp_path / "first")
    second = set_bpk(saves, tmp_path / "second", "--precision", "bf16")
    with set_published_by_a_daemon(first, tmp_path) as (run, back):
        (back / "model-00002-of-00003.safetensors").unlink()
        saved_as_a_trainer_saves(second, back / "model.bpk")
        run.wait_for("updated", [back / "model.bpk"])
        assert set_files(back) == converted_set(second, tmp_path / "expected-second")


@pytest.mark.daemon
def test_daemon_leaves_its_set_alone_once_someone_changed_a_shard(saves: dict[str, Path], tmp_path: Path) -> None:
    """One shard of the set rewritten by someone: the set is no longer provably syncd's, and nothing of it is
    replaced at the .bpk's next save (on_exists: skip)."""
    first = set_bpk(saves, tmp_path / "first")
    second = set_bpk(saves, tmp_path / "second", "--precision", "bf16")
    with set_published_by_a_daemon(first, tmp_path) as (run, back):
        shard = back / "model-00002-of-00003.safetensors"
        shard.write_bytes(shard.read_bytes())  # the same bytes, written again: someone else's file now
        before = set_files(back)
        saved_as_a_trainer_saves(second, back / "model.bpk")
        run.wait_for("skipped", [back / "model.bpk"])
        assert set_files(back) == before
