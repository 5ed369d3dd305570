"""Error kinds are declared where errors are raised: the daemon's classification reads them."""

from __future__ import annotations

import os

from syncd.daemon.sync import classify
from syncd.errors import FormatError, SourceChangedError, SyncdError, one_line
from syncd.formats.fileio import open_regular_file, pread_exact


def test_a_read_failing_in_the_file_system_is_a_transient_environment_error_like_an_open() -> None:
    # /proc/self/mem reads EIO at an unmapped address: a real read error of the environment, not of the file
    fd = os.open("/proc/self/mem", os.O_RDONLY)
    try:
        pread_exact(fd, 8, 0, "/proc/self/mem", "the header")
    except FormatError as exc:
        error = exc
    finally:
        os.close(fd)
    assert (error.kind, error.transient) == ("environment", True)
    assert classify(error) == ("error", True)  # retried, not refused forever as a bad file


def test_an_open_that_is_refused_for_permission_is_not_the_files_fault_and_not_transient(tmp_path) -> None:
    directory = tmp_path / "dir.safetensors"
    directory.mkdir()
    os.chmod(tmp_path, 0o000)
    try:
        pid = os.fork()
        if pid == 0:  # as nobody: the directory above cannot be searched
            os.setgid(65534)
            os.setuid(65534)
            try:
                open_regular_file(directory)
            except FormatError as exc:
                os._exit(
                    0 if (exc.kind, exc.transient, classify(exc)) == ("environment", False, ("skipped", False)) else 1
                )
            os._exit(2)
        assert os.waitpid(pid, 0)[1] == 0
    finally:
        os.chmod(tmp_path, 0o755)


def test_a_source_that_changed_is_busy_and_never_logged_as_a_bad_file() -> None:
    error = SourceChangedError("changed while it was being converted", "a.safetensors")
    assert (error.kind, error.transient) == ("busy", True)


def test_os_errors_name_their_kind_by_errno() -> None:
    full = SyncdError.from_os_error("cannot write the output", "a.bpk", OSError(28, "No space left on device"))
    denied = SyncdError.from_os_error("cannot write the output", "a.bpk", OSError(13, "Permission denied"))
    assert (full.kind, full.transient) == ("environment", True)
    assert (denied.kind, denied.transient) == ("environment", False)
    assert str(full) == "a.bpk: cannot write the output (No space left on device)"


def test_one_line_keeps_everything_on_one_line() -> None:
    assert one_line("a\nb\u2028c") == "a\\nb\\u2028c"
    assert one_line(ValueError()) == "ValueError"
