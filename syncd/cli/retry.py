"""`syncd retry -c FILE PATH... | --all-failed`: look again at files that failed, once their cause is fixed."""

from __future__ import annotations

import sys
from pathlib import Path

from syncd.daemon.retry import request_retry
from syncd.errors import SyncdError, UsageError


def run_retry(config_path: Path, paths: list[Path], *, all_failed: bool) -> int:
    """A line saying how many failures were marked and who looks at them; 1 when a PATH is not a file the
    daemon knows (a typo, or not under a watch), with a line naming it."""
    if bool(paths) == all_failed:
        raise UsageError("retry: give the PATHs to look at again, or --all-failed (see syncd retry --help)")
    request = request_retry(config_path, paths or None)
    count = len(request.marked)
    if count or all_failed:
        if request.daemon_pid is not None:
            print(f"{count} failed file(s) marked for another look; the daemon (pid {request.daemon_pid}) is scanning")
        else:
            print(f"{count} failed file(s) marked for another look; no daemon runs: its next start looks")
    for path in request.not_failed:
        print(f"{path}: has not failed; nothing to look at again")
    sys.stdout.flush()
    if request.unknown:
        where = ", ".join(request.unknown)
        raise SyncdError(f"not known to the daemon (never seen: a typo, or not under a watch of {config_path})", where)
    return 0
