"""Reading trainers' checkpoints: safetensors' save_file writes mode 0600, a default ACL cannot open such a
file to a group (the creation mode masks it), and the documented setup, syncd@TRAINER (the daemon runs as the
training user), converts them; `check-config --user` warns about what a service user cannot read or write."""

from __future__ import annotations

import os
import pwd
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO
from convcheck import run_cli
from daemonutil import DaemonRun, runnable_by_others

pytestmark = [pytest.mark.daemon, pytest.mark.root]

TRAINER = pwd.getpwnam("nobody")  # the training user
OTHER = pwd.getpwnam("daemon")  # a system user like `syncd`, not the files' owner

SAVE = """
import sys, numpy as np
from safetensors.numpy import save_file
save_file({"fc.weight": np.ones((4, 3), np.float32), "fc.bias": np.zeros(4, np.float32)}, sys.argv[1])
"""


@pytest.fixture
def shared_root() -> Iterator[Path]:
    """A directory other users can reach (pytest's tmp_path is root's alone)."""
    assert os.geteuid() == 0, "these tests act as other users: run the suite as root, as CI does"
    runnable_by_others()
    root = Path(tempfile.mkdtemp(prefix="syncd-perm-", dir="/tmp"))
    os.chmod(root, 0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _as(user: pwd.struct_passwd, *args: object, groups: list[int] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*map(str, args)],
        user=user.pw_uid,
        group=user.pw_gid,
        extra_groups=groups or [],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def _save_as(user: pwd.struct_passwd, path: Path) -> None:
    proc = _as(user, sys.executable, "-c", SAVE, path)
    assert proc.returncode == 0, proc.stderr


def test_save_file_writes_0600_and_a_default_acl_cannot_open_it_to_a_group(shared_root: Path) -> None:
    shared = shared_root / "shared"
    shared.mkdir()
    group = OTHER.pw_gid  # the group the ACL names (as `syncd` would be)
    for spec in (f"d:g:{group}:rX", f"g:{group}:rX", "d:o::-", "o::-"):
        subprocess.run(["setfacl", "-m", spec, str(shared)], check=True, timeout=60)

    checkpoint = shared / "model.safetensors"
    _save_as(pwd.getpwuid(0), checkpoint)
    assert stat.S_IMODE(os.stat(checkpoint).st_mode) == 0o600
    acl = subprocess.run(["getfacl", "-n", str(checkpoint)], capture_output=True, text=True, check=True).stdout
    assert re.search(rf"^group:{group}:r-[x-]\t#effective:---$", acl, re.M) and "mask::---" in acl
    denied = _as(OTHER, "cat", checkpoint)
    assert denied.returncode != 0 and "Permission denied" in denied.stderr

    # the same ACL does open a file whose writer leaves group bits (0640 here; torch.save under umask 022)
    fd = os.open(shared / "group.bin", os.O_WRONLY | os.O_CREAT, 0o640)
    os.write(fd, b"weights")
    os.close(fd)
    assert _as(OTHER, "cat", shared / "group.bin").stdout == "weights"


def test_syncd_at_trainer_converts_the_trainers_0600_checkpoints(shared_root: Path) -> None:
    with DaemonRun(shared_root / "d") as run:
        os.chown(run.root, TRAINER.pw_uid, TRAINER.pw_gid)  # the instance's state and log are the trainer's
        runs = run.watch_dir()
        os.chown(runs, TRAINER.pw_uid, TRAINER.pw_gid)
        os.chmod(runs, 0o700)  # private to the trainer
        checkpoint = runs / "step-100.safetensors"
        _save_as(TRAINER, checkpoint)
        info = os.stat(checkpoint)
        assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (TRAINER.pw_uid, 0o600)

        as_other = _as(OTHER, sys.executable, "-m", "syncd", "check-config", run.config_path)
        assert as_other.returncode == 0
        assert f"user {OTHER.pw_name} cannot list 1 director(ies), e.g. {runs}" in as_other.stdout
        checked = run_cli("check-config", run.config_path, "--user", TRAINER.pw_name)
        assert checked.returncode == 0 and "warning" not in checked.stdout, checked.stdout

        run.start(user=TRAINER.pw_uid)  # what syncd@nobody.service does: User=%i
        run.wait_for("converted", [checkpoint])
        output = os.stat(runs / "step-100.bpk")
        assert (output.st_uid, stat.S_IMODE(output.st_mode)) == (TRAINER.pw_uid, 0o600)
        assert run.stop()[0] == 0


def test_check_config_warns_about_unreadable_checkpoints_and_unwritable_directories(shared_root: Path) -> None:
    with DaemonRun(shared_root / "d") as run:
        runs = run.watch_dir()
        os.chmod(run.root, 0o755)
        os.chmod(runs, 0o755)  # listable by all, writable by root only
        _save_as(pwd.getpwuid(0), runs / "private.safetensors")  # 0600 root
        (runs / "notes.txt").write_text("not a checkpoint: never a warning")
        os.chmod(runs / "notes.txt", 0o600)
        proc = run_cli("check-config", run.config_path, "--user", OTHER.pw_name)
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stdout.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 2, proc.stdout
    assert (
        f"user daemon cannot read 1 checkpoint(s), e.g. {runs / 'private.safetensors'} (owner root, mode 0600)"
        in (warnings[0])
    )
    assert "syncd@WRITER.service" in warnings[0]
    assert f"user daemon cannot write 1 output director(ies), e.g. {runs}" in warnings[1]
    assert proc.stdout.splitlines()[-1].endswith("valid (1 watch)")
