"""Is a directory on a filesystem that other machines write to? Read from `statfs(2)`'s `f_type`.

On a network or cluster filesystem inotify reports only what this machine's kernel did: a checkpoint another
node writes makes no event here. A watch on such a filesystem is therefore watched with inotify (this node's
writes, at once) and polled as well (other nodes' writes), and the nodes that share it coordinate through
claims beside the outputs (`syncd.daemon.claims`).

The magic numbers are the kernel's (include/uapi/linux/magic.h, fs/smb/client, fs/ceph) and the vendors'
(Lustre's LL_SUPER_MAGIC, GPFS's, BeeGFS's). GlusterFS's native client is a FUSE filesystem, as are sshfs,
s3fs and the like: FUSE is taken as shared, since nothing says which process behind it writes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

# f_type -> the name said in the `started` line
NETWORK_FILESYSTEMS: dict[int, str] = {
    0x6969: "nfs",
    0x517B: "smb",
    0xFF534D42: "cifs",
    0xFE534D42: "smb2",
    0x0BD00BD0: "lustre",
    0x00C36400: "ceph",
    0x47504653: "gpfs",
    0x19830326: "beegfs",
    0x65735546: "fuse",  # GlusterFS's native client, sshfs, s3fs...
    0x01161970: "gfs2",
    0x7461636F: "ocfs2",
    0x6B414653: "afs",
    0x5346414F: "afs",  # OpenAFS
    0x01021997: "9p",
    0xAAD7AAEA: "panfs",
}

_STATFS_BYTES = 256  # struct statfs is 120 bytes on 64-bit Linux; f_type (a long) comes first
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def filesystem_type(path: str | os.PathLike[str]) -> int:
    """`statfs(path).f_type`: the magic number of the filesystem `path` is on. OSError if it cannot be read."""
    buffer = ctypes.create_string_buffer(_STATFS_BYTES)
    if _libc.statfs(os.fsencode(path), buffer) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), os.fspath(path))
    return ctypes.c_ulong.from_buffer(buffer).value & 0xFFFFFFFF  # f_type is a 32-bit magic in a long


def network_filesystem_name(f_type: int) -> str | None:
    """The name of the network or cluster filesystem whose magic number is `f_type`; None for a local one."""
    return NETWORK_FILESYSTEMS.get(f_type & 0xFFFFFFFF)


def shared_filesystem(*paths: Path | None) -> str | None:
    """The name of the network filesystem any of `paths` is on (the first found), None when all are local or
    cannot be read (a missing mirror is reported elsewhere)."""
    for path in paths:
        if path is None:
            continue
        try:
            name = network_filesystem_name(filesystem_type(path))
        except OSError:
            continue
        if name is not None:
            return name
    return None
