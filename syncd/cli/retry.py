"""`syncd retry -c FILE PATH... | --all-failed`: look again at files that failed, once their cause is fixed."""

from __future__ import annotations

from pathlib import Path

from syncd.daemon.retry import request_retry
from syncd.errors import UsageError


def run_retry(config_path: Path, paths: list[Path], *, all_failed: bool) -> int:
    """One line of output: how many failures were marked, and who looks at them."""
    if bool(paths) == all_failed:
        raise UsageError("syncd retry: give the PATHs to look at again, or --all-failed")
    request = request_retry(config_path, paths or None)
    count = len(request.marked)
    if request.daemon_pid is not None:
        print(f"{count} failed file(s) marked for another look; the daemon (pid {request.daemon_pid}) is scanning")
    else:
        print(f"{count} failed file(s) marked for another look; no daemon runs: its next start looks")
    return 0
