"""Path and resource safety of the running daemon: symlinks, FIFOs, odd names, permission bits,
deep and large trees. Everything runs the real daemon on real files."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from daemonutil import NOBODY, DaemonRun, runnable_by_others, scratch_files, stop_cleanly, wait_until

from syncd.daemon.claims import Published, claim_path, stamp_of
from syncd.engine.convert import ConvertRequest, convert
from syncd.formats import open_checkpoint

pytestmark = pytest.mark.daemon


def write_checkpoint(path: Path, seed: int = 0, mode: int | None = None) -> Path:
    rng = np.random.default_rng(seed)
    tensors = {"fc.weight": rng.standard_normal((3, 5), dtype=np.float32), "fc.bias": np.zeros(3, np.float32)}
    data = safetensors.numpy.save(tensors)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(data)
    if mode is not None:
        os.chmod(path, mode)
    return path


def files_below(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")}


def test_symlinks_are_never_followed_out_of_the_tree(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    secret = write_checkpoint(outside / "secret.safetensors", seed=1)
    before = files_below(outside)
    with DaemonRun(tmp_path / "d") as run:
        runs = run.watch_dir()
        (runs / "link.safetensors").symlink_to(secret)
        (runs / "linked_dir").symlink_to(outside, target_is_directory=True)
        run.start()
        sentinel = write_checkpoint(runs / "sentinel.safetensors")
        run.wait_for("converted", [sentinel])
        run.wait_for("skipped", [runs / "link.safetensors"])
        run.quiet(0.5)
        assert files_below(outside) == before  # nothing read into or written beside the outside tree
        assert not (runs / "link.bpk").exists()
        assert not run.statuses(source=runs / "linked_dir" / "secret.safetensors")
        stop_cleanly(run)


def test_a_fifo_named_like_a_checkpoint_does_not_block_a_worker(tmp_path: Path) -> None:
    with DaemonRun(tmp_path / "d", workers=1) as run:
        runs = run.watch_dir()
        os.mkfifo(runs / "early.safetensors")
        run.start()
        os.mkfifo(runs / "late.safetensors")
        good = write_checkpoint(runs / "good.safetensors")
        run.wait_for("converted", [good], timeout=10)
        run.wait_for("skipped", [runs / "early.safetensors", runs / "late.safetensors"], timeout=10)
        stop_cleanly(run)


def test_names_with_spaces_newlines_and_non_utf8_bytes(tmp_path: Path) -> None:
    names = [b"with space.safetensors", b"new\nline.safetensors", b"caf\xe9-latin1.safetensors"]
    with DaemonRun(tmp_path / "d") as run:
        runs = run.watch_dir()
        run.start()
        raw_runs = os.fsencode(runs)
        for i, name in enumerate(names):
            write_checkpoint(Path(os.fsdecode(raw_runs + b"/" + name)), seed=i)
        sources = [Path(os.fsdecode(raw_runs + b"/" + name)) for name in names]
        run.wait_for("converted", sources)
        for name in names:
            output = raw_runs + b"/" + name.replace(b".safetensors", b".bpk")
            assert os.path.exists(output)
            with open_checkpoint(os.fsdecode(output)) as reader:
                assert {t.name for t in reader.tensors} == {"fc.weight", "fc.bias"}
        # the log keeps every name exactly (fsdecode'd, surrogates and all)
        logged = {os.fsencode(r["source"]) for r in run.statuses("converted")}
        assert {raw_runs + b"/" + name for name in names} <= logged
        stop_cleanly(run)


def test_outputs_get_the_source_permission_bits_never_wider(tmp_path: Path) -> None:
    with DaemonRun(tmp_path / "d") as run:
        runs = run.watch_dir()
        run.start()
        private = write_checkpoint(runs / "private.safetensors", mode=0o600)
        shared = write_checkpoint(runs / "shared.safetensors", seed=1, mode=0o640)
        run.wait_for("converted", [private, shared])
        assert stat.S_IMODE(os.stat(runs / "private.bpk").st_mode) == 0o600
        assert stat.S_IMODE(os.stat(runs / "shared.bpk").st_mode) == 0o640
        stop_cleanly(run)


def test_a_mirror_subdirectory_that_is_a_symlink_is_not_written_through(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    with DaemonRun(tmp_path / "d", watches=[{"path": "runs", "output": {"mirror": "out"}}]) as run:
        runs, mirror = run.watch_dir(), run.watch_dir("out")
        (mirror / "exp").symlink_to(outside, target_is_directory=True)
        run.start()
        source = write_checkpoint(runs / "exp" / "model.safetensors")
        run.wait_for("error", [source])
        assert list(outside.iterdir()) == []
        assert not scratch_files(mirror, outside)
        stop_cleanly(run)


@pytest.mark.root
def test_a_claim_record_planted_by_another_user_does_not_make_their_victims_file_syncds(tmp_path: Path) -> None:
    """Anyone who may create files in a shared tree can stat any file there and write a claim record naming
    it as syncd's output of a checkpoint of theirs: the record proves nothing, and the file is not replaced."""
    run = DaemonRun(
        tmp_path,
        [{"path": "runs", "direction": "bpk->safetensors", "layout": "keep"}],
        cluster={"shared": True, "poll_interval": 1},
        unleased_settle_seconds=1,
    )
    runs = run.watch_dir()
    os.chmod(runs, 0o1777)
    victim = runs / "model.safetensors"
    victim.write_bytes(b"root's own file")
    os.chmod(victim, 0o600)
    record = Published("model.bpk", (1, 2, 3, 4), stamp_of(os.lstat(victim)), node="elsewhere")
    planted = claim_path(victim)
    planted.write_bytes(record.to_bytes())
    os.chown(planted, NOBODY, NOBODY)
    source = write_checkpoint(tmp_path / "theirs.safetensors")
    checkpoint = tmp_path / "model.bpk"
    convert(ConvertRequest(source=source, dest=checkpoint, layout="keep"))
    os.chown(checkpoint, NOBODY, NOBODY)
    os.rename(checkpoint, runs / "model.bpk")
    with run:
        run.start()
        run.wait_for("skipped", [runs / "model.bpk"])
        stop_cleanly(run)
    assert victim.read_bytes() == b"root's own file"


def test_a_tree_deeper_than_the_limit_is_reported_and_the_rest_served(tmp_path: Path) -> None:
    with DaemonRun(tmp_path / "d") as run:
        runs = run.watch_dir()
        deep = runs.joinpath(*(f"d{i}" for i in range(70)))
        deep.mkdir(parents=True)
        buried = write_checkpoint(deep / "buried.safetensors")
        top = write_checkpoint(runs / "top.safetensors")
        run.start()
        run.wait_for("converted", [top])
        limit = [r for r in run.statuses("skipped") if "deeper than" in r.get("reason", "")]
        assert limit, run.log_text()
        assert not run.statuses("converted", buried)  # not reached by the start-up scan
        stop_cleanly(run)


@pytest.mark.slow
def test_a_hundred_thousand_files_do_not_exhaust_memory(tmp_path: Path) -> None:
    with DaemonRun(tmp_path / "d") as run:
        runs = run.watch_dir()
        for d in range(100):
            directory = runs / f"shard{d:03}"
            directory.mkdir()
            for f in range(1000):
                (directory / f"f{f}.txt").touch()
        checkpoints = [write_checkpoint(runs / f"shard{d:03}" / "model.safetensors", seed=d) for d in range(0, 100, 10)]
        run.start()
        run.wait_for("converted", checkpoints, timeout=60)
        assert run.proc is not None
        peak_kib = _peak_rss_kib(run.proc.pid)
        assert peak_kib < 256 * 1024, f"daemon peak RSS {peak_kib} KiB"
        stop_cleanly(run)


@pytest.mark.root
def test_running_out_of_inotify_watches_falls_back_to_polling_and_says_so(tmp_path: Path) -> None:
    limit_file = Path("/proc/sys/fs/inotify/max_user_watches")
    original = limit_file.read_text()
    with DaemonRun(tmp_path / "d") as run:
        runs = run.watch_dir()
        for d in range(20):
            (runs / f"sub{d}").mkdir()
        limit_file.write_text("4\n")  # far fewer than the tree needs
        try:
            run.start()
        finally:
            limit_file.write_text(original)
        fallback = wait_until(
            lambda: [r for r in run.records() if "polling" in r.get("reason", "")],
            10,
            "a sync log line about the inotify limit",
        )
        assert "inotify unavailable" in fallback[0]["reason"]
        source = write_checkpoint(runs / "sub7" / "model.safetensors")
        run.wait_for("converted", [source], timeout=20)  # served by polling
        stop_cleanly(run)


@pytest.mark.root
def test_directories_made_past_the_inotify_watch_limit_switch_the_tree_to_polling(tmp_path: Path) -> None:
    """The limit met by directories made while the daemon runs: watchdog skips them without a word, and their
    files waited for the ten-minute rescan. The daemon is given a limit of its own (a user namespace's
    max_inotify_watches, which the kernel enforces as fs.inotify.max_user_watches), so no other test's
    watches run short."""
    with DaemonRun(tmp_path / "d", rescan_interval=3600) as run:
        runs = run.watch_dir()
        for d in range(5):
            (runs / f"sub{d}").mkdir()
        limited = [
            "unshare",
            "--user",
            "--map-root-user",
            "sh",
            "-c",
            f'echo 30 > {_USER_WATCH_LIMIT}; exec "$@"',
            "sh",
        ]
        run.start(wrapper=limited)
        early = write_checkpoint(runs / "sub3" / "model.safetensors")
        run.wait_for("converted", [early], timeout=20)
        assert not [r for r in run.records() if "polling" in r.get("reason", "")], run.log_text()
        for d in range(5, 60):
            (runs / f"sub{d}").mkdir()
        fallback = wait_until(
            lambda: [r for r in run.records() if "polling" in r.get("reason", "")],
            20,
            "a sync log line about the inotify limit",
        )
        # The tree is watched anew; the new inotify instance counts the directories it could not watch, or,
        # when the old instance's watches were not yet released (its reading thread still in read() on a
        # loaded machine), fails at the root with ENOSPC, which watchdog words "inotify watch limit reached".
        reason = fallback[0]["reason"]
        assert reason.startswith("inotify unavailable (") and "watch limit reached" in reason, run.log_text()
        late = write_checkpoint(runs / "sub55" / "model.safetensors")
        run.wait_for("converted", [late], timeout=20)  # polled, not left for the rescan an hour away
        stop_cleanly(run)


_USER_WATCH_LIMIT = "/proc/sys/user/max_inotify_watches"


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc status")


@contextlib.contextmanager
def _nobodys_daemon() -> Iterator[tuple[DaemonRun, Path]]:
    """A daemon run as nobody on its own tree `runs` (that everyone may write), started: (run, runs)."""
    runnable_by_others()
    root = Path(tempfile.mkdtemp(prefix="syncd-nobody-", dir="/tmp"))
    try:
        os.chmod(root, 0o777)
        with DaemonRun(root / "d", [{"path": "runs"}], settle_seconds=0.1) as run:
            os.chmod(run.root, 0o777)
            runs = run.watch_dir()
            os.chmod(runs, 0o777)
            run.start(user=NOBODY)
            yield run, runs
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.root
def test_a_directory_opened_to_the_daemon_after_it_was_made_is_watched_and_scanned() -> None:
    """A run directory made under umask 077 and opened later (chmod): watchdog watches a directory only when it
    sees it made, so its checkpoints waited for the safety rescan, every one."""
    with _nobodys_daemon() as (run, runs):
        (runs / "exp").mkdir(mode=0o700)  # root's, closed to the daemon
        early = write_checkpoint(runs / "exp" / "early.safetensors", seed=1, mode=0o644)
        sync = write_checkpoint(runs / "sync.safetensors", seed=2, mode=0o644)
        run.wait_for("converted", [sync])  # (the events before it are handled)
        assert not (runs / "exp" / "early.bpk").exists()
        os.chmod(runs / "exp", 0o777)
        run.wait_for("converted", [early])  # scanned once opened
        late = write_checkpoint(runs / "exp" / "late.safetensors", seed=3, mode=0o644)
        run.wait_for("converted", [late])  # watched since
        stop_cleanly(run)


@pytest.mark.root
def test_directories_the_daemon_may_not_read_made_and_removed_leave_its_tree_watched() -> None:
    """watchdog took a directory it may not read for watched, under descriptor -1, which every such directory
    shared: the second one's removal broke its reader thread, a traceback-like warning in the journal, and the
    whole tree went unwatched, silently (a trainer making its run directories under umask 077)."""
    with _nobodys_daemon() as (run, runs):
        for step in range(3):
            (runs / "exp").mkdir(mode=0o700)  # root's, closed to the daemon
            made = write_checkpoint(runs / f"after-mkdir-{step}.safetensors", seed=step, mode=0o644)
            run.wait_for("converted", [made])
            (runs / "exp").rmdir()
            removed = write_checkpoint(runs / f"after-rmdir-{step}.safetensors", seed=step, mode=0o644)
            run.wait_for("converted", [removed])
        stop_cleanly(run)
        assert "Warning" not in run.stderr(), run.stderr()


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.parametrize("poll", [False, True], ids=["inotify", "polled"])
def test_an_unprivileged_daemon_skips_what_it_cannot_read_and_serves_the_rest(tmp_path: Path, poll: bool) -> None:
    assert os.geteuid() == 0, "this test runs the daemon as another user: run the suite as root, as CI does"
    runnable_by_others()
    root = Path(tempfile.mkdtemp(prefix="syncd-nobody-", dir="/tmp"))
    try:
        os.chmod(root, 0o777)
        # the daemon, as nobody, can lease none of these files: each is taken once unchanged this long
        with DaemonRun(root / "d", [{"path": "runs", "poll": poll}], unleased_settle_seconds=1) as run:
            os.chmod(run.root, 0o777)
            runs = run.watch_dir()
            os.chmod(runs, 0o777)
            readable = write_checkpoint(runs / "readable.safetensors", mode=0o644)
            unreadable = write_checkpoint(runs / "unreadable.safetensors", seed=1, mode=0o600)
            closed_dir = runs / "closed"
            write_checkpoint(closed_dir / "hidden.safetensors", seed=2, mode=0o644)
            os.chmod(closed_dir, 0o700)
            run.start(user=NOBODY)
            run.wait_for("converted", [readable])
            run.wait_for("skipped", [unreadable])
            late = write_checkpoint(runs / "late.safetensors", seed=3, mode=0o644)
            run.wait_for("converted", [late])
            os.close(os.open(unreadable, os.O_WRONLY))  # an event (a close after writing), the same version
            run.quiet(0.6)
            assert len(run.statuses("skipped", unreadable)) == 1, run.log_text()
            (skipped,) = run.statuses("skipped", unreadable)
            assert "Permission denied" in skipped["error"]
            assert (
                f"syncd retry -c {run.config_path}" in skipped["reason"] and "syncd@root.service" in skipped["reason"]
            )
            assert any("cannot list" in r.get("reason", "") for r in run.statuses("skipped", closed_dir))
            # one line in the journal for it, not one per walk of the start-up (stale-scratch sweep, scan)
            (said,) = [line for line in run.stderr().splitlines() if str(closed_dir) in line]
            assert said.endswith(f"skipped {closed_dir}: not scanned: cannot list the directory (Permission denied)")
            assert os.stat(runs / "readable.bpk").st_uid == NOBODY
            assert not (runs / "unreadable.bpk").exists()
            os.chmod(unreadable, 0o644)  # the fix a person makes: the attribute change alone brings it back
            run.wait_for("converted", [unreadable])
            stop_cleanly(run)
    finally:
        shutil.rmtree(root, ignore_errors=True)
