"""`syncd check-config FILE [--user NAME]`: every problem of a configuration, one line each."""

from __future__ import annotations

import os
import sys
from typing import TextIO

from syncd.daemon.access import check_access, uid_of
from syncd.daemon.config import validate
from syncd.errors import ConfigError

REMAP_SEES = (
    "applied to the source's names as in the file, before the layout adapter renames weight/bias to "
    "gamma/beta (as Burn's stores do): a .safetensors' weight/bias/running_mean, a .bpk's gamma/beta"
)


def run_check_config(path: str | os.PathLike[str], out: TextIO | None = None, user: str | None = None) -> int:
    """Prints one line per problem; 0 when valid, 2 when not. A state directory or sync log `user` (default:
    the caller) cannot write is a problem too (the daemon would not start); a valid config also gets a warning
    line for each watched tree the user cannot list, read or write."""
    out = out or sys.stdout
    # the config's editors are judged as the service's user sees them: it and root alone may edit the file
    config, problems = validate(path, runs_as=None if user is None else uid_of(user))
    for problem in problems:
        print(problem, file=out)
    if problems or config is None:
        return ConfigError.exit_code
    access = check_access(config, user)
    for line in access.problems + access.warnings:
        print(line, file=out)
    if access.problems:  # the daemon run as that user would exit at start
        return ConfigError.exit_code
    for i, watch in enumerate(config.watches):
        if watch.remap:  # which names the rules see changed once (Burn's order): say it where they are checked
            print(f"{path}: watches[{i}].remap: {len(watch.remap)} rules, {REMAP_SEES}", file=out)
    count = len(config.watches)
    print(f"{path}: valid ({count} watch{'es' if count != 1 else ''})", file=out)
    return 0
