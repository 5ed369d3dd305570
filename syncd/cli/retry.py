"""`syncd retry -c FILE PATH... | --all-failed | --adopt [PATH...]`: look again at files that failed, once their
cause is fixed; after a lost state, adopt the outputs that name their sources."""

from __future__ import annotations

import sys
from pathlib import Path

from syncd.daemon.retry import request_adoption, request_retry
from syncd.errors import SyncdError, UsageError


def run_retry(config_path: Path, paths: list[Path], *, all_failed: bool, adopt: bool = False) -> int:
    """A line saying how many failures were marked and who looks at them; 1 when a PATH is not a file the
    daemon knows (a typo, or not under a watch), with a line naming it."""
    if adopt:
        if all_failed:
            raise UsageError("retry: --adopt takes PATHs or nothing, not --all-failed (see syncd retry --help)")
        return _run_adoption(config_path, paths)
    if paths and all_failed:
        raise UsageError("retry: give PATHs or --all-failed, not both (see syncd retry --help)")
    if not paths and not all_failed:
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


def _run_adoption(config_path: Path, paths: list[Path]) -> int:
    """One line per output adopted and per source whose output is not; 1 when a PATH's output is not."""
    adoption = request_adoption(config_path, paths or None)
    for source, output in adoption.adopted:
        print(f"{output}: adopted as the output of {Path(source).name}")
    who = f"the daemon (pid {adoption.daemon_pid}) is scanning" if adoption.daemon_pid else "its next start looks"
    print(f"{len(adoption.adopted)} output(s) adopted; {who}" if adoption.adopted else "no output adopted")
    for source, why in adoption.refused:
        print(f"{source}: {why}")
    sys.stdout.flush()
    return 1 if paths and adoption.refused else 0
