"""The README's install steps, run as written in a scratch root (no systemd runs in CI's container, and
this must not touch the machine): absolute paths move under the scratch root, `systemd-sysusers` and
`systemd-analyze verify` get `--root`, and only what needs a running systemd (systemctl) or a package
manager (apt-get) is left out. Then the installed units are verified and their security scores kept."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import REPO

SECURITY_LIMIT = 0.6  # systemd-analyze security's score of syncd.service before issue 14; not to grow
NEEDS_A_RUNNING_SYSTEM = ("systemctl", "apt-get", "dnf")
MOVED = ("/opt/", "/etc/", "/srv/", "/var/")


def readme_install_steps() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Installing the service") :]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block is not None
    return [line.split("  #")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def in_scratch(line: str, root: Path) -> list[str] | None:
    """The command of one README line for the scratch root, or None for one that needs a live system."""
    words = shlex.split(line)
    if words[0] == "sudo":
        words = words[1:]
    if words[0] in NEEDS_A_RUNNING_SYSTEM:
        return None
    words = [f"{root}{word}" if word.startswith(MOVED) else word for word in words]
    if words[0] in ("systemd-sysusers",) or words[:2] == ["systemd-analyze", "verify"]:
        words.insert(1 if words[0] == "systemd-sysusers" else 2, f"--root={root}")
    return words


def _source_tree(destination: Path) -> Path:
    """What a clone holds that the install uses (a copy: pip's build must not leave files in the repo)."""
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, destination / name)
    for name in ("syncd", "systemd", "config"):
        shutil.copytree(REPO / name, destination / name, ignore=shutil.ignore_patterns("__pycache__", "state", "runs"))
    return destination


def _root_with_systemd(root: Path) -> None:
    """The parts of the host a unit verification looks at: systemd's own units and /bin/kill."""
    system = (
        Path("/usr/lib/systemd/system") if Path("/usr/lib/systemd/system").is_dir() else Path("/lib/systemd/system")
    )
    shutil.copytree(system, root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)  # present on every systemd host
    (root / "bin").mkdir(exist_ok=True)
    shutil.copy(shutil.which("kill") or "/bin/kill", root / "bin/kill")


@pytest.mark.slow
def test_the_readme_install_steps_run_as_written(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    _root_with_systemd(root)
    source = tmp_path / "clone"
    source.mkdir()
    _source_tree(source)
    steps = readme_install_steps()
    assert any("python3 -m venv /opt/syncd" in step for step in steps)
    assert any("systemd-analyze verify /etc/systemd/system/syncd.service" in step for step in steps)
    ran = []
    for line in steps:
        command = in_scratch(line, root)
        if command is None:
            continue
        if command[:2] == [str(root / "opt/syncd/bin/syncd"), "check-config"]:
            _config_into_scratch(root)
            command = command[: command.index("--user")]  # `syncd` exists only in the scratch root's passwd
        proc = subprocess.run(command, cwd=source, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{line}\n{proc.stdout}\n{proc.stderr}"
        ran.append((line, proc))
    assert len(ran) >= 8, [line for line, _ in ran]

    assert (root / "opt/syncd/bin/syncd").stat().st_mode & 0o111
    passwd = (root / "etc/passwd").read_text()
    assert re.search(r"^syncd:x:\d+:\d+:syncd checkpoint synchronizer:/var/lib/syncd:", passwd, re.M)
    version = subprocess.run([root / "opt/syncd/bin/syncd", "--version"], capture_output=True, text=True, timeout=60)
    assert version.stdout.startswith("syncd ")
    check = next(proc for line, proc in ran if "check-config" in line)
    assert "valid (1 watch)" in check.stdout and "warning" not in check.stdout
    unit = (root / "etc/systemd/system/syncd.service").read_text()
    assert "ExecStart=/opt/syncd/bin/syncd run -c /etc/syncd/syncd.yaml" in unit


def _config_into_scratch(root: Path) -> None:
    """The installed config names /srv, /var: for check-config in the scratch root they move too (the
    syncd user exists only in the scratch root's /etc/passwd, so the check runs as root there)."""
    config = root / "etc/syncd/syncd.yaml"
    text = config.read_text()
    for prefix in MOVED:
        text = text.replace(f" {prefix}", f" {root}{prefix}")
    config.write_text(text)


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
