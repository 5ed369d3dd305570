"""The two systemd units verify (`systemd-analyze verify`, offline, in a scratch root holding systemd's own
units) and keep their security scores (`systemd-analyze security --offline`). Needs systemd's
`systemd-analyze`: run by `.ci/systemd-tests`, not by the README's test command."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import REPO

SECURITY_LIMIT = 0.6  # systemd-analyze security's score of syncd.service once hardened; not to grow


def _root_with_systemd(root: Path) -> None:
    """The parts of the host a unit verification looks at: systemd's own units and /bin/kill."""
    system = (
        Path("/usr/lib/systemd/system") if Path("/usr/lib/systemd/system").is_dir() else Path("/lib/systemd/system")
    )
    shutil.copytree(system, root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)  # present on every systemd host
    (root / "bin").mkdir(exist_ok=True)
    shutil.copy(shutil.which("kill") or "/bin/kill", root / "bin/kill")


@pytest.mark.parametrize(
    "unit, instance", [("syncd.service", "syncd.service"), ("syncd@.service", "syncd@alice.service")]
)
def test_units_verify_and_keep_their_security_score(tmp_path: Path, unit: str, instance: str) -> None:
    root = tmp_path / "root"
    _root_with_systemd(root)
    units = root / "etc/systemd/system"
    shutil.copy(REPO / "systemd" / unit, units / unit)
    program = root / "opt/syncd/bin/syncd"
    program.parent.mkdir(parents=True)
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    verify = subprocess.run(
        ["systemd-analyze", "verify", f"--root={root}", instance], capture_output=True, text=True, timeout=120
    )
    assert verify.returncode == 0 and verify.stderr == "", verify.stderr

    (tmp_path / instance).write_text((REPO / "systemd" / unit).read_text())
    security = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", str(tmp_path / instance)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    score = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", security.stdout)
    assert score is not None, security.stdout + security.stderr
    assert float(score.group(1)) <= SECURITY_LIMIT, security.stdout
