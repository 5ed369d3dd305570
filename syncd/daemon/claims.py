"""Claims on an output, honoured by every syncd that shares the tree (one per node on a shared filesystem).

Before converting into `dest`, a node takes the claim `.<dest name>.syncd-claim` beside it: the file is opened
(created if missing) and locked with `flock(LOCK_EX | LOCK_NB)`. The lock *is* the claim: the kernel, or on a
network filesystem its lock manager (NFSv4 leases, Lustre's LDLM, Ceph's MDS, GPFS's token manager), drops it
when the holder dies however it dies -- a SIGKILL, an OOM kill, a node that loses power (after the lease
expires). So a claim is never "broken" by a timeout: a node finding the lock held does not convert and looks
again later, and a holder that is alive (stopped, swapping, slow) keeps its claim for as long as it lives.

Why flock and a file beside the output: the output's directory is the one place every node that may publish
there can reach; an exclusively created file alone (O_EXCL) would outlive its dead creator and need a timeout
to be broken, which would break a live but slow holder's claim. flock on a Linux NFS client is carried to the
server as a whole-file POSIX lock, so it holds across nodes.

The claim file also holds the record of the last publish (`Published`): which source version was converted
and which output file came of it, both by identity (inode, size, mtime, ctime, without the device number,
which differs from one client of a network filesystem to another). A node that did not publish the file
adopts it from that record without reading the source: the output is syncd's when it still is exactly the
file recorded (any write, truncate, chmod or utime changes its ctime, which no one can set back). A record
that does not match proves nothing, and the file is then judged as if there were none.

Right before an output is put in place, its publisher adds to the claim file the record of that output
(`placing`), the publish's own record replacing both afterwards. A node killed in between leaves an output
its `placing` still proves (by identity without the ctime, which putting the file in place changes).

The file stays while its output exists (it is the record); a claim file whose output is gone is removed by
whichever node next finds it unlocked. Removing takes the lock first and checks the name still is that file;
taking a claim checks the same after locking, so a claim is never taken on a file just unlinked.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

CLAIM_SUFFIX = ".syncd-claim"
_NAME_MAX = 255  # bytes in one path component on Linux filesystems
_RECORD_MAX = 1 << 20  # a record is a few hundred bytes, a set's ~100 more per file; anything longer is not ours
_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# errors of flock that mean the filesystem offers no lock across nodes (a Lustre mount without -o flock)
NO_LOCKS = frozenset({errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL})

Stamp = tuple[int, int, int, int]  # inode, size, mtime_ns, ctime_ns: one version of a file, on any node


def claim_path(dest: Path) -> Path:
    """The claim file of the output `dest`. A name too long for one more suffix is shortened (two outputs
    whose long names share their beginning then share a claim: they are converted one after the other)."""
    room = _NAME_MAX - 1 - len(CLAIM_SUFFIX)
    name = os.fsencode(dest.name)
    if len(name) > room:
        return dest.parent / f".{name[:room].decode('utf-8', 'surrogateescape')}{CLAIM_SUFFIX}"
    return dest.parent / f".{dest.name}{CLAIM_SUFFIX}"


def is_claim_name(name: str) -> bool:
    """True for the names of claim files, which the watcher and the scans ignore."""
    return name.startswith(".") and name.endswith(CLAIM_SUFFIX) and len(name) > len(CLAIM_SUFFIX) + 1


def stamp_of(info: os.stat_result) -> Stamp:
    return (info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


class ClaimError(OSError):
    """The claim could not be taken for a reason other than another holder (no locks on this filesystem)."""


@dataclass(frozen=True)
class Published:
    """The publishing node's record: the source version converted and the output file that came of it."""

    source: str  # the source's file name, as the output's syncd.source metadata names it
    source_stamp: Stamp
    dest_stamp: Stamp  # NOT_PLACED: a set's index not put in place yet (its shards are placed first)
    node: str = ""  # the host that published, for people reading the file
    members: tuple[tuple[str, Stamp], ...] = ()  # a set: its other files, by name beside the output

    def to_doc(self) -> dict[str, object]:
        doc: dict[str, object] = {
            "source": self.source,
            "source_stamp": list(self.source_stamp),
            "dest_stamp": list(self.dest_stamp),
            "node": self.node,
        }
        if self.members:
            doc["members"] = {name: list(stamp) for name, stamp in self.members}
        return doc

    def member_stamp(self, name: str) -> Stamp | None:
        return dict(self.members).get(name)

    def to_bytes(self) -> bytes:
        return _encode(self.to_doc())

    @classmethod
    def from_bytes(cls, data: bytes, key: str | None = None) -> Published | None:
        """The record in `data` (or under its `key`); None for anything that is not a whole record (an
        empty claim, a torn write)."""
        try:
            doc = json.loads(data)
            if key is not None:
                doc = doc[key]
            source, node = doc["source"], doc.get("node", "")
            source_stamp, dest_stamp = _stamp(doc["source_stamp"]), _stamp(doc["dest_stamp"])
            members = [(name, _stamp(stamp)) for name, stamp in doc.get("members", {}).items()]
        except (ValueError, KeyError, TypeError, AttributeError):
            return None
        if not isinstance(source, str) or not isinstance(node, str) or source_stamp is None or dest_stamp is None:
            return None
        checked = tuple((name, stamp) for name, stamp in members if _is_member_name(name) and stamp is not None)
        if len(checked) != len(members):
            return None
        return cls(source, source_stamp, dest_stamp, node, checked)


NOT_PLACED: Stamp = (0, 0, 0, 0)  # no file has inode 0


def _written_by_us(info: os.stat_result) -> bool:
    """A record proves something only in a claim file that no one but syncd's own user could have written: one
    this user owns and no group or other may write. Anyone who may create files in a tree could otherwise
    plant a record naming any file (its identity is one stat away) as syncd's output, to have it replaced or
    removed. The nodes of a shared tree run syncd as one user (docs/many-nodes.md)."""
    return info.st_uid == os.geteuid() and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _is_member_name(name: object) -> bool:
    """A set's file named as its index names its shards: a relative path inside the set's directory."""
    if not isinstance(name, str) or not name or "\x00" in name or name.startswith("/"):
        return False
    parts = name.split("/")
    return all(part not in ("", ".", "..") for part in parts)


def _encode(doc: dict[str, object]) -> bytes:
    return (json.dumps(doc, sort_keys=True) + "\n").encode()


def _stamp(value: object) -> Stamp | None:
    if isinstance(value, list) and len(value) == 4 and all(type(v) is int for v in value):
        return (value[0], value[1], value[2], value[3])
    return None


class Claim:
    """A claim held on one output: the claim file's descriptor, locked. Release it (or leave the `with`)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd

    def published(self) -> Published | None:
        """The record of the last publish of this output, if the file holds a whole one."""
        data = self._read()
        return None if data is None else Published.from_bytes(data)

    def placing(self) -> Published | None:
        """The record of an output about to be put in place and not recorded as published since (its
        publisher died in between), if the file holds a whole one. Its `dest_stamp` has the ctime the file
        had before it was put in place."""
        data = self._read()
        return None if data is None else Published.from_bytes(data, "placing")

    def record_placing(self, placing: Published) -> None:
        """Add the record of the output about to be put in place, keeping the last publish's (made durable
        before the output is placed)."""
        last = self.published()
        self._write(_encode({**(last.to_doc() if last is not None else {}), "placing": placing.to_doc()}))

    def _read(self) -> bytes | None:
        if not _written_by_us(os.fstat(self.fd)):
            return None
        data = os.pread(self.fd, _RECORD_MAX + 1, 0)
        return None if len(data) > _RECORD_MAX else data

    def record(self, published: Published) -> None:
        """Write the record of a publish (made durable before the claim is released)."""
        self._write(published.to_bytes())

    def _write(self, data: bytes) -> None:
        """Replace the record in one write, never truncating first: a holder killed between a truncate and
        its write would leave no record at all. A shorter record is padded with spaces (JSON's own)."""
        data = data.ljust(os.fstat(self.fd).st_size, b" ")
        os.pwrite(self.fd, data, 0)
        os.fsync(self.fd)

    def forget(self) -> None:
        """Empty the record: the output it named is no longer syncd's (or never was)."""
        os.ftruncate(self.fd, 0)

    def release(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)  # drops the lock

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def try_claim(dest: Path) -> Claim | None:
    """Take the claim on `dest`, or None while another holder (any process, any node) has it.

    Raises ClaimError when the filesystem gives no locks, OSError when the claim file cannot be made."""
    path = claim_path(dest)
    while True:
        fd = os.open(path, _FLAGS, 0o600)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise OSError(errno.EINVAL, "the claim file is not a regular file", os.fspath(path))
            if not _lock(fd, path):
                os.close(fd)
                return None
            if _names(path, fd):
                _keep_private(fd, info)
                return Claim(path, fd)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # removed (or replaced) between our open and our lock: take the one there now


def _keep_private(fd: int, info: os.stat_result) -> None:
    """A claim file only its syncd may open: flock needs no write access, so any user who could read it could
    hold its lock and keep the output from being converted, unseen. (Older syncds made them 0644.)"""
    if info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) & 0o077:
        os.fchmod(fd, 0o600)


def records_of(dest: Path) -> tuple[Published | None, Published | None]:
    """The claim file's records of `dest` (the last publish, an output about to be placed), read without
    taking the claim: what a holder may be rewriting, so a hint, never proof of whose `dest` is."""
    try:
        fd = os.open(claim_path(dest), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None, None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None, None
        claim = Claim(claim_path(dest), fd)
        return claim.published(), claim.placing()
    finally:
        os.close(fd)


def is_held(dest: Path) -> bool:
    """True while some holder has the claim on `dest` (it is converting it now). A shared lock tells, and
    needs only a descriptor open for reading, on NFS too."""
    try:
        fd = os.open(claim_path(dest), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return False


def remove_if_orphaned(path: Path) -> bool:
    """Remove the claim file `path` if nobody holds it and its output is gone; True if it was removed."""
    name = path.name
    if not is_claim_name(name) or len(os.fsencode(name)) >= _NAME_MAX:
        return False  # not a claim, or one whose output's name was shortened: which output is unknown
    dest = path.parent / name[1 : -len(CLAIM_SUFFIX)]
    if os.path.lexists(dest):
        return False
    try:
        # for writing: NFS carries flock as a whole-file POSIX lock, and an exclusive one needs that
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # held: its holder is publishing that output right now
        if os.path.lexists(dest) or not _names(path, fd):
            return False
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(fd)


def _lock(fd: int, path: Path) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in NO_LOCKS:
            raise ClaimError(exc.errno, f"no file locks on this filesystem ({exc.strerror})", os.fspath(path)) from exc
        raise
    return True


def _names(path: Path, fd: int) -> bool:
    """The name `path` still is the file open as `fd`."""
    try:
        now = os.lstat(path)
    except FileNotFoundError:
        return False
    here = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (here.st_dev, here.st_ino)


def this_node() -> str:
    return socket.gethostname()
