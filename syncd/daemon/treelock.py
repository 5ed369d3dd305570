"""One daemon per tree. Two daemons with state directories of their own, watching one tree, each take the
other's output for a checkpoint (neither's state knows the other's): each converts it back, and the other
converts that back, without end -- and a source deleted by its user is made again from the other daemon's
output. So a daemon holds an `flock` on the directory of every tree it watches alone (not on the trees it
shares with other nodes, where claims coordinate the daemons: docs/many-nodes.md), and a second one is refused.

The lock is on the directory itself, so nothing is created in the user's tree; the kernel drops it when the
process ends, however it ends."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterable
from pathlib import Path

from syncd.errors import SyncdError


class TreeLocks:
    """The trees this daemon holds."""

    def __init__(self) -> None:
        self._held: dict[Path, int] = {}

    def hold(self, roots: Iterable[Path]) -> None:
        """Hold exactly `roots` (those held before and not listed are let go). Raises SyncdError naming the first
        root another process holds; none of `roots` is held then."""
        self.release()
        try:
            for root in roots:
                fd = _lock(root)
                if fd is not None:
                    self._held[root] = fd
        except SyncdError:
            self.release()
            raise

    def release(self) -> None:
        for fd in self._held.values():
            os.close(fd)  # drops the lock
        self._held.clear()


def _lock(root: Path) -> int | None:
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None  # a tree not there (yet): the watcher reports it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SyncdError(
            "another syncd watches this tree (a daemon with a state directory of its own): two daemons on one "
            "tree convert each other's outputs back and forth; run one, or set `cluster: shared: true` in both "
            "if they are to share it",
            str(root),
        ) from None
    except OSError:
        os.close(fd)
        return None  # a filesystem without flock on directories: nothing to hold
    return fd
