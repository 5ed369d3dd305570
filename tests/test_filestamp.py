"""File identity (FileStamp): one version of one file, and the check that a source read is still that version,
unchanged, at its path, when its conversion is about to be published."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from syncd.errors import SourceChangedError
from syncd.formats import open_checkpoint
from syncd.formats.fileio import FileStamp
from syncd.formats.shards import read_index

STAMP = FileStamp(dev=1, ino=2, size=3, mtime_ns=4, ctime_ns=5)


def test_a_stamp_changes_with_identity_size_mtime_and_a_known_ctime() -> None:
    assert not STAMP.changed(STAMP)
    for field, value in (("dev", 9), ("ino", 9), ("size", 9), ("mtime_ns", 9), ("ctime_ns", 9)):
        assert STAMP.changed(dataclasses.replace(STAMP, **{field: value})), field
    unknown = dataclasses.replace(STAMP, ctime_ns=0)  # a state row written before ctimes were recorded
    assert not STAMP.changed(unknown) and not unknown.changed(STAMP)
    assert STAMP.same_file(dataclasses.replace(STAMP, size=9, mtime_ns=9, ctime_ns=9))
    assert not STAMP.same_file(dataclasses.replace(STAMP, ino=9))


def test_a_stamp_is_what_stat_says(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"12345")
    info = os.stat(path)
    stamp = FileStamp.of_path(path)
    assert stamp == FileStamp(info.st_dev, info.st_ino, 5, info.st_mtime_ns, info.st_ctime_ns)
    with open(path, "rb") as handle:
        assert FileStamp.of_fd(handle.fileno()) == stamp
    link = tmp_path / "link"
    link.symlink_to(path)
    assert FileStamp.of_path(link) == stamp
    assert not FileStamp.of_path(link, follow_symlinks=False).same_file(stamp)


def _source(path: Path) -> Path:
    save_file({"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, str(path))
    return path


def test_a_source_read_and_left_alone_is_unchanged(tmp_path: Path) -> None:
    with open_checkpoint(_source(tmp_path / "a.safetensors")) as reader:
        reader.check_unchanged()


def test_a_source_written_to_while_read_has_changed(tmp_path: Path) -> None:
    source = _source(tmp_path / "a.safetensors")
    with open_checkpoint(source) as reader:
        with open(source, "ab") as handle:
            handle.write(b"\0")
        with pytest.raises(SourceChangedError, match=": changed while it was being converted; nothing was published$"):
            reader.check_unchanged()


def test_a_source_whose_path_names_another_file_or_none_is_not_published(tmp_path: Path) -> None:
    """The file read is left untouched (its directory is moved away), so only its path tells: unlinking or
    renaming the file itself would change its ctime and be caught as a change first."""
    directory = tmp_path / "run"
    directory.mkdir()
    source = _source(directory / "a.safetensors")
    with open_checkpoint(source) as reader:
        directory.rename(tmp_path / "moved")
        with pytest.raises(SourceChangedError, match=": was removed while it was being converted"):
            reader.check_unchanged()
        directory.mkdir()
        _source(source)  # a new file at the same path
        with pytest.raises(SourceChangedError, match=": was replaced while it was being converted"):
            reader.check_unchanged()


def test_a_sets_index_changed_or_removed_since_it_was_read(tmp_path: Path) -> None:
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"w": "model-00001-of-00001.safetensors"}}))
    read = read_index(index)
    read.check_unchanged()
    with open(index, "a") as handle:
        handle.write(" ")
    with pytest.raises(SourceChangedError, match=": changed while it was being converted"):
        read.check_unchanged()
    index.unlink()
    with pytest.raises(SourceChangedError, match=": was removed while it was being converted"):
        read.check_unchanged()
