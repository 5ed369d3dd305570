"""The statuses of the sync log, and which of them are successes, failures and the daemon's life cycle.

A sync log line's `status` is one of `Status`; its value is the text written (JSON lines keep plain strings).

A failure is a file that was not converted and will not be until something changes: its content, the
configuration, its permissions, or `syncd retry`. The state database records it (so it is said once per
version), `syncd status` lists it among the recent failures, and systemd's STATUS= and the metrics count it.
`skipped` is one: a symlink, a file we may not read, a destination that someone else's file holds
(on_exists: skip) all leave a source without its output, which is what an operator must see.
"""

from __future__ import annotations

from enum import StrEnum


class Status(StrEnum):
    CONVERTED = "converted"  # an output was written and published
    UPDATED = "updated"  # syncd's own earlier output of a source saved again was replaced by the new conversion
    IN_SYNC = "in_sync"  # the output already matches its source
    SKIPPED = "skipped"  # left alone: not a regular file, not readable for us, destination exists (on_exists: skip)
    CONFLICT = "conflict"  # the output exists with different content and was left alone
    REFUSED = "refused"  # the source cannot be converted safely (unsupported, ambiguous layout, ...)
    ERROR = "error"  # the conversion (or the daemon's own work) failed
    WARNING = "warning"  # something odd that did not stop the work (a modification time in the future)
    REMOVED = "removed"  # deleted: a dead syncd's scratch, a shard no longer in its set, its output at an old name
    STARTED = "started"
    STOPPED = "stopped"
    RELOADED = "reloaded"


SUCCESSES = frozenset({Status.CONVERTED, Status.UPDATED, Status.IN_SYNC})
FAILURES = frozenset({Status.REFUSED, Status.CONFLICT, Status.ERROR, Status.SKIPPED})
LIFECYCLE = frozenset({Status.STARTED, Status.STOPPED, Status.RELOADED})  # not work: not counted
STATUSES = tuple(status.value for status in Status)  # in the order help texts list them
