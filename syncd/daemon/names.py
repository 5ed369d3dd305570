"""Which file names are conversion candidates for a watch, decided from the name alone, in one place.

The watcher's event handler, the catch-up scans and the daemon's decision code all ask `is_candidate`, so a
name that one of them skips is skipped by all three. A candidate:

* announces a format by its extension (`syncd.formats.format_for_path`) that the watch converts in its
  direction;
* is not one of syncd's own scratch files (`.<name>.syncd-<pid>-<n>.tmp`, `syncd.engine.publish`) nor one of
  its claim files (`.<name>.syncd-claim`, `syncd.daemon.claims`), whatever the configuration says;
* does not match the watch's `ignore` globs: names that are temporary by convention. By default dotfiles
  (a writer's `.tmp-1.safetensors`, renamed into place when complete), `*.tmp*` (a writer's
  `model.tmp.safetensors`; Burn's own scratch `<name>.<pid>-<n>.tmp`, docs/burn-adapters.md#publishing), `*.part` and
  `.~*`. They match the file name only, never a directory on the way, so a tree below a hidden directory is
  still served;
* matches the watch's `include` patterns and none of its `exclude` patterns (each tried on the name and on
  the path relative to the watch; an index's own name too).

A sharded set's index (`model.safetensors.index.json`) stands for the set and is judged as the weights file
it names (`model.safetensors`); its shards are candidates too, and the decision code takes them to their set.
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

from syncd.daemon.claims import is_claim_name
from syncd.daemon.config.schema import Watch
from syncd.engine.directions import DIRECTIONS
from syncd.engine.publish import is_scratch_name
from syncd.formats import format_for_path
from syncd.formats.shards import is_set_index, set_stem, shard_extension


def is_candidate(watch: Watch, path: Path) -> bool:
    """True if `path` names a checkpoint this watch converts (decided from the name alone)."""
    own = path
    if is_set_index(path.name):  # judged as the weights file it stands for
        path = path.with_name(set_stem(path.name) + shard_extension(path.name))
    name = path.name
    from_format = format_for_path(name)
    if from_format is None or from_format.name not in DIRECTIONS[watch.direction]:
        return False
    if is_scratch_name(name) or is_claim_name(name) or is_ignored(watch, name):
        return False
    return matches_patterns(watch, path, own)


def is_ignored(watch: Watch, name: str) -> bool:
    """True if the file name `name` matches one of the watch's `ignore` globs (temporary names)."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in watch.ignore)


def matches_patterns(watch: Watch, *paths: Path) -> bool:
    """The watch's `include` and `exclude` patterns, each tried on the name and the path below the watch of
    each of `paths` (a set's index: its own and the weights file's it stands for, so `exclude: ["*.index.json"]`
    leaves sets out and `include: ["*.index.json"]` takes only them)."""
    subjects = []
    for path in paths:
        rel = os.fsdecode(path.relative_to(watch.path)) if path.is_relative_to(watch.path) else path.name
        subjects += [path.name, rel]

    def hit(patterns: tuple[str, ...]) -> bool:
        return any(fnmatch.fnmatchcase(subject, p) for p in patterns for subject in subjects)

    return hit(watch.include) and not hit(watch.exclude)
