"""Which names are candidates (syncd.daemon.names), and the configuration settings that decide it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from syncd.daemon.config import DEFAULT_IGNORE, DEFAULT_RESCAN_INTERVAL, Watch, load_config
from syncd.daemon.names import is_candidate
from syncd.errors import ConfigError

ROOT = Path("/srv/runs")


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("model.safetensors", True),
        ("model.bpk", True),
        ("MODEL.BPK", False),  # the default `include` patterns are case-sensitive
        ("epoch 3\nfinal.safetensors", True),
        ("model.pt", False),
        ("model.safetensors.part", False),
        (".tmp-1.safetensors", False),  # a writer's temporary name, renamed into place when complete
        (".model.safetensors", False),
        ("model.tmp.safetensors", False),
        ("model.tmp123.bpk", False),
        (".~lock.model.bpk", False),
        ("model.part", False),
        (".model.bpk.syncd-12-0.tmp", False),  # syncd's own scratch file
        ("model.bpk.12-0.tmp", False),  # Burn's scratch file (docs/burn-adapters.md#publishing)
    ],
)
def test_default_candidates(name: str, expected: bool) -> None:
    assert is_candidate(Watch(path=ROOT), ROOT / "exp" / name) is expected


def test_ignore_matches_the_name_only_not_the_directories_above_it() -> None:
    watch = Watch(path=ROOT)
    assert is_candidate(watch, ROOT / ".cache" / "model.safetensors")
    assert is_candidate(watch, ROOT / "tmp.d" / "model.safetensors")


def test_direction_include_exclude_and_ignore() -> None:
    to_burn = Watch(path=ROOT, direction="safetensors->bpk")
    assert is_candidate(to_burn, ROOT / "a.safetensors") and not is_candidate(to_burn, ROOT / "a.bpk")
    picky = Watch(path=ROOT, include=("exp/*",), exclude=("*draft*",), ignore=("old-*",))
    assert is_candidate(picky, ROOT / "exp" / "a.bpk")
    assert not is_candidate(picky, ROOT / "other" / "a.bpk")
    assert not is_candidate(picky, ROOT / "exp" / "draft.bpk")
    assert not is_candidate(picky, ROOT / "exp" / "old-1.bpk")
    assert is_candidate(picky, ROOT / "exp" / ".tmp-1.bpk")  # the watch's own list replaced the default


def test_a_sets_index_is_matched_by_its_own_name_and_by_the_weights_file_it_stands_for() -> None:
    """`exclude: ["*.index.json"]` converted sets all the same (an index was judged only as model.safetensors),
    and check-config refused `include: ["*.index.json"]` as matching nothing."""
    index = ROOT / "bert" / "model.safetensors.index.json"
    assert is_candidate(Watch(path=ROOT), index)
    assert not is_candidate(Watch(path=ROOT, exclude=("*.index.json",)), index)
    assert not is_candidate(Watch(path=ROOT, exclude=("model.safetensors",)), index)
    only_sets = Watch(path=ROOT, include=("*.index.json",))
    assert is_candidate(only_sets, index) and not is_candidate(only_sets, ROOT / "bert" / "model.safetensors")


def test_syncd_scratch_files_are_never_candidates_whatever_the_configuration() -> None:
    watch = Watch(path=ROOT, include=("*",), ignore=())
    assert is_candidate(watch, ROOT / ".hidden.bpk")
    assert not is_candidate(watch, ROOT / ".model.bpk.syncd-12-0.tmp")


def write_config(tmp_path: Path, text: str) -> Path:
    (tmp_path / "runs").mkdir(exist_ok=True)
    (tmp_path / "other").mkdir(exist_ok=True)
    path = tmp_path / "syncd.yaml"
    path.write_text(text)
    os.chmod(path, 0o644)
    return path


def test_ignore_and_rescan_interval_defaults(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path, "watches:\n  - path: runs\n"))
    assert config.watches[0].ignore == DEFAULT_IGNORE == (".*", "*.tmp*", "*.part", ".~*")
    assert config.rescan_interval == DEFAULT_RESCAN_INTERVAL == 600.0


def test_a_watchs_ignore_replaces_the_global_one(tmp_path: Path) -> None:
    text = """\
rescan_interval: null
ignore: ["draft-*"]
watches:
  - path: runs
  - path: other
    ignore: []
"""
    config = load_config(write_config(tmp_path, text))
    assert [watch.ignore for watch in config.watches] == [("draft-*",), ()]
    assert config.rescan_interval is None


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("rescan_interval: 0", "syncd.yaml:1: rescan_interval: expected a number > 0 and <= 604800 or null, got 0"),
        ("ignore: '.*'", "syncd.yaml:1: ignore: expected a list of non-empty strings, got '.*'"),
        ("ignored: []", "syncd.yaml:1: ignored: unknown key (did you mean 'ignore'?)"),
    ],
)
def test_bad_settings_name_their_line(tmp_path: Path, line: str, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(write_config(tmp_path, f"{line}\nwatches:\n  - path: runs\n"))
    assert str(caught.value).endswith(expected)
