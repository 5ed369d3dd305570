"""Runs the real daemon (`python -m syncd run -c CONFIG`) in a subprocess for the acceptance tests.

Each `DaemonRun` has its own directory holding the config (mode 0644), the state directory, the sync log and
the watched trees; systemd's side of sd_notify is played by a real AF_UNIX datagram socket whose path goes
to the daemon in NOTIFY_SOCKET. Waiting is always a polling loop on a condition, with a timeout.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import yaml
from conftest import REPO

from syncd.engine.publish import is_scratch_name

START_TIMEOUT = 20.0
POLL = 0.02
PR_CAPBSET_DROP = 24
CAP_LEASE = 28  # linux/capability.h
NOBODY = 65534  # a user that is not the daemon's (nor the test's)


def wait_until(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll `condition` until it returns something truthy (returned); AssertionError naming `what` after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(POLL)


def _drop_capabilities(capabilities: list[int]) -> None:
    """In the child before exec: prctl(PR_CAPBSET_DROP) for each capability."""
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in capabilities:
        if libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), f"prctl(PR_CAPBSET_DROP, {capability})")


def _become(capabilities: list[int], user: int | None) -> None:
    """In the child before exec: drop `capabilities`, then switch to `user`."""
    _drop_capabilities(capabilities)
    if user is not None:
        os.setgroups([])
        os.setgid(user)
        os.setuid(user)


def _all_threads_stopped(pid: int) -> bool:
    """Every thread of `pid` is in the stopped state (`T` in /proc/PID/task/TID/stat)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except FileNotFoundError:
            continue  # a thread that ended meanwhile
        if stat.rsplit(")", 1)[1].split()[0] != "T":
            return False
    return True


def scratch_files(*roots: Path) -> list[Path]:
    """syncd's scratch files (`.<name>.syncd-<pid>-<n>.tmp`) anywhere below `roots`."""
    return [path for root in roots for path in root.rglob("*") if is_scratch_name(path.name)]


def write_file(path: Path, data: bytes) -> None:
    """Write `data` as a writer saving a checkpoint does: one open, one write, one close (one close event)."""
    with open(path, "wb") as handle:
        handle.write(data)


def mentioning(records: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """The sync log records in which `text` appears anywhere."""
    return [r for r in records if text in json.dumps(r)]


def runnable_by_others(*also: Path) -> None:
    """Let other users reach this checkout and the interpreter (o+x along their paths): a daemon started
    as another user runs the code from here. `also`: more directories they must reach."""
    for path in (REPO, Path(sys.executable).resolve().parent, Path(sys.prefix), *also):
        for directory in [path, *path.parents]:
            mode = os.stat(directory).st_mode
            if not mode & stat.S_IXOTH:
                os.chmod(directory, stat.S_IMODE(mode) | stat.S_IXOTH)


def as_nobody(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`argv` run as the user nobody (the suite runs as root), with no supplementary groups, this checkout
    reachable to it."""
    runnable_by_others()
    return subprocess.run(
        argv,
        env=env,
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=120,
    )


def stop_cleanly(run: DaemonRun, *roots: Path) -> None:
    """SIGTERM, and the daemon exits 0 leaving no scratch file below `roots` (default: its own directory)."""
    code, seconds = run.stop()
    assert code == 0, f"exit status {code} after {seconds:.1f} s\n{run.stderr()}"
    assert scratch_files(*(roots or (run.root,))) == []


class DaemonRun:
    """One daemon with its own files under `root`. Use as a context manager: leaving kills what is left."""

    starts = 0  # daemons started in this process: conftest checks that a test starting one is marked `daemon`

    def __init__(self, root: Path, watches: list[dict[str, Any]] | None = None, **settings: Any) -> None:
        self.root = root
        self.config_path = root / "syncd.yaml"
        self.log_path = root / "sync.log.jsonl"
        self.state_dir = root / "state"
        self.stderr_path = root / "daemon.stderr"
        self.proc: subprocess.Popen[bytes] | None = None
        self.notifications: list[list[str]] = []
        self._socket_dir = Path(tempfile.mkdtemp(prefix="syncd-ns-"))  # AF_UNIX paths must stay short
        self.notify_path = self._socket_dir / "notify.sock"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(os.fspath(self.notify_path))
        self._sock.setblocking(False)
        self.write_config(watches if watches is not None else [{"path": "runs"}], **settings)

    # -- files

    def watch_dir(self, name: str = "runs") -> Path:
        path = self.root / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def write_config(self, watches: list[dict[str, Any]], **settings: Any) -> None:
        """Write the config (relative paths resolve against `root`); watched directories are created."""
        for watch in watches:
            self.watch_dir(watch["path"])
        doc = {
            "workers": 2,
            "settle_seconds": 0.2,
            "state_dir": "state",
            "log": {"path": self.log_path.name, "level": "info"},
            **settings,
            "watches": [{"direction": "both", **watch} for watch in watches],
        }
        self.write_config_text(yaml.safe_dump(doc, sort_keys=False))

    def write_config_text(self, text: str) -> None:
        scratch = self.config_path.with_name(self.config_path.name + ".new")
        scratch.write_text(text)
        os.chmod(scratch, 0o644)  # the daemon refuses a config that group or others may write
        os.replace(scratch, self.config_path)

    # -- the process

    def start(
        self,
        drop_capabilities: Iterable[int] = (),
        user: int | None = None,
        env: dict[str, str] | None = None,
        wrapper: Iterable[str] = (),
    ) -> list[str]:
        """Start the daemon and wait for READY=1; returns that notification's lines. `drop_capabilities`
        (e.g. CAP_LEASE) are removed from its bounding set, so even root runs without them; `user` runs it
        as that uid (and gid), with no supplementary groups, as the service's own user would run; `wrapper`
        goes in front of the command (e.g. `unshare --pid --fork` for a daemon in its own PID namespace)."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        extra = env or {}
        env = {**os.environ, "NOTIFY_SOCKET": os.fspath(self.notify_path), "PYTHONPATH": os.fspath(REPO)}
        env.pop("WATCHDOG_USEC", None)
        env.update(extra)
        started_at = len(self.notifications)
        DaemonRun.starts += 1
        dropped = list(drop_capabilities)
        if user is not None:  # the daemon must reach systemd's socket as that user
            os.chmod(self._socket_dir, 0o755)
            os.chmod(self.notify_path, 0o777)
        with open(self.stderr_path, "ab") as stderr:
            self.proc = subprocess.Popen(
                [*wrapper, sys.executable, "-m", "syncd", "run", "-c", os.fspath(self.config_path)],
                cwd=self.root,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=stderr,
                stderr=stderr,
                preexec_fn=(lambda: _become(dropped, user)) if dropped or user is not None else None,
            )

        def ready() -> list[str] | None:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"the daemon exited with {self.proc.returncode} before READY=1:\n{self.stderr()}")
            self.receive()
            return next((lines for lines in self.notifications[started_at:] if "READY=1" in lines), None)

        return wait_until(ready, START_TIMEOUT, "READY=1 on NOTIFY_SOCKET")

    def receive(self) -> list[list[str]]:
        """Collect every datagram waiting on the notify socket; returns all received so far."""
        while True:
            try:
                data = self._sock.recv(65536)
            except BlockingIOError:
                return self.notifications
            self.notifications.append(data.decode().split("\n"))

    def send(self, signum: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The daemon stopped (SIGSTOP) for the block: none of its threads runs, so nothing reads its inotify
        queue or looks at a file until the block ends (SIGCONT). A signal arrives asynchronously: the block
        starts only once every thread is seen stopped."""
        assert self.proc is not None
        pid = self.proc.pid
        self.send(signal.SIGSTOP)
        try:
            wait_until(lambda: _all_threads_stopped(pid), START_TIMEOUT, "every thread of the daemon stopped")
            yield
        finally:
            self.send(signal.SIGCONT)

    def stop(self, timeout: float = 60.0) -> tuple[int | None, float]:
        """SIGTERM; returns (exit status or None if it did not exit within `timeout`, seconds taken)."""
        assert self.proc is not None
        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        return code, time.monotonic() - started

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stderr(self) -> str:
        with contextlib.suppress(FileNotFoundError):
            return self.stderr_path.read_text(errors="replace")
        return ""

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._sock.close()
        shutil.rmtree(self._socket_dir, ignore_errors=True)

    def __enter__(self) -> DaemonRun:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- the sync log

    def records(self) -> list[dict[str, Any]]:
        """Every complete line of the sync log, parsed."""
        try:
            data = self.log_path.read_bytes()
        except FileNotFoundError:
            return []
        lines = data.split(b"\n")[:-1]  # a line still being written has no newline yet
        return [json.loads(line) for line in lines if line]

    def statuses(self, status: str | None = None, source: Path | None = None) -> list[dict[str, Any]]:
        return [
            r
            for r in self.records()
            if (status is None or r["status"] == status) and (source is None or r.get("source") == str(source))
        ]

    def wait_for(self, status: str, sources: Iterable[Path] = (), count: int = 1, timeout: float = 60.0) -> None:
        """Wait until the log has `status` lines for every one of `sources` (or `count` of them if none)."""
        wanted = {str(path) for path in sources}

        def done() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"the daemon exited with {self.proc.returncode}:\n{self.stderr()}")
            found = {r.get("source") for r in self.records() if r["status"] == status}
            return wanted <= found if wanted else len(self.statuses(status)) >= count

        what = f"{status!r} for {sorted(wanted) or count}"
        try:
            wait_until(done, timeout, what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nlog:\n{self.log_text()}\nstderr:\n{self.stderr()}") from None

    def quiet(self, seconds: float) -> None:
        """Let `seconds` pass while the daemon runs (for checking that nothing more happens): the log must
        not change during the last `seconds`, polled."""
        size = -1
        calm_since = time.monotonic()
        deadline = time.monotonic() + 4 * seconds + 10
        while time.monotonic() - calm_since < seconds:
            current = self.log_path.stat().st_size if self.log_path.exists() else 0
            if current != size:
                size, calm_since = current, time.monotonic()
            assert time.monotonic() < deadline, "the sync log never stopped growing"
            time.sleep(POLL)

    def log_text(self) -> str:
        buffer = io.StringIO()
        for record in self.records():
            print(json.dumps({k: v for k, v in record.items() if k != "layout"}), file=buffer)
        return buffer.getvalue()
