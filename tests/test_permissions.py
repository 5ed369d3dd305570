"""Reading trainers' checkpoints: safetensors' save_file writes mode 0600, a default ACL cannot open such a
file to a group (the creation mode masks it), and the documented setup, syncd@TRAINER (the daemon runs as the
training user), converts them; `check-config --user` warns about what a service user cannot read or write."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import struct
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


# POSIX ACLs as the kernel stores them in the xattrs system.posix_acl_access / system.posix_acl_default
# (linux/posix_acl_xattr.h): a little-endian u32 version 2, then entries of (u16 tag, u16 perm, u32 id),
# sorted by tag and then id; only ACL_USER and ACL_GROUP entries carry an id.
ACL_XATTR_VERSION = 2
ACL_USER_OBJ, ACL_USER, ACL_GROUP_OBJ, ACL_GROUP, ACL_MASK, ACL_OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
ACL_UNDEFINED_ID = 0xFFFFFFFF
ACL_ENTRY = struct.Struct("<HHI")
R, W, X = 4, 2, 1


def acl_xattr(entries: list[tuple[int, int, int]]) -> bytes:
    """The xattr value of an ACL given as (tag, perm, id) entries."""
    return struct.pack("<I", ACL_XATTR_VERSION) + b"".join(ACL_ENTRY.pack(*entry) for entry in sorted(entries))


def acl_entries(value: bytes) -> list[tuple[int, int, int]]:
    """The (tag, perm, id) entries of an ACL xattr value."""
    assert struct.unpack_from("<I", value)[0] == ACL_XATTR_VERSION and (len(value) - 4) % ACL_ENTRY.size == 0
    return [ACL_ENTRY.unpack_from(value, offset) for offset in range(4, len(value), ACL_ENTRY.size)]


def test_save_file_writes_0600_and_a_default_acl_cannot_open_it_to_a_group(shared_root: Path) -> None:
    shared = shared_root / "shared"
    shared.mkdir(mode=0o755)
    group = OTHER.pw_gid  # the group the ACL names (as `syncd` would be)
    # what `setfacl -m d:g:GROUP:rX,g:GROUP:rX,d:o::-,o::-` sets on a 0755 directory, with its mask
    acl = acl_xattr(
        [
            (ACL_USER_OBJ, R | W | X, ACL_UNDEFINED_ID),
            (ACL_GROUP_OBJ, R | X, ACL_UNDEFINED_ID),
            (ACL_GROUP, R | X, group),
            (ACL_MASK, R | X, ACL_UNDEFINED_ID),
            (ACL_OTHER, 0, ACL_UNDEFINED_ID),
        ]
    )
    os.setxattr(shared, "system.posix_acl_access", acl)
    os.setxattr(shared, "system.posix_acl_default", acl)
    assert acl_entries(os.getxattr(shared, "system.posix_acl_default")) == acl_entries(acl)

    checkpoint = shared / "model.safetensors"
    _save_as(pwd.getpwuid(0), checkpoint)
    assert stat.S_IMODE(os.stat(checkpoint).st_mode) == 0o600
    inherited = acl_entries(os.getxattr(checkpoint, "system.posix_acl_access"))
    assert (ACL_GROUP, R | X, group) in inherited  # the entry is there, but the 0600 creation mode ...
    assert (ACL_MASK, 0, ACL_UNDEFINED_ID) in inherited  # ... leaves a mask that makes it ineffective
    denied = _as(OTHER, "cat", checkpoint)
    assert denied.returncode != 0 and "Permission denied" in denied.stderr

    # the same ACL does open a file whose writer leaves group bits (0640 here; torch.save under umask 022)
    fd = os.open(shared / "group.bin", os.O_WRONLY | os.O_CREAT, 0o640)
    os.write(fd, b"weights")
    os.close(fd)
    assert (ACL_MASK, R, ACL_UNDEFINED_ID) in acl_entries(os.getxattr(shared / "group.bin", "system.posix_acl_access"))
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
        assert as_other.returncode == 2  # the state and the log are the trainer's: OTHER's daemon could not start
        assert f"user {OTHER.pw_name} cannot write {run.root} (log.path), so the daemon cannot start" in as_other.stdout
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
    # the daemon's own files first (state and log left in root's directory, as a syncd@USER config copied
    # from the service's with state_dir unchanged would): the daemon could not start, so the config is refused
    # (it was `valid`, exit 0, and the daemon then failed at every start)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:2] == [
        f"{run.config_path}: user daemon cannot create {run.root}/state (state_dir) in {run.root}, so the daemon "
        "cannot start",
        f"{run.config_path}: user daemon cannot write {run.root} (log.path), so the daemon cannot start",
    ]
    warnings = lines[2:]
    assert len(warnings) == 2 and all(line.startswith("warning: ") for line in warnings), proc.stdout
    assert (
        f"user daemon cannot read 1 checkpoint(s), e.g. {runs / 'private.safetensors'} (owner root, mode 0600)"
        in (warnings[0])
    )
    assert "syncd@WRITER.service" in warnings[0]
    assert f"user daemon cannot write 1 output director(ies), e.g. {runs}" in warnings[1]


def test_as_root_an_output_takes_its_sources_owner_as_it_takes_its_mode(tmp_path: Path) -> None:
    """A daemon (or `syncd convert`) running as root made a trainer's 0600 checkpoint into a root-owned 0600
    output the trainer could not read. As root, an output (a set: every file) now takes its source's owner and
    group, as it takes its mode bits."""
    from daemonutil import NOBODY

    from syncd.engine.convert import ConvertRequest, convert

    assert os.geteuid() == 0, "the suite runs as root (README)"
    source = tmp_path / "mnist.safetensors"
    shutil.copyfile(REPO / "tests" / "data" / "fixtures" / "pytorch" / "mnist.safetensors", source)
    os.chmod(source, 0o600)
    os.chown(source, NOBODY, NOBODY)
    convert(ConvertRequest(source=source))
    out = os.stat(tmp_path / "mnist.bpk")
    assert (out.st_uid, out.st_gid, stat.S_IMODE(out.st_mode)) == (NOBODY, NOBODY, 0o600)
    shards = tmp_path / "set"
    shards.mkdir()
    convert(ConvertRequest(source=tmp_path / "mnist.bpk", dest=shards, shard_size=1 << 20, always_index=True))
    files = sorted(shards.iterdir())
    assert len(files) == 3  # two shards and the index
    assert {(os.stat(f).st_uid, os.stat(f).st_gid, stat.S_IMODE(os.stat(f).st_mode)) for f in files} == {
        (NOBODY, NOBODY, 0o600)
    }


def test_a_state_dir_the_unit_gives_its_user_at_start_is_a_warning_not_a_problem(
    shared_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/var/lib/syncd left root's by a first run as root: StateDirectory= hands it to the unit's user at every
    start, so `check-config --user` refusing the config (exit 2) stopped a correct install. Missing, it was a
    warning already. (The unit's directories are taken below a directory of this test's.)"""
    from syncd.daemon import access
    from syncd.daemon.config import load_config

    var_lib = shared_root / "var-lib"
    (shared_root / "runs").mkdir()
    monkeypatch.setattr(access, "UNIT_MADE", (var_lib,))

    def checked(state: Path) -> access.AccessReport:
        state.mkdir(parents=True, exist_ok=True)  # root's, 0755
        config_path = shared_root / "syncd.yaml"
        config_path.write_text(
            f"state_dir: {state}\nlog: {{path: {state / 'sync.jsonl'}}}\nwatches:\n  - path: {shared_root / 'runs'}\n"
        )
        config_path.chmod(0o644)
        return access.check_access(load_config(config_path), OTHER.pw_name)

    own = checked(var_lib / f"syncd@{OTHER.pw_name}")  # syncd@daemon.service's StateDirectory=
    assert own.problems == []
    assert any("the daemon starts only if systemd gives it to the user" in line for line in own.warnings)
    # no unit gives the user another package's directory, the system unit's (User=syncd), or /var/lib itself
    for state in (var_lib / "dpkg", var_lib / "syncd", var_lib):
        assert checked(state).problems, state
