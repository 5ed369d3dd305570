"""Claims on outputs (syncd/daemon/claims.py), the filesystem types that make a watch shared
(syncd/daemon/fstype.py) and the `cluster:` section that settles it, with real processes, real locks, real
PID namespaces and this machine's real filesystems."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from daemonutil import NOBODY, runnable_by_others

from syncd.daemon.claims import (
    CLAIM_SUFFIX,
    Published,
    claim_path,
    is_claim_name,
    is_held,
    records_of,
    remove_if_orphaned,
    try_claim,
)
from syncd.daemon.config import ClusterSettings, Watch, check_config, load_config
from syncd.daemon.fstype import NETWORK_FILESYSTEMS, filesystem_type, network_filesystem_name
from syncd.daemon.names import is_candidate
from syncd.daemon.service import shared_watches

# holds the claim on argv[1] until its standard input closes, saying "held" once it has it
HOLDER = """
import sys
from pathlib import Path
from syncd.daemon.claims import try_claim
claim = try_claim(Path(sys.argv[1]))
print("held" if claim is not None else "refused", flush=True)
sys.stdin.read()
"""


def hold(dest: Path, wrapper: tuple[str, ...] = ()) -> subprocess.Popen[str]:
    """Another process (in another PID namespace with `wrapper`) holding the claim on `dest`."""
    proc = subprocess.Popen(
        [*wrapper, sys.executable, "-c", HOLDER, os.fspath(dest)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.fspath(REPO)},
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "held"
    return proc


def holding_process(proc: subprocess.Popen[str]) -> int:
    """The process that holds the claim: `proc` itself, or the child `unshare --fork` runs it as."""
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    return int(children[0]) if children else proc.pid


@pytest.mark.root
@pytest.mark.parametrize("namespace", [(), ("unshare", "--pid", "--fork", "--kill-child", "--mount-proc")])
def test_a_claim_is_exclusive_while_its_holder_lives_and_free_once_it_is_killed(
    tmp_path: Path, namespace: tuple[str, ...]
) -> None:
    dest = tmp_path / "model.bpk"
    holder = hold(dest, namespace)
    try:
        assert try_claim(dest) is None
        assert is_held(dest)
        assert not remove_if_orphaned(claim_path(dest))  # held: never removed, output or not
    finally:
        os.kill(holding_process(holder), signal.SIGKILL)  # however it dies, the kernel drops its lock
        holder.wait(30)
    claim = try_claim(dest)
    assert claim is not None
    with claim:
        assert try_claim(dest) is None  # two claims in one process exclude each other too (one per open)
    assert not is_held(dest)


def test_the_record_of_a_publish_is_read_back_and_a_torn_one_proves_nothing(tmp_path: Path) -> None:
    dest = tmp_path / "model.bpk"
    published = Published("model.safetensors", (1, 2, 3, 4), (5, 6, 7, 8), node="node-a")
    claim = try_claim(dest)
    assert claim is not None
    with claim:
        assert claim.published() is None  # a new claim file holds no record
        claim.record(published)
    again = try_claim(dest)
    assert again is not None
    with again:
        assert again.published() == published
    data = published.to_bytes()
    for torn in (data[: len(data) // 2], b"", b"{}", data.replace(b"[1, 2, 3, 4]", b'["1", 2, 3, 4]')):
        assert Published.from_bytes(torn) is None


def _recorded(dest: Path, published: Published) -> Path:
    claim = try_claim(dest)
    assert claim is not None
    with claim:
        claim.record(published)
    return claim_path(dest)


def test_a_record_in_a_claim_file_others_may_write_proves_nothing(tmp_path: Path) -> None:
    dest = tmp_path / "model.bpk"
    path = _recorded(dest, Published("model.safetensors", (1, 2, 3, 4), (5, 6, 7, 8)))
    for mode in (0o664, 0o646):
        os.chmod(path, mode)  # anyone of the group (or anyone at all) could have written this record
        assert records_of(dest) == (None, None)
    os.chmod(path, 0o644)
    assert records_of(dest)[0] is not None


@pytest.mark.root
def test_a_record_in_a_claim_file_another_user_owns_proves_nothing(tmp_path: Path) -> None:
    dest = tmp_path / "model.bpk"
    path = _recorded(dest, Published("model.safetensors", (1, 2, 3, 4), (5, 6, 7, 8)))
    os.chown(path, NOBODY, NOBODY)  # planted by someone who may create files in the tree
    assert records_of(dest) == (None, None)
    claim = try_claim(dest)
    assert claim is not None
    with claim:
        assert claim.published() is None and claim.placing() is None


def test_a_record_naming_a_member_outside_the_sets_directory_is_no_record() -> None:
    stamp = [1, 2, 3, 4]
    for name in ("../outside/victim.txt", "/etc/passwd", "sub/../../x", "./m.safetensors", "a//b", ""):
        doc = {"source": "m.bpk", "source_stamp": stamp, "dest_stamp": stamp, "members": {name: stamp}}
        assert Published.from_bytes(json.dumps(doc).encode()) is None, name
    doc = {"source": "m.bpk", "source_stamp": stamp, "dest_stamp": stamp, "members": {"sub/m-1.safetensors": stamp}}
    assert Published.from_bytes(json.dumps(doc).encode()) is not None


def test_a_claim_file_is_removed_only_when_its_output_is_gone_and_nobody_holds_it(tmp_path: Path) -> None:
    dest = tmp_path / "model.bpk"
    dest.write_bytes(b"output")
    claim = try_claim(dest)
    assert claim is not None
    claim.release()
    assert not remove_if_orphaned(claim_path(dest))  # the output is there: the file is its record
    dest.unlink()
    assert remove_if_orphaned(claim_path(dest))
    assert sorted(os.listdir(tmp_path)) == []
    assert not remove_if_orphaned(tmp_path / "model.bpk")  # not a claim name: never touched


def test_an_output_name_too_long_for_the_suffix_gets_a_shortened_claim_that_works(tmp_path: Path) -> None:
    dest = tmp_path / ("é" * 120 + ".bpk")  # 244 bytes: room for the output, not for its claim's suffix
    path = claim_path(dest)
    assert len(os.fsencode(path.name)) == 255 and is_claim_name(path.name)
    claim = try_claim(dest)
    assert claim is not None
    with claim:
        assert try_claim(dest) is None
    assert not remove_if_orphaned(path)  # which output it served cannot be told from its name: kept


def test_claim_files_are_never_candidates_whatever_the_watch_lets_through(tmp_path: Path) -> None:
    name = f".model.safetensors{CLAIM_SUFFIX}"
    assert is_claim_name(name) and not is_claim_name("model.safetensors") and not is_claim_name(CLAIM_SUFFIX)
    everything = Watch(path=tmp_path, ignore=(), include=("*",))
    assert not is_candidate(everything, tmp_path / name)
    assert is_candidate(everything, tmp_path / "model.safetensors")


def test_a_claim_is_never_taken_through_a_symlink_planted_at_its_name(tmp_path: Path) -> None:
    dest = tmp_path / "model.bpk"
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    os.symlink(target, claim_path(dest))
    with pytest.raises(OSError):
        try_claim(dest)
    assert target.read_bytes() == b""


# ------------------------------------------------------------------------------------------ filesystem types

# the kernel's names (/proc/mounts) of filesystems other nodes write to, and the name syncd gives each
NETWORK_MOUNT_TYPES = {
    "nfs": "nfs",
    "nfs4": "nfs",
    "cifs": "cifs",
    "smb3": "cifs",
    "lustre": "lustre",
    "ceph": "ceph",
    "gpfs": "gpfs",
    "beegfs": "beegfs",
    "gfs2": "gfs2",
    "ocfs2": "ocfs2",
    "9p": "9p",
    "afs": "afs",
}


def mounts() -> list[tuple[Path, str]]:
    """(mount point, filesystem type) of every mount this process sees."""
    found = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        point = fields[1].replace("\\040", " ")
        found.append((Path(point), fields[2]))
    return found


def test_every_filesystem_of_this_machine_is_told_local_or_shared_as_its_mount_type_says() -> None:
    seen = 0
    for point, fstype in mounts():
        try:
            magic = filesystem_type(point)
        except OSError:
            continue  # a mount point this process may not reach
        seen += 1
        expected = "fuse" if fstype.startswith("fuse.") or fstype == "fuse" else NETWORK_MOUNT_TYPES.get(fstype)
        assert network_filesystem_name(magic) == expected, (point, fstype, hex(magic))
    assert seen >= 3


def test_the_magic_numbers_are_the_kernels() -> None:
    # include/uapi/linux/magic.h, fs/smb/client/cifsglob.h, Lustre's LL_SUPER_MAGIC, GPFS, BeeGFS
    expected = {
        0x6969: "nfs",
        0xFF534D42: "cifs",
        0xFE534D42: "smb2",
        0x517B: "smb",
        0x0BD00BD0: "lustre",
        0x00C36400: "ceph",
        0x47504653: "gpfs",
        0x19830326: "beegfs",
        0x65735546: "fuse",
    }
    for magic, name in expected.items():
        assert network_filesystem_name(magic) == name
        assert NETWORK_FILESYSTEMS[magic] == name
    for local in (0xEF53, 0x01021994, 0x9123683E, 0x58465342, 0x9FA0, 0x62656572):  # ext4 tmpfs btrfs xfs proc sys
        assert network_filesystem_name(local) is None
    # a negative f_type (a long holding a 32-bit magic with its top bit set) is the same filesystem
    assert network_filesystem_name(0xFF534D42 - (1 << 32)) == "cifs"


def test_a_filesystem_that_cannot_be_read_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        filesystem_type(tmp_path / "missing")


# ------------------------------------------------------------------------------------------ the cluster: section


def config_with(directory: Path, cluster: str) -> Path:
    (directory / "runs").mkdir(exist_ok=True)
    path = directory / "syncd.yaml"
    path.write_text(f"{cluster}watches:\n  - path: runs\n")
    path.chmod(0o644)
    return path


def test_a_single_machine_needs_no_cluster_section_and_its_watches_are_not_shared(tmp_path: Path) -> None:
    config = load_config(config_with(tmp_path, ""))
    assert config.cluster == ClusterSettings(shared="auto", poll_interval=10.0)
    assert shared_watches(config) == {}  # this machine's filesystems are local


@pytest.mark.parametrize("value", ["true", "false", "auto"])
def test_cluster_shared_and_poll_interval_are_read(tmp_path: Path, value: str) -> None:
    config = load_config(config_with(tmp_path, f"cluster:\n  shared: {value}\n  poll_interval: 2.5\n"))
    expected = {"true": True, "false": False, "auto": "auto"}[value]
    assert config.cluster == ClusterSettings(shared=expected, poll_interval=2.5)
    shared = shared_watches(config)
    assert shared == ({config.watches[0].path: "shared: true"} if value == "true" else {})


@pytest.mark.parametrize(
    ("cluster", "expected"),
    [
        ("cluster:\n  shared: yes-please\n", "syncd.yaml:2: cluster.shared: expected auto, true or false, got"),
        (
            "cluster:\n  poll_interval: 0\n",
            "syncd.yaml:2: cluster.poll_interval: expected a number > 0 and <= 604800, got 0",
        ),
        ("cluster:\n  pol_interval: 5\n", "syncd.yaml:2: cluster.pol_interval: unknown key"),
    ],
)
def test_a_bad_cluster_setting_is_named_with_its_line(tmp_path: Path, cluster: str, expected: str) -> None:
    problems = check_config(config_with(tmp_path, cluster))
    assert len(problems) == 1 and expected in problems[0], problems


# takes the lock on the file argv[1] as a user who may read it would: flock needs no write access
LOCKER = "import fcntl, os, sys; fcntl.flock(os.open(sys.argv[1], os.O_RDONLY), fcntl.LOCK_EX | fcntl.LOCK_NB)"


@pytest.mark.root
def test_no_other_user_can_hold_a_claim_to_keep_its_output_from_being_converted(tmp_path: Path) -> None:
    runnable_by_others(tmp_path)
    new, old = tmp_path / "new.bpk", tmp_path / "old.bpk"
    claim_path(old).write_bytes(b"")
    os.chmod(claim_path(old), 0o644)  # as syncd made claim files before
    previous = os.umask(0)
    try:
        for dest in (new, old):
            claim = try_claim(dest)
            assert claim is not None
            claim.release()
    finally:
        os.umask(previous)
    for dest in (new, old):
        assert os.stat(claim_path(dest)).st_mode & 0o777 == 0o600
        locker = subprocess.run(
            [sys.executable, "-c", LOCKER, os.fspath(claim_path(dest))],
            user=NOBODY,
            group=NOBODY,
            extra_groups=[],
            capture_output=True,
            text=True,
        )
        assert locker.returncode != 0 and "PermissionError" in locker.stderr
        claim = try_claim(dest)
        assert claim is not None
        claim.release()
