"""sd_notify(3) without libsystemd: tells systemd (Type=notify) that the daemon is ready, alive, reloading
or stopping, by sending a datagram to $NOTIFY_SOCKET.

Every function is a no-op returning False when NOTIFY_SOCKET is unset (run by hand, in tests, under another
supervisor). A failed send is logged and returns False rather than raising: losing a status update must not
take the daemon down (systemd's own timeouts catch a daemon that really cannot reach it).
"""

from __future__ import annotations

import logging
import os
import socket
import time

from syncd.errors import one_line

log = logging.getLogger("syncd.notify")


def _address(value: str) -> str | bytes | None:
    """The socket address for a NOTIFY_SOCKET value: a path, or `@name` for the abstract namespace."""
    if value.startswith("/"):
        return value
    if value.startswith("@") and len(value) > 1:
        return b"\0" + os.fsencode(value[1:])
    return None  # e.g. vsock: addresses of newer systemd, for VMs; syncd does not run there


def notify(*assignments: str) -> bool:
    """Send `KEY=value` assignments in one datagram; True if it was sent."""
    target = os.environ.get("NOTIFY_SOCKET")
    if not target:
        return False
    address = _address(target)
    if address is None:
        log.warning("NOTIFY_SOCKET=%r is not a path or abstract socket; not notifying", target)
        return False
    message = "\n".join(assignments).encode("utf-8", errors="replace")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            # never block the main thread (it is the one that pings): a reader that stopped reading loses
            # a status line, not the daemon
            sock.send(message, socket.MSG_DONTWAIT)
    except BlockingIOError:
        log.debug("systemd's notify socket %s is full; a notification was dropped", target)
        return False
    except OSError as exc:
        log.warning("could not notify systemd at %s: %s", target, exc)
        return False
    return True


def ready(status_text: str | None = None) -> bool:
    """Startup is complete: systemd considers the service started (Type=notify)."""
    extra = [f"STATUS={one_line(status_text)}"] if status_text else []
    return notify("READY=1", f"MAINPID={os.getpid()}", *extra)


def extend_timeout(seconds: float) -> bool:
    """Still starting (or reloading): systemd's start timeout (TimeoutStartSec, 90 s by default) is pushed to
    `seconds` from now. A start-up scan of a large tree may take longer than the timeout, and a unit killed
    for it is restarted into the same scan, again and again; one that stops scanning stops extending."""
    return notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1_000_000)}")


def status(text: str) -> bool:
    """A one-line status shown by `systemctl status`."""
    return notify(f"STATUS={one_line(text)}")


def watchdog() -> bool:
    """Still alive; must be sent more often than WatchdogSec (see watchdog_interval)."""
    return notify("WATCHDOG=1")


def reloading() -> bool:
    """A configuration reload has begun; send ready() when it is done. MONOTONIC_USEC lets systemd >= 253
    tell this reload from an earlier one."""
    return notify("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")


def stopping() -> bool:
    """Shutdown has begun."""
    return notify("STOPPING=1")


def watchdog_interval() -> float | None:
    """Seconds between watchdog() calls: half of $WATCHDOG_USEC, as sd_watchdog_enabled(3) advises; None when
    the watchdog is off or is meant for another process ($WATCHDOG_PID)."""
    usec_text = os.environ.get("WATCHDOG_USEC")
    if not usec_text:
        return None
    pid_text = os.environ.get("WATCHDOG_PID")
    try:
        usec = int(usec_text)
        if pid_text and int(pid_text) != os.getpid():
            return None
    except ValueError:
        return None
    if usec <= 0:
        return None
    return usec / 1_000_000 / 2
