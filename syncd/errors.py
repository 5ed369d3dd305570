"""The errors a user can see. Each renders as one line that names the file and what is wrong."""

from __future__ import annotations

# what str.splitlines() splits on, shown escaped: a tensor or file name holding one must not break the line
_LINE_BREAKS = str.maketrans({c: repr(c)[1:-1] for c in "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"})


def one_line(text: object) -> str:
    return str(text).translate(_LINE_BREAKS)


class SyncdError(Exception):
    """Base of every error syncd reports to a user (never shown as a traceback)."""

    exit_code = 1

    def __init__(self, message: str, path: str | None = None) -> None:
        self.message = one_line(message)
        self.path = path
        super().__init__(f"{one_line(path)}: {self.message}" if path else self.message)


class FormatError(SyncdError):
    """A checkpoint file is malformed or exceeds a limit; `tensor` names the culprit when known."""

    def __init__(self, message: str, path: str | None = None, tensor: str | None = None) -> None:
        self.tensor = tensor
        super().__init__(f"tensor '{tensor}': {message}" if tensor else message, path)


class UnsupportedError(SyncdError):
    """A well-formed file holds something the other format or side cannot represent."""


class AmbiguousLayoutError(SyncdError):
    """The evidence in a file does not decide its layout; a module map or --layout must settle it."""


class VerificationError(SyncdError):
    """The written output does not match its source; nothing is published."""


class AlreadyExistsError(SyncdError):
    """The destination exists (or appeared during the work) and replacing it was not asked for."""

    exit_code = 3


class ConflictError(AlreadyExistsError):
    """The destination exists with different content than the one syncd would publish."""


class ConfigError(SyncdError):
    """The configuration file is invalid."""

    exit_code = 2


class UsageError(SyncdError):
    exit_code = 2
