"""What a configuration holds: the settings, their types and their defaults, each default stated once here.

The YAML keys are the field names (`log:` and `watches:` are sections; a watch's `output:` becomes `mirror`,
`tensors: {include, exclude}` becomes `tensor_include`/`tensor_exclude`). The builder reads each key with the
default named here, and the dataclasses carry the same default, so a Config built in code and one read from
a file with the key left out agree.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from syncd.adapters import AUTO, ModuleMap
from syncd.daemon.readiness import UNLEASED_SETTLE_SECONDS
from syncd.daemon.synclog import DEFAULT_BACKUPS, DEFAULT_MAX_BYTES
from syncd.engine.hashing import DEFAULT_HASH
from syncd.formats.registry import FORMATS

DEFAULT_CONFIG_PATH = Path("/etc/syncd/syncd.yaml")

# top level
DEFAULT_WORKERS = 2
# Each conversion may hold up to ~208 MiB of buffers and run up to 8 threads (engine/write/onepass.py); past
# this many at once a machine gains nothing and a unit's MemoryMax and TasksMax are long passed.
MAX_WORKERS = 32
# Any duration in the config: a week. Longer ones are typing mistakes, and past ~290 years the waits they
# become fail outright (time_t).
MAX_SECONDS = 7 * 24 * 3600.0
# rotating renames every backup, under the sync log's lock: a billion of them held every worker's log line
MAX_LOG_BACKUPS = 1000
DEFAULT_SETTLE_SECONDS = 1.0
DEFAULT_UNLEASED_SETTLE_SECONDS = UNLEASED_SETTLE_SECONDS  # a file whose writer nothing can see (readiness.py)
DEFAULT_STATE_DIR = "./state"  # relative paths resolve against the config file's directory
DEFAULT_POLL_INTERVAL = 2.0  # used when a watch sets `poll: true` but the global poll_interval is null
DEFAULT_RESCAN_INTERVAL = 600.0  # seconds between safety rescans of every watch (they find what events missed)
# a worker busy with one file longer than this stops the watchdog pings (systemd then restarts syncd)
DEFAULT_STUCK_WORKER_SECONDS = 1800.0
DEFAULT_HASH_NAME = DEFAULT_HASH  # the source hash recorded in outputs (`hash:`)
METRICS_SUFFIX = ".prom"  # node_exporter's textfile collector reads only files named so

# log:
DEFAULT_LOG_PATH = "./syncd.log.jsonl"
DEFAULT_LOG_MAX_BYTES = DEFAULT_MAX_BYTES  # 0: never rotate
DEFAULT_LOG_BACKUPS = DEFAULT_BACKUPS
LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_LOG_LEVEL = "info"

# cluster: (one syncd per node on a shared filesystem; syncd.daemon.claims, syncd.daemon.fstype)
SHARED_CHOICES = ("auto", True, False)  # auto: watches on a network filesystem are shared
DEFAULT_SHARED = "auto"
DEFAULT_CLUSTER_POLL_INTERVAL = 10.0  # seconds between polls of a shared watch, for other nodes' files
CLUSTER_KEYS = ("shared", "poll_interval")

# watches[]:
DEFAULT_INCLUDE = tuple(f"*{fmt.extension}" for fmt in FORMATS)
# File-name globs ignored when neither the watch nor the config sets `ignore:` (`.~*` is inside `.*`, and is
# named for when a configuration keeps it but lets other dotfiles through); see syncd.daemon.names.
DEFAULT_IGNORE = (".*", "*.tmp*", "*.part", ".~*")
DEFAULT_DIRECTION = "both"
ON_EXISTS = ("skip", "error", "overwrite")
DEFAULT_ON_EXISTS = "skip"

TOP_LEVEL_KEYS = (
    "workers",
    "settle_seconds",
    "unleased_settle_seconds",
    "state_dir",
    "log",
    "poll_interval",
    "rescan_interval",
    "stuck_worker_seconds",
    "ignore",
    "hash",
    "metrics",
    "cluster",
    "watches",
)
LOG_KEYS = ("path", "max_bytes", "backups", "level")
WATCH_KEYS = (
    "path",
    "recursive",
    "include",
    "exclude",
    "ignore",
    "direction",
    "output",
    "on_exists",
    "layout",
    "modules",
    "poll",
    "remap",
    "map_indices_contiguous",
    "tensors",
    "precision",
    "shard_size",
    "top_level_key",
)
TENSOR_FILTER_KEYS = ("include", "exclude")
# settings a running daemon cannot change (dotted field names): a reload keeps the running values and names
# the ones that differ in its `reloaded` line
RESTART_SETTINGS = ("workers", "state_dir", "log.path")


@dataclass(frozen=True)
class LogSettings:
    path: Path
    max_bytes: int = DEFAULT_LOG_MAX_BYTES
    backups: int = DEFAULT_LOG_BACKUPS
    level: str = DEFAULT_LOG_LEVEL


@dataclass(frozen=True)
class ClusterSettings:
    """How a watch on a filesystem other nodes write to is served: claims beside the outputs (each checkpoint
    converted once in the cluster) and inotify for this node's writes plus a poll every `poll_interval`
    seconds for other nodes'. `shared`: "auto" (watches on a network filesystem), True (every watch, for a
    filesystem statfs does not tell apart) or False (none)."""

    shared: str | bool = DEFAULT_SHARED
    poll_interval: float = DEFAULT_CLUSTER_POLL_INTERVAL


@dataclass(frozen=True)
class Watch:
    path: Path
    recursive: bool = True
    include: tuple[str, ...] = DEFAULT_INCLUDE
    exclude: tuple[str, ...] = ()
    ignore: tuple[str, ...] = DEFAULT_IGNORE  # file-name globs of temporary names (syncd.daemon.names)
    direction: str = DEFAULT_DIRECTION
    mirror: Path | None = None  # None: outputs go beside their sources
    on_exists: str = DEFAULT_ON_EXISTS
    layout: str = AUTO
    module_map: ModuleMap | None = field(default=None, compare=False)
    modules_file: Path | None = None  # where the module map came from when given as a file path
    poll: bool = False
    # Burn's store vocabulary; see syncd/adapters/keys.py and precision.py for the semantics
    remap: tuple[tuple[str, str], ...] = ()  # ordered (pattern, replacement) rules, Rust replacement syntax
    map_indices_contiguous: bool | None = None  # None: as Burn's store for the source's format
    tensor_include: tuple[str, ...] = ()  # regexes searched in tensor names; none: every tensor
    tensor_exclude: tuple[str, ...] = ()
    precision: str | None = None  # f16 | bf16 | f32 (f32: restore what an earlier conversion cast down)
    shard_size: int | None = None  # bytes per shard when writing safetensors; None: as carried, else one file
    top_level_key: str | None = None  # a PyTorch checkpoint's key holding the tensors (Burn's with_top_level_key)
    line: int = 0  # the line of its `path:`, for messages
    index: int = 0  # its position in the config's `watches:` list, for messages

    @property
    def modules(self) -> dict[str, str]:
        """The module map's pattern -> kind rules, in order."""
        return {rule.pattern: rule.kind for rule in self.module_map.rules} if self.module_map else {}

    def output_dir_for(self, source: Path) -> Path:
        """The directory a converted `source` (a file under this watch) is published into."""
        if self.mirror is None:
            return source.parent
        return self.mirror / source.parent.relative_to(self.path)


@dataclass(frozen=True)
class Config:
    path: Path  # the file this was read from
    state_dir: Path
    log: LogSettings
    watches: tuple[Watch, ...]
    workers: int = DEFAULT_WORKERS
    settle_seconds: float = DEFAULT_SETTLE_SECONDS
    unleased_settle_seconds: float = DEFAULT_UNLEASED_SETTLE_SECONDS
    poll_interval: float | None = None
    rescan_interval: float | None = DEFAULT_RESCAN_INTERVAL  # None: no periodic safety rescan
    stuck_worker_seconds: float = DEFAULT_STUCK_WORKER_SECONDS
    hash_name: str = DEFAULT_HASH_NAME
    metrics: Path | None = None  # a Prometheus textfile (`*.prom`) rewritten every second; None: none
    cluster: ClusterSettings = field(default_factory=ClusterSettings)

    def polling_interval_for(self, watch: Watch) -> float | None:
        """Seconds between polls when `watch` must be polled, None when inotify serves it."""
        if self.poll_interval is not None:
            return self.poll_interval
        return DEFAULT_POLL_INTERVAL if watch.poll else None

    def restart_settings_changed(self, new: Config) -> list[str]:
        """The RESTART_SETTINGS that differ in `new`."""
        return [name for name in RESTART_SETTINGS if _get(self, name) != _get(new, name)]

    def keeping_restart_settings(self, running: Config) -> Config:
        """This configuration with the RESTART_SETTINGS taken from `running` (what a reload applies)."""
        new = self
        for name in RESTART_SETTINGS:
            new = _replace(new, name, _get(running, name))
        return new


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _replace(obj: Any, dotted: str, value: Any) -> Any:
    head, _, rest = dotted.partition(".")
    return dataclasses.replace(obj, **{head: _replace(getattr(obj, head), rest, value) if rest else value})
