"""Whose file is a destination? Where an output goes, and what may happen to a file already there.

syncd replaces only what it can prove is its own: the output it published from this very source, unchanged
since (a record syncd made says so: the state database recorded its identity -- device, inode, size, mtime
and ctime, which every write, truncate, chmod or utime changes -- and its `syncd.source` names the source).
A file's own metadata is a hint, never proof: a user who loads syncd's output, edits it and saves it with the
metadata kept owns that file. Without a record (state lost), a destination is in sync only if its bytes are
exactly the conversion of the current source: the conversion is run and the publish compares bytes
(`Action.VERIFY`), a file that differs being someone else's, which the watch's `on_exists` decides about.
On a shared filesystem the record may be another node's: the claim file beside the output holds the last
publish (`syncd.daemon.claims.Published`), which proves the same thing by the same identity (without the
device number, which differs between clients); an output so proven is adopted without reading the source.
An output is also recorded right before it is put in place, in the state and in the claim, so that one
placed by a daemon killed before it could record the publish is still proven (by its identity without the
ctime, which placing the file changes): else every later save would leave it alone as someone else's file.
Every file is opened confined, without following symlinks and without blocking (a FIFO or a symlink to a
device renamed onto any of the names must not hang a worker).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from syncd.daemon.claims import Published, Stamp, records_of, stamp_of
from syncd.daemon.config import Watch
from syncd.daemon.names import is_candidate
from syncd.daemon.state import Placing, StateDB
from syncd.engine import carry
from syncd.engine.directions import converts_to
from syncd.errors import ConflictError, SyncdError
from syncd.formats import BURNPACK, Format, open_checkpoint, read_metadata
from syncd.formats.fileio import FileStamp
from syncd.formats.registry import BY_NAME, checkpoint_stem, format_for_path
from syncd.formats.shards import BIN_INDEX_SUFFIX, INDEX_SUFFIX, is_set_index, read_index, set_stem

# the failure recorded for a source whose destination holds a file not proven syncd's (`syncd retry --adopt`)
DESTINATION_EXISTS = "destination exists"


def destination_for(watch: Watch, source: Path, from_format: Format) -> Path:
    """Where the conversion of `source` (a single file) is published. A .bpk goes to a set's index where the
    watch sets a `shard_size` (a set of one shard too), or where it carries a sharded set's layout."""
    if from_format.name == BURNPACK:
        if watch.shard_size is not None:
            return watch.output_dir_for(source) / (source.stem + INDEX_SUFFIX)
        index = _set_destination(watch, source)
        if index is not None:
            return index
    return watch.output_dir_for(source) / (checkpoint_stem(source) + converts_to(from_format).extension)


def set_destination(watch: Watch, index: Path) -> Path:
    """Where the conversion of the sharded set behind `index` is published: one .bpk named after the set."""
    return watch.output_dir_for(index) / (set_stem(index) + BY_NAME[BURNPACK].extension)


class Action(StrEnum):
    """What the conversion may do about its destination."""

    # publish only where nothing is (a file appearing meanwhile: skipped with on_exists: skip, else a conflict)
    CREATE = "create"
    REPLACE = "replace"  # replace syncd's own earlier output, provided it is still exactly `replace_if`
    OVERWRITE = "overwrite"  # replace someone else's file (on_exists: overwrite)
    IN_SYNC = "in_sync"  # the destination already holds this source's conversion: nothing to write
    # no record, but the file names this source: convert, and publish nothing -- the destination is in sync
    # if it holds exactly the bytes converted, else it is someone else's file (`on_exists` decides)
    VERIFY = "verify"
    SKIP = "skip"  # someone else's file, left alone (on_exists: skip)


@dataclass(frozen=True)
class Decision:
    action: Action
    replace_if: FileStamp | None = None  # for REPLACE: the identity of our output being replaced
    # a set: each file of syncd's own set and its identity (REPLACE: each replaced only while still so;
    # IN_SYNC: recorded as the set's members)
    set_files: dict[Path, FileStamp] | None = None
    said: str | None = None  # for IN_SYNC: why, when it is worth a line in the sync log


def decide(
    state: StateDB,
    watch: Watch,
    source: Path,
    version: FileStamp,
    dest: Path,
    published: Published | None = None,
    placing: Published | None = None,
) -> Decision:
    """What to do about `dest` before converting `source` (at `version`) into it; `published` and `placing`
    are the records in the output's claim file, on a shared filesystem.

    syncd's own earlier output of this source (proven by the state's record, or by the publishing node's) is
    replaced (`updated`) whatever `on_exists` says, or adopted as it is when the record shows it is the
    conversion of this very version of the source; a file whose metadata names this source is verified
    against the conversion (in sync only if it holds exactly those bytes); anything else is someone else's
    file, which `on_exists` decides: skip (leave it, say so), error (conflict) or overwrite (replace it, but
    never a file that is itself a checkpoint this watch converts: in a `direction: both` tree that would swap
    two users' files; that raises ConflictError).
    """
    if not os.path.lexists(dest):
        return Decision(Action.CREATE)
    root = watch.mirror or watch.path
    if is_set_index(dest):
        claimed = [(record, placed_only) for record, placed_only in ((published, False), (placing, True)) if record]
        return _decide_set(state, watch, source, version, dest, root, claimed)
    ours = own_earlier_output(state, source, dest, root)
    if ours is not None:
        return Decision(Action.REPLACE, ours)
    placed = placed_by_this_daemon(state, source, dest, root)
    if placed is not None:
        placed_version, identity = placed
        if not placed_version.changed(version):
            return Decision(Action.IN_SYNC, said=PLACED_UNRECORDED)
        return Decision(Action.REPLACE, identity)
    for record, placed_only in ((published, False), (placing, True)):
        if record is not None:
            proven = published_by_syncd(record, source, dest, placed_only=placed_only)
            if proven is not None:
                if record.source_stamp == source_stamp(version):  # (the publisher logged it, unless it died first)
                    return Decision(Action.IN_SYNC, said=PLACED_UNRECORDED if placed_only else None)
                return Decision(Action.REPLACE, proven)
    if names_source(dest, source, root):
        return Decision(Action.VERIFY)
    return someone_elses(watch, dest)


# the line for an output a daemon put in place and was stopped before it could record (or log) the publish
PLACED_UNRECORDED = "published by a syncd stopped before it could record the publish: recorded now"


def _decide_set(
    state: StateDB,
    watch: Watch,
    source: Path,
    version: FileStamp,
    index: Path,
    root: Path,
    claimed: list[tuple[Published, bool]],
) -> Decision:
    """A sharded set at `index`. Every file there -- the index, the shards it lists, the files any record
    names -- must be syncd's output of `source` by a record: this daemon's state (published as a member of
    the set, or about to be placed), or the claim's (another node's publish or placing: `claimed`, with
    whether each is a record of placing). Then the set is adopted where every record is of the source's
    current version, else replaced. Where a file has no record (the state was lost, or the set is someone
    else's) the set is verified: converted, and in sync only if every file holds exactly those bytes, for a
    set carries no `syncd.source` that would say whether it is worth comparing."""
    try:
        listed = read_index(index, root).files
    except SyncdError:
        return someone_elses(watch, index)
    row = state.get(source)
    ours = row is not None and row.dest is not None and os.fsencode(row.dest) == os.fsencode(index)
    recorded = {Path(path): stamp for path, stamp in state.members(index).items()} if ours else {}
    placed = {Path(path): entry for path, entry in state.placed_from(source).items()}
    label = carry.file_label(source.name)
    claimed = [(record, placed_only) for record, placed_only in claimed if record.source == label]
    named = {index.parent / name for record, _ in claimed for name, _ in record.members}
    files: dict[Path, FileStamp] = {}
    current, by_placing = True, False
    for path in {index, *(index.parent / name for name in listed), *recorded, *placed, *named}:
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            continue  # a shard not written yet, or one removed: nothing there to replace
        now = FileStamp.of(info)
        proof = (
            _set_file_proof(path, index, info, recorded, placed, claimed, version)
            if stat.S_ISREG(info.st_mode)
            else None
        )
        if proof is None:
            return Decision(Action.VERIFY)
        current, by_placing = current and proof[0], by_placing or proof[1]
        files[path] = now
    if current:
        return Decision(Action.IN_SYNC, said=PLACED_UNRECORDED if by_placing else None, set_files=files)
    return Decision(Action.REPLACE, set_files=files)


def _set_file_proof(
    path: Path,
    index: Path,
    info: os.stat_result,
    recorded: dict[Path, FileStamp],
    placed: dict[Path, Placing],
    claimed: list[tuple[Published, bool]],
    version: FileStamp,
) -> tuple[bool, bool] | None:
    """(whether the record proving `path` is of the source's current version, whether it is a record of
    placing), or None where no record proves it. Placing a file changed its ctime, which is not compared."""
    now = FileStamp.of(info)
    mine = recorded.get(path)
    if mine is not None and not mine.changed(now):
        return False, False  # an earlier version's (the current one, published and unchanged, is done already)
    entry = placed.get(path)
    if entry is not None and _placed_as(entry.output, now):
        return not entry.version.changed(version), True
    for record, placed_only in claimed:
        stamp = record.dest_stamp if path == index else record.member_stamp(path.name)
        compared = 3 if placed_only else 4
        if stamp is not None and stamp[:compared] == stamp_of(info)[:compared]:
            return record.source_stamp == source_stamp(version), placed_only
    return None


def _placed_as(recorded: FileStamp, now: FileStamp) -> bool:
    """The file recorded right before it was put in place: placing it changed its ctime, nothing else."""
    return (recorded.dev, recorded.ino, recorded.size, recorded.mtime_ns) == (now.dev, now.ino, now.size, now.mtime_ns)


def source_stamp(version: FileStamp) -> Stamp:
    """A source version as a record names it: without the device number, the same on every node."""
    return (version.ino, version.size, version.mtime_ns, version.ctime_ns)


def published_by_syncd(
    published: Published, source: Path, dest: Path, *, placed_only: bool = False
) -> FileStamp | None:
    """The identity of `dest` if it still is exactly the file a node recorded publishing from `source`
    (`placed_only`: recorded before putting it in place, which changed its ctime)."""
    if published.source != carry.file_label(source.name):
        return None
    try:
        info = os.lstat(dest)
    except FileNotFoundError:
        return None
    compared = 3 if placed_only else 4  # (inode, size, mtime_ns, ctime_ns)
    if not stat.S_ISREG(info.st_mode) or stamp_of(info)[:compared] != published.dest_stamp[:compared]:
        return None
    return FileStamp.of(info)


def placed_by_this_daemon(state: StateDB, source: Path, dest: Path, root: Path) -> tuple[FileStamp, FileStamp] | None:
    """(the source version it converted, the identity of `dest`) if `dest` is the output this daemon recorded
    as about to be put in place from `source`, unchanged since, and never recorded as published (the daemon
    was killed in between): the same file, size and mtime (placing it changed its ctime), naming `source`."""
    placing = state.placing(dest)
    if placing is None or os.fsencode(placing.source) != os.fsencode(source):
        return None
    try:
        info = os.lstat(dest)
    except FileNotFoundError:
        return None
    now = FileStamp.of(info)
    if not stat.S_ISREG(info.st_mode) or not _placed_as(placing.output, now):
        return None
    if _source_named_in(dest, root) != carry.file_label(source.name):
        return None
    return placing.version, now


def someone_elses(watch: Watch, dest: Path) -> Decision:
    """What `on_exists` says about a file at `dest` that is not syncd's output of the source."""
    if watch.on_exists == "skip":
        return Decision(Action.SKIP)
    if watch.on_exists == "overwrite":
        if is_candidate(watch, dest):
            raise ConflictError(
                "exists and is itself a checkpoint this watch converts (someone's file, not syncd's output); "
                "on_exists: overwrite replaces only files that are not sources",
                str(dest),
            )
        return Decision(Action.OVERWRITE)
    return Decision(Action.CREATE)  # on_exists: error; the publish reports the conflict


def is_own_output_converted_back(state: StateDB, watch: Watch, source: Path, dest: Path) -> bool:
    """An output of ours names its source in metadata; converting it back would chase our own tail. Only
    while that source is there: an output copied alone into a tree is a checkpoint like any other.

    A `source` this daemon (or, by the claim's record, another node) converted into `dest` before, or was
    putting in place there, is a checkpoint saved again, whatever it names: a
    .bpk that `syncd convert` made from model.safetensors, copied into the tree and converted into
    model.safetensors, must be converted again at its next save. (The daemon's own outputs are known by its
    state before this is asked.)"""
    row = state.get(source)
    if row is not None and row.dest is not None and os.fsencode(row.dest) == os.fsencode(dest):
        return False
    placing = state.placing(dest)  # converted into it by a daemon killed before recording that
    if placing is not None and os.fsencode(placing.source) == os.fsencode(source):
        return False
    published, placing_there = records_of(dest)  # by another node, on a shared tree: while `dest` is still that
    for record, placed_only in ((published, False), (placing_there, True)):
        if record is not None and published_by_syncd(record, source, dest, placed_only=placed_only) is not None:
            return False
    if is_set_index(source):
        # a set carries no syncd.source: the claim's record beside its index is the proof that a node made it
        # from `dest` (a one-direction node took another node's set for a user's checkpoint: "destination
        # exists" at every save, or with on_exists: overwrite the trainer's .bpk replaced, then for ever)
        return _recorded_output_of(source, dest)
    try:
        named = read_metadata(source, watch.path).get(carry.SOURCE)
        if named == carry.file_label(dest.name):
            # the file it names, beside it: the destination itself, unless the watch's outputs now go to a
            # mirror (an output published beside its source before then names that source, still there)
            if not os.path.lexists(source.parent / dest.name):
                # gone (a trainer's rotation): still an output where a node's record says it published exactly
                # this file from it (a node without state made the source again, and two nodes then converted
                # each other's outputs for ever)
                return _recorded_output_of(source, source.parent / dest.name)
        elif not _is_conversion_of(watch, source, named):
            return False
        with open_checkpoint(source, watch.path):  # (the rare case: a broken table is for the conversion to report)
            return True
    except SyncdError:
        return False  # a broken file is reported by the conversion itself


def _recorded_output_of(output: Path, original: Path) -> bool:
    """A claim's record says a node published `output`, as it is now, from `original`."""
    published, placing = records_of(output)
    return any(
        record is not None and published_by_syncd(record, original, output, placed_only=placed_only) is not None
        for record, placed_only in ((published, False), (placing, True))
    )


def _is_conversion_of(watch: Watch, source: Path, named: object) -> bool:
    """`source` names, beside it, a checkpoint whose conversion it is though not its namesake: the .bpk of a
    `.pt` (syncd writes no pickles, so its conversion goes to a third name, a .safetensors), or of a
    .safetensors whose conversion is a set (`shard_size`). Converting it would make that third file (a second
    copy of the model) from an output, and only when the .bpk came first: `model.bpk` converted from
    `model.pt` is an output whichever of the two the daemon looks at first."""
    if not isinstance(named, str) or not named or "/" in named or named in (".", ".."):
        return False
    original = source.parent / named
    if carry.file_label(original.name) != named:
        return False
    if not os.path.lexists(original):  # rotated away: still an output where a node's record says so
        return _recorded_output_of(source, original)
    if original.name.endswith(BIN_INDEX_SUFFIX):  # a pytorch_model-*.bin set's index: its .bpk, likewise
        member = original.with_name(set_stem(original) + ".bin")  # (the watch takes the set by its shards' names)
        return is_candidate(watch, member) and set_destination(watch, original) == source
    if not is_candidate(watch, original):
        return False
    from_format = format_for_path(original)
    if from_format is None:
        return False
    return destination_for(watch, original, from_format) == source


def own_earlier_output(state: StateDB, source: Path, dest: Path, root: Path) -> FileStamp | None:
    """The identity of `dest` if it provably is the output syncd published from `source` and nobody changed
    it since: the state database recorded exactly this file (identity, size, mtime, ctime) as our output
    of `source`, and its `syncd.source` names `source`."""
    row = state.get(source)
    if row is None or row.dest is None or row.dest_version is None:
        return None  # (a failed row keeps the output last published: a failed save does not disown it)
    if os.fsencode(row.dest) != os.fsencode(dest):
        return None
    try:
        info = os.lstat(dest)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(info.st_mode) or row.dest_version.changed(FileStamp.of(info)):
        return None
    if not row.dest_version.ctime_ns:
        return None  # recorded before ctimes were: not proof enough to replace it
    if _source_named_in(dest, root) != carry.file_label(source.name):
        return None
    return FileStamp.of(info)


@dataclass(frozen=True)
class EarlierOutput:
    """syncd's earlier output of a source at another name in the directory its output now goes to."""

    unchanged: dict[Path, FileStamp]  # its files, all still exactly as published (a set: the index first)
    left: list[Path]  # its files where one of them changed since: someone else's now, left alone


def earlier_output_elsewhere(state: StateDB, source: Path, dest: Path, root: Path) -> EarlierOutput | None:
    """The output this daemon last published from `source` when it was not `dest` but another name in the same
    directory: the single file where a set now goes or the set where a single file now goes (a watch's
    `shard_size` turned on or off, a .bpk that gained or lost a set's layout). Left there, the earlier output
    goes stale beside the new one, and a loader may well take it: transformers' from_pretrained reads
    model.safetensors before model.safetensors.index.json. Each file is proven syncd's as a replaced output is
    (the state's record of exactly that file; a single file names `source`). Asked before the state records
    `dest` as the output; None where there is no such output."""
    row = state.get(source)
    if row is None or row.dest is None or row.dest_version is None:
        return None
    earlier = Path(row.dest)
    if os.fsencode(earlier) == os.fsencode(dest) or earlier.parent != dest.parent or not os.path.lexists(earlier):
        return None
    if not is_set_index(earlier):
        proven = own_earlier_output(state, source, earlier, root)
        return EarlierOutput({earlier: proven}, []) if proven is not None else EarlierOutput({}, [earlier])
    unchanged: dict[Path, FileStamp] = {}
    changed: list[Path] = []
    members = {Path(path): stamp for path, stamp in state.members(earlier).items()}
    for path in sorted(members, key=lambda member: member != earlier):  # the index first: no set without a shard
        try:
            now = FileStamp.of(os.lstat(path))
        except FileNotFoundError:
            continue
        if members[path].changed(now) or not members[path].ctime_ns:
            changed.append(path)
        else:
            unchanged[path] = now
    if changed:  # one file changed makes the whole set someone else's, as when it is replaced
        return EarlierOutput({}, [*unchanged, *changed])
    return EarlierOutput(unchanged, [])


def names_source(dest: Path, source: Path, root: Path) -> bool:
    """A hint, never proof: `dest`'s `syncd.source` metadata names `source` (a user's edit that kept the
    metadata names it too, so this only says the file is worth comparing with the conversion)."""
    return _source_named_in(dest, root) == carry.file_label(source.name)


def _source_named_in(dest: Path, root: Path) -> str | None:
    """The `syncd.source` metadata of `dest`."""
    try:
        return read_metadata(dest, root).get(carry.SOURCE)
    except SyncdError:
        return None


def _set_destination(watch: Watch, path: Path) -> Path | None:
    """Where a .bpk that carries a sharded set's layout goes back to: that set's index (None otherwise)."""
    try:
        shards = carry.parse(read_metadata(path, watch.path), str(path)).shards
    except SyncdError:
        return None  # the conversion reports what is wrong with the file
    if shards is None or not shards.with_index or watch.shard_size is not None:
        return None
    return watch.output_dir_for(path) / shards.index_name
