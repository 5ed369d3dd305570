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


# How long a message systemd must not miss (READY=1, RELOADING=1, STOPPING=1) waits for room on a full socket.
# A socket holds only so many datagrams (net.unix.max_dgram_qlen: 10 by default, 512 under systemd's sysctl.d);
# dropped, READY=1 would leave the unit "activating" until its start timeout killed it.
STATE_CHANGE_WAIT_SECONDS = 5.0


def notify(*assignments: str, wait: float = 0.0) -> bool:
    """Send `KEY=value` assignments in one datagram; True if it was sent. On a full socket the message is
    dropped, unless `wait` > 0: then it waits that long for room."""
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
            if wait > 0:
                sock.settimeout(wait)
                sock.send(message)
            else:
                # never block the main thread (it is the one that pings): a reader that stopped reading loses
                # a status line, not the daemon
                sock.send(message, socket.MSG_DONTWAIT)
    except (BlockingIOError, TimeoutError):
        log.log(
            logging.WARNING if wait > 0 else logging.DEBUG,
            "systemd's notify socket %s is full; %s dropped",
            target,
            assignments[0],
        )
        return False
    except OSError as exc:
        log.warning("could not notify systemd at %s: %s", target, exc)
        return False
    return True


def ready(status_text: str | None = None) -> bool:
    """Startup is complete: systemd considers the service started (Type=notify)."""
    extra = [f"STATUS={one_line(status_text)}"] if status_text else []
    return notify("READY=1", f"MAINPID={os.getpid()}", *extra, wait=STATE_CHANGE_WAIT_SECONDS)


def beat(status_text: str, alive: bool, starting: float | None = None) -> bool:
    """The main loop's tick, one datagram: a one-line status for `systemctl status`; WATCHDOG=1 when `alive`
    (to be sent more often than WatchdogSec, see watchdog_interval); and with `starting`, before READY=1,
    systemd's start timeout (TimeoutStartSec, 90 s by default) pushed to that many seconds from now: a
    start-up scan of a large tree may take longer than the timeout, and a unit killed for it is restarted into
    the same scan, again and again; one that stops scanning stops extending."""
    assignments = [f"STATUS={one_line(status_text)}"]
    if alive:
        assignments.append("WATCHDOG=1")
    if starting is not None:
        assignments.append(f"EXTEND_TIMEOUT_USEC={int(starting * 1_000_000)}")
    return notify(*assignments)


def reloading() -> bool:
    """A configuration reload has begun; send ready() when it is done. MONOTONIC_USEC lets systemd >= 253
    tell this reload from an earlier one."""
    monotonic = f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}"
    return notify("RELOADING=1", monotonic, wait=STATE_CHANGE_WAIT_SECONDS)


def stopping() -> bool:
    """Shutdown has begun."""
    return notify("STOPPING=1", wait=STATE_CHANGE_WAIT_SECONDS)


def watchdog_interval() -> float | None:
    """Seconds between watchdog pings (beat): half of $WATCHDOG_USEC, as sd_watchdog_enabled(3) advises; None when
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
