"""The systemd unit: its directives, and what it forbids does not break the Python stack syncd runs on.
`systemd-analyze verify` and `security` run in tests/system/test_units.py (`.ci/systemd-tests`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
UNIT = REPO / "systemd" / "syncd.service"


def unit_directives(text: str) -> dict[str, list[str]]:
    directives: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            directives.setdefault(key.strip(), []).append(value.strip())
    return directives


def copy_with_runnable_exec_start(tmp_path: Path, text: str | None = None) -> Path:
    """The unit as installed, but with ExecStart on a binary that exists here (verify checks that it does)."""
    text = UNIT.read_text() if text is None else text
    copy = tmp_path / "syncd.service"
    copy.write_text(text.replace("ExecStart=/opt/syncd/bin/syncd ", f"ExecStart={Path(sys.executable).resolve()} "))
    return copy


def test_unit_runs_the_daemon_as_its_own_user_under_the_watchdog() -> None:
    directives = unit_directives(UNIT.read_text())
    expected = {
        "Type": "notify",
        "NotifyAccess": "main",
        "ExecStart": "/opt/syncd/bin/syncd run -c /etc/syncd/syncd.yaml",
        "ExecReload": "/bin/kill -HUP $MAINPID",
        "KillSignal": "SIGTERM",
        "TimeoutStopSec": "10",
        "WatchdogSec": "30",
        "Restart": "on-failure",
        "User": "syncd",
        "Group": "syncd",
        "StateDirectory": "syncd",
        "LogsDirectory": "syncd",
        "ReadWritePaths": "-/srv/checkpoints",
        "UMask": "0027",
        "MemoryMax": "1G",
    }
    assert {key: directives.get(key, [None])[-1] for key in expected} == expected


def test_unit_is_hardened() -> None:
    directives = unit_directives(UNIT.read_text())
    for key in (
        "NoNewPrivileges", "PrivateTmp", "PrivateDevices", "ProtectKernelTunables", "ProtectKernelModules",
        "ProtectKernelLogs", "ProtectControlGroups", "ProtectClock", "ProtectHostname", "RestrictNamespaces",
        "LockPersonality", "MemoryDenyWriteExecute", "RestrictRealtime", "RestrictSUIDSGID", "ProtectHome",
    ):  # fmt: skip
        assert directives.get(key) == ["yes"], key
    assert directives["ProtectSystem"] == ["strict"]
    # nothing but CAP_LEASE, which lets the daemon see whether a checkpoint is still open for writing
    assert directives["CapabilityBoundingSet"] == ["CAP_LEASE"] and directives["AmbientCapabilities"] == ["CAP_LEASE"]
    assert directives["RestrictAddressFamilies"] == ["AF_UNIX"]
    assert directives["SystemCallArchitectures"] == ["native"]
    assert directives["SystemCallFilter"][0] == "@system-service"


# Run in a child: PR_SET_MDWE is the kernel's own W^X, what MemoryDenyWriteExecute=yes enforces.
MDWE_CHILD = r"""
import ctypes, mmap, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(65, 1, 0, 0, 0) != 0:  # PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN
    sys.exit(77)
try:
    mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    sys.exit("a writable+executable mapping was allowed: W^X is not in force")
except OSError:
    pass
import json, sqlite3, socket, yaml, cbor2
import numpy as np
import safetensors.numpy
import watchdog.observers
import syncd.daemon.config, syncd.daemon.state, syncd.daemon.synclog, syncd.daemon.notify
a = np.arange(256 * 256, dtype=np.float32).reshape(256, 256)
assert (a @ a.T).shape == (256, 256)
path = sys.argv[1]
safetensors.numpy.save_file({"w": a.T.copy()}, path)
assert (safetensors.numpy.load_file(path)["w"] == a.T).all()
sqlite3.connect(":memory:").execute("select 1")
print("ok")
"""


def test_python_numpy_and_safetensors_work_without_writable_executable_memory(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", MDWE_CHILD, str(tmp_path / "w.safetensors")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 77, "this kernel has no PR_SET_MDWE (Linux < 6.3): the check cannot run here"
    assert result.returncode == 0 and result.stdout == "ok\n", result.stderr


def test_the_system_unit_and_a_users_instance_share_no_state_or_log_directory() -> None:
    """systemd creates (and chowns) each unit's StateDirectory/LogsDirectory for its own user: an instance's
    directory inside syncd.service's would be handed to the syncd user, or be out of alice's reach under its
    0750 parent."""
    system = unit_directives(UNIT.read_text())
    instance = unit_directives((REPO / "systemd" / "syncd@.service").read_text().replace("%i", "alice"))
    for key, base in (("StateDirectory", "/var/lib"), ("LogsDirectory", "/var/log")):
        (ours,), (theirs,) = system[key], instance[key]
        mine, alices = Path(base, ours), Path(base, theirs)
        assert mine != alices and not alices.is_relative_to(mine) and not mine.is_relative_to(alices), key
