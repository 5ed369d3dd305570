"""sd_notify over a real AF_UNIX datagram socket, as systemd listens for it."""

from __future__ import annotations

import os
import socket
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
    assert notify.status("converting a.bpk\nand b.bpk")
    # a newline would start a new assignment: shown escaped (syncd.errors.one_line), nothing lost
    assert received(listener) == ["STATUS=converting a.bpk\\nand b.bpk"]
    assert notify.watchdog()
    assert received(listener) == ["WATCHDOG=1"]
    assert notify.stopping()
    assert received(listener) == ["STOPPING=1"]
    assert notify.extend_timeout(2.5)
    assert received(listener) == ["EXTEND_TIMEOUT_USEC=2500000"]  # microseconds, as sd_notify(3) wants
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert notify.reloading()
    reloading, monotonic = received(listener)
    assert reloading == "RELOADING=1"
    assert monotonic.startswith("MONOTONIC_USEC=") and int(monotonic.split("=")[1]) >= before


def test_abstract_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"syncd-test-{os.getpid()}-{time.monotonic_ns()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        sock.settimeout(2)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert notify.watchdog()
        assert sock.recv(100) == b"WATCHDOG=1"


def test_no_socket_means_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify.ready() is False
    assert notify.watchdog() is False
    monkeypatch.setenv("NOTIFY_SOCKET", "")
    assert notify.stopping() is False


def test_unreachable_or_odd_socket_is_logged_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone.sock"))
    assert notify.ready() is False
    assert "could not notify systemd" in caplog.text
    monkeypatch.setenv("NOTIFY_SOCKET", "vsock:2:1234")
    assert notify.status("x") is False


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
