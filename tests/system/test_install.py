"""docs/install.md's install, upgrade and uninstall blocks, run as written in a scratch root, with the
installed `syncd run` converting a trainer's checkpoint as the service user in between.

Nothing here touches the machine: absolute paths move under the scratch root, `systemd-sysusers` and
`userdel` get `--root`, and the accounts made there are used by their numbers (the host does not know their
names). Only what needs a running systemd (systemctl) or a package manager is left out; what systemd does
for the unit before it starts (the state and log directories, the user and group) is done as the unit says.
Needs systemd's `systemd-sysusers`: run by `.ci/systemd-tests`, not by the README's test command."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import MNIST_ST, REPO

from syncd.formats.burnpack import BurnpackReader

INSTALL_DOC = REPO / "docs" / "install.md"
NEEDS_A_RUNNING_SYSTEM = ("systemctl", "apt-get", "dnf")
MOVED = ("/opt/", "/etc/", "/srv/", "/var/")
ACCOUNT_OPTIONS = ("-o", "-g", "-user", "-group")  # options whose value is a user or group name
TAKES_A_ROOT = ("systemd-sysusers", "userdel", "groupdel")
TRAINER = 65534  # nobody: the training user, made a member of the group syncd
POLL = 0.05


def doc_block(heading: str) -> list[str]:
    """The commands of the first ```sh block under `## heading` in docs/install.md, comments dropped."""
    text = INSTALL_DOC.read_text()
    section = text[text.index(f"\n## {heading}\n") :]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block is not None, heading
    return [line.split("  #")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def accounts(root: Path, table: str) -> dict[str, int]:
    """name -> id of the scratch root's /etc/passwd or /etc/group."""
    path = root / "etc" / table
    if not path.exists():
        return {}
    return {fields[0]: int(fields[2]) for fields in (line.split(":") for line in path.read_text().splitlines())}


def in_scratch(line: str, root: Path) -> list[str] | None:
    """The command of one line of the doc for the scratch root, or None for one that needs a live system."""
    words = shlex.split(line)
    if words[0] == "sudo":
        words = words[1:]
    if words[0] in NEEDS_A_RUNNING_SYSTEM:
        return None
    words = [f"{root}{word}" if word.startswith(MOVED) else word for word in words]
    scratch_accounts = {**accounts(root, "group"), **accounts(root, "passwd")}
    for i in range(1, len(words)):
        if words[i - 1] in ACCOUNT_OPTIONS and words[i] in scratch_accounts:
            words[i] = str(scratch_accounts[words[i]])
    if words[0] in TAKES_A_ROOT:
        words.insert(1, f"--root={root}")
    outside = [word for word in words[1:] if word.startswith("/") and not word.startswith(str(root))]
    assert not outside, f"{line}: would touch {outside} outside the scratch root"
    return words


def run_block(heading: str, root: Path, clone: Path) -> list[str]:
    """Run a block of the doc line by line in the scratch root; returns the lines run."""
    ran = []
    for line in doc_block(heading):
        command = in_scratch(line, root)
        if command is None:
            continue
        if command[:2] == [str(root / "opt/syncd/bin/syncd"), "check-config"]:
            _config_into_scratch(root)
            command = command[: command.index("--user")]  # `syncd` exists only in the scratch root's passwd
        proc = subprocess.run(command, cwd=clone, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{line}\n{proc.stdout}\n{proc.stderr}"
        if "check-config" in line:
            assert "valid (1 watch)" in proc.stdout and "warning" not in proc.stdout, proc.stdout
        ran.append(line)
    return ran


def _config_into_scratch(root: Path) -> None:
    """The installed config names /srv and /var: in the scratch root they move too."""
    config = root / "etc/syncd/syncd.yaml"
    text = config.read_text()
    for prefix in MOVED:
        text = text.replace(f" {prefix}", f" {root}{prefix}")
    config.write_text(text)


def _clone(destination: Path) -> Path:
    """What a clone holds that the install uses (a copy: pip's build must not leave files in the repo)."""
    destination.mkdir()
    for name in ("pyproject.toml", "README.md", "setup.py"):
        shutil.copy(REPO / name, destination / name)
    for name in ("syncd", "systemd", "config"):
        shutil.copytree(REPO / name, destination / name, ignore=shutil.ignore_patterns("__pycache__", "state", "runs"))
    return destination


def _traversable_by_others(path: Path) -> None:
    """The service user must reach the interpreter the venv was made from: o+x along its path."""
    for directory in [path, *path.parents]:
        mode = os.stat(directory).st_mode
        if not mode & stat.S_IXOTH:
            os.chmod(directory, stat.S_IMODE(mode) | stat.S_IXOTH)


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A scratch root other users can enter (pytest's tmp_path is root's alone); the host's login.defs is
    there, as on the host, so that userdel removes the user's group as it does there, and /etc/systemd/system."""
    assert os.geteuid() == 0, "the install runs as root: run the suite as root, as CI does"
    top = Path(tempfile.mkdtemp(prefix="syncd-install-", dir="/tmp"))
    os.chmod(top, 0o755)
    root = top / "root"
    (root / "etc/systemd/system").mkdir(parents=True)  # present on every systemd host
    os.chmod(root, 0o755)
    if Path("/etc/login.defs").exists():
        shutil.copy("/etc/login.defs", root / "etc/login.defs")
    yield root
    shutil.rmtree(top, ignore_errors=True)


def _unit_directories(root: Path, uid: int, gid: int) -> None:
    """What systemd makes before it starts syncd.service: StateDirectory= and LogsDirectory=, with their modes."""
    unit = (root / "etc/systemd/system/syncd.service").read_text()
    for key, base in (("StateDirectory", "var/lib"), ("LogsDirectory", "var/log")):
        name = re.search(rf"^{key}=(\S+)$", unit, re.M)
        mode = re.search(rf"^{key}Mode=(\d+)$", unit, re.M)
        assert name and mode, key
        directory = root / base / name.group(1)
        directory.mkdir(parents=True, exist_ok=True)
        os.chown(directory, uid, gid)
        os.chmod(directory, int(mode.group(1), 8))


def _as_trainer(script: str, root: Path, gid: int, umask: int, data: bytes = b"") -> None:
    """A shell command as the training user, a member of the group syncd, under `umask`."""
    proc = subprocess.run(
        ["/bin/sh", "-c", script],
        input=data,
        cwd=root / "srv/checkpoints",
        user=TRAINER,
        group=TRAINER,
        extra_groups=[gid],
        umask=umask,
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr


def _records(log: Path) -> list[dict]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_bytes().split(b"\n")[:-1] if line]


def _wait_for(log: Path, status: str, source: Path, daemon: subprocess.Popen, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        found = [r for r in _records(log) if r["status"] == status and r.get("source") == str(source)]
        if found:
            return found[0]
        assert daemon.poll() is None, f"syncd run exited with {daemon.returncode}"
        assert time.monotonic() < deadline, f"no {status!r} for {source} in {timeout} s:\n{log.read_text()}"
        time.sleep(POLL)


def _serve_as_the_service_user(root: Path, uid: int, gid: int) -> None:
    """Start the installed `syncd run` as the unit does (User=syncd, Group=syncd, its config); a trainer with
    umask 002 saves a checkpoint in a directory of its own; the service converts it. With umask 022 the
    trainer's directory is not group-writable, and the service says it cannot write beside the checkpoint."""
    _unit_directories(root, uid, gid)
    log = root / "var/log/syncd/sync.log.jsonl"
    unit = (root / "etc/systemd/system/syncd.service").read_text()
    assert "ExecStart=/opt/syncd/bin/syncd run -c /etc/syncd/syncd.yaml" in unit
    daemon = subprocess.Popen(
        [root / "opt/syncd/bin/syncd", "run", "-c", root / "etc/syncd/syncd.yaml"],
        user=uid,
        group=gid,
        extra_groups=[],
        umask=0o027,  # the unit's UMask=
        env={"PATH": "/usr/bin:/bin", "PYTHONUNBUFFERED": "1"},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while not any(r["status"] == "started" for r in _records(log)):
            assert daemon.poll() is None, daemon.stdout.read().decode() if daemon.stdout else ""
            assert time.monotonic() < deadline, "syncd run never started"
            time.sleep(POLL)

        tree = root / "srv/checkpoints"
        _as_trainer("mkdir exp1 && cat > exp1/step-1.safetensors", root, gid, 0o002, MNIST_ST.read_bytes())
        source = tree / "exp1/step-1.safetensors"
        record = _wait_for(log, "converted", source, daemon)
        output = tree / "exp1/step-1.bpk"
        info = output.stat()
        assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (uid, gid, 0o664), record
        with BurnpackReader(output) as reader:
            assert len(reader.tensors) == 18

        _as_trainer("mkdir exp2 && cat > exp2/step-1.safetensors", root, gid, 0o022, MNIST_ST.read_bytes())
        refused = _wait_for(log, "error", tree / "exp2/step-1.safetensors", daemon)
        assert "cannot create a scratch file beside it" in refused["error"], refused
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(60) == 0
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait(10)


@pytest.mark.slow
@pytest.mark.daemon
@pytest.mark.root
def test_install_serve_upgrade_and_uninstall_as_the_doc_says(scratch: Path, tmp_path: Path) -> None:
    root = scratch
    clone = _clone(tmp_path / "clone")
    installed = run_block("Install", root, clone)
    assert any("python3 -m venv /opt/syncd" in line for line in installed) and len(installed) >= 7, installed
    uid, gid = accounts(root, "passwd")["syncd"], accounts(root, "group")["syncd"]
    passwd = (root / "etc/passwd").read_text()
    assert re.search(r"^syncd:x:\d+:\d+:syncd checkpoint synchronizer:/var/lib/syncd:", passwd, re.M)
    tree = (root / "srv/checkpoints").stat()
    assert (tree.st_uid, tree.st_gid, stat.S_IMODE(tree.st_mode)) == (0, gid, 0o2775)
    home = (root / "opt/syncd/pyvenv.cfg").read_text()
    _traversable_by_others(Path(re.search(r"^home = (.+)$", home, re.M).group(1)))  # type: ignore[union-attr]

    _serve_as_the_service_user(root, uid, gid)

    marker = "# this clone's newer version\n"
    with open(clone / "syncd/__init__.py", "a") as package:
        package.write(marker)
    assert run_block("Upgrade", root, clone)
    upgraded = list((root / "opt/syncd/lib").glob("python3*/site-packages/syncd/__init__.py"))
    assert len(upgraded) == 1 and upgraded[0].read_text().endswith(marker)

    assert run_block("Uninstall", root, clone)
    for gone in ("opt/syncd", "etc/syncd", "var/lib/syncd", "var/log/syncd", "etc/sysusers.d/syncd.conf"):
        assert not (root / gone).exists(), gone
    assert "syncd" not in accounts(root, "passwd") and "syncd" not in accounts(root, "group")
    output = (root / "srv/checkpoints/exp1/step-1.bpk").stat()
    assert output.st_uid == 0  # the service's outputs were given to root; the trainer's files stay the trainer's
    assert (root / "srv/checkpoints/exp1/step-1.safetensors").stat().st_uid == TRAINER
