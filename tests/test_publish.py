"""Atomic, no-replace publishing: real files, real processes, real signals; no mocked file system."""

from __future__ import annotations

import errno
import fcntl
import multiprocessing
import os
import random
import signal
import stat
import subprocess
import sys
import time
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from pathlib import Path

import pytest
from conftest import REPO

from syncd.engine import publish as pub
from syncd.engine.publish import (
    Scratch,
    ensure_destination_free,
    is_scratch_name,
    open_scratch,
    publish,
    remove_stale_scratch,
)
from syncd.errors import AlreadyExistsError, ConflictError, SyncdError
from syncd.formats.fileio import FileStamp

MIB = 1 << 20

# Runs in a separate interpreter so that kills and races involve real processes. Modes:
#   slow DEST MIB   -- write MIB MiB, say "half" halfway and wait for a line on stdin, then publish
#   put DEST SIZE SEED -- say "open" once the scratch exists, write content(SEED, SIZE), publish
# Prints "result <status>" or "error <ExceptionClass> <message>".
WORKER = r"""
import os, random, sys
from pathlib import Path
from syncd.errors import SyncdError
from syncd.engine.publish import ensure_destination_free, open_scratch, publish

def content(seed, size):
    return random.Random(seed).randbytes(size)

def write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]

mode, dest = sys.argv[1], Path(sys.argv[2])
try:
    ensure_destination_free(dest)
    with open_scratch(dest, 0o640) as scratch:
        if mode == "slow":
            chunks = int(sys.argv[3])
            for i in range(chunks):
                if i == chunks // 2:
                    print("half", flush=True)
                    sys.stdin.readline()
                write_all(scratch.fd, bytes([i % 251]) * (1 << 20))
        else:
            print("open", flush=True)
            data = memoryview(content(int(sys.argv[4]), int(sys.argv[3])))
            for start in range(0, len(data), 1 << 16):
                write_all(scratch.fd, data[start:start + (1 << 16)])
        result = publish(scratch, source=Path("source.safetensors"))
    print("result", result.status, flush=True)
except SyncdError as e:
    print("error", type(e).__name__, e, flush=True)
"""


def _content(seed: int, size: int) -> bytes:
    """Same bytes as the worker's `content` (a mismatch would fail the tests that use both)."""
    return random.Random(seed).randbytes(size)


def _spawn(*args: object) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen(
        [sys.executable, "-c", WORKER, *map(str, args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def _scratch_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if is_scratch_name(p.name))


def _append(scratch: Scratch, data: bytes) -> None:
    """Append all of `data` to the scratch file as a writer does, naming the output in its error as convert
    does (the package's writers take `scratch.fd`)."""
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(scratch.fd, view) :]
    except OSError as e:
        raise SyncdError(f"cannot write the output being built ({e.strerror})", str(scratch.dest)) from e


def _write_file(path: Path, data: bytes) -> os.stat_result:
    path.write_bytes(data)
    return path.stat()


def _publish_bytes(dest: Path, data: bytes, *, replace: bool = False, mode: int = 0o644) -> pub.PublishResult:
    with open_scratch(dest, mode) as scratch:
        _append(scratch, data)
        return publish(scratch, replace=replace, source=Path("in.safetensors"))


def _dead_pid() -> int:
    """A pid that belonged to a process that has exited (and was reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


# --- races between processes -----------------------------------------------------------------------------


def test_destination_created_during_slow_write_is_not_replaced(tmp_path: Path) -> None:
    dest = tmp_path / "model.bpk"
    writer = _spawn("slow", dest, 200)
    try:
        assert writer.stdout is not None and writer.stdin is not None
        assert writer.stdout.readline() == "half\n"
        # The early check has passed and the scratch file is half written: the race window is open.
        [scratch] = _scratch_files(tmp_path)
        assert scratch.stat().st_size == 100 * MIB
        theirs = b"another writer's checkpoint\n" * 5000
        subprocess.run(
            [sys.executable, "-c", "import sys; open(sys.argv[1], 'xb').write(sys.stdin.buffer.read())", dest],
            input=theirs,
            check=True,
        )
        writer.stdin.write("go\n")
        writer.stdin.flush()
        out, _ = writer.communicate(timeout=60)
    finally:
        writer.kill()
        writer.wait()
    # A regular file with other bytes: the AlreadyExistsError subclass that says so.
    assert out.startswith("error ConflictError "), out
    assert str(dest) in out and "--overwrite" in out
    assert dest.read_bytes() == theirs
    assert _scratch_files(tmp_path) == []


CONTENDERS = 8
ROUNDS = 50


def _round_content(worker: int, rnd: int) -> bytes:
    if rnd % 10 == 0:  # every tenth round everyone publishes the same bytes
        return f"round {rnd}, shared;".encode() * 8000
    return f"round {rnd}, worker {worker};".encode() * 8000


def _contender(worker: int, dest: Path, barrier: Barrier, results: Queue) -> None:
    for rnd in range(ROUNDS):
        barrier.wait(timeout=30)
        try:
            result = _publish_bytes(dest, _round_content(worker, rnd))
            outcome = result.status
        except AlreadyExistsError as e:
            outcome = type(e).__name__
        except BaseException as e:  # report it instead of dying silently and breaking the barrier
            outcome = f"unexpected {e!r}"
        results.put((rnd, worker, outcome))
        barrier.wait(timeout=30)


def test_concurrent_publishers_exactly_one_wins_each_round(tmp_path: Path) -> None:
    dest = tmp_path / "model.safetensors"
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(CONTENDERS + 1)
    results = ctx.Queue()
    procs = [ctx.Process(target=_contender, args=(i, dest, barrier, results)) for i in range(CONTENDERS)]
    for proc in procs:
        proc.start()
    try:
        for rnd in range(ROUNDS):
            barrier.wait(timeout=30)  # start the round
            barrier.wait(timeout=30)  # everyone has published or lost
            outcomes = {}
            for _ in range(CONTENDERS):
                got_round, worker, outcome = results.get(timeout=30)
                assert got_round == rnd
                outcomes[worker] = outcome
            winners = [w for w, o in outcomes.items() if o == "published"]
            assert len(winners) == 1, outcomes
            losers = sorted(o for w, o in outcomes.items() if w != winners[0])
            assert losers == ["in_sync" if rnd % 10 == 0 else "ConflictError"] * (CONTENDERS - 1), outcomes
            assert dest.read_bytes() == _round_content(winners[0], rnd)
            assert _scratch_files(tmp_path) == []
            dest.unlink()  # only the main process touches dest between the barriers
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    assert all(proc.exitcode == 0 for proc in procs)


@pytest.mark.root
@pytest.mark.slow
def test_sigkill_at_random_moments_never_leaves_a_partial_destination(tmp_path: Path) -> None:
    size = 4 * MIB
    rng = random.Random(20240604)

    def run(dest: Path, seed: int, kill_after: float | None) -> subprocess.Popen[str]:
        proc = _spawn("put", dest, size, seed)
        assert proc.stdout is not None
        assert proc.stdout.readline() == "open\n"
        if kill_after is not None:
            time.sleep(kill_after)
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        return proc

    # How long from "scratch open" to done, so that kill times spread over write, fsync and link.
    started = time.monotonic()
    assert run(tmp_path / "calibration.bpk", 99, None).returncode == 0
    span = time.monotonic() - started
    assert (tmp_path / "calibration.bpk").read_bytes() == _content(99, size)

    killed_pids = []
    for i in range(30):
        proc = run(tmp_path / f"model-{i}.bpk", i, rng.uniform(0, span * 1.2))
        killed_pids.append(proc.pid)
    for i in range(30):
        dest = tmp_path / f"model-{i}.bpk"
        if dest.exists():
            assert dest.read_bytes() == _content(i, size), f"{dest} is partial"

    leftovers = set(_scratch_files(tmp_path))
    assert leftovers, "no kill landed before the publish; the test did not exercise anything"
    assert {int(p.name.split("-")[-2]) for p in leftovers} <= set(killed_pids)

    # Files remove_stale_scratch must leave alone.
    dead = _dead_pid()
    keep = [
        tmp_path / f".x.bpk.syncd-{os.getpid()}-0.tmp",  # a live process's scratch
        tmp_path / "x.bpk.123-0.tmp",  # Burn's scratch naming
        tmp_path / f".y.bpk.syncd-{dead}-0.tmp",  # dead pid, but a symlink
        tmp_path / f".z.bpk.syncd-{dead}-1.tmp",  # dead pid, but someone else's file
    ]
    keep[0].write_bytes(b"live")
    live = os.open(keep[0], os.O_RDONLY)
    fcntl.flock(live, fcntl.LOCK_EX)  # a living holder, as open_scratch takes
    keep[1].write_bytes(b"burn")
    keep[2].symlink_to(tmp_path / "calibration.bpk")
    keep[3].write_bytes(b"other user")
    os.chown(keep[3], 65534, 65534)

    empty = {p for p in leftovers if p.stat().st_size == 0}  # (as one made and not locked yet: kept a while)
    assert set(remove_stale_scratch(tmp_path)) == leftovers - empty
    os.close(live)
    assert all(os.path.lexists(p) for p in keep)
    assert set(_scratch_files(tmp_path)) == {keep[0], keep[2], keep[3], *empty}
    assert (tmp_path / "calibration.bpk").read_bytes() == _content(99, size)


# --- failures before publishing ---------------------------------------------------------------------------


@pytest.mark.root
@pytest.mark.parametrize("replace", [False, True])
def test_enospc_midway_keeps_previous_destination(small_fs: Path, replace: bool) -> None:
    dest = small_fs / "model.bpk"
    before = _write_file(dest, b"previous good checkpoint" * 10000)
    with pytest.raises(SyncdError) as info, open_scratch(dest) as scratch:
        for _ in range(4):
            _append(scratch, b"\xab" * (256 << 10))
        publish(scratch, replace=replace)
    assert isinstance(info.value.__cause__, OSError)
    assert info.value.__cause__.errno == errno.ENOSPC
    assert str(dest) in str(info.value) and "\n" not in str(info.value)
    assert dest.read_bytes() == b"previous good checkpoint" * 10000
    assert dest.stat().st_ino == before.st_ino
    assert _scratch_files(small_fs) == []


def test_keyboard_interrupt_midway_removes_scratch(tmp_path: Path) -> None:
    dest = tmp_path / "model.bpk"
    _write_file(dest, b"old")
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt), open_scratch(dest) as scratch:
            _append(scratch, b"x" * MIB)
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # the handler runs between bytecodes; give it some
                time.sleep(0.001)
            publish(scratch, replace=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert dest.read_bytes() == b"old"
    assert _scratch_files(tmp_path) == []


def test_scratch_left_unpublished_is_removed(tmp_path: Path) -> None:
    dest = tmp_path / "model.bpk"
    with open_scratch(dest) as scratch:
        _append(scratch, b"data")
        assert scratch.path.parent == tmp_path and is_scratch_name(scratch.path.name)
    assert list(tmp_path.iterdir()) == []


# --- symlinks ---------------------------------------------------------------------------------------------


def test_symlinks_planted_at_scratch_names_are_never_followed(tmp_path: Path) -> None:
    dest = tmp_path / "model.bpk"
    target = tmp_path / "victim"
    before = _write_file(target, b"victim's data")
    # Predict the names: the counter is process-wide and this test is single-threaded.
    n = next(pub._counter) + 1
    planted = [tmp_path / f".model.bpk.syncd-{os.getpid()}-{n + k}.tmp" for k in range(6)]
    for link in planted[:5]:
        link.symlink_to(target)
    planted[5].symlink_to(tmp_path / "nowhere")  # dangling: O_CREAT must not create its target
    with open_scratch(dest, 0o600) as scratch:
        assert scratch.path.name == f".model.bpk.syncd-{os.getpid()}-{n + 6}.tmp"
        _append(scratch, b"new")
        assert publish(scratch).status == "published"
    assert dest.read_bytes() == b"new"
    assert target.read_bytes() == b"victim's data"
    assert stat.S_IMODE(target.stat().st_mode) == stat.S_IMODE(before.st_mode)
    assert not (tmp_path / "nowhere").exists()
    assert all(link.is_symlink() for link in planted)


def test_symlink_destination_without_replace_is_left_alone(tmp_path: Path) -> None:
    dest = tmp_path / "model.bpk"
    target = tmp_path / "victim"
    _write_file(target, b"same bytes")  # even identical content through a symlink is not "in sync"
    dest.symlink_to(target)
    with pytest.raises(AlreadyExistsError) as info:
        ensure_destination_free(dest)
    assert str(info.value) == f"{dest}: file already exists. To replace it, use --overwrite (on_exists: overwrite)."
    with pytest.raises(AlreadyExistsError) as info:
        _publish_bytes(dest, b"same bytes")
    assert not isinstance(info.value, ConflictError)
    assert dest.is_symlink() and target.read_bytes() == b"same bytes"
    assert _scratch_files(tmp_path) == []


def test_dangling_symlink_destination_is_not_followed(tmp_path: Path) -> None:
    dest = tmp_path / "model.bpk"
    dest.symlink_to(tmp_path / "nowhere")
    with pytest.raises(AlreadyExistsError):
        ensure_destination_free(dest)
    with pytest.raises(AlreadyExistsError):
        _publish_bytes(dest, b"data")
    assert dest.is_symlink() and not (tmp_path / "nowhere").exists()
    assert _scratch_files(tmp_path) == []


def test_replace_replaces_the_symlink_not_its_target(tmp_path: Path) -> None:
    dest = tmp_path / "model.bpk"
    target = tmp_path / "victim"
    _write_file(target, b"victim's data")
    dest.symlink_to(target)
    assert _publish_bytes(dest, b"new", replace=True).status == "replaced"
    assert not dest.is_symlink() and dest.read_bytes() == b"new"
    assert target.read_bytes() == b"victim's data"


# --- publishing outcomes ----------------------------------------------------------------------------------


def test_publish_new_and_replace(tmp_path: Path) -> None:
    """The result names the file it put in place, exactly as that file then is (what the daemon records)."""
    dest = tmp_path / "model.bpk"
    ensure_destination_free(dest)
    assert _publish_bytes(dest, b"one") == pub.PublishResult("published", dest, placed=FileStamp.of_path(dest))
    assert _publish_bytes(tmp_path / "other.bpk", b"x", replace=True).status == "published"
    assert _publish_bytes(dest, b"two", replace=True) == pub.PublishResult(
        "replaced", dest, placed=FileStamp.of_path(dest)
    )
    assert dest.read_bytes() == b"two"
    assert _scratch_files(tmp_path) == []


def test_identical_destination_is_in_sync_and_untouched(tmp_path: Path) -> None:
    dest = tmp_path / "model.bpk"
    data = _content(1, 3 * MIB + 5)  # more than one comparison chunk
    before = _write_file(dest, data)
    assert _publish_bytes(dest, data) == pub.PublishResult("in_sync", dest)
    after = dest.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert _scratch_files(tmp_path) == []


@pytest.mark.parametrize("theirs_tail", [b"Y", b"", b"XX"], ids=["same-size", "shorter", "longer"])
def test_different_destination_is_a_conflict(tmp_path: Path, theirs_tail: bytes) -> None:
    dest = tmp_path / "model.bpk"
    ours = _content(2, 2 * MIB) + b"X"
    theirs = ours[:-1] + theirs_tail
    _write_file(dest, theirs)
    with pytest.raises(ConflictError) as info:
        _publish_bytes(dest, ours)
    message = str(info.value)
    assert message.startswith(f"{dest}: ") and "in.safetensors" in message and "\n" not in message
    assert info.value.exit_code == AlreadyExistsError.exit_code
    assert dest.read_bytes() == theirs
    assert _scratch_files(tmp_path) == []


def test_link_that_reports_eexist_after_succeeding_is_a_success(tmp_path: Path) -> None:
    # NFS replays a link whose reply was lost: the destination is already our scratch inode.
    dest = tmp_path / "model.bpk"
    with open_scratch(dest) as scratch:
        _append(scratch, b"ours")
        os.link(scratch.path, dest)
        assert publish(scratch).status == "published"
    assert dest.read_bytes() == b"ours"
    assert _scratch_files(tmp_path) == []


# --- without hard links: renameat2(RENAME_NOREPLACE); other file systems stood in by PlacingCalls ---------


class NoHardLinks(pub.PlacingCalls):
    """A file system without hard links (vfat, some FUSE and network file systems): link(2) fails with
    `error`, as theirs do; the rename without replace is the kernel's own."""

    def __init__(self, error: int = errno.EPERM) -> None:
        self.error = error

    def link(self, src: Path, dst: Path) -> None:
        raise OSError(self.error, os.strerror(self.error), str(src), None, str(dst))


class NoHardLinksNorRenameat2(NoHardLinks):
    """... on a kernel or file system that refuses renameat2's RENAME_NOREPLACE too (EINVAL)."""

    def rename_noreplace(self, src: Path, dst: Path) -> None:
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), str(src), None, str(dst))


def _publish_with(calls: pub.PlacingCalls, dest: Path, data: bytes) -> pub.PublishResult:
    with open_scratch(dest) as scratch:
        _append(scratch, data)
        return publish(scratch, source=Path("in.safetensors"), calls=calls)


@pytest.mark.parametrize("error", [errno.EPERM, errno.ENOTSUP, errno.EXDEV, errno.EMLINK], ids=errno.errorcode.get)
def test_without_hard_links_a_rename_that_never_replaces_publishes(tmp_path: Path, error: int) -> None:
    dest = tmp_path / "model.bpk"
    calls = NoHardLinks(error)
    assert _publish_with(calls, dest, b"first").status == "published"
    before = dest.stat()
    assert _publish_with(calls, dest, b"first").status == "in_sync"
    with pytest.raises(ConflictError):
        _publish_with(calls, dest, b"second")
    assert dest.read_bytes() == b"first" and dest.stat().st_ino == before.st_ino
    assert list(tmp_path.iterdir()) == [dest]


def test_without_hard_links_or_renameat2_nothing_is_published_and_it_says_why(tmp_path: Path) -> None:
    dest = tmp_path / "model.bpk"
    with pytest.raises(SyncdError) as info:
        _publish_with(NoHardLinksNorRenameat2(), dest, b"data")
    assert str(info.value).startswith(f"{dest}: this file system supports neither hard links nor rename-without")
    assert "--overwrite" in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_a_link_that_fails_for_another_reason_is_an_error_naming_the_destination(tmp_path: Path) -> None:
    dest = tmp_path / "model.bpk"
    with pytest.raises(SyncdError) as info:
        _publish_with(NoHardLinks(errno.EIO), dest, b"data")
    assert str(info.value).startswith(f"{dest}: cannot link the finished output into place")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("via_syscall", [False, True], ids=["libc", "syscall"])
def test_renameat2_never_replaces(tmp_path: Path, via_syscall: bool) -> None:
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    a.write_bytes(b"a")
    b.write_bytes(b"b")
    with pytest.raises(FileExistsError):
        pub._renameat2(a, b, pub._RENAME_NOREPLACE, via_syscall=via_syscall)
    assert (a.read_bytes(), b.read_bytes()) == (b"a", b"b")
    pub._renameat2(a, c, pub._RENAME_NOREPLACE, via_syscall=via_syscall)
    assert not a.exists() and c.read_bytes() == b"a"
    with pytest.raises(OSError) as info:  # errno reaches the caller, as the unsupported check needs
        pub._renameat2(c, a, 1 << 30, via_syscall=via_syscall)
    assert info.value.errno == errno.EINVAL


# --- modes and names --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("umask", "mode", "expected"),
    [(0o077, 0o644, 0o644), (0o000, 0o600, 0o600), (0o022, 0o4775, 0o775), (0o777, 0o640, 0o640)],
)
@pytest.mark.parametrize("replace", [False, True])
def test_mode_is_exactly_the_requested_bits(
    tmp_path: Path, umask: int, mode: int, expected: int, replace: bool
) -> None:
    dest = tmp_path / "model.bpk"
    old = os.umask(umask)
    try:
        with open_scratch(dest, mode) as scratch:
            assert stat.S_IMODE(os.fstat(scratch.fd).st_mode) == expected
            _append(scratch, b"data")
            publish(scratch, replace=replace)
    finally:
        os.umask(old)
    assert stat.S_IMODE(dest.stat().st_mode) == expected


def test_long_destination_name_still_gets_a_scratch_file(tmp_path: Path) -> None:
    dest = tmp_path / ("é" * 120 + ".bpk")  # 244 bytes: the scratch name must be shortened to fit
    assert _publish_bytes(dest, b"data").status == "published"
    assert dest.read_bytes() == b"data"
    assert list(tmp_path.iterdir()) == [dest]


def test_is_scratch_name() -> None:
    assert is_scratch_name(".model.bpk.syncd-4242-0.tmp")
    assert is_scratch_name(".a.b.syncd-1-17.tmp")
    assert not is_scratch_name("model.bpk.4242-0.tmp")  # Burn's scratch
    assert not is_scratch_name("model.bpk.syncd-4242-0.tmp")  # not hidden
    assert not is_scratch_name(".model.bpk.syncd-42x-0.tmp")
    assert not is_scratch_name(".model.bpk.syncd-4242-0.tmp.bak")
    assert not is_scratch_name("model.bpk")


def test_a_scratch_is_stale_exactly_when_nobody_holds_its_lock_whatever_its_pid(tmp_path: Path) -> None:
    # pids decide nothing: another PID namespace reuses them, PID 1 is always alive
    unheld = [tmp_path / f".a.syncd-{10**30}-0.tmp", tmp_path / ".b.syncd-1-0.tmp", tmp_path / ".c.syncd-0-0.tmp"]
    for path in unheld:
        path.write_bytes(b"x")
    # an empty one just made may be another node's, made and not locked yet: a daemon's start-up sweep took it
    # from a live conversion (CI: a second daemon started while the first was between creating and locking)
    fresh = tmp_path / ".e.syncd-7-0.tmp"
    fresh.write_bytes(b"")
    with open_scratch(tmp_path / "d.bpk") as held:  # a live scratch, this process's own
        assert sorted(remove_stale_scratch(tmp_path)) == sorted(unheld)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([held.path.name, fresh.name])
