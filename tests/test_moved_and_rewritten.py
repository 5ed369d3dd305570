"""Checkpoints moved or rewritten under syncd's feet: a directory moved out of the tree while its checkpoint
converts (and moved back), and a sharded set whose shard is rewritten in place keeping its size and mtime."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from syncd.engine.convert import ConvertRequest, convert
from syncd.errors import SyncdError, VerificationError


def _state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {"fc.weight": torch.randn(64, 32), "fc.bias": torch.randn(64), "norm.weight": torch.randn(64)}


def test_a_directory_moved_away_mid_conversion_is_retried_not_refused(tmp_path: Path) -> None:
    """The written file is checked through its open descriptor, so moving its directory does not make it
    'not read back'; the source no longer at its path is a transient condition, and once the directory is back
    the same conversion succeeds."""
    tree = tmp_path / "tree"
    exp = tree / "exp"
    exp.mkdir(parents=True)
    source = exp / "model.safetensors"
    save_file(_state(0), source)
    away = tmp_path / "away"
    moved: list[bool] = []

    def move_when_written(done: int, total: int) -> None:
        if done == total and not moved:
            os.rename(exp, away)
            moved.append(True)

    with pytest.raises(SyncdError) as caught:
        convert(ConvertRequest(source=source, within=tree, progress=move_when_written))
    assert moved
    assert not isinstance(caught.value, VerificationError), caught.value
    assert caught.value.kind == "busy" or caught.value.transient, caught.value
    assert sorted(os.listdir(away)) == ["model.safetensors"]  # nothing published, no scratch file left
    os.rename(away, exp)
    result = convert(ConvertRequest(source=source, within=tree))
    assert result.status == "published"
    assert sorted(os.listdir(exp)) == ["model.bpk", "model.safetensors"]
