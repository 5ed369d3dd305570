"""What the daemon does with one candidate path: decide, convert, record, log.

Every decision ends in exactly one sync log line, except the silent ones a person would not want to read
(an up-to-date file seen again, our own output, an ignored name, a file still being written). A file that
failed is logged once per version: the state database remembers the failure until the file changes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import signal
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from syncd.adapters.keys import TensorFilter, compile_rule
from syncd.daemon.config import Watch
from syncd.daemon.names import is_candidate
from syncd.daemon.state import StateDB
from syncd.daemon.synclog import SyncLog
from syncd.engine import carry, hashing
from syncd.engine.convert import ConvertRequest, ConvertResult, convert, source_digest
from syncd.engine.directions import converts_to
from syncd.engine.options import StoreOptions
from syncd.engine.progress import ProgressCallback
from syncd.errors import (
    TRANSIENT_ERRNOS,
    AlreadyExistsError,
    AmbiguousLayoutError,
    ConflictError,
    FormatError,
    IncompleteFileError,
    SyncdError,
    UnsupportedError,
    VerificationError,
    one_line,
)
from syncd.formats import BURNPACK, PYTORCH, SAFETENSORS, Format, format_for_path, open_checkpoint
from syncd.formats.fileio import FileStamp
from syncd.formats.registry import BY_NAME
from syncd.formats.shards import (
    IndexFiles,
    index_listing,
    is_set_index,
    looks_like_shard,
    member_files,
    set_stem,
    shard_extension,
)

log = logging.getLogger("syncd.sync")

# A file that does not read, was not seen closed and changed less than this long ago may still be being
# written (when open_for_writing cannot tell): it is looked at again rather than refused.
INCOMPLETE_GRACE_SECONDS = 60.0
BUSY_RETRY_SECONDS = 1.0  # how soon a file still being written is looked at again (its close comes sooner)
# Without a lease (no CAP_LEASE and not the file's owner, or a file system without leases) a file whose close
# was not seen must be this long without any change before it is taken as complete (README: Reliability).
UNLEASED_SETTLE_SECONDS = 10.0
FUTURE_SLACK_SECONDS = 2.0  # clock skew tolerated before a modification time counts as "in the future"
MAX_BACKOFF_SECONDS = 60.0
# A file shorter than its header says (a writer that closes after every chunk) is looked at again, quietly,
# with backoff from INCOMPLETE_FIRST_RETRY up to INCOMPLETE_MAX_RETRY seconds, while it changed less than
# INCOMPLETE_GRACE_SECONDS ago; one unchanged for longer is refused once, saying so.
INCOMPLETE_FIRST_RETRY = 0.25
INCOMPLETE_MAX_RETRY = 8.0
STATE_RETRY_SECONDS = 5.0


@dataclass
class Outcome:
    """What happened to a candidate: `retry_in` asks the queue to look again later."""

    status: str | None  # the sync log status written, or None for a silent decision
    retry_in: float | None = None


def destination_for(watch: Watch, source: Path, to_format: Format) -> Path:
    return watch.output_dir_for(source) / (source.stem + to_format.extension)


class Syncer:
    """Holds what every decision needs; one instance serves all workers (state and log are thread-safe)."""

    def __init__(self, state: StateDB, synclog: SyncLog, settle_seconds: float, hash_name: str = "xxh3_128") -> None:
        self.state = state
        self.synclog = synclog
        self.settle_seconds = settle_seconds
        # who wants to follow a conversion's bytes (the daemon's status); called with the source path
        self.progress_for: Callable[[Path], ProgressCallback | None] = lambda _path: None
        self._future: dict[tuple[Path, int], float] = {}  # (path, mtime_ns) in the future -> first seen
        self._incomplete: dict[Path, int] = {}  # path seen shorter than its header says -> looks so far
        # a set is reached through its index and through each shard's events: one worker at a time per set
        self._set_locks: dict[Path, threading.Lock] = {}
        self._set_locks_guard = threading.Lock()
        self._index_files = IndexFiles()  # each index parsed once per version, not on every event beside it
        self.hash_name = hash_name

    # -- the decision

    def process(self, watch: Watch, path: Path, closed: bool) -> Outcome:
        """Decide about `path`; a failure of the state database is logged and the path retried later."""
        try:
            return self._process(watch, path, closed)
        except SyncdError as exc:
            if exc.kind != "environment":
                raise
            self.synclog.log("error", watch=str(watch.path), source=str(path), error=one_line(exc), reason="will retry")
            return Outcome("error", retry_in=STATE_RETRY_SECONDS)

    def _process(self, watch: Watch, path: Path, closed: bool) -> Outcome:
        if not is_candidate(watch, path):
            return Outcome(None)
        if is_set_index(path):
            return self._process_set(watch, path, closed)
        from_format = format_for_path(path)
        assert from_format is not None  # is_candidate checked it
        if from_format.name in (SAFETENSORS, PYTORCH):
            index = index_listing(path, self._index_files)
            if index is not None:  # a shard is converted with its set, through the set's index
                return self._process_set(watch, Path(index), closed=False)
            if looks_like_shard(path.name):
                return Outcome(None)  # save_pretrained writes the index last: its arrival brings the set
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            return Outcome(None)  # gone again (a scratch renamed away, a deleted file)
        if not stat.S_ISREG(info.st_mode):
            return self._not_regular(watch, path, info)
        wait = self._settle_wait(watch, path, info, closed)
        if wait > 0:
            return Outcome(None, retry_in=wait)
        version = FileStamp.of(info)
        dest = destination_for(watch, path, converts_to(from_format))
        if from_format.name == BURNPACK:
            dest = _set_destination(watch, path) or dest
        if self.state.is_up_to_date(path, version, dest) or self.state.failed_same_version(path, version):
            return Outcome(None)
        if self.state.is_own_output(path, version):
            return Outcome(None)
        writing = open_for_writing(path)
        if writing:
            # a writer pausing longer than the settle time; its close brings the file back at once
            return Outcome(None, retry_in=BUSY_RETRY_SECONDS)
        if writing is None and not closed:
            wait = self._unleased_wait(path, info)
            if wait > 0:
                return Outcome(None, retry_in=wait)
        return self._convert(watch, path, version, dest, from_format, finished=closed or writing is False)

    def _process_set(self, watch: Watch, index: Path, closed: bool) -> Outcome:
        """The index is the set's commit point: the set is converted once the index and every shard it lists
        are complete (present, settled, nobody writing them). A shard still missing is waited for while the
        index is recent; after that the conversion reports it."""
        with self._set_locks_guard:
            lock = self._set_locks.setdefault(index, threading.Lock())
        with lock:
            return self._process_set_locked(watch, index, closed)

    def _process_set_locked(self, watch: Watch, index: Path, closed: bool) -> Outcome:
        try:
            info = os.lstat(index)
        except FileNotFoundError:
            return Outcome(None)
        if not stat.S_ISREG(info.st_mode):
            return self._not_regular(watch, index, info)
        if self.state.is_own_output(index, FileStamp.of(info)):
            return Outcome(None)
        try:
            members = [Path(p) for p in member_files(index, self._index_files)]
        except SyncdError:
            members = []  # a broken (or half-written) index: the conversion reports it, or it is retried
        stats = [info]
        missing = []
        for member in members:
            try:
                stats.append(os.lstat(member))
            except FileNotFoundError:
                missing.append(member)
        if missing:
            return self._missing_shards(watch, index, stats, missing)
        wait = max(self._settle_wait(watch, index, st, closed and st is info) for st in stats)
        if wait > 0:
            return Outcome(None, retry_in=wait)
        version = _set_version(stats)
        dest = watch.output_dir_for(index) / (set_stem(index) + BY_NAME[BURNPACK].extension)
        if self.state.is_up_to_date(index, version, dest) or self.state.failed_same_version(index, version):
            return Outcome(None)
        if any(open_for_writing(p) for p in [index, *members] if os.path.lexists(p)):
            return Outcome(None, retry_in=BUSY_RETRY_SECONDS)
        from_format = BY_NAME[PYTORCH if shard_extension(index) == ".bin" else SAFETENSORS]
        return self._convert(watch, index, version, dest, from_format, finished=True)

    def _missing_shards(self, watch: Watch, index: Path, stats: list[os.stat_result], missing: list[Path]) -> Outcome:
        """A shard the index lists is not there. While the set keeps changing it is waited for quietly: one
        `warning` line, then looks with backoff (its arrival brings the set back at once); after
        INCOMPLETE_GRACE_SECONDS without any change the set is refused once, naming what is missing, as a
        truncated file is. The set's next change (the shard arriving) is a new version, looked at anew."""
        names = ", ".join(p.name for p in missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        quiet = min(self._age(None, index, st) for st in stats)
        if quiet < INCOMPLETE_GRACE_SECONDS:
            looks = self._incomplete.get(index, 0)
            if looks == 0:
                reason = f"waiting for {names}, which the index lists and which is not there yet"
                self.synclog.log("warning", watch=str(watch.path), source=str(index), reason=reason)
            if len(self._incomplete) > 10_000:
                self._incomplete.clear()
            self._incomplete[index] = looks + 1
            backoff = min(INCOMPLETE_MAX_RETRY, INCOMPLETE_FIRST_RETRY * 2.0**looks)
            return Outcome(None, retry_in=min(backoff, INCOMPLETE_GRACE_SECONDS - quiet + 0.1))
        self._incomplete.pop(index, None)
        version = _set_version(stats)
        if self.state.failed_same_version(index, version):
            return Outcome(None)
        dest = watch.output_dir_for(index) / (set_stem(index) + BY_NAME[BURNPACK].extension)
        from_format = BY_NAME[PYTORCH if shard_extension(index) == ".bin" else SAFETENSORS]
        direction = f"{from_format.short}->{converts_to(from_format).short}"
        base = {"watch": str(watch.path), "source": str(index), "dest": str(dest), "direction": direction}
        error = FormatError(
            f"the index lists {names}, not there after {INCOMPLETE_GRACE_SECONDS:.0f} s without any change",
            str(index),
        )
        return self._failed(index, version, error, base, time.monotonic())

    def _not_regular(self, watch: Watch, path: Path, info: os.stat_result) -> Outcome:
        # symlinks are never followed (they may point out of the tree); FIFOs, sockets, devices never opened
        kind = "a symlink" if stat.S_ISLNK(info.st_mode) else "not a regular file"
        version = FileStamp.of(info)
        if self.state.record_failure(path, version, f"skipped: {kind}", transient=False, kind="input"):
            self.synclog.log("skipped", watch=str(watch.path), source=str(path), reason=f"{kind}; not converted")
        return Outcome("skipped")

    def _settle_wait(self, watch: Watch, path: Path, info: os.stat_result, closed: bool) -> float:
        """Seconds until the file has been quiet long enough. A close or rename says the writer is done,
        so a short check suffices; a bare create/modify must stay unchanged for the full settle time."""
        window = min(self.settle_seconds, 0.05) if closed else self.settle_seconds
        return max(0.0, window - self._age(watch, path, info))

    def _unleased_wait(self, path: Path, info: os.stat_result) -> float:
        """Without a lease nothing tells whether a writer still has the file open: a writer that sets the
        full size first and fills it in later, pausing, looks complete (and reads, half zeros). Such a file is
        taken only after UNLEASED_SETTLE_SECONDS without any change (mtime or ctime), unless its close was seen."""
        changed = max(info.st_mtime_ns, info.st_ctime_ns) / 1e9
        age = time.time() - changed
        if age < -FUTURE_SLACK_SECONDS:
            age = self._age(None, path, info)
        return max(0.0, max(UNLEASED_SETTLE_SECONDS, self.settle_seconds) - age)

    def _age(self, watch: Watch | None, path: Path, info: os.stat_result) -> float:
        """How long the file has been quiet. A modification time in the future (a copy from a host whose clock
        runs ahead) is taken as the moment we first saw it, and said once."""
        age = time.time() - info.st_mtime
        if age >= -FUTURE_SLACK_SECONDS:
            return age
        key = (path, info.st_mtime_ns)
        if key not in self._future:
            if len(self._future) > 10_000:
                self._future.clear()
            self._future[key] = time.monotonic()
            if watch is not None:
                self.synclog.log(
                    "warning",
                    watch=str(watch.path),
                    source=str(path),
                    reason=f"modification time {-age:.0f} s in the future; treated as now",
                )
        return time.monotonic() - self._future[key]

    # -- converting

    def _convert(
        self, watch: Watch, path: Path, version: FileStamp, dest: Path, from_format: Format, *, finished: bool
    ) -> Outcome:
        """`finished`: the writer is known to be done (its close or rename was seen, or nobody has the file
        open for writing); otherwise a file that does not read may be one still being written."""
        direction = f"{from_format.short}->{converts_to(from_format).short}"
        base = {"watch": str(watch.path), "source": str(path), "dest": str(dest), "direction": direction}
        started = time.monotonic()
        try:
            if self._is_reverse_of_own_output(watch, path, dest):
                return Outcome(None)
            replace_if, overwrite = None, False
            if os.path.lexists(dest):
                decided = self._existing_destination(watch, path, version, dest, base)
                if isinstance(decided, Outcome):
                    return decided
                replace_if, overwrite = decided
            if watch.mirror is not None:
                _make_mirror_dirs(watch, dest.parent)
            _check_inside(dest.parent, watch.mirror or watch.path)
            result = convert(
                ConvertRequest(
                    source=path,
                    dest=dest,
                    to_format=converts_to(from_format).name,
                    layout=watch.layout,
                    module_map=watch.module_map,
                    overwrite=overwrite,
                    fail_early_if_exists=False,
                    within=watch.path,
                    replace_if=replace_if,
                    progress=self.progress_for(path),
                    store=self._store_options(watch),
                    shard_size=watch.shard_size,
                    hash_name=self.hash_name,
                    top_level_key=watch.top_level_key,
                )
            )
        except Exception as exc:
            return self._failed_or_later(path, version, exc, base, started, finished)
        return self._converted(path, version, dest, result, base, started, updated=replace_if is not None)

    def _converted(
        self,
        path: Path,
        version: FileStamp,
        dest: Path,
        result: ConvertResult,
        base: dict,
        started: float,
        *,
        updated: bool,
    ) -> Outcome:
        if result.status == "in_sync":
            status = "in_sync"
        else:
            status = "updated" if updated and result.status == "replaced" else "converted"
        self.state.record(path, version, dest, status="in_sync" if status == "in_sync" else "converted")
        self._incomplete.pop(path, None)
        self.synclog.log(
            status,
            **base,
            tensors=result.tensors,
            bytes=result.bytes,
            duration_ms=round((time.monotonic() - started) * 1000, 1),
            layout=[f"{result.source_layout} -> {result.target_layout}", *result.decisions],
            reason=_dropped_reason(result.dropped, result.restored),
        )
        return Outcome(status)

    def _failed_or_later(
        self, path: Path, version: FileStamp, exc: BaseException, base: dict, started: float, finished: bool
    ) -> Outcome:
        if isinstance(exc, SyncdError) and exc.kind == "busy":
            # changed, replaced or removed while we read it: never published; looked at again once quiet
            log.info("%s", one_line(exc))
            gone = not os.path.lexists(path)
            return Outcome(None, retry_in=None if gone else max(self.settle_seconds, BUSY_RETRY_SECONDS))
        if isinstance(exc, IncompleteFileError):
            wait = self._incomplete_wait(path)
            if wait is not None:
                log.debug("%s is not complete yet, looking again in %.2f s: %s", path, wait, exc)
                return Outcome(None, retry_in=wait)
        content_error = isinstance(exc, FormatError) and exc.kind == "input"
        if content_error and not finished and _recently_changed(version):
            log.debug("%s does not read yet, looking again later: %s", path, exc)
            return Outcome(None, retry_in=max(self.settle_seconds, BUSY_RETRY_SECONDS))
        return self._failed(path, version, exc, base, started)

    def _incomplete_wait(self, path: Path) -> float | None:
        """Seconds until a file shorter than its header says is looked at again, or None once it has been
        unchanged for INCOMPLETE_GRACE_SECONDS (nobody is still appending: it is refused). A writer that
        closes after every chunk is not done at its first close; each new chunk's close brings it back
        sooner than the backoff."""
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            self._incomplete.pop(path, None)
            return None
        quiet = self._age(None, path, info)
        if quiet >= INCOMPLETE_GRACE_SECONDS:
            self._incomplete.pop(path, None)
            return None
        if len(self._incomplete) > 10_000:
            self._incomplete.clear()
        looks = self._incomplete.get(path, 0)
        self._incomplete[path] = looks + 1
        backoff = min(INCOMPLETE_MAX_RETRY, INCOMPLETE_FIRST_RETRY * 2.0**looks)
        return min(backoff, INCOMPLETE_GRACE_SECONDS - quiet + 0.1)

    def _is_reverse_of_own_output(self, watch: Watch, path: Path, dest: Path) -> bool:
        """An output of ours names its source in metadata; converting it back would chase our own tail. Only
        while that source is there: an output copied alone into a tree is a checkpoint like any other."""
        try:
            with open_checkpoint(path, watch.path) as reader:
                source_name = reader.header.metadata.get(carry.SOURCE)
        except SyncdError:
            return False  # a broken file is reported by the conversion itself
        return source_name is not None and source_name == carry.file_label(dest.name) and os.path.lexists(dest)

    def _existing_destination(
        self, watch: Watch, path: Path, version: FileStamp, dest: Path, base: dict
    ) -> Outcome | tuple[FileStamp | None, bool]:
        """What to do about a destination that exists: an Outcome (done), or (replace_if, overwrite).

        syncd's own earlier output of this source is replaced (`updated`) whatever `on_exists` says; a file
        that already holds this source's conversion is `in_sync`; anything else is someone else's file, which
        `on_exists` decides: skip (leave it, say so), error (conflict) or overwrite (replace it, but never a
        file that is itself a checkpoint this watch converts: in a `direction: both` tree that would swap two
        users' files).
        """
        root = watch.mirror or watch.path
        ours = self._own_earlier_output(path, dest, root)
        if ours is not None:
            return ours, False
        if _carries_source(dest, path, root, watch.path):
            self.state.record(path, version, dest, status="in_sync")
            self.synclog.log("in_sync", **base, reason="destination already holds this source's conversion")
            return Outcome("in_sync")
        if watch.on_exists == "skip":
            if self.state.record_failure(path, version, "destination exists", transient=False, kind="config"):
                self.synclog.log("skipped", **base, reason="destination exists (on_exists: skip)")
            return Outcome("skipped")
        if watch.on_exists == "overwrite" and is_candidate(watch, dest):
            raise ConflictError(
                "exists and is itself a checkpoint this watch converts (someone's file, not syncd's output); "
                "on_exists: overwrite replaces only files that are not sources",
                str(dest),
            )
        return None, watch.on_exists == "overwrite"

    def _own_earlier_output(self, path: Path, dest: Path, root: Path) -> FileStamp | None:
        """The identity of `dest` if it provably is the output syncd published from `path` and nobody changed
        it since: the state database recorded exactly this file (identity, size, mtime, ctime) as our output
        of `path`, and its `syncd.source` names `path`."""
        state = self.state.get(path)
        if state is None or state.dest is None or state.dest_version is None:
            return None  # (a failed row keeps the output last published: a failed save does not disown it)
        if os.fsencode(state.dest) != os.fsencode(dest):
            return None
        try:
            info = os.lstat(dest)
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(info.st_mode) or state.dest_version.changed(FileStamp.of(info)):
            return None
        if not state.dest_version.ctime_ns:
            return None  # recorded before ctimes were: not proof enough to replace it
        if _source_named_in(dest, root) != carry.file_label(path.name):
            return None
        return FileStamp.of(info)

    def _failed(self, path: Path, version: FileStamp, exc: BaseException, base: dict, started: float) -> Outcome:
        status, transient = classify(exc)
        text = one_line(exc)
        kind = exc.kind if isinstance(exc, SyncdError) else "environment" if isinstance(exc, OSError) else None
        first = self.state.record_failure(path, version, text, transient=transient, kind=kind)
        if first:
            fields = {**base, "duration_ms": round((time.monotonic() - started) * 1000, 1), "error": text}
            suggestion = getattr(exc, "suggestion", None)
            if suggestion:
                fields["reason"] = "module map that would settle it:\n" + suggestion
            elif isinstance(exc, IncompleteFileError):
                fields["reason"] = (
                    f"shorter than its header says and unchanged for "
                    f"{INCOMPLETE_GRACE_SECONDS:.0f} s: truncated, not still being written"
                )
            elif transient:
                fields["reason"] = "will retry"
            self.synclog.log(status, **fields)
        if status == "error" and not transient and not isinstance(exc, SyncdError | OSError):
            # a bug of ours: the traceback goes to the journal (the sync log's line already says what failed)
            log.error("%s: %s", path, text, exc_info=True)
        if transient:
            row = self.state.get(path)
            attempts = row.attempts if row else 1
            return Outcome(status, retry_in=min(MAX_BACKOFF_SECONDS, 2.0 ** min(attempts, 6)))
        return Outcome(status)

    def _store_options(self, watch: Watch) -> StoreOptions:
        """The watch's remap/filter/precision settings (validated when the config was loaded)."""
        return StoreOptions(
            tuple(compile_rule(p, r) for p, r in watch.remap),
            watch.map_indices_contiguous,
            TensorFilter.of(watch.tensor_include, watch.tensor_exclude),
            watch.precision,
        )


def _set_version(stats: list[os.stat_result]) -> FileStamp:
    """One version for a whole set: the index's identity, the total size, the latest mtime of any file, and as
    its ctime a digest of every file's identity, size, mtime and ctime (the kernel moves a file's ctime on every
    write, so a shard rewritten in place with the same size, or replaced by `cp -p`/`rsync -t` with an older
    mtime, is a new version of the set, as a single file's ctime makes it one)."""
    index = stats[0]
    members = [(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) for st in stats]
    digest = hashlib.blake2b(repr(members).encode("ascii"), digest_size=8).digest()
    every = int.from_bytes(digest, "little") >> 1 or 1  # non-zero (0 is "unknown"), within SQLite's INTEGER
    total, latest = sum(st.st_size for st in stats), max(st.st_mtime_ns for st in stats)
    return FileStamp(index.st_dev, index.st_ino, total, latest, ctime_ns=every)


def _set_destination(watch: Watch, path: Path) -> Path | None:
    """Where a .bpk that carries a sharded set's layout goes back to: that set's index (None otherwise)."""
    try:
        with open_checkpoint(path, watch.path) as reader:
            shards = carry.parse(reader.header.metadata, str(path)).shards
    except SyncdError:
        return None  # the conversion reports what is wrong with the file
    if shards is None or not shards.with_index or watch.shard_size is not None:
        return None
    return watch.output_dir_for(path) / shards.index_name


def classify(exc: BaseException) -> tuple[str, bool]:
    """(sync log status, transient?) for a failure, read from the kind the error declared where it was raised
    (syncd/errors.py); an OSError that escaped undeclared counts as the environment's."""
    if isinstance(exc, AlreadyExistsError):
        return "conflict", False
    if isinstance(exc, OSError):
        return "error", exc.errno in TRANSIENT_ERRNOS
    if not isinstance(exc, SyncdError):
        return "error", False  # a bug: logged with its traceback
    if exc.kind == "environment":
        if isinstance(exc, FormatError) and not exc.transient:
            return "skipped", False  # unreadable for us: reported once, not an error in the file
        return "error", exc.transient
    if isinstance(exc, FormatError | UnsupportedError | AmbiguousLayoutError | VerificationError):
        return "refused", exc.transient
    return "error", exc.transient


def _dropped_reason(dropped: list[str], restored: list[str]) -> str | None:
    parts = []
    if dropped:
        parts.append(f"carried in metadata (no Burn slot): {', '.join(dropped)}")
    if restored:
        parts.append(f"restored from metadata: {', '.join(restored)}")
    return "; ".join(parts) or None


def _source_named_in(dest: Path, root: Path) -> str | None:
    """The `syncd.source` metadata of `dest`, read through the confined, no-follow, non-blocking open."""
    try:
        with open_checkpoint(dest, root) as reader:
            return reader.header.metadata.get(carry.SOURCE)
    except SyncdError:
        return None


def _carries_source(dest: Path, source: Path, dest_root: Path, source_root: Path) -> bool:
    """True if `dest` is a syncd output of exactly this `source` content (name and recorded hash match: XXH3-128,
    or sha256 in outputs of older versions and with `hash: sha256`; of a sharded set, the hash covers the
    index and every shard, as the conversion records it). Every file is opened
    confined, without following symlinks and without blocking (a FIFO or a symlink to a device renamed onto
    any of the names must not hang a worker)."""
    try:
        with open_checkpoint(dest, dest_root) as reader:
            metadata = reader.header.metadata
    except SyncdError:
        return False
    recorded = hashing.recorded_source_hash(metadata)
    if metadata.get(carry.SOURCE) != carry.file_label(source.name) or recorded is None:
        return False
    return recorded.hexdigest == source_digest(source, source_root, recorded.name)


def open_for_writing(path: Path) -> bool | None:
    """True if some process has `path` open for writing, False if none has, None if we cannot tell.

    The kernel refuses a read lease (EAGAIN) while any descriptor has the file open for writing. Taking one
    needs the file's owner or CAP_LEASE and a local file system; without them the settle time has to do.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        # A writer opening the file while we hold the lease waits until we drop it (at once) and the kernel
        # signals us: SIGURG, which is ignored by default, instead of SIGIO, which would end the process.
        fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGURG)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
    except OSError as exc:
        return True if exc.errno == errno.EAGAIN else None
    else:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return False
    finally:
        os.close(fd)


def _recently_changed(version: FileStamp) -> bool:
    return time.time() - version.mtime_ns / 1e9 < INCOMPLETE_GRACE_SECONDS


def _check_inside(directory: Path, root: Path) -> None:
    """Outputs go only where the configuration says: a directory that resolves elsewhere (through a
    symlink planted in the tree) is refused."""
    real, top = os.path.realpath(directory), os.path.realpath(root)
    if real != top and not real.startswith(top.rstrip("/") + "/"):
        raise SyncdError(f"output directory resolves outside {root}; not writing there", str(directory))


def _make_mirror_dirs(watch: Watch, directory: Path) -> None:
    """Create the mirror's subdirectories, refusing to pass through a symlink (it could lead anywhere)."""
    assert watch.mirror is not None
    current = watch.mirror
    if not os.path.isdir(watch.mirror):
        # never created by us: a missing mirror may be an unmounted file system; retried until it is back
        raise SyncdError(
            f"the mirror directory {watch.mirror} is missing", str(directory), kind="environment", transient=True
        )
    for part in directory.relative_to(watch.mirror).parts:
        current = current / part
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(current, 0o755)
            info = os.lstat(current)
        except OSError as exc:
            what = f"cannot create the mirror directory {current}"
            raise SyncdError.from_os_error(what, str(directory), exc) from exc
        if not stat.S_ISDIR(info.st_mode):
            raise SyncdError(f"mirror path {current} is not a directory (a symlink?); not writing there")
