"""Publishing an output file atomically, without replacing anyone's file unless asked.

Copies Burn's atomic write and its v0.22.0 no-replace publish (docs/burn-adapters.md#publishing): the output is
built in a scratch file beside the destination and only then put in place, so a reader never sees a
partial file and a failed or interrupted write never damages the previous destination.

API::

    ensure_destination_free(dest: Path) -> None      # early AlreadyExistsError, before any work
    open_scratch(dest: Path, mode: int = 0o644) -> Scratch
    publish(scratch: Scratch, *, replace: bool = False, source: Path | None = None, ...) -> PublishResult
    remove_stale_scratch(directory: Path) -> list[Path]
    is_scratch_name(name: str) -> bool

    with open_scratch(dest, mode=src_mode & 0o777) as scratch:
        write_the_output(scratch.fd)       # the writer names the destination in its own errors
        result = publish(scratch, source=src)   # result.status: "published" | "in_sync" | "replaced"

* The scratch file is ``.<name>.syncd-<pid>-<n>.tmp`` in the destination's directory, created with
  O_EXCL|O_NOFOLLOW (a symlink planted at that name is never followed; the next ``n`` is tried) and mode
  0600, then fchmod-ed to ``mode & 0o777`` -- exactly the requested bits, whatever the umask.
* Without ``replace`` the scratch is hard-linked to the destination: the link is the only guard, so a file
  that appeared while we worked is never replaced. If the destination is a regular file with exactly our
  bytes the result is "in_sync"; otherwise AlreadyExistsError (ConflictError when it is a regular file
  with other content). ``ensure_destination_free`` only fails early; it guards nothing.
* Where hard links are unavailable (EPERM, ENOTSUP, EXDEV, EMLINK) renameat2(RENAME_NOREPLACE) is used;
  if that is unsupported too we refuse with a SyncdError rather than fall back to a replacing rename. The two
  calls come from a ``PlacingCalls`` (``publish(..., calls=)``): tests stand in such file systems with it.
* With ``replace`` the scratch is renamed over the destination; a symlink there is replaced, not followed.
* Anything that fails or is interrupted (KeyboardInterrupt included) before the file is in place removes
  the scratch. A SIGKILL cannot be caught: ``remove_stale_scratch`` (a daemon's start) and
  ``remove_stale_scratch_of`` (the next conversion to the same destination) later delete scratch files whose
  lock (an flock held while the scratch is open) no living process holds. The file and then its directory are
  fsync-ed so a publish survives power loss.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import itertools
import os
import re
import signal
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Literal

from syncd.errors import AlreadyExistsError, ConflictError, SyncdError
from syncd.formats.fileio import FileStamp

__all__ = [
    "SYSTEM_CALLS",
    "PlacingCalls",
    "Published",
    "PublishResult",
    "Scratch",
    "ensure_destination_free",
    "is_scratch_name",
    "open_scratch",
    "publish",
    "remove_stale_scratch",
    "remove_if_stale",
    "remove_if_unchanged",
    "remove_stale_scratch_of",
    "scratch_target",
    "source_owner",
    "abandon_open_scratches",
]

_SCRATCH_RE = re.compile(r"\.(?P<name>.+)\.syncd-(?P<pid>[0-9]+)-(?P<n>[0-9]+)\.tmp", re.DOTALL)
_NAME_MAX = 255  # bytes in one path component on Linux file systems
# an empty scratch file younger than this may be one its writer has made and not locked yet (open_scratch)
SCRATCH_GRACE_SECONDS = 10.0
_SCRATCH_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_COMPARE_CHUNK = 1 << 20
_OVERWRITE_HINT = "To replace it, use --overwrite (on_exists: overwrite)."

# Errors from link(2) that mean "this file system cannot hard-link here", not "the destination is taken".
_NO_HARDLINKS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK})
# Errors from renameat2(2) that mean RENAME_NOREPLACE is unsupported by this kernel or file system.
_NO_RENAMEAT2 = frozenset({errno.EINVAL, errno.ENOSYS})
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAMEAT2_SYSCALL = {"x86_64": 316, "amd64": 316, "aarch64": 276, "arm64": 276}

# Process-wide, like Burn's: two scratch files of one process never share a name, even across threads.
_counter = itertools.count()
# Scratch files this process has open, so a stopping daemon can remove those it abandons.
_open_scratches: set[Path] = set()
_open_lock = threading.Lock()


# What publish did. "in_sync": the destination already held exactly these bytes; nothing changed.
Published = Literal["published", "in_sync", "replaced"]


class PlacingCalls:
    """The system calls that put a finished scratch file at its destination without replacing anything:
    link(2), and where the file system has no hard links renameat2(2) with RENAME_NOREPLACE.

    `publish` takes them as an object, the seam through which a test stands in a file system this machine
    does not have (no hard links, no renameat2) with calls that fail as that file system's do."""

    def link(self, src: Path, dst: Path) -> None:
        os.link(src, dst, follow_symlinks=False)

    def rename_noreplace(self, src: Path, dst: Path) -> None:
        _renameat2(src, dst, _RENAME_NOREPLACE)


SYSTEM_CALLS = PlacingCalls()


@dataclass(frozen=True)
class PublishResult:
    """What publish did, and where."""

    status: Published
    path: Path
    removed: tuple[Path, ...] = ()  # a set: files of syncd's earlier set that the new one no longer has
    # the file put in place, as it was once there (None: nothing placed, "in_sync"): whoever records the
    # output as syncd's checks that the path still holds this file, not one swapped in right after
    placed: FileStamp | None = None


class Scratch:
    """An open scratch file for `dest`. Use as a context manager: leaving it unpublished removes the file."""

    def __init__(self, path: Path, fd: int, dest: Path, dir_fd: int = -1, owner: tuple[int, int] | None = None) -> None:
        self.path = path
        self.fd = fd
        self.dest = dest
        self.dir_fd = dir_fd  # its directory, wherever that is moved meanwhile
        self.owner = owner  # (uid, gid) the file is given right before it is published, if any
        self.published = False

    def unlink(self) -> bool:
        """Remove the scratch name from its directory, found through the directory's descriptor: a directory
        moved (out of the tree) while we worked still gets its scratch file removed."""
        if self.dir_fd < 0:
            return _unlink_quietly(self.path)
        try:
            os.unlink(self.path.name, dir_fd=self.dir_fd)
        except FileNotFoundError:
            return False
        return True

    def discard(self) -> None:
        """Close and delete the scratch file (best effort: it may already be gone)."""
        self.close()
        if not self.published:
            self.unlink()
        if self.dir_fd >= 0:
            dir_fd, self.dir_fd = self.dir_fd, -1
            os.close(dir_fd)
        with _open_lock:
            _open_scratches.discard(self.path)

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

    def __enter__(self) -> Scratch:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.discard()


def is_scratch_name(name: str) -> bool:
    """True for the names of syncd's scratch files, which a watcher must ignore."""
    return _SCRATCH_RE.fullmatch(name) is not None


def ensure_destination_free(dest: Path) -> None:
    """Fail before any work when `dest` exists (even as a dangling symlink). Not a guard: publish is."""
    try:
        os.lstat(dest)
    except FileNotFoundError:
        return
    raise _already_exists(dest)


def open_scratch(
    dest: Path, mode: int = 0o644, within: Path | None = None, owner: tuple[int, int] | None = None
) -> Scratch:
    """Create a fresh scratch file beside `dest` whose permission bits are exactly `mode & 0o777`. `within`: the
    directory `dest`'s must lie in, as it resolves (a set's shard named `sub/...` beside its index, where
    `sub` could be a symlink planted to lead anywhere); checked on the directory as opened, which is where
    the scratch is made and linked from. `owner`: (uid, gid) given to the file as it is published (a scratch
    file stays this process's own until then, so a stale one is still known for ours)."""
    dest = Path(dest)
    try:
        dir_fd = os.open(dest.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise SyncdError.from_os_error("cannot open the directory to write it in", str(dest), e) from e
    if within is not None and not _resolves_within(dir_fd, within):
        os.close(dir_fd)
        raise SyncdError(f"its directory resolves outside {within} (a symlink?); not writing there", str(dest))
    while True:
        path = dest.parent / _scratch_name(dest.name, os.getpid(), next(_counter))
        with interrupts_held():  # made and known together: Ctrl-C or SIGTERM between the two left it for good
            try:
                fd = os.open(path.name, _SCRATCH_FLAGS, 0o600, dir_fd=dir_fd)
            except FileExistsError:
                continue  # a leftover or a planted file/symlink: never touch it, take the next name
            except OSError as e:
                os.close(dir_fd)
                raise SyncdError.from_os_error("cannot create a scratch file beside it", str(dest), e) from e
            scratch = Scratch(path, fd, dest, dir_fd, owner)
            with _open_lock:
                _open_scratches.add(path)
        try:
            # ownership: held while the file is open, dropped by the kernel when this process dies however it
            # dies; works across PID namespaces and (NFS, through its lock manager) across hosts
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.fchmod(fd, mode & 0o777)  # fchmod is not filtered by the umask
        except BaseException:
            scratch.discard()
            raise
        return scratch


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """SIGINT and SIGTERM held back for the moment (on the main thread, whose handlers raise): delivered when
    it ends. Other threads' signals run their handlers on the main thread too, at its next instruction."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _resolves_within(dir_fd: int, top: Path) -> bool:
    real, root = os.readlink(f"/proc/self/fd/{dir_fd}"), os.path.realpath(top)
    return real == root or real.startswith(root.rstrip("/") + "/")


def publish(
    scratch: Scratch,
    *,
    replace: bool = False,
    replace_if: FileStamp | None = None,
    source: Path | None = None,
    before_placing: Callable[[], None] | None = None,
    calls: PlacingCalls = SYSTEM_CALLS,
) -> PublishResult:
    """Make the finished scratch file `scratch.dest`; `source` names the input in a ConflictError.

    Without `replace` an existing destination is never changed: "in_sync" if it holds our bytes,
    else AlreadyExistsError/ConflictError. With `replace_if`, a destination that is still exactly that file
    (identity, size, mtime and ctime) is replaced; anything else there is left alone (ConflictError).
    `before_placing` runs after the fsync, right before the file is put in place, and may raise to stop it.
    `calls` places a new file (link, or rename without replacing). The scratch file is gone afterwards in
    every case.
    """
    try:
        if scratch.owner is not None:
            _give_owner(scratch)
        _fsync_file(scratch)
        if before_placing is not None:
            before_placing()
        if replace:
            result = _publish_replacing(scratch)
        elif replace_if is not None:
            result = _publish_replacing_ours(scratch, replace_if, source, calls)
        else:
            result = _publish_new(scratch, source, calls)
        if result.status != "in_sync":
            result = PublishResult(result.status, result.path, result.removed, FileStamp.of_fd(scratch.fd))
    finally:
        scratch.discard()
    if result.status != "in_sync":
        _fsync_directory(scratch.dest)
    return result


def _give_owner(scratch: Scratch) -> None:
    assert scratch.owner is not None
    try:
        os.fchown(scratch.fd, *scratch.owner)
    except OSError as e:
        raise SyncdError.from_os_error("cannot give the output its source's owner", str(scratch.dest), e) from e


def source_owner(fd: int) -> tuple[int, int] | None:
    """As root, the owner and group an output takes from its source (as it takes its mode bits): a trainer's
    0600 checkpoint converted by a daemon running as root is still the trainer's to read. None otherwise (an
    output is its writer's, as any file)."""
    if os.geteuid() != 0:
        return None
    info = os.fstat(fd)
    return info.st_uid, info.st_gid


def abandon_open_scratches() -> list[Path]:
    """Remove every scratch file this process still has open (a stopping daemon abandons its work).

    A thread still writing keeps writing into an unlinked inode; its publish then fails, so nothing
    partial ever appears at a destination.
    """
    with _open_lock:
        paths = list(_open_scratches)
        _open_scratches.clear()
    return [path for path in paths if _unlink_quietly(path)]


def remove_stale_scratch(directory: Path) -> list[Path]:
    """Delete our scratch files that no living process holds (SIGKILL, power loss); return what went.

    Only regular files named like our scratch files and owned by this user. A scratch file is live exactly
    while the process writing it holds its lock (open_scratch), so the pid in its name decides nothing: a
    syncd in another PID namespace or on another host sharing the tree keeps its files, and a syncd that ran
    as PID 1 in a container gets its own back after a SIGKILL. An empty one younger than SCRATCH_GRACE_SECONDS
    is kept (remove_if_stale): another node's daemon, running while this one starts, may have made it and not
    locked it yet (a start-up sweep took such a file from a live conversion); the next scan takes it if stale.
    """
    removed = []
    with os.scandir(directory) as entries:
        for entry in entries:
            if _SCRATCH_RE.fullmatch(entry.name) is not None and remove_if_stale(
                Path(entry.path), SCRATCH_GRACE_SECONDS
            ):
                removed.append(Path(entry.path))
    return removed


def remove_stale_scratch_of(dest: Path, min_age: float = SCRATCH_GRACE_SECONDS) -> list[Path]:
    """Remove the scratch files of `dest` no living process holds (a syncd killed while writing it: SIGKILL,
    the OOM killer, a lost node) and return them: whoever writes `dest` next clears what the last one left,
    one-shot `syncd convert` included, which has no start-up sweep. `min_age`: see remove_if_stale (0 for a
    caller holding `dest`'s claim, which no other writer can be between creating and locking a scratch of)."""
    try:
        entries = list(os.scandir(dest.parent))
    except OSError:
        return []
    return [
        Path(entry.path)
        for entry in entries
        # (the cheap tests first: a directory of 20,000 checkpoints is looked through at every conversion)
        if entry.name.startswith(".")
        and entry.name.endswith(".tmp")
        and scratch_target(entry.name) == dest.name
        and remove_if_stale(Path(entry.path), min_age)
    ]


def scratch_target(name: str) -> str | None:
    """The name of the destination a scratch file named `name` is being built for (None if it is not one;
    a name shortened to fit NAME_MAX gives its shortened form)."""
    match = _SCRATCH_RE.fullmatch(name)
    return None if match is None else match.group("name")


def remove_if_unchanged(path: Path, identity: FileStamp) -> bool:
    """Delete `path`, an output syncd published and no longer needs (a shard its set's new layout does not
    have, an earlier output at another name), unless it changed since it was published as `identity` (then
    it is someone else's, and stays). True if removed."""
    try:
        if identity.changed(FileStamp.of(os.lstat(path))):
            return False
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def remove_if_stale(path: Path, min_age: float = 0.0) -> bool:
    """Delete the scratch file `path` if no living process holds it; True if it went. An empty one younger
    than `min_age` seconds is kept: its writer may be between creating it and locking it (open_scratch), a
    window worth guarding wherever other daemons may run (a shared tree: a daemon's start-up too)."""
    if _SCRATCH_RE.fullmatch(path.name) is None:
        return False
    if min_age > 0:
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            return False
        if info.st_size == 0 and time.time() - info.st_ctime < min_age:
            return False
    return _remove_if_unheld(path)


def _remove_if_unheld(path: Path) -> bool:
    try:
        fd = _open_to_lock(path)
    except OSError:
        return False  # gone, a symlink (ELOOP), unreadable: not ours to judge
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # held: its writer is alive (or we cannot tell: keep it)
        # unlink while holding the lock, and only if the name still is this file
        try:
            now = os.lstat(path)
        except FileNotFoundError:
            return False
        return (now.st_dev, now.st_ino) == (info.st_dev, info.st_ino) and _unlink_quietly(path)
    finally:
        os.close(fd)


def _open_to_lock(path: Path) -> int:
    """A descriptor to try `path`'s lock through: open for writing where we may, since NFS carries flock to its
    lock manager as a whole-file POSIX lock, and an exclusive one needs a descriptor open for writing (a
    read-only one gets EBADF there, which would keep every dead node's scratch forever)."""
    flags = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    if stat.S_ISREG(os.lstat(path).st_mode):  # never open anything else for writing (a device planted there)
        try:
            return os.open(path, os.O_RDWR | flags)
        except PermissionError:
            pass  # a read-only scratch file (its source's mode) of a daemon not running as root
    return os.open(path, os.O_RDONLY | flags)


def _scratch_name(name: str, pid: int, n: int) -> str:
    """`.<name>.syncd-<pid>-<n>.tmp`, with `name` shortened if the whole would exceed NAME_MAX."""
    suffix = f".syncd-{pid}-{n}.tmp"
    room = _NAME_MAX - 1 - len(suffix)
    encoded = os.fsencode(name)
    if len(encoded) > room:
        # surrogateescape keeps a UTF-8 sequence cut in half representable (and still a valid file name).
        name = encoded[:room].decode("utf-8", "surrogateescape")
    return f".{name}{suffix}"


def _publish_replacing(scratch: Scratch) -> PublishResult:
    existed = _exists(scratch.dest)  # only for the reported status; the rename replaces regardless
    try:
        os.rename(scratch.path, scratch.dest)
    except OSError as e:
        raise SyncdError.from_os_error("cannot move the finished output into place", str(scratch.dest), e) from e
    scratch.published = True
    return PublishResult("replaced" if existed else "published", scratch.dest)


def _publish_replacing_ours(
    scratch: Scratch, expected: FileStamp, source: Path | None, calls: PlacingCalls
) -> PublishResult:
    """Replace the destination only while it is still the file we published (`expected`); else as new.

    The identity is checked as late as possible, right before the rename. A writer that changes the file in
    the microseconds between the check and the rename loses that change to our output: no file system offers
    a compare-and-rename, and the window is that of one system call.
    """
    try:
        theirs = os.lstat(scratch.dest)
    except FileNotFoundError:
        return _publish_new(scratch, source, calls)  # gone meanwhile: publish without replacing anything
    if not stat.S_ISREG(theirs.st_mode) or expected.changed(FileStamp.of(theirs)):
        raise ConflictError(
            "changed since syncd published it (someone else's file now); nothing was replaced", str(scratch.dest)
        )
    return _publish_replacing(scratch)


def _publish_new(scratch: Scratch, source: Path | None, calls: PlacingCalls) -> PublishResult:
    if _place_new(scratch, calls):
        return PublishResult("published", scratch.dest)
    verdict = _compare_with_destination(scratch)
    if verdict == "same":
        return PublishResult("in_sync", scratch.dest)
    if verdict == "different":
        what = f"the output of {source}" if source is not None else "the new output"
        raise ConflictError(
            f"file already exists with content different from {what}; nothing was replaced. " + _OVERWRITE_HINT,
            str(scratch.dest),
        )
    raise _already_exists(scratch.dest)


def _place_new(scratch: Scratch, calls: PlacingCalls) -> bool:
    """Put the scratch file at its destination unless something is there; False if something was."""
    try:
        calls.link(scratch.path, scratch.dest)
    except FileExistsError:
        # NFS: a link whose reply was lost is retried and reports EEXIST although it succeeded.
        if not _is_our_file(scratch, scratch.dest):
            return False
    except OSError as e:
        if e.errno in _NO_HARDLINKS:
            return _place_new_by_rename(scratch, calls)
        raise SyncdError.from_os_error("cannot link the finished output into place", str(scratch.dest), e) from e
    scratch.published = True
    scratch.unlink()
    return True


def _place_new_by_rename(scratch: Scratch, calls: PlacingCalls) -> bool:
    """Fallback for file systems without hard links: renameat2(RENAME_NOREPLACE), never a plain rename."""
    try:
        calls.rename_noreplace(scratch.path, scratch.dest)
    except FileExistsError:
        return False
    except OSError as e:
        if e.errno in _NO_RENAMEAT2:
            raise SyncdError(
                "this file system supports neither hard links nor rename-without-replace, so the output "
                "cannot be published without risking replacing a file; use --overwrite to replace",
                str(scratch.dest),
            ) from e
        raise SyncdError.from_os_error("cannot move the finished output into place", str(scratch.dest), e) from e
    scratch.published = True
    return True


def _renameat2(src: Path, dst: Path, flags: int, *, via_syscall: bool = False) -> None:
    """renameat2(2) through libc, or the raw syscall where libc (e.g. old glibc, musl) lacks it."""
    libc = ctypes.CDLL(None, use_errno=True)
    func = None if via_syscall else getattr(libc, "renameat2", None)
    args = (
        ctypes.c_int(_AT_FDCWD),
        ctypes.c_char_p(os.fsencode(src)),
        ctypes.c_int(_AT_FDCWD),
        ctypes.c_char_p(os.fsencode(dst)),
        ctypes.c_uint(flags),
    )
    if func is not None:
        rc = func(*args)
    else:
        import platform  # here: only a libc without renameat2 needs the machine's syscall number

        number = _RENAMEAT2_SYSCALL.get(platform.machine().lower())
        if number is None:
            raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS), str(src), None, str(dst))
        rc = libc.syscall(ctypes.c_long(number), *args)
    if rc != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(src), None, str(dst))


def refuse_if_different(scratch: Scratch, source: Path | None) -> None:
    """Before anything of a set is placed: a file already at this part's destination must hold exactly its
    bytes (then publishing it finds it in sync), else ConflictError, as publishing it would raise."""
    if os.path.lexists(scratch.dest) and _compare_with_destination(scratch) != "same":
        what = f"the output of {source}" if source is not None else "the new output"
        raise ConflictError(
            f"file already exists with content different from {what}; nothing was replaced. " + _OVERWRITE_HINT,
            str(scratch.dest),
        )


def _compare_with_destination(scratch: Scratch) -> Literal["same", "different", "not_a_file"]:
    """Compare our bytes with the destination's without following a symlink or blocking on a FIFO."""
    try:
        fd = os.open(scratch.dest, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return "not_a_file"  # a symlink (ELOOP), vanished, unreadable: report it as simply existing
    try:
        theirs = os.fstat(fd)
        if not stat.S_ISREG(theirs.st_mode):
            return "not_a_file"
        if theirs.st_size != os.fstat(scratch.fd).st_size:
            return "different"
        return "same" if _same_bytes(scratch.fd, fd, theirs.st_size) else "different"
    finally:
        os.close(fd)


def _same_bytes(fd_a: int, fd_b: int, size: int) -> bool:
    offset = 0
    while offset < size:
        a = os.pread(fd_a, _COMPARE_CHUNK, offset)
        b = os.pread(fd_b, _COMPARE_CHUNK, offset)
        if a != b or not a:
            return False
        offset += len(a)
    return True


def _is_our_file(scratch: Scratch, path: Path) -> bool:
    try:
        theirs = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    ours = os.fstat(scratch.fd)
    return (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino)


def _fsync_file(scratch: Scratch) -> None:
    try:
        os.fsync(scratch.fd)
    except OSError as e:
        raise SyncdError.from_os_error("cannot flush the output being built to disk", str(scratch.dest), e) from e


def _fsync_directory(dest: Path) -> None:
    """Make the new directory entry durable; without this a power loss can undo the publish."""
    try:
        fd = os.open(dest.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise SyncdError(
            f"saved, but syncing its directory failed, so it may not survive power loss ({e.strerror})",
            str(dest),
        ) from e


def _exists(path: Path) -> bool:
    try:
        os.lstat(path)
    except FileNotFoundError:
        return False
    return True


def _unlink_quietly(path: str | os.PathLike[str]) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def _already_exists(dest: Path) -> AlreadyExistsError:
    return AlreadyExistsError(f"file already exists. {_OVERWRITE_HINT}", str(dest))
