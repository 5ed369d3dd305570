"""The store settings of a watch (remap, map_indices_contiguous, tensors, precision, shard_size): read, and every
bad value reported by `check-config` with its line."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from test_config import write_config

from syncd.cli.check_config import run_check_config
from syncd.daemon.config import check_config, load_config

GOOD = r"""
watches:
  - path: runs
    remap:
      - ["^model\\.layers\\.(\\d+)\\.", "blocks.$1."]
      - ['\.self_attn\.', '.attn.']
    map_indices_contiguous: true
    tensors:
      include: ["^model\\."]
      exclude: ["rotary_emb"]
    precision: bf16
    shard_size: 5GB
"""


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    (tmp_path / "runs").mkdir()
    return tmp_path / "runs"


def test_store_settings_are_read(tmp_path: Path, runs: Path) -> None:
    (watch,) = load_config(write_config(tmp_path, GOOD)).watches
    assert watch.remap == ((r"^model\.layers\.(\d+)\.", "blocks.$1."), (r"\.self_attn\.", ".attn."))
    assert watch.map_indices_contiguous is True
    assert (watch.tensor_include, watch.tensor_exclude) == ((r"^model\.",), ("rotary_emb",))
    assert (watch.precision, watch.shard_size) == ("bf16", 5 * 10**9)


def test_check_config_says_which_names_the_rules_see(tmp_path: Path, runs: Path) -> None:
    path = write_config(tmp_path, GOOD)
    out = io.StringIO()
    assert run_check_config(path, out) == 0
    lines = out.getvalue().splitlines()
    assert f"{path}: watches[0].remap: 2 rules, applied to the source's names as in the file" in lines[0]
    assert "weight/bias" in lines[0] and "gamma/beta" in lines[0]
    assert lines[-1] == f"{path}: valid (1 watch)"


def test_defaults(tmp_path: Path, runs: Path) -> None:
    (watch,) = load_config(write_config(tmp_path, "watches:\n  - path: runs\n")).watches
    assert (watch.remap, watch.map_indices_contiguous) == ((), None)  # None: as Burn's store for the format
    assert (watch.tensor_include, watch.tensor_exclude) == ((), ())
    assert (watch.precision, watch.shard_size) == (None, None)


BAD = r"""
watches:
  - path: runs
    remap:
      - ["^model\\.layers\\.(\\d+)\\.", "blocks.$1."]
      - ["^model\\.(", "x"]
      - ["^(a)", "$2"]
      - "just a string"
    tensors:
      include: ["ok", "[bad"]
      exclude: oops
      other: []
    precision: f8
    shard_size: huge
"""


def test_check_config_names_every_problem_with_its_line(tmp_path: Path, runs: Path) -> None:
    path = write_config(tmp_path, BAD)
    problems = check_config(path)
    name = str(path)
    assert problems == [
        f"{name}:6: watches[0].remap[1]: pattern '^model\\.(' does not compile: missing ), unterminated subpattern "
        "at position 8",
        f"{name}:7: watches[0].remap[2]: replacement '$2' names group $2, but pattern '^(a)' has 1 group",
        f"{name}:8: watches[0].remap[3]: expected [pattern, replacement] (two strings), got 'just a string'",
        f"{name}:10: watches[0].tensors.include: pattern '[bad' does not compile: unterminated character set at "
        "position 0",
        f"{name}:11: watches[0].tensors.exclude: expected a list of non-empty strings, got 'oops'",
        f"{name}:12: watches[0].tensors.other: unknown key",
        f"{name}:13: watches[0].precision: expected one of f16, bf16, f32, got 'f8'",
        f"{name}:14: watches[0].shard_size: shard size 'huge' is not a size such as 500MB, 5GB or 2GiB",
    ]
    out = io.StringIO()
    assert run_check_config(path, out) == 2
    assert out.getvalue().splitlines() == problems


def test_remap_must_be_a_list(tmp_path: Path, runs: Path) -> None:
    path = write_config(tmp_path, "watches:\n  - path: runs\n    remap: {a: b}\n")
    assert check_config(path) == [
        f"{path}:3: watches[0].remap: expected a list of [pattern, replacement] rules, got a mapping"
    ]


def test_null_means_unset(tmp_path: Path, runs: Path) -> None:
    text = "watches:\n  - path: runs\n    precision: null\n    shard_size: null\n    remap: null\n    tensors: null\n"
    (watch,) = load_config(write_config(tmp_path, text)).watches
    assert (watch.precision, watch.shard_size, watch.remap, watch.tensor_include) == (None, None, (), ())
