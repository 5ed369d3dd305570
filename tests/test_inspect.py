"""`syncd inspect` through the real CLI: table, JSON, hashes, and one-line errors."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import cbor2
import pytest
from conftest import MNIST_BPK, MNIST_ST
from convcheck import run_cli
from formatgen import bpk_bytes, descriptor
from hfsets import save_llama

pytestmark = pytest.mark.torch


def test_json_lists_every_tensor_with_param_ids_as_decimal_strings() -> None:
    result = run_cli("inspect", str(MNIST_BPK), "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["format"] == "burnpack"
    assert doc["header"]["data_start"] == 1536 and doc["header"]["metadata_size"] == 1398
    assert len(doc["tensors"]) == 18
    first = doc["tensors"][0]
    assert first["name"] == "conv1.conv.weight" and first["offset"] == 1536
    bias = next(t for t in doc["tensors"] if t["name"] == "conv1.conv.bias")
    assert bias["param_id"] == "9505838338724798577" and bias["shape"] == [64] and bias["bytes"] == 256


def test_hash_is_the_sha256_of_each_tensor_bytes() -> None:
    doc = json.loads(run_cli("inspect", str(MNIST_ST), "--json", "--hash").stdout)
    data = MNIST_ST.read_bytes()
    for tensor in doc["tensors"]:
        raw = data[tensor["offset"] : tensor["offset"] + tensor["bytes"]]
        assert tensor["sha256"] == hashlib.sha256(raw).hexdigest()


def test_table_is_aligned_with_a_header_row() -> None:
    result = run_cli("inspect", str(MNIST_BPK))
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("name"))
    rows = lines[header + 1 :]
    assert len(rows) == 18
    # the dtype column starts at the same position on every row
    column = lines[header].index("dtype")
    assert all(row[column : column + 3] == "F32" for row in rows)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"NRUB", "insufficient bytes"),
        (b"XXXX\x01\x00\x00\x00\x00\x00", "header length"),
        (b"NRUB\x02\x00\x00\x00\x00\x00", "Unsupported version 2"),
    ],
)
def test_bad_file_is_one_line_exit_1(tmp_path: Path, content: bytes, expected: str) -> None:
    path = tmp_path / "bad.bpk" if content.startswith(b"NRUB") else tmp_path / "bad.safetensors"
    path.write_bytes(content)
    result = run_cli("inspect", str(path))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert str(path) in result.stderr and expected in result.stderr


def test_missing_file_and_usage_errors(tmp_path: Path) -> None:
    missing = run_cli("inspect", str(tmp_path / "nope.bpk"))
    assert missing.returncode == 1 and "no such file" in missing.stderr
    usage = run_cli("inspect")
    assert usage.returncode == 2 and "Traceback" not in usage.stderr


def test_a_sharded_sets_index_describes_the_whole_set(tmp_path: Path) -> None:
    index = save_llama(tmp_path / "llama", sharded=True)
    doc = json.loads(run_cli("inspect", str(index), "--json", "--hash").stdout)
    listed = json.loads(index.read_text())
    assert doc["header"]["shards"] == sorted(set(listed["weight_map"].values()))
    assert {t["name"]: t["shard"] for t in doc["tensors"]} == listed["weight_map"]
    assert doc["header"]["index_total_size"] == listed["metadata"]["total_size"]
    assert doc["header"]["tensor_bytes"] == sum(t["bytes"] for t in doc["tensors"])
    for tensor in doc["tensors"]:
        data = (index.parent / tensor["shard"]).read_bytes()
        raw = data[tensor["offset"] : tensor["offset"] + tensor["bytes"]]
        assert tensor["sha256"] == hashlib.sha256(raw).hexdigest()
    table = run_cli("inspect", str(index)).stdout.splitlines()
    assert table[0].startswith(f"{index}: safetensors") and "shard" in next(r for r in table if r.startswith("name"))


def test_a_set_with_a_missing_shard_is_one_line(tmp_path: Path) -> None:
    index = save_llama(tmp_path / "llama", sharded=True)
    (index.parent / "model-00002-of-00003.safetensors").unlink()
    result = run_cli("inspect", str(index))
    assert result.returncode == 1 and result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and "model-00002-of-00003.safetensors" in result.stderr


def test_control_characters_in_names_and_metadata_are_shown_escaped_never_sent_to_the_terminal(
    tmp_path: Path,
) -> None:
    """A tensor named with an escape sequence would restyle (or retitle, or worse) the terminal it is listed
    on: every control character is shown escaped, as a line break in an error is."""
    source = tmp_path / "odd.bpk"
    tensors = {"a\x1b[31mRED": descriptor("U8", [1], 0, 1)}
    source.write_bytes(bpk_bytes(tensors, b"\x01", metadata={"note\x07": "x\x1b]0;title\x07"}))
    proc = run_cli("inspect", source)
    assert proc.returncode == 0, proc.stderr
    assert not any(c in proc.stdout for c in "\x1b\x07"), proc.stdout
    assert "a\\x1b[31mRED" in proc.stdout and "note\\x07: x\\x1b]0;title\\x07" in proc.stdout


def test_json_holds_only_json_numbers_for_scalars_that_are_not_finite(tmp_path: Path) -> None:
    """A best loss of inf, a NaN in a scheduler's record: `Infinity` and `NaN` are no JSON, and a reader of
    --json (node's JSON.parse, jq) failed on the whole document."""
    doc = {
        "tensors": {"w": descriptor("U8", [1], 0, 1)},
        "scalars": {"best": {"Float": float("inf")}, "low": {"Float": float("-inf")}, "odd": {"Float": float("nan")}},
    }
    source = tmp_path / "scalars.bpk"
    source.write_bytes(bpk_bytes(meta_raw=cbor2.dumps(doc), data=b"\x01"))
    proc = run_cli("inspect", source, "--json")
    assert proc.returncode == 0, proc.stderr

    def no_constants(name: str) -> None:
        raise AssertionError(f"{name} is not JSON")

    shown = json.loads(proc.stdout, parse_constant=no_constants)["scalars"]
    assert shown == {"best": {"Float": "inf"}, "low": {"Float": "-inf"}, "odd": {"Float": "nan:7ff8000000000000"}}
