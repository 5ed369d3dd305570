"""The sharded-set reader and writer side (syncd/formats/shards.py) against real save_pretrained output."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from hfsets import save_llama, tiny_llama
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.numpy import load_file

from syncd.errors import FormatError
from syncd.formats.shards import (
    IndexFiles,
    ShardedReader,
    ShardLayout,
    find_index,
    index_listing,
    layout_by_size,
    parse_shard_size,
    render_index,
    shard_file_names,
    split_greedy,
)

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def llama_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama(tmp_path_factory.mktemp("llama") / "sharded", sharded=True)


def copy_set(index: Path, where: Path) -> Path:
    shutil.copytree(index.parent, where)
    return where / index.name


def test_reads_every_tensor_of_every_shard(llama_set: Path) -> None:
    with ShardedReader(llama_set) as reader:
        assert len(reader.shards) == 3
        expected = {}
        for shard in sorted(llama_set.parent.glob("model-*.safetensors")):
            expected.update(load_file(shard))
        assert sorted(t.name for t in reader.tensors) == sorted(expected)
        for name, array in expected.items():
            assert reader.read(name) == array.tobytes()
        # shard after shard: a shard's tensors are contiguous in the table
        order = [reader.index.weight_map[t.name] for t in reader.tensors]
        assert order == sorted(order)
        assert reader.header.metadata == {"format": "pt"}


def test_index_renders_byte_identical(llama_set: Path) -> None:
    with ShardedReader(llama_set) as reader:
        assert reader.index.is_canonical()
        layout = ShardLayout.of(reader)
    assert layout.index_text is None
    assert ShardLayout.from_json(json.loads(json.dumps(layout.to_json()))).index_bytes() == llama_set.read_bytes()


def test_non_canonical_index_is_carried_verbatim(llama_set: Path, tmp_path: Path) -> None:
    index = copy_set(llama_set, tmp_path / "set")
    compact = json.dumps(json.loads(index.read_text()), separators=(",", ":")).encode()
    index.write_bytes(compact)
    with ShardedReader(index) as reader:
        assert not reader.index.is_canonical()
        assert ShardLayout.of(reader).index_bytes() == compact


def test_greedy_split_is_huggingface_hubs(llama_set: Path) -> None:
    state = tiny_llama().state_dict()
    for limit in (5_000, 40_000, 100_000, 10**9):
        ours = split_greedy([(k, v.numel() * v.element_size()) for k, v in state.items()], limit)
        theirs = split_torch_state_dict_into_shards(state, max_shard_size=limit)
        assert [set(group) for group in ours] == [set(v) for v in theirs.filename_to_tensors.values()]
        assert shard_file_names(len(ours)) == list(theirs.filename_to_tensors)


def test_big_tensor_gets_its_own_shard_ahead_of_the_open_one() -> None:
    assert split_greedy([("a", 3), ("b", 20), ("c", 3), ("d", 6)], 10) == [["b"], ["a", "c"], ["d"]]


def test_layout_by_size_and_one_file() -> None:
    layout = layout_by_size([("a", 6), ("b", 6)], 10)
    assert [f for f, _ in layout.files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert layout.with_index and layout.index_metadata == {"total_size": 12}
    one = layout_by_size([("a", 6), ("b", 6)], None)
    assert one.files == [("model.safetensors", ["a", "b"])] and not one.with_index


def test_a_checkpoint_of_no_tensor_is_one_file_of_none() -> None:
    """Without a size, a source of no tensor is one plain file of none. A set of none (an index lists at least
    one tensor) is refused before a layout is asked for: test_sets.py's
    test_a_set_of_no_tensor_is_refused_and_one_file_of_none_written."""
    one = layout_by_size([], None)
    assert one.files == [("model.safetensors", [])] and not one.with_index


def test_render_index_matches_save_pretrained_formatting() -> None:
    text = render_index({"total_size": 8}, {"b": "x.safetensors", "a": "y.safetensors", "é": "x.safetensors"})
    assert text == (
        b'{\n  "metadata": {\n    "total_size": 8\n  },\n  "weight_map": {\n    "a": "y.safetensors",\n'
        b'    "b": "x.safetensors",\n    "\\u00e9": "x.safetensors"\n  }\n}\n'
    )


@pytest.mark.parametrize(
    ("text", "size"), [("40KB", 40_000), ("5GB", 5 * 10**9), ("2GiB", 2 << 30), ("1000", 1000), ("1.5MB", 1_500_000)]
)
def test_shard_sizes(text: str, size: int) -> None:
    assert parse_shard_size(text) == size


@pytest.mark.parametrize("text", ["", "0", "5XB", "-3MB", "GB"])
def test_bad_shard_sizes(text: str) -> None:
    with pytest.raises(ValueError):
        parse_shard_size(text)


def test_restricted_layout_renumbers_and_recounts(llama_set: Path) -> None:
    """total_size follows the tensors kept; transformers' total_parameters (parameters, not buffers, which the
    tensors cannot tell apart) is dropped, where a recount could say more than the whole model had."""
    with ShardedReader(llama_set) as reader:
        layout = ShardLayout.of(reader)
        sizes = {t.name: t.nbytes for t in reader.tensors}
        elements = {t.name: math.prod(t.shape) for t in reader.tensors}
    assert layout.index_metadata["total_parameters"] == sum(elements.values())
    keep = {n for f, names in layout.files if f != "model-00002-of-00003.safetensors" for n in names}
    smaller = layout.restricted_to(keep, sizes)
    assert [f for f, _ in smaller.files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert smaller.index_metadata == {"total_size": sum(sizes[n] for n in keep)}
    assert layout.restricted_to(set(sizes), sizes) is layout


def test_find_index(llama_set: Path, tmp_path: Path) -> None:
    assert find_index(llama_set.parent) == str(llama_set)
    with pytest.raises(FormatError, match="found none"):
        find_index(tmp_path)


# ------------------------------------------------------------------------------------------- refusals


def edit_index(index: Path, change) -> None:
    document = json.loads(index.read_text())
    change(document)
    index.write_text(json.dumps(document, indent=2))


def refused(index: Path, match: str, culprit: Path | None = None) -> None:
    with pytest.raises(FormatError, match=match) as info:
        ShardedReader(index, within=index.parent).close()
    assert "\n" not in str(info.value) and str(culprit or index) in str(info.value)


def test_missing_shard(llama_set: Path, tmp_path: Path) -> None:
    index = copy_set(llama_set, tmp_path / "set")
    (index.parent / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(FormatError, match="no such file"):
        ShardedReader(index)


@pytest.mark.parametrize(
    "bad",
    [
        "../model-00001-of-00003.safetensors",
        "/etc/passwd.safetensors",
        "a/../b.safetensors",
        "config.json",
        "",
        "a//b.safetensors",
        "a\\b.safetensors",
    ],
)
def test_shard_outside_or_not_a_shard(llama_set: Path, tmp_path: Path, bad: str) -> None:
    index = copy_set(llama_set, tmp_path / "set")
    edit_index(index, lambda d: d["weight_map"].update({"lm_head.weight": bad}))
    refused(index, "not a .safetensors file inside its directory")


def test_symlinked_shard_leading_out_is_refused(llama_set: Path, tmp_path: Path) -> None:
    index = copy_set(llama_set, tmp_path / "set")
    outside = tmp_path / "elsewhere.safetensors"
    shard = index.parent / "model-00003-of-00003.safetensors"
    shard.rename(outside)
    os.symlink(outside, shard)
    refused(index, "symlink", shard)
    with ShardedReader(index) as reader:  # a user's own command follows it (the Hugging Face cache links shards)
        assert len(reader.tensors) == len(json.loads(index.read_text())["weight_map"])


def test_tensor_listed_in_the_wrong_shard(llama_set: Path, tmp_path: Path) -> None:
    index = copy_set(llama_set, tmp_path / "set")
    edit_index(index, lambda d: d["weight_map"].update({"lm_head.weight": "model-00001-of-00003.safetensors"}))
    refused(index, "puts tensor 'lm_head.weight' in model-00001-of-00003.safetensors, which does not hold it")


def test_tensor_the_index_does_not_list(llama_set: Path, tmp_path: Path) -> None:
    index = copy_set(llama_set, tmp_path / "set")
    edit_index(index, lambda d: d["weight_map"].pop("lm_head.weight"))
    refused(index, "holds tensor 'lm_head.weight' but the index does not list it")


def test_duplicate_names_in_the_index(llama_set: Path, tmp_path: Path) -> None:
    index = copy_set(llama_set, tmp_path / "set")
    text = index.read_text().replace('"weight_map": {', '"weight_map": {\n"lm_head.weight": "x.safetensors",', 1)
    index.write_text(text)
    refused(index, "duplicate key 'lm_head.weight'")


@pytest.mark.parametrize(
    ("document", "match"),
    [
        ("[]", "no `weight_map`"),
        ('{"weight_map": {}}', "lists no tensors"),
        ('{"weight_map": {"a": 3}}', "not a file name"),
        ('{"metadata": {"total_size": -1}, "weight_map": {"a": "a.safetensors"}}', "total_size"),
        ('{"metadata": [], "weight_map": {"a": "a.safetensors"}}', "`metadata` is not an object"),
        ("{", "not valid JSON"),
        (b"\xff", "not valid UTF-8"),
    ],
)
def test_malformed_index(tmp_path: Path, document: str | bytes, match: str) -> None:
    index = tmp_path / "model.safetensors.index.json"
    index.write_bytes(document if isinstance(document, bytes) else document.encode())
    refused(index, match)


def test_layout_json_is_checked() -> None:
    good = layout_by_size([("a", 4)], 10).to_json()
    assert ShardLayout.from_json(good).files == [("model.safetensors", ["a"])]
    for bad in (
        {},
        {**good, "files": []},
        {**good, "files": [["../x.safetensors", ["a"]]]},
        {**good, "files": [["x.safetensors", "a"]]},
        {**good, "index_metadata": 3},
    ):
        with pytest.raises((ValueError, FormatError)):
            ShardLayout.from_json(bad)


def test_reader_serves_bytes_from_the_right_shard(llama_set: Path) -> None:
    with ShardedReader(llama_set) as reader:
        info = reader.tensor("lm_head.weight")
        buf = memoryview(bytearray(16))
        reader.readinto("lm_head.weight", 4, buf)
        assert bytes(buf) == reader.read("lm_head.weight")[4:20]
        assert b"".join(bytes(c) for c in reader.iter_chunks("lm_head.weight", 1000)) == reader.read("lm_head.weight")
        assert reader.reader_for("lm_head.weight").path.endswith("model-00003-of-00003.safetensors")
        assert info.nbytes == torch.Size(info.shape).numel() * 4
        with pytest.raises(FormatError, match="Tensor not found"):
            reader.tensor("nope")


def test_set_membership_on_disk(llama_set: Path, tmp_path: Path) -> None:
    from syncd.formats.shards import index_listing, looks_like_shard, member_files

    assert looks_like_shard("model-00001-of-00003.safetensors")
    assert not looks_like_shard("model.safetensors") and not looks_like_shard("model-1-of-3.safetensors")
    shards = sorted(str(p) for p in llama_set.parent.glob("model-*.safetensors"))
    assert member_files(llama_set) == shards
    assert index_listing(shards[1]) == str(llama_set)
    # a set whose shards are not named like save_pretrained's is found through its index
    index = copy_set(llama_set, tmp_path / "set")
    for i, file in enumerate(sorted(index.parent.glob("model-*.safetensors"))):
        file.rename(index.parent / f"part{i}.safetensors")
    edit_index(
        index,
        lambda d: d.update(weight_map={k: f"part{int(v[6:11]) - 1}.safetensors" for k, v in d["weight_map"].items()}),
    )
    assert index_listing(index.parent / "part2.safetensors") == str(index)
    (index.parent / "lone.safetensors").write_bytes(b"")
    assert index_listing(index.parent / "lone.safetensors") is None


def test_a_directory_is_listed_for_its_indexes_once_per_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file's event asks which index lists it: listing the directory each time made a pass over a
    directory of N checkpoints cost N^2 (71 s for 6,000). Listed once per change of the directory; one changed
    within its timestamps' granularity is listed again."""
    index = save_llama(tmp_path / "llama", sharded=True)
    directory = os.fspath(index.parent)
    for n in range(50):
        (index.parent / f"other-{n}.safetensors").write_bytes(b"")
    known = IndexFiles()
    assert known.index_names(directory) == (index.name,)
    listed = known.index_names(directory)
    assert known.index_names(directory) is listed  # changed just now, but listed a moment ago: not again
    known.forget(directory)  # an index's own event
    assert known.index_names(directory) is not listed
    monkeypatch.setattr(IndexFiles, "RELIST_NS", 0)
    assert known.index_names(directory) is not known.index_names(directory)  # changed just now: listed again
    monkeypatch.setattr(IndexFiles, "RECENT_NS", -(1 << 62))  # as if every change were long past
    listed = known.index_names(directory)
    assert known.index_names(directory) is listed
    shard = index.parent / "model-00001-of-00003.safetensors"
    assert (
        index_listing(shard, known) == os.fspath(index)
        and index_listing(index.parent / "other-1.safetensors", known) is None
    )
    (index.parent / "pytorch_model.bin.index.json").write_text("{}")  # a new index: the directory changed
    assert known.index_names(directory) == ("model.safetensors.index.json", "pytorch_model.bin.index.json")
