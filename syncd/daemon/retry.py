"""Another look at files that failed: their failures are marked in the state database, and the running daemon
(if any) is asked with SIGUSR1 to scan; without a daemon, its next start looks at them."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

from syncd.daemon.config import load_config
from syncd.daemon.state import StateDB, lock_holder


@dataclass(frozen=True)
class RetryRequest:
    marked: list[str]  # the sources whose failures were marked
    daemon_pid: int | None  # the daemon asked to scan; None when none runs


def request_retry(config_path: Path, paths: list[Path] | None) -> RetryRequest:
    """Mark the failures of `paths` (None: every failed file) for another look and wake the daemon."""
    config = load_config(config_path, check_filesystem=False)
    with StateDB(config.state_dir) as state:
        marked = state.retry_failures([os.path.abspath(p) for p in paths] if paths else None)
    holder = lock_holder(config.state_dir)
    if holder is not None:
        os.kill(holder, signal.SIGUSR1)
    return RetryRequest(marked, holder)
