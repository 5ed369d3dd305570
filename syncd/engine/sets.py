"""Writing a sharded safetensors set: every shard laid out here, written and checked (by the caller's
`write_shard`) in a scratch file beside its destination,
then the shards published one by one and the index last, so the index (the set's commit point, as for
`save_pretrained`, which also writes it last) never names a shard that is not in place.

A set written here holds what save_pretrained writes and nothing more: each shard's `__metadata__` is the
one carried from the original set (`{"format": "pt"}` for a fresh split), so a round trip gives back the
original files byte for byte.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path

from syncd.engine.publish import (
    PublishResult,
    Scratch,
    ensure_destination_free,
    open_scratch,
    publish,
    refuse_if_different,
    remove_if_unchanged,
)
from syncd.errors import ConflictError, SyncdError
from syncd.formats.fileio import FileStamp, pwrite_all
from syncd.formats.safetensors import plan_safetensors
from syncd.formats.shards import ShardLayout
from syncd.formats.table import TensorSpec


def set_paths(layout: ShardLayout, directory: Path) -> list[Path]:
    """Every file the set consists of: its shards, then its index (when it has one)."""
    paths = [directory / file for file, _ in layout.files]
    return paths + ([directory / layout.index_name] if layout.with_index else [])


def check_layout_covers(layout: ShardLayout, specs: Sequence[TensorSpec], dest: str) -> None:
    """Every tensor to write in exactly one shard, and no shard naming a tensor that is not written."""
    listed = [name for _, names in layout.files for name in names]
    written = {spec.name for spec in specs}
    if len(listed) != len(set(listed)) or set(listed) != written:
        missing = sorted(written - set(listed))[:3]
        extra = sorted(set(listed) - written)[:3]
        raise SyncdError(f"the shard layout does not match the tensors (unlisted {missing}, absent {extra})", dest)


def write_set(
    specs: Sequence[TensorSpec],
    layout: ShardLayout,
    directory: Path,
    *,
    mode: int,
    owner: tuple[int, int] | None = None,
    replace: bool,
    write_shard: Callable[[Scratch, bytes, int, list[tuple[TensorSpec, int]]], None],
    before_publish: Callable[[], None] = lambda: None,
    source: Path | None = None,
    replace_if: Mapping[Path, FileStamp] | None = None,
    before_placing: Callable[[Path, FileStamp], None] | None = None,
    compare_existing: bool = False,
) -> tuple[list[PublishResult], list[Path]]:
    """Lay out each shard, have it written and checked (`write_shard(scratch, header bytes, file size,
    [(spec, absolute start)...])`), then publish the set; returns one result per file.

    `replace_if`: syncd's own earlier set (every file of it, its index included, with the identity each must
    still have): those files are replaced, each only while still exactly that file, and those the new set
    does not have are removed once its index is in place, unless changed. Anything else already at one of
    the set's names is never replaced: refused before anything is written, or with `compare_existing`, once
    the set is written, before anything is placed, unless it holds exactly the bytes written (then that file
    is in sync: a set already there is found to be this conversion, as a single output is).
    `before_placing(path, identity)` runs right before each file is put in place. Returns the results, and
    the files of the earlier set removed."""
    check_layout_covers(layout, specs, str(directory / layout.index_name))
    owned = dict(replace_if or {})
    paths = set_paths(layout, directory)
    if not replace:
        for path in paths:
            if path in owned:
                _check_still_ours(path, owned[path])
            elif not compare_existing:
                ensure_destination_free(path)
    by_name = {spec.name: spec for spec in specs}
    with ExitStack() as stack:
        scratches: list[Scratch] = []
        for file, names in layout.files:
            scratch = stack.enter_context(open_scratch(directory / file, mode, within=directory, owner=owner))
            shard_specs = [by_name[name] for name in names]
            plan = plan_safetensors(shard_specs, layout.metadata_of(file))
            write_shard(scratch, plan.header, plan.file_size, list(zip(shard_specs, plan.starts, strict=True)))
            scratches.append(scratch)
        if layout.with_index:
            index = stack.enter_context(open_scratch(directory / layout.index_name, mode, owner=owner))
            _write(index, lambda fd: pwrite_all(fd, layout.index_bytes(), 0))
            scratches.append(index)
        before_publish()
        if compare_existing and not replace:
            for scratch in scratches:
                if scratch.dest not in owned:
                    refuse_if_different(scratch, source)
        results = [
            publish(
                scratch,
                replace=replace,
                replace_if=owned.get(scratch.dest),
                source=source,
                before_placing=_placing_call(before_placing, scratch),
            )
            for scratch in scratches
        ]
    removed = [path for path, identity in owned.items() if path not in paths and remove_if_unchanged(path, identity)]
    return results, removed


def _check_still_ours(path: Path, identity: FileStamp) -> None:
    try:
        now = FileStamp.of(os.lstat(path))
    except FileNotFoundError:
        return
    if identity.changed(now):
        raise ConflictError(
            "changed since syncd published it with its set (someone else's file now); nothing was replaced",
            str(path),
        )


def _placing_call(
    before_placing: Callable[[Path, FileStamp], None] | None, scratch: Scratch
) -> Callable[[], None] | None:
    if before_placing is None:
        return None
    return lambda: before_placing(scratch.dest, FileStamp.of_fd(scratch.fd))


def _write(scratch: Scratch, write: Callable[[int], object]) -> None:
    try:
        write(scratch.fd)
    except OSError as exc:
        raise SyncdError(f"cannot write the output ({exc.strerror or exc})", str(scratch.dest)) from exc
