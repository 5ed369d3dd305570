"""sd_notify over a real AF_UNIX datagram socket, as systemd listens for it."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from syncd.daemon import notify


@pytest.fixture
def listener(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(2)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    yield sock
    sock.close()


def received(sock: socket.socket) -> list[str]:
    return sock.recv(4096).decode().split("\n")


def test_ready_reports_pid_and_status(listener: socket.socket) -> None:
    assert notify.ready("watching 2 trees") is True
    assert received(listener) == ["READY=1", f"MAINPID={os.getpid()}", "STATUS=watching 2 trees"]


def test_each_message(listener: socket.socket) -> None:
    assert notify.beat("converting a.bpk\nand b.bpk", alive=False)
    # a newline would start a new assignment: shown escaped (syncd.errors.one_line), nothing lost
    assert received(listener) == ["STATUS=converting a.bpk\\nand b.bpk"]
    assert notify.beat("idle", alive=True)
    assert received(listener) == ["STATUS=idle", "WATCHDOG=1"]
    assert notify.beat("scanning", alive=True, starting=2.5)
    # microseconds, as sd_notify(3) wants
    assert received(listener) == ["STATUS=scanning", "WATCHDOG=1", "EXTEND_TIMEOUT_USEC=2500000"]
    assert notify.stopping()
    assert received(listener) == ["STOPPING=1"]
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert notify.reloading()
    reloading, monotonic = received(listener)
    assert reloading == "RELOADING=1"
    assert monotonic.startswith("MONOTONIC_USEC=") and int(monotonic.split("=")[1]) >= before


def _fill(listener: socket.socket) -> int:
    """Datagrams sent to `listener` until it takes no more (its queue: net.unix.max_dgram_qlen)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
        sender.connect(listener.getsockname())
        count = 0
        while True:
            try:
                sender.send(b"STATUS=filler", socket.MSG_DONTWAIT)
            except BlockingIOError:
                return count
            count += 1


# the system calls a send waiting for room sleeps in: sendto, or poll/ppoll (a socket with a timeout is polled)
_WAITING_CALLS = {"x86_64": {"44", "7", "271"}, "aarch64": {"206", "73"}}[os.uname().machine]


def _waiting_for_room(thread: threading.Thread) -> bool:
    """The thread sleeps in the kernel in a send or in the poll before one (/proc's view of its system call)."""
    fields = Path(f"/proc/self/task/{thread.native_id}/syscall").read_text().split()
    return bool(fields) and fields[0] in _WAITING_CALLS


def test_ready_waits_for_room_on_a_full_socket_where_a_beat_is_dropped(listener: socket.socket) -> None:
    """A burst of beats can fill systemd's socket; READY=1 dropped would leave the unit starting until its
    start timeout killed it. A beat gives way; READY=1 waits until the reader makes room."""
    fillers = _fill(listener)
    assert fillers > 0
    assert notify.beat("dropped", alive=True) is False
    results: list[bool] = []
    sender = threading.Thread(target=lambda: results.append(notify.ready("up")))
    sender.start()
    deadline = time.monotonic() + 30
    while not _waiting_for_room(sender):  # the socket is full: READY=1 must be waiting, not dropped
        assert sender.is_alive() and time.monotonic() < deadline, "READY=1 was not held for room"
    for _ in range(fillers):
        assert received(listener) == ["STATUS=filler"]
    sender.join(30)
    assert results == [True]
    assert received(listener) == ["READY=1", f"MAINPID={os.getpid()}", "STATUS=up"]


def test_abstract_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"syncd-test-{os.getpid()}-{time.monotonic_ns()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        sock.settimeout(2)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert notify.beat("idle", alive=True)
        assert sock.recv(100) == b"STATUS=idle\nWATCHDOG=1"


def test_no_socket_means_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify.ready() is False
    assert notify.beat("idle", alive=True) is False
    monkeypatch.setenv("NOTIFY_SOCKET", "")
    assert notify.stopping() is False


def test_unreachable_or_odd_socket_is_logged_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone.sock"))
    assert notify.ready() is False
    assert "could not notify systemd" in caplog.text
    monkeypatch.setenv("NOTIFY_SOCKET", "vsock:2:1234")
    assert notify.beat("x", alive=False) is False


def test_watchdog_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert notify.watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    assert notify.watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert notify.watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))  # meant for another process
    assert notify.watchdog_interval() is None
    monkeypatch.delenv("WATCHDOG_PID")
    for bad in ("0", "-5", "soon"):
        monkeypatch.setenv("WATCHDOG_USEC", bad)
        assert notify.watchdog_interval() is None
