"""The systemd unit: it verifies cleanly, its hardening scores as safe, and what it forbids does not break
the Python stack syncd runs on."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
UNIT = REPO / "systemd" / "syncd.service"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
MAX_EXPOSURE = 2.0


# verify's complaints that come from this machine rather than the unit: no syncd user, no running systemd
ENVIRONMENTAL = (
    re.compile(r"Failed to (connect to|create) bus"),
    re.compile(r"System has not been booted with systemd"),
    re.compile(r"Failed to resolve (user|group) .?syncd"),
    re.compile(r"(User|Group)=syncd"),
)


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


def verify(unit: Path) -> tuple[int, list[str], list[str]]:
    """`systemd-analyze verify`: its exit status, its complaints about the unit, and those about this machine."""
    assert SYSTEMD_ANALYZE is not None
    result = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60
    )
    lines = (result.stdout + result.stderr).splitlines()
    environmental = [line for line in lines if any(p.search(line) for p in ENVIRONMENTAL)]
    return result.returncode, [line for line in lines if line not in environmental], environmental


def test_unit_verifies_without_errors(tmp_path: Path) -> None:
    code, problems, environmental = verify(copy_with_runnable_exec_start(tmp_path))
    assert problems == []
    assert code == 0 or environmental, "verify failed without saying why"  # only this machine may fail it


def test_verify_would_catch_a_broken_unit(tmp_path: Path) -> None:
    broken = UNIT.read_text().replace("Type=notify", "Type=notifyy").replace("UMask=0027", "UMask=bogus")
    _, problems, _ = verify(copy_with_runnable_exec_start(tmp_path, broken))
    assert any("notifyy" in line for line in problems)
    assert any("bogus" in line for line in problems)
    # and its exit status says so, e.g. for a unit whose program is not there
    absent = tmp_path / "not-installed" / "syncd"
    (tmp_path / "absent").mkdir()
    unit = tmp_path / "absent" / "syncd.service"
    unit.write_text(UNIT.read_text().replace("ExecStart=/opt/syncd/bin/syncd ", f"ExecStart={absent} "))
    code, problems, _ = verify(unit)
    assert code != 0 and any(str(absent) in line for line in problems), problems


def exposure(unit: Path) -> tuple[float, str]:
    assert SYSTEMD_ANALYZE is not None
    result = subprocess.run(
        [SYSTEMD_ANALYZE, "security", "--offline=true", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", result.stdout)
    assert match, result.stdout + result.stderr
    return float(match.group(1)), result.stdout


def test_security_exposure_is_low(tmp_path: Path) -> None:
    score, report = exposure(copy_with_runnable_exec_start(tmp_path))
    remaining = [line for line in report.splitlines() if line.startswith("✗")]
    print(f"exposure {score}; remaining: {remaining}")
    assert score < MAX_EXPOSURE, report
    # and the review does tell a hardened unit from a bare one
    bare = tmp_path / "bare" / "syncd.service"
    bare.parent.mkdir()
    bare.write_text(f"[Service]\nType=notify\nExecStart={Path(sys.executable).resolve()}\n")
    assert exposure(bare)[0] > 8.0


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
