"""The errors a user can see. Each renders as one line that names the file and what is wrong.

Every error declares, where it is raised, what kind of failure it is:

* `kind`: "input" (the file itself is wrong or unsupported: fixing it needs a new version of the file),
  "config" (a setting decides it: a module map or layout would settle it, so a reload looks again),
  "environment" (the machine is in the way: a missing output directory, a full or read-only disk, an I/O
  error, a permission), or "busy" (the source changed or is still being written while we read it).
* `transient`: retrying later may succeed without anyone touching the file (a full disk gets space, a
  removed directory comes back). The daemon retries these with backoff, also after a restart.

The daemon classifies failures by these two attributes only; it never inspects `__cause__`.
"""

from __future__ import annotations

import errno as _errno
from typing import Literal

Kind = Literal["input", "config", "environment", "busy"]

# what str.splitlines() splits on, and every other control character (an escape sequence in a tensor's name
# would restyle the terminal it is shown on), shown escaped: a name holding one must not break the line
_CONTROLS = [chr(c) for c in (*range(0x20), *range(0x7F, 0xA0))] + ["\u2028", "\u2029"]
_LINE_BREAKS = str.maketrans({c: repr(c)[1:-1] for c in _CONTROLS})

# errnos of the environment that heal by themselves or by an administrator's action on the machine, not on
# the file: retried. ENOENT is here because the daemon raises it only for directories it writes into.
TRANSIENT_ERRNOS = frozenset(
    {
        _errno.ENOSPC,
        _errno.EDQUOT,
        _errno.EROFS,
        _errno.EIO,
        _errno.EAGAIN,
        _errno.EBUSY,
        _errno.ENOMEM,
        _errno.EINTR,
        _errno.ENOENT,
        _errno.ESTALE,
        _errno.ETIMEDOUT,
        _errno.ENFILE,
        _errno.EMFILE,
    }
)


def one_line(text: object) -> str:
    """`text` (an exception, a message, a path) as one line: line breaks inside it are shown escaped, so
    nothing of it is lost and a name holding a newline cannot start a bogus line. An exception with no
    message shows its type's name."""
    if isinstance(text, BaseException) and not str(text):
        return type(text).__name__
    return str(text).translate(_LINE_BREAKS)


def yaml_problem(exc: Exception) -> tuple[int | None, str]:
    """(the line, what is wrong) of a PyYAML error, whose own text runs over several lines with a copy of the
    offending line and a caret under it."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    reason = getattr(exc, "reason", None)
    if mark is None and reason is not None:  # a character the reader refuses
        character = getattr(exc, "character", None)
        code = ord(character) if isinstance(character, str) and len(character) == 1 else character
        shown = f"#x{code:04x}" if isinstance(code, int) else repr(character)
        return None, one_line(f"{reason}: character {shown} at position {getattr(exc, 'position', '?')}")
    what = getattr(exc, "problem", None) or getattr(exc, "context", None) or exc
    return (mark.line + 1 if mark is not None else None), one_line(what)


class SyncdError(Exception):
    """Base of every error syncd reports to a user (never shown as a traceback)."""

    exit_code = 1
    kind: Kind = "input"
    transient = False

    def __init__(
        self, message: str, path: str | None = None, *, kind: Kind | None = None, transient: bool | None = None
    ) -> None:
        self.message = one_line(message)
        self.path = path
        if kind is not None:
            self.kind = kind
        if transient is not None:
            self.transient = transient
        super().__init__(f"{one_line(path)}: {self.message}" if path else self.message)

    @classmethod
    def from_os_error(cls, message: str, path: str | None, exc: OSError) -> SyncdError:
        """An error of the environment (the file system refused something); transient when its errno heals."""
        return cls(
            f"{message} ({exc.strerror or exc})", path, kind="environment", transient=exc.errno in TRANSIENT_ERRNOS
        )


class FormatError(SyncdError):
    """A checkpoint file is malformed or exceeds a limit; `tensor` names the culprit when known."""

    def __init__(
        self,
        message: str,
        path: str | None = None,
        tensor: str | None = None,
        *,
        kind: Kind | None = None,
        transient: bool | None = None,
    ) -> None:
        self.tensor = tensor
        super().__init__(f"tensor '{tensor}': {message}" if tensor else message, path, kind=kind, transient=transient)


class IncompleteFileError(FormatError):
    """The file is shorter than its own header says (or than a header needs): a writer may still be
    appending to it, closing it between chunks, so the daemon looks again while it keeps changing."""


class UnsupportedError(SyncdError):
    """A well-formed file holds something the other format or side cannot represent."""


class AmbiguousLayoutError(SyncdError):
    """The evidence in a file does not decide its layout; a module map or --layout must settle it."""

    kind: Kind = "config"


class VerificationError(SyncdError):
    """The written output does not match its source; nothing is published."""


class SourceChangedError(SyncdError):
    """The source changed (was written, replaced or removed) between the first byte read and publishing:
    what was read may mix two versions, so nothing is published; the daemon looks again once it is quiet."""

    kind: Kind = "busy"
    transient = True


class AlreadyExistsError(SyncdError):
    """The destination exists (or appeared during the work) and replacing it was not asked for."""

    exit_code = 3


class ConflictError(AlreadyExistsError):
    """The destination exists with different content than the one syncd would publish."""


class ConfigError(SyncdError):
    """The configuration file is invalid."""

    exit_code = 2
    kind: Kind = "config"


class UsageError(SyncdError):
    exit_code = 2
