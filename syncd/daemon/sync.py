"""What the daemon does with one candidate path: decide, convert, record, log.

The decisions live beside this module: `readiness` (is the file settled, complete, nobody writing it) and
`ownership` (where the output goes, whose file is there). This module puts them in order, calls the engine,
records the outcome in the state database and writes the sync log line. On a tree shared with other nodes
(`claims`), the output's claim is taken before anything is decided about it, held through the publish and
the record of it, and a claim someone else holds means "look again later".

Every decision ends in exactly one sync log line, except the silent ones a person would not want to read
(an up-to-date file seen again, our own output, an ignored name, a file still being written, a claim held
by another node, another node's output adopted from its record). A file that failed is logged once per
version: the state database remembers the failure until the file changes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import shlex
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from syncd.adapters.keys import TensorFilter, compile_rule
from syncd.daemon import claims, ownership
from syncd.daemon.collector import CollectorPause
from syncd.daemon.config import Watch
from syncd.daemon.config.schema import DEFAULT_CLUSTER_POLL_INTERVAL
from syncd.daemon.names import is_candidate
from syncd.daemon.ownership import Action
from syncd.daemon.readiness import (
    INCOMPLETE_FIRST_RETRY,
    INCOMPLETE_GRACE_SECONDS,
    INCOMPLETE_MAX_RETRY,
    Readiness,
    anyone_writing,
    changed_since,
    set_version,
)
from syncd.daemon.state import SUCCESS_STATUSES, StateDB
from syncd.daemon.statuses import Status
from syncd.daemon.synclog import SyncLog
from syncd.engine import carry
from syncd.engine.convert import ConvertRequest, ConvertResult, convert
from syncd.engine.directions import converts_to
from syncd.engine.options import StoreOptions
from syncd.engine.progress import ProgressCallback
from syncd.engine.publish import remove_if_unchanged, remove_stale_scratch_of
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
from syncd.formats import PYTORCH, SAFETENSORS, Format, format_for_path
from syncd.formats.fileio import FileStamp
from syncd.formats.registry import BY_NAME
from syncd.formats.shards import (
    IndexFiles,
    index_listing,
    is_set_index,
    looks_like_shard,
    member_files,
    shard_extension,
)

log = logging.getLogger("syncd.sync")

MAX_BACKOFF_SECONDS = 60.0
STATE_RETRY_SECONDS = 5.0
CLAIM_FIRST_RETRY = 0.25  # a claim held by someone else is tried again this soon, then less and less often
# a claim held this long is said once: no conversion takes that long, so its holder is stuck or no syncd
CLAIM_HELD_WARNING_SECONDS = 1800.0


@dataclass
class _Job:
    """One conversion being decided: what every step of it needs."""

    watch: Watch
    path: Path
    version: FileStamp
    dest: Path
    from_format: Format
    finished: bool
    started: float
    base: dict = field(default_factory=dict)  # the sync log fields every line about it carries
    placed: dict[Path, claims.Stamp] = field(default_factory=dict)  # the output files put in place so far


_HELD = object()  # the claim is someone else's


@dataclass(frozen=True)
class Outcome:
    """What happened to a candidate: `retry_in` asks the queue to look again later."""

    status: Status | None  # the sync log status written, or None for a silent decision
    retry_in: float | None = None


SILENT = Outcome(None)  # nothing to do, nothing to say


def later(seconds: float | None) -> Outcome:
    """Not ready yet: nothing said, looked at again after `seconds`."""
    return Outcome(None, retry_in=seconds)


class Syncer:
    """Holds what every decision needs; one instance serves all workers (state and log are thread-safe)."""

    MAX_SET_LOCKS = 1024

    def __init__(self, state: StateDB, synclog: SyncLog, settle_seconds: float, hash_name: str) -> None:
        self.state = state
        self.synclog = synclog
        self.readiness = Readiness(settle_seconds, self._warn)
        self.hash_name = hash_name
        self.config_path: Path | None = None  # named in what a person is told to run (`syncd retry -c ...`)
        # who wants to follow a conversion's bytes (the daemon's status); called with the source path
        self.progress_for: Callable[[Path], ProgressCallback | None] = lambda _path: None
        # asked on a worker's thread as its conversion starts: what the conversion tells that it moves on
        self.alive_for: Callable[[], Callable[[], None] | None] = lambda: None
        # a set is reached through its index and through each shard's events: one worker at a time per set
        self._set_locks: dict[Path, threading.Lock] = {}  # one per set seen, those held kept past MAX_SET_LOCKS
        self._set_locks_guard = threading.Lock()
        self._index_files = IndexFiles()  # each index parsed once per version, not on every event beside it
        self._missing: dict[Path, int] = {}  # a set's index -> looks while a shard it lists is not there
        self._state_fault: str | None = None  # what the state database's failure says, while it lasts
        self._state_retries: dict[Path, int] = {}  # looks at each file meanwhile (its backoff)
        self._state_fault_lock = threading.Lock()
        # a set's index -> looks while it waits for its index to be written again (-1: said so, after the grace)
        self._uncommitted_looks: dict[Path, int] = {}
        # watches (by path) on a filesystem other nodes write to: their outputs are claimed before converting
        self.shared: frozenset[Path] = frozenset()
        self.claim_retry_max = DEFAULT_CLUSTER_POLL_INTERVAL
        # output -> times its claim was found held in a row, since when, whether that was said, last look
        self._claim_waits: dict[Path, tuple[int, float, bool, float]] = {}
        self.clock: Callable[[], float] = time.monotonic  # of the claim waits
        self._no_locks_said: set[Path] = set()
        self._collector = CollectorPause()  # off while converting, as `syncd convert` has it (collector.py)

    def set_settle_times(self, settle_seconds: float, unleased_settle_seconds: float) -> None:
        """How long a file must stay unchanged before it is taken (readiness.py): at start and at each reload."""
        self.readiness.settle_seconds = settle_seconds
        self.readiness.unleased_settle_seconds = unleased_settle_seconds

    def _warn(self, watch_root: Path, path: Path, reason: str) -> None:
        self.synclog.log(Status.WARNING, watch=str(watch_root), source=str(path), reason=reason)

    # -- the decision

    def process(self, watch: Watch, path: Path, closed: bool) -> Outcome:
        """Decide about `path`; a failure of the state database is logged and the path retried later."""
        try:
            outcome = self._process(watch, path, closed)
        except SyncdError as exc:
            if exc.kind != "environment":
                raise
            return self._state_failed(watch, path, exc)
        if self._state_fault is not None and outcome.status is not None:  # decided, so recorded: it works again
            with self._state_fault_lock:
                self._state_fault = None
                self._state_retries.clear()
        return outcome

    def _state_failed(self, watch: Watch, path: Path, exc: SyncdError) -> Outcome:
        """The state database failing (a full or read-only disk) is the daemon's fault, not the file's: said
        once while it lasts, each file looked at again with backoff up to a minute. (Every waiting file said it
        every 5 s: 1,200 lines a minute for 100 files, pushing the sync log's history out.)"""
        text = one_line(exc)
        with self._state_fault_lock:
            said, self._state_fault = self._state_fault == text, text
            if len(self._state_retries) > 10_000:
                self._state_retries.clear()
            attempts = self._state_retries[path] = self._state_retries.get(path, 0) + 1
        if not said:
            reason = "will retry every file waiting, said once while it lasts"
            self.synclog.log(Status.ERROR, watch=str(watch.path), source=str(path), error=text, reason=reason)
        return Outcome(Status.ERROR, retry_in=min(MAX_BACKOFF_SECONDS, STATE_RETRY_SECONDS * 2.0 ** (attempts - 1)))

    def _process(self, watch: Watch, path: Path, closed: bool) -> Outcome:
        """One file: a candidate, present and regular, settled, not already done, nobody writing it."""
        if not is_candidate(watch, path):
            return SILENT
        index = _set_index_of(path, self._index_files)
        if index is not None:  # a shard is converted with its set, through the set's index
            if index != path and not is_candidate(watch, index):
                return SILENT  # the set is left out by its index's name (exclude: ["*.index.json"])
            return self._process_set(watch, index, closed=closed and index == path)
        if _awaits_index(path):
            return SILENT  # save_pretrained writes the index last: its arrival brings the set
        info = _lstat(path)
        if info is None or not stat.S_ISREG(info.st_mode):
            return self._not_regular(watch, path, info)
        wait = self.readiness.settle_wait(watch.path, path, info, closed)
        if wait > 0:
            return later(wait)
        version = FileStamp.of(info)
        from_format = format_for_path(path)
        assert from_format is not None  # is_candidate checked it
        dest = ownership.destination_for(watch, path, from_format)
        if self._done_already(path, version, dest) or self.state.is_own_output(path, version):
            return SILENT
        wait, finished = self.readiness.writer_wait(path, info, closed)
        if wait > 0:
            return later(wait)
        return self._convert(watch, path, version, dest, from_format, finished=finished)

    def _process_set(self, watch: Watch, index: Path, closed: bool) -> Outcome:
        """The index is the set's commit point: the set is converted once the index and every shard it lists
        are complete (present, settled, nobody writing them). A shard still missing is waited for while the
        index is recent; after that the conversion reports it."""
        with self._set_locks_guard:
            lock = self._set_locks.setdefault(index, threading.Lock())
            if not lock.acquire(blocking=False):
                # another worker has the set (an event of one of its shards): looked at again once it is done,
                # rather than a worker idle behind it for the whole conversion (and called stuck meanwhile)
                return later(self.readiness.busy_retry)
            if len(self._set_locks) > self.MAX_SET_LOCKS:
                # (taken under the guard only, so a lock nobody holds is nobody's to take: dropped safely)
                self._set_locks = {path: held for path, held in self._set_locks.items() if held.locked()}
        try:
            return self._process_set_locked(watch, index, closed)
        finally:
            lock.release()

    def _process_set_locked(self, watch: Watch, index: Path, closed: bool) -> Outcome:
        info = _lstat(index)
        if info is None or not stat.S_ISREG(info.st_mode):
            return self._not_regular(watch, index, info)
        if self.state.is_own_output(index, FileStamp.of(info)):
            return SILENT
        members = _members(index, self._index_files)
        stats = [info, *(_lstat(member) for member in members)]
        missing = [member for member, st in zip(members, stats[1:], strict=True) if st is None]
        if missing:
            return self._missing_shards(watch, index, [st for st in stats if st is not None], missing)
        self._missing.pop(index, None)
        present = [st for st in stats if st is not None]  # (all of them: none is missing)
        if self._saving_again(index, present):
            return self._uncommitted(watch, index, present)
        self._uncommitted_looks.pop(index, None)
        wait = self.readiness.set_wait(watch.path, index, stats, closed)
        if wait > 0:
            return later(wait)
        version = set_version([st for st in stats if st is not None])
        dest = ownership.set_destination(watch, index)
        if self._done_already(index, version, dest):
            return SILENT
        if anyone_writing([index, *members]):
            return later(self.readiness.busy_retry)
        return self._convert(watch, index, version, dest, _set_format(index), finished=True)

    def _saving_again(self, index: Path, stats: list[os.stat_result]) -> bool:
        """Whether the set is being written anew and must be waited for. save_pretrained writes its shards,
        then the index, the commit point; a copy or a download may write them in any order. Converted before
        the set is whole again, the output would be new shards with old ones, a model no save ever held.
        - As it was converted: nothing under way (whether done already is decided elsewhere).
        - The index as converted, some shards written since the conversion and some not: the next save, shard
          by shard, for as long as it takes (a shard copied a minute after the one before, over a slow link,
          was published beside the earlier save's). Every shard written since: the whole next save, converted;
          the index that follows is converted again.
        - A new index, some shards changed since the set was converted and some not: replaced in any order
          (a download), waited for until left INCOMPLETE_GRACE_SECONDS (a download that skips unchanged files
          ends so). All changed, or none: committed.
        - An index never converted, shards newer than it beside older ones: the next save begun before the
          earlier one was converted, or a download in any order: waited for as above. Every shard newer: a set
          copied in index first."""
        info, shards = stats[0], stats[1:]
        converted = self._converted_version(index)
        if converted is not None and not set_version(stats).changed(converted):
            return False
        if converted is not None and converted.ino == info.st_ino and info.st_mtime_ns <= converted.mtime_ns:
            # changed since the conversion, not since the index: a set copied in index first was converted with
            # every shard newer than its index, and then the next save's first shard made them all "newer"
            since = [st.st_mtime_ns > converted.mtime_ns for st in shards]
            return any(since) and not all(since)
        newer = [st.st_mtime_ns > info.st_mtime_ns for st in shards]
        if not any(newer):
            since = [st.st_mtime_ns > converted.mtime_ns for st in shards] if converted is not None else []
            mixed = any(since) and not all(since)
        else:
            mixed = not all(newer)
        return mixed and min(self.readiness.age(None, index, st) for st in stats) < INCOMPLETE_GRACE_SECONDS

    def _converted_version(self, index: Path) -> FileStamp | None:
        """The set's version (set_version) this daemon last converted it at, if it did."""
        row = self.state.get(index)
        return row.version if row is not None and row.status in SUCCESS_STATUSES else None

    def _uncommitted(self, watch: Watch, index: Path, stats: list[os.stat_result]) -> Outcome:
        """A set saved again whose index is not written yet: waited for with backoff (the index's event brings
        it back at once). Left so for INCOMPLETE_GRACE_SECONDS, it is said once, with the way to convert it as
        it is: a shard edited alone, without its index, is the one case that is not a save under way."""
        looks = self._uncommitted_looks.get(index, 0)
        quiet = min(self.readiness.age(None, index, st) for st in stats)
        if quiet >= INCOMPLETE_GRACE_SECONDS and looks >= 0:
            self._warn(
                watch.path,
                index,
                "shards written after this index and the index not written since: a save under way, waited for "
                "(save_pretrained writes the index last); a shard edited alone: `touch` the index to convert the "
                "set as it is (a minute after the touch, if nothing changes meanwhile)",
            )
            looks = -1  # said: no more lines until the set leaves this state
        if len(self._uncommitted_looks) > 10_000:
            self._uncommitted_looks.clear()
        self._uncommitted_looks[index] = looks + 1 if looks >= 0 else looks
        backoff = min(INCOMPLETE_MAX_RETRY, INCOMPLETE_FIRST_RETRY * 2.0 ** max(looks, 0))
        return later(backoff if looks >= 0 else INCOMPLETE_MAX_RETRY)

    def _converted_as_it_is(self, index: Path, info: os.stat_result) -> bool:
        """The index is the one this daemon converted the set with, not written since. (Shards it lists that
        went are then a save of fewer shards under way -- save_pretrained removes the old ones first and writes
        the new index last -- not shards still to come.)"""
        converted = self._converted_version(index)
        return converted is not None and converted.ino == info.st_ino and info.st_mtime_ns <= converted.mtime_ns

    def _missing_shards(self, watch: Watch, index: Path, stats: list[os.stat_result], missing: list[Path]) -> Outcome:
        """A shard the index lists is not there. While the set keeps changing it is waited for quietly: one
        `warning` line, then looks with backoff (its arrival brings the set back at once); after
        INCOMPLETE_GRACE_SECONDS without any change the set is refused once, naming what is missing, as a
        truncated file is. The set's next change (the shard arriving) is a new version, looked at anew."""
        names = ", ".join(p.name for p in missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        quiet = min(self.readiness.age(None, index, st) for st in stats)
        if quiet < INCOMPLETE_GRACE_SECONDS:
            looks = self._missing.get(index, 0)
            if looks == 0 and not self._converted_as_it_is(index, stats[0]):
                self._warn(watch.path, index, f"waiting for {names}, which the index lists and which is not there yet")
            if len(self._missing) > 10_000:
                self._missing.clear()
            self._missing[index] = looks + 1
            backoff = min(INCOMPLETE_MAX_RETRY, INCOMPLETE_FIRST_RETRY * 2.0**looks)
            return later(min(backoff, INCOMPLETE_GRACE_SECONDS - quiet + 0.1))
        self._missing.pop(index, None)
        version = set_version(stats)
        if self.state.failed_same_version(index, version):
            return SILENT
        from_format = _set_format(index)
        dest = ownership.set_destination(watch, index)
        direction = f"{from_format.short}->{converts_to(from_format).short}"
        base = {"watch": str(watch.path), "source": str(index), "dest": str(dest), "direction": direction}
        error = FormatError(
            f"the index lists {names}, not there after {INCOMPLETE_GRACE_SECONDS:.0f} s without any change",
            str(index),
        )
        return self._failed(index, version, error, base, time.monotonic())

    def _done_already(self, path: Path, version: FileStamp, dest: Path) -> bool:
        """Up to date, or failed already in this version (which was said once)."""
        return self.state.is_up_to_date(path, version, dest) or self.state.failed_same_version(path, version)

    def _not_regular(self, watch: Watch, path: Path, info: os.stat_result | None) -> Outcome:
        if info is None:
            return SILENT  # gone again (a scratch renamed away, a deleted file)
        # symlinks are never followed (they may point out of the tree); FIFOs, sockets, devices never opened
        kind = "a symlink" if stat.S_ISLNK(info.st_mode) else "not a regular file"
        version = FileStamp.of(info)
        if self.state.record_failure(path, version, f"skipped: {kind}", transient=False, kind="input"):
            self.synclog.log(Status.SKIPPED, watch=str(watch.path), source=str(path), reason=f"{kind}; not converted")
        return Outcome(Status.SKIPPED)

    # -- converting

    def _convert(
        self, watch: Watch, path: Path, version: FileStamp, dest: Path, from_format: Format, *, finished: bool
    ) -> Outcome:
        """`finished`: the writer is known to be done (its close or rename was seen, or nobody has the file
        open for writing); otherwise a file that does not read may be one still being written. On a shared
        filesystem the output's claim is taken first: while another node (or worker) holds it, nothing is
        done and the file is looked at again later."""
        direction = f"{from_format.short}->{converts_to(from_format).short}"
        job = _Job(watch, path, version, dest, from_format, finished, time.monotonic())
        job.base = {"watch": str(watch.path), "source": str(path), "dest": str(dest), "direction": direction}
        try:
            if ownership.is_own_output_converted_back(self.state, watch, path, dest):
                return SILENT
            claim = self._claim(job) if watch.path in self.shared else None
        except Exception as exc:
            return self._failed_or_later(path, version, exc, job.base, job.started, finished)
        if claim is _HELD:
            return later(self._claim_wait(job))
        if not isinstance(claim, claims.Claim):
            return self._decide_and_convert(job, None)
        with claim:
            self._claim_waits.pop(dest, None)
            self._remove_abandoned_scratch(dest)
            return self._decide_and_convert(job, claim)

    def _decide_and_convert(self, job: _Job, claim: claims.Claim | None) -> Outcome:
        watch, path, version, dest, base = job.watch, job.path, job.version, job.dest, job.base
        try:
            records = (claim.published(), claim.placing()) if claim is not None else (None, None)
            decision = ownership.decide(self.state, watch, path, version, dest, *records)
            if decision.action is Action.IN_SYNC:
                # published by another node, or placed by this one before it was killed, as a record proves:
                # adopted without reading the source, quietly
                earlier = ownership.earlier_output_elsewhere(self.state, path, dest, watch.mirror or watch.path)
                self.state.record(path, version, dest, status="in_sync", members=decision.set_files)
                self._remove_earlier_output(earlier, path, base)
                if decision.said is not None:  # a publish whose publisher died before logging it: said now
                    self.synclog.log(Status.IN_SYNC, **base, reason=decision.said)
                else:
                    log.debug("in_sync %s: %s is its conversion, as syncd's record shows", path, dest)
                return Outcome(Status.IN_SYNC)
            if decision.action is Action.SKIP:
                return self._skipped(path, version, base, "destination exists (on_exists: skip)")
            if decision.action is Action.VERIFY:
                result, decision = self._verify(job, claim)
                if result is None:
                    reason = "destination exists and is not this source's conversion (on_exists: skip)"
                    return self._skipped(path, version, base, reason + self._adopt_hint(path, dest, claim))
            elif decision.action is Action.CREATE and job.watch.on_exists == "skip":
                # a destination that appeared while converting (another writer; another source of the same
                # output, model.pt beside model.safetensors) is skipped as one found before would have been
                try:
                    result = self._run_engine(job, decision, claim)
                except ConflictError:
                    reason = "destination appeared while converting and is not this source's conversion"
                    return self._skipped(path, version, base, reason + " (on_exists: skip)")
            else:
                result = self._run_engine(job, decision, claim)
            published = _as_placed(dest, result)
        except Exception as exc:
            return self._failed_or_later(path, version, exc, base, job.started, job.finished)
        updated = decision.action is Action.REPLACE
        root = watch.mirror or watch.path
        return self._converted(
            path, version, dest, result, published, base, job.started, updated=updated, claim=claim, root=root
        )

    def _claim(self, job: _Job) -> claims.Claim | object | None:
        """The output's claim, _HELD while someone else has it, or None where the filesystem has no locks
        (said once per watch: every node then converts for itself, which the publish keeps safe)."""
        try:
            claim = claims.try_claim(job.dest)
        except claims.ClaimError as exc:
            if job.watch.path not in self._no_locks_said:
                self._no_locks_said.add(job.watch.path)
                self.synclog.log(
                    Status.ERROR,
                    watch=str(job.watch.path),
                    dest=str(job.dest),
                    error=f"{exc.strerror}: claims cannot be taken, so every node converts every checkpoint",
                    reason="mount the filesystem with file locks shared by every node (Lustre: -o flock)",
                )
            return None
        except OSError as exc:
            raise SyncdError.from_os_error(
                "cannot take the output's claim", str(claims.claim_path(job.dest)), exc
            ) from exc
        return _HELD if claim is None else claim

    def _claim_wait(self, job: _Job) -> float:
        """Seconds until a claim held by someone else is tried again: soon at first (a conversion on this
        node ends any moment), backing off to the cluster's poll interval. A claim held for longer than any
        conversion takes is said once: a holder that never lets go (a process of any user who may open the
        claim file, a dead node's lock an NFSv3 server still keeps) would otherwise keep the output stale, unseen."""
        if len(self._claim_waits) > 10_000:
            self._claim_waits.clear()
        now = self.clock()
        tries, since, said, last = self._claim_waits.get(job.dest, (0, now, False, now))
        if now - last > 2 * self.claim_retry_max + CLAIM_FIRST_RETRY:
            # not looked at since its last retry fell due (its source went: a trainer's rotation): a new wait
            tries, since, said = 0, now, False
        if not said and now - since >= CLAIM_HELD_WARNING_SECONDS:
            said = True
            self.synclog.log(
                Status.WARNING,
                **job.base,
                reason=f"the output's claim {claims.claim_path(job.dest)} has been held by another process for "
                f"{(now - since) / 60:.0f} min; nothing is converted into it until it is let go",
            )
        self._claim_waits[job.dest] = (tries + 1, since, said, now)
        return min(self.claim_retry_max, CLAIM_FIRST_RETRY * 2.0**tries)

    def _remove_abandoned_scratch(self, dest: Path) -> None:
        """Scratch files of `dest` no living process holds: a node that died converting it left them, and
        whoever takes its claim next removes them (only the claim holder writes scratch for `dest`)."""
        for path in remove_stale_scratch_of(dest, min_age=0.0):
            self.synclog.log(Status.REMOVED, source=str(path), reason="a scratch file of a syncd that died")

    def _adopt_hint(self, source: Path, dest: Path, claim: claims.Claim | None) -> str:
        """Said of a destination that names its source (a set: that lists the files the daemon writes) but
        holds other bytes: a user's edit, or syncd's output of an earlier version of the source saved while no
        record was kept (docs/daemon.md). Where a record of syncd's publish of it is still there (the state's,
        the claim's), no state was lost: the record shows the file changed since, someone's edit, and
        adopting it would make the next conversion replace it (a set's: delete its shards)."""
        row = self.state.get(source)
        recorded = row is not None and row.dest is not None and os.fsencode(row.dest) == os.fsencode(dest)
        if recorded or (claim is not None and claim.published() is not None):
            return "; it changed since syncd published it (its record shows), so it is someone else's now"
        config = f" -c {self.config_path}" if self.config_path else ""
        what = "it is a set" if is_set_index(dest) else "it names this source"
        return (
            f"; {what}: if it is syncd's output of an earlier version (a lost state directory), "
            f"`syncd retry{config} --adopt` makes it the daemon's again"
        )

    def _skipped(self, path: Path, version: FileStamp, base: dict, reason: str) -> Outcome:
        if self.state.record_failure(path, version, ownership.DESTINATION_EXISTS, transient=False, kind="config"):
            self.synclog.log(Status.SKIPPED, **base, reason=reason)
        return Outcome(Status.SKIPPED)

    def _verify(self, job: _Job, claim: claims.Claim | None) -> tuple[ConvertResult | None, ownership.Decision]:
        """A destination that names this source but has no record of ours: converted without replacing
        anything, the publish compares bytes -- the same bytes are in sync (and from now on ours); other bytes
        make it someone else's file, which `on_exists` decides about (None: skip it). Returns the result and
        the decision it was published under."""
        create = ownership.Decision(Action.CREATE)
        try:
            return self._run_engine(job, create, claim), create
        except ConflictError:
            decision = ownership.someone_elses(job.watch, job.dest)
            if decision.action is Action.SKIP:
                return None, decision
            if decision.action is not Action.OVERWRITE:
                raise
        return self._run_engine(job, decision, claim), decision

    def _run_engine(self, job: _Job, decision: ownership.Decision, claim: claims.Claim | None) -> ConvertResult:
        watch, path, dest = job.watch, job.path, job.dest
        if watch.mirror is not None:
            _make_mirror_dirs(watch, dest.parent)
        _check_inside(dest.parent, watch.mirror or watch.path)
        request = ConvertRequest(
            source=path,
            dest=dest,
            to_format=converts_to(job.from_format).name,
            layout=watch.layout,
            module_map=watch.module_map,
            overwrite=decision.action is Action.OVERWRITE,
            fail_early_if_exists=False,
            within=watch.path,
            replace_if=decision.replace_if,
            replace_set=decision.set_files,
            progress=self.progress_for(path),
            alive=self.alive_for(),
            sweep_scratch=False,  # (the start-up sweep and the rescans remove a dead syncd's scratch files)
            store=_store_options(watch),
            shard_size=watch.shard_size,
            always_index=watch.shard_size is not None,
            hash_name=self.hash_name,
            top_level_key=watch.top_level_key,
            before_placing=lambda path, output: self._record_placing(job, path, output, claim),
        )
        with self._collector.converting():
            return convert(request)

    def _record_placing(self, job: _Job, path: Path, output: FileStamp, claim: claims.Claim | None) -> None:
        """Record an output file about to be put in place (a set's: each of them), in the state and in the
        claim (for the other nodes, the output's own file): a daemon killed between placing it and recording
        the publish leaves a file no other record proves syncd's, which every later save of the source would
        then leave alone as someone else's."""
        self.state.record_placing(job.path, job.version, path, output)
        job.placed[path] = (output.ino, output.size, output.mtime_ns, output.ctime_ns)
        if claim is not None and (path == job.dest or is_set_index(job.dest)):
            # a set's shards are placed before its index: each record names every file placed so far
            placing = claims.Published(
                carry.file_label(job.path.name),
                ownership.source_stamp(job.version),
                job.placed.get(job.dest, claims.NOT_PLACED),
                node=claims.this_node(),
                members=tuple((file.name, stamp) for file, stamp in job.placed.items() if file != job.dest),
            )
            try:
                claim.record_placing(placing)
            except OSError as exc:  # placed all the same: only a kill right after it would then cost a conversion
                log.warning("%s: cannot record the output being placed at %s (%s)", claim.path, job.dest, exc.strerror)

    def _converted(
        self,
        path: Path,
        version: FileStamp,
        dest: Path,
        result: ConvertResult,
        published: dict[Path, os.stat_result],
        base: dict,
        started: float,
        *,
        updated: bool,
        claim: claims.Claim | None = None,
        root: Path,
    ) -> Outcome:
        """`published`: each output file as it is now (_as_placed), the record every later decision proves
        against."""
        if result.status == "in_sync":
            status = Status.IN_SYNC
        else:
            status = Status.UPDATED if updated and result.status == "replaced" else Status.CONVERTED
        dest_version = FileStamp.of(published[dest])
        recorded = "in_sync" if status is Status.IN_SYNC else "converted"
        # a set's files, each as published (its index included): what a later save may replace
        members = {file: FileStamp.of(published[file]) for file in result.files} if is_set_index(dest) else None
        earlier = ownership.earlier_output_elsewhere(self.state, path, dest, root)  # (before the record moves on)
        self.state.record(path, version, dest, dest_version=dest_version, status=recorded, members=members)
        if claim is not None:
            stamps = ownership.source_stamp(version), claims.stamp_of(published[dest])
            others = tuple((file.name, claims.stamp_of(published[file])) for file in (members or ()) if file != dest)
            try:
                record = claims.Published(carry.file_label(path.name), *stamps, node=claims.this_node(), members=others)
                claim.record(record)
            except OSError as exc:  # published all the same: the other nodes then verify it by converting
                log.warning("%s: cannot record the publish of %s (%s)", claim.path, dest, exc.strerror)
        self.readiness.converted(path)
        for gone in result.removed:
            why = f"a shard of the set published from {path.name} that its new layout no longer has"
            self.synclog.log(Status.REMOVED, watch=base["watch"], source=str(gone), reason=why)
        self._remove_earlier_output(earlier, path, base)
        self.synclog.log(
            status,
            **base,
            tensors=result.tensors,
            bytes=result.bytes,
            duration_ms=round((time.monotonic() - started) * 1000, 1),
            layout=[f"{result.source_layout} -> {result.target_layout}", *result.decisions],
            reason=_converted_reason(
                result, replaced_theirs=status is Status.CONVERTED and result.status == "replaced"
            ),
        )
        return Outcome(status)

    def _remove_earlier_output(self, earlier: ownership.EarlierOutput | None, path: Path, base: dict) -> None:
        """syncd's earlier output of `path` at another name, now that the new one is in place: removed, each
        file logged `removed`; or, where someone changed it, left with one warning (ownership.py)."""
        if earlier is None:
            return
        now = Path(base["dest"]).name
        why = f"syncd's earlier output of {path.name}, now published as {now} instead"
        for file, identity in earlier.unchanged.items():
            if remove_if_unchanged(file, identity):
                self.synclog.log(Status.REMOVED, watch=base["watch"], source=str(file), reason=why)
        if earlier.left:
            names = ", ".join(file.name for file in earlier.left)
            self.synclog.log(
                Status.WARNING,
                **base,
                reason=f"left {names}, syncd's earlier output of this source, now stale beside {now}: changed "
                "since syncd published it (someone else's now); remove it if nothing needs it",
            )

    def _failed_or_later(
        self, path: Path, version: FileStamp, exc: BaseException, base: dict, started: float, finished: bool
    ) -> Outcome:
        not_yet = self.readiness.not_ready_after(
            path, version, exc, finished, changed=lambda: self._set_changed_since(path, version)
        )
        if not_yet is not None:
            log.log(not_yet.level, "%s", not_yet.why)
            return later(not_yet.retry_in)
        return self._failed(path, version, exc, base, started)

    def _set_changed_since(self, path: Path, version: FileStamp) -> bool:
        """`path` is no longer as stamped in `version`: for a set's index, the set (the index and every shard
        it lists, as `set_version` stamps them: the index's own stamp never equals that)."""
        if not is_set_index(path):
            return changed_since(path, version)
        stats = [_lstat(file) for file in [path, *_members(path, self._index_files)]]
        present = [st for st in stats if st is not None]
        return len(present) < len(stats) or set_version(present).changed(version)

    def _failed(self, path: Path, version: FileStamp, exc: BaseException, base: dict, started: float) -> Outcome:
        status, transient = classify(exc)
        text = one_line(exc)
        kind = exc.kind if isinstance(exc, SyncdError) else "environment" if isinstance(exc, OSError) else None
        first = self.state.record_failure(path, version, text, transient=transient, kind=kind)
        if first:
            fields = {**base, "duration_ms": round((time.monotonic() - started) * 1000, 1), "error": text}
            reason = self._failure_reason(path, exc, status, transient)
            self.synclog.log(status, **fields, reason=reason)
        if status is Status.ERROR and not transient and not isinstance(exc, SyncdError | OSError):
            # a bug of ours: the traceback goes to the journal (the sync log's line already says what failed)
            log.error("%s: %s", path, text, exc_info=True)
        if transient:
            row = self.state.get(path)
            attempts = row.attempts if row else 1
            return Outcome(status, retry_in=min(MAX_BACKOFF_SECONDS, 2.0 ** min(attempts, 6)))
        return Outcome(status)

    def _failure_reason(self, path: Path, exc: BaseException, status: Status, transient: bool) -> str | None:
        """What a person can do about a failure, for its sync log line."""
        suggestion = getattr(exc, "suggestion", None)
        if suggestion:
            return "module map that would settle it:\n" + suggestion
        if isinstance(exc, IncompleteFileError):
            # (the error says what is missing; this, why the daemon stopped waiting for it: an empty file too)
            return f"still incomplete after {INCOMPLETE_GRACE_SECONDS:.0f} s without a change: not being written"
        if status is Status.SKIPPED and os.path.lexists(path) and not os.access(path, os.R_OK):
            return _unreadable_reason(path, self.config_path)
        if transient:
            return "will retry"
        if status is Status.ERROR:  # (a permission refused, a directory made immutable...): an operator's fix
            config = f" -c {shlex.quote(os.fspath(self.config_path))}" if self.config_path else ""
            again = f"syncd retry{config} {shlex.quote(os.fspath(path))}"
            return f"looked at again when the file changes; once the cause is fixed, `{again}`"
        return None


def classify(exc: BaseException) -> tuple[Status, bool]:
    """(sync log status, transient?) for a failure, read from the kind the error declared where it was raised
    (syncd/errors.py); an OSError that escaped undeclared counts as the environment's."""
    if isinstance(exc, AlreadyExistsError):
        return Status.CONFLICT, False
    if isinstance(exc, OSError):
        return Status.ERROR, exc.errno in TRANSIENT_ERRNOS
    if not isinstance(exc, SyncdError):
        return Status.ERROR, False  # a bug: logged with its traceback
    if exc.kind == "environment":
        if isinstance(exc, FormatError) and not exc.transient:
            return Status.SKIPPED, False  # unreadable for us: reported once, not an error in the file
        return Status.ERROR, exc.transient
    if isinstance(exc, FormatError | UnsupportedError | AmbiguousLayoutError | VerificationError):
        return Status.REFUSED, exc.transient
    return Status.ERROR, exc.transient


def _converted_reason(result: ConvertResult, *, replaced_theirs: bool) -> str | None:
    """What a conversion's line says beside its status: a file someone else made replaced (on_exists:
    overwrite: the audit trail of what was lost), what `syncd convert` says without -v (what of a PyTorch
    checkpoint was taken and left, guesses by convention, a remap rule that matched nothing, index gaps Burn
    cannot load), tensors carried or restored."""
    parts = []
    if replaced_theirs:
        parts.append("replaced the file that was there, not syncd's (on_exists: overwrite)")
    parts += [*result.source_notes, *result.notes]
    if result.dropped:
        parts.append(f"carried in metadata (no Burn slot): {', '.join(result.dropped)}")
    if result.restored:
        parts.append(f"restored from metadata: {', '.join(result.restored)}")
    return "; ".join(parts) or None


def _unreadable_reason(path: Path, config_path: Path | None) -> str:
    """A file the daemon's user may not read: what heals it (a chmod, noticed by itself; `syncd retry` at
    once) and what serves files only their writer may read (the service instance running as that writer)."""
    me = _user_name(os.geteuid())
    try:
        owner = _user_name(os.lstat(path).st_uid)
    except OSError:
        owner = "OWNER"
    config = f" -c {config_path}" if config_path is not None else ""
    return (
        f"{me} may not read it; once its mode lets {me} read it, it is converted (the change is noticed; "
        f"`syncd retry{config} PATH` asks at once); for checkpoints only their writer may read, run "
        f"syncd@{owner}.service, which runs as {owner}"
    )


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _as_placed(dest: Path, result: ConvertResult) -> dict[Path, os.stat_result]:
    """Each output file as it is now, once it is checked to be the very file the conversion put there: a
    writer that renamed its own file over the path right after syncd placed its output must not have that
    file recorded as syncd's (every later save of the source would then replace it). Compared by file and
    size, not by timestamps, which a network file system's cached attributes may give differently through
    the descriptor and the path. A file found already holding the output's bytes was not placed, and is
    taken as it is."""
    now = {file: os.lstat(file) for file in dict.fromkeys([dest, *result.files])}
    for file, placed in result.placed.items():
        info = now.get(file)
        if info is not None and (info.st_dev, info.st_ino, info.st_size) != (placed.dev, placed.ino, placed.size):
            raise ConflictError(
                "replaced by another writer right after syncd put its output there: that file is someone "
                "else's, and is not recorded as syncd's",
                str(file),
            )
    return now


def _lstat(path: Path) -> os.stat_result | None:
    """The file's own stat (never through a symlink); None when it is gone."""
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _set_index_of(path: Path, known: IndexFiles) -> Path | None:
    """The index of the sharded set `path` belongs to (`path` itself for an index), None for a single file.
    `known`: each index parsed once per version."""
    if is_set_index(path):
        known.forget(os.path.dirname(os.path.abspath(path)))  # the shards beside it are its from now on
        return path
    from_format = format_for_path(path)
    if from_format is None or from_format.name not in (SAFETENSORS, PYTORCH):
        return None
    index = index_listing(path, known)
    return None if index is None else Path(index)


def _awaits_index(path: Path) -> bool:
    """A shard no index lists yet: save_pretrained writes the index last, and its arrival brings the set."""
    from_format = format_for_path(path)
    return from_format is not None and from_format.name in (SAFETENSORS, PYTORCH) and looks_like_shard(path.name)


def _set_format(index: Path) -> Format:
    """What a set's shards are: torch.save `.bin` files for a `*.bin.index.json`, else safetensors."""
    return BY_NAME[PYTORCH if shard_extension(index) == ".bin" else SAFETENSORS]


def _members(index: Path, known: IndexFiles) -> list[Path]:
    """The shards an index lists; none for a broken (or half-written) index: the conversion reports it, or it
    is retried."""
    return [Path(p) for p in member_files(index, known)]


def _store_options(watch: Watch) -> StoreOptions:
    """The watch's remap/filter/precision settings (validated when the config was loaded)."""
    return StoreOptions(
        tuple(compile_rule(p, r) for p, r in watch.remap),
        watch.map_indices_contiguous,
        TensorFilter.of(watch.tensor_include, watch.tensor_exclude),
        watch.precision,
    )


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
