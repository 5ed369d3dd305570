"""One daemon per tree. Two daemons with state directories of their own, watching one tree, each take the
other's output for a checkpoint (neither's state knows the other's): each converts it back, and the other
converts that back, without end -- and a source deleted by its user is made again from the other daemon's
output. So a daemon holds an `flock` on the directory of every tree it watches alone (not on the trees it
shares with other nodes, where claims coordinate the daemons: docs/many-nodes.md), and a second one is refused.

A tree inside another daemon's tree is the same mistake (a system-wide daemon on /data and a user's
`syncd@alice` on /data/alice/runs), so a daemon also holds a shared lock on every directory above its trees:
an exclusive lock on a tree is refused while a daemon watches a tree inside it, and a shared one above a tree
while a daemon watches a tree that holds it. The locks are on the directories themselves, so nothing is created
in anyone's tree; the kernel drops them when the process ends, however it ends."""

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
        self._roots: list[Path] = []

    def hold(self, roots: Iterable[Path]) -> None:
        """Hold exactly `roots`, and the directories above them (what was held before and is not is let go).
        Raises SyncdError naming the first tree another daemon's trees overlap; nothing is held then."""
        self.release()
        self._roots = list(roots)
        try:
            for directory, (mode, root) in sorted(_locks_for(self._roots).items()):
                fd = _lock(directory, mode, root)
                if fd is not None:
                    self._held[directory] = fd
        except SyncdError:
            self.release()
            raise

    def refresh(self, tree: Path) -> None:
        """Hold the directories of `tree` (one of the roots held) that were made anew since they were locked: a
        lock on a removed directory holds nothing, and another daemon could take the new one. The other trees'
        locks are kept all along. Raises SyncdError where another daemon took it first."""
        real = Path(os.path.realpath(tree))
        roots = self._roots if tree in self._roots else [*self._roots, tree]  # one held back by a reload
        for directory, (mode, root) in sorted(_locks_for(roots).items()):
            if directory != real and directory not in real.parents:
                continue
            held = self._held.get(directory)
            if held is not None and _same_directory(held, directory):
                continue
            fd = _lock(directory, mode, root)
            if held is not None:
                os.close(held)
                del self._held[directory]
            if fd is not None:
                self._held[directory] = fd
        self._roots = roots

    def release(self) -> None:
        for fd in self._held.values():
            os.close(fd)  # drops the lock
        self._held.clear()
        self._roots = []


def _same_directory(fd: int, directory: Path) -> bool:
    try:
        now, held = os.stat(directory), os.fstat(fd)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def _locks_for(roots: Iterable[Path]) -> dict[Path, tuple[int, Path]]:
    """Each directory to lock -> (how: exclusive for a tree, shared above one; the tree it is for). One lock
    per directory: a tree of this daemon above another of its trees is held exclusively, once."""
    locks: dict[Path, tuple[int, Path]] = {}
    for root in roots:
        real = Path(os.path.realpath(root))
        locks[real] = (fcntl.LOCK_EX, root)
        for above in real.parents:
            if above not in locks:
                locks[above] = (fcntl.LOCK_SH, root)
    return locks


def _lock(directory: Path, mode: int, root: Path) -> int | None:
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None  # a tree not there (yet: the watcher reports it), a directory above it we may not read
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        where = "this tree or a directory inside it" if mode == fcntl.LOCK_EX else f"{directory}, which holds it"
        raise SyncdError(
            f"another syncd watches {where} (a daemon with a state directory of its own): two daemons on one "
            "tree convert each other's outputs back and forth; run one, or set `cluster: shared: true` in both "
            "if they are to share it",
            str(root),
        ) from None
    except OSError:
        os.close(fd)
        return None  # a filesystem without flock on directories: nothing to hold
    return fd
