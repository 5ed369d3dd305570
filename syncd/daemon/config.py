"""The daemon's YAML configuration: schema, validation with line numbers, and safety checks.

`load_config` returns frozen dataclasses or raises one ConfigError; `check_config` lists every problem
(for `syncd check-config`). Problems name the file, the line and the key, e.g.
`syncd.yaml:12: watches[0].direction: expected one of bpk->safetensors, safetensors->bpk, both, got 'sideways'`.

Decisions worth knowing:
- Relative paths resolve against the directory of the file that names them; `~` is expanded.
- Watched directories and mirror directories must exist: a typo should not silently watch nothing or
  create a new tree somewhere.
- A mirror directory may not overlap any watched tree (in either direction): the daemon would see its own
  outputs as new sources and convert them back. Two watches may not claim the same files either (same
  directory, or one inside another watch that is recursive), since their settings could disagree.
- With `output: beside` and `direction: both`, outputs land in the watched tree by design; the watcher tells
  its own outputs apart through the state database, not through the config.
- A watch's module map (inline, or a module-map file as `syncd convert --modules` reads it, `layout:` included)
  is read by the adapters' one parser, `parse_module_map`; this module only puts line numbers on its problems.
- Burn's store vocabulary per watch (issue 16): `remap:` ordered [pattern, replacement] rules (KeyRemapper),
  `map_indices_contiguous:`, `tensors: {include, exclude}` (regexes, as PathFilter), `precision:` and
  `shard_size:`. Rules and patterns are compiled here, so a bad one is reported with its line.
"""

from __future__ import annotations

import difflib
import math
import os
import stat
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import yaml

from syncd.adapters import AUTO, LAYOUT_CHOICES, MapProblem, ModuleMap, parse_module_map
from syncd.adapters.keys import compile_filter, compile_rule
from syncd.adapters.precision import PRECISIONS
from syncd.daemon.names import DEFAULT_IGNORE
from syncd.errors import ConfigError, one_line
from syncd.formats.registry import DIRECTIONS, FORMATS
from syncd.formats.shards import parse_shard_size

DEFAULT_CONFIG_PATH = Path("/etc/syncd/syncd.yaml")
# used when a watch sets `poll: true` but the global poll_interval is null
DEFAULT_POLL_INTERVAL = 2.0
# seconds between safety rescans of every watch, which find what inotify events missed
DEFAULT_RESCAN_INTERVAL = 600.0

ON_EXISTS = ("skip", "error", "overwrite")
LOG_LEVELS = ("debug", "info", "warning", "error")

TOP_LEVEL_KEYS = (
    "workers",
    "settle_seconds",
    "state_dir",
    "log",
    "poll_interval",
    "rescan_interval",
    "stuck_worker_seconds",
    "ignore",
    "hash",
    "watches",
)
# settings a running daemon cannot change: a SIGHUP names them in its `reloaded` line
RESTART_SETTINGS = ("workers", "state_dir", "log.path")
HASH_CHOICES = ("xxh3_128", "sha256")  # syncd.engine.hashing.HASH_CHOICES, without importing the converter
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
)
TENSOR_FILTER_KEYS = ("include", "exclude")


@dataclass(frozen=True)
class LogSettings:
    path: Path
    max_bytes: int = 10 * 1024 * 1024  # 0: never rotate
    backups: int = 5
    level: str = "info"


@dataclass(frozen=True)
class Watch:
    path: Path
    recursive: bool = True
    include: tuple[str, ...] = tuple(f"*{fmt.extension}" for fmt in FORMATS)
    exclude: tuple[str, ...] = ()
    ignore: tuple[str, ...] = DEFAULT_IGNORE  # file-name globs of temporary names (syncd.daemon.names)
    direction: str = "both"
    mirror: Path | None = None  # None: outputs go beside their sources
    on_exists: str = "skip"
    layout: str = AUTO
    module_map: ModuleMap | None = field(default=None, compare=False)
    modules_file: Path | None = None  # where the module map came from when given as a file path
    poll: bool = False
    # Burn's store vocabulary (issue 16); see syncd/adapters/keys.py and precision.py for the semantics
    remap: tuple[tuple[str, str], ...] = ()  # ordered (pattern, replacement) rules, Rust replacement syntax
    map_indices_contiguous: bool | None = None  # None: as Burn's store for the source's format
    tensor_include: tuple[str, ...] = ()  # regexes searched in tensor names; none: every tensor
    tensor_exclude: tuple[str, ...] = ()
    precision: str | None = None  # f16 | bf16 | f32 (f32: restore what an earlier conversion cast down)
    shard_size: int | None = None  # bytes per shard when writing safetensors; None: as carried, else one file
    line: int = 0  # the line of its `path:`, for messages
    index: int = 0  # its position in the config's `watches:` list, for messages

    @property
    def modules(self) -> dict[str, str]:
        """The module map's pattern -> kind rules, in order."""
        return {rule.pattern: rule.kind for rule in self.module_map.rules} if self.module_map else {}

    @property
    def output(self) -> str:
        return "beside" if self.mirror is None else f"mirror:{self.mirror}"

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
    workers: int = 2
    settle_seconds: float = 1.0
    poll_interval: float | None = None
    rescan_interval: float | None = DEFAULT_RESCAN_INTERVAL  # None: no periodic safety rescan
    # a worker busy with one file longer than this stops the watchdog pings (systemd then restarts syncd)
    stuck_worker_seconds: float = 1800.0

    def restart_settings_changed(self, new: Config) -> list[str]:
        """The RESTART_SETTINGS that differ in `new` (a reload keeps the running values)."""
        now = {"workers": self.workers, "state_dir": self.state_dir, "log.path": self.log.path}
        then = {"workers": new.workers, "state_dir": new.state_dir, "log.path": new.log.path}
        return [name for name in RESTART_SETTINGS if now[name] != then[name]]

    hash_name: str = "xxh3_128"  # the source hash recorded in outputs (`hash:`)

    def polling_interval_for(self, watch: Watch) -> float | None:
        """Seconds between polls when `watch` must be polled, None when inotify serves it."""
        if self.poll_interval is not None:
            return self.poll_interval
        return DEFAULT_POLL_INTERVAL if watch.poll else None


@dataclass(frozen=True)
class Problem:
    file: str
    line: int | None
    key: str | None
    message: str

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        return f"{where}: {self.key}: {self.message}" if self.key else f"{where}: {self.message}"

    def to_error(self) -> ConfigError:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        return ConfigError(f"{self.key}: {self.message}" if self.key else self.message, path=where)


# ---------------------------------------------------------------------------------------------- public API


def load_config(path: str | os.PathLike[str], *, check_filesystem: bool = True) -> Config:
    """Read and validate `path`. Raises ConfigError naming the first problem (and how many more).

    `check_filesystem=False` skips the checks that need the watched trees to exist and the file mode to be
    safe; `syncd log` uses it to find the log of a config it will not act on.
    """
    config, problems = _validate(Path(path), check_filesystem=check_filesystem)
    if problems:
        error = problems[0].to_error()
        if len(problems) > 1:
            more = len(problems) - 1
            error = ConfigError(
                f"{error.message} (and {more} more problem{'s' if more > 1 else ''}; `syncd check-config` lists them)",
                error.path,
            )
        raise error
    assert config is not None
    return config


def check_config(path: str | os.PathLike[str]) -> list[str]:
    """Every problem in the config at `path`, one line each; empty when it is valid."""
    _, problems = _validate(Path(path), check_filesystem=True)
    return [str(problem) for problem in problems]


REMAP_SEES = (
    "applied to the source's names as in the file, before the layout adapter renames weight/bias to "
    "gamma/beta (as Burn's stores do): a .safetensors' weight/bias/running_mean, a .bpk's gamma/beta"
)


def run_check_config(path: str | os.PathLike[str], out: TextIO | None = None, user: str | None = None) -> int:
    """`syncd check-config FILE`: prints one line per problem; 0 when valid, 2 when not. A valid config also
    gets a warning line for each watched tree `user` (default: the caller) cannot list, read or write."""
    out = out or sys.stdout
    config, problems = _validate(Path(path), check_filesystem=True)
    for problem in problems:
        print(problem, file=out)
    if problems or config is None:
        return ConfigError.exit_code
    from syncd.daemon.access import access_warnings

    for warning in access_warnings(config, user):
        print(warning, file=out)
    for i, watch in enumerate(config.watches):
        if watch.remap:  # which names the rules see changed once (Burn's order): say it where they are checked
            print(f"{path}: watches[{i}].remap: {len(watch.remap)} rules, {REMAP_SEES}", file=out)
    count = len(config.watches)
    print(f"{path}: valid ({count} watch{'es' if count != 1 else ''})", file=out)
    return 0


# ---------------------------------------------------------------------------------------------- validation


def _validate(path: Path, *, check_filesystem: bool) -> tuple[Config | None, list[Problem]]:
    """Every problem becomes a Problem line, including what the YAML library or the OS refuses in ways of
    their own (nesting deeper than the parser's recursion, a NUL byte in a path): a reload must never die."""
    try:
        return _validate_unguarded(path, check_filesystem=check_filesystem)
    except RecursionError:
        return None, [Problem(str(path), None, None, "nested too deeply to read (is it generated?)")]
    except (ValueError, TypeError, OverflowError, MemoryError) as exc:
        return None, [Problem(str(path), None, None, f"invalid value: {one_line(exc)}")]


def _validate_unguarded(path: Path, *, check_filesystem: bool) -> tuple[Config | None, list[Problem]]:
    reader = _YamlFile(path)
    root = reader.load()
    if root is None:
        return None, reader.problems
    if check_filesystem:
        reader.check_not_writable_by_others()
    builder = _ConfigBuilder(reader, check_filesystem)
    config = builder.build(root)
    problems = reader.problems
    if config is not None:
        problems += _check_watch_safety(config, str(path), builder.mirror_lines)
    return (config if not problems else None), _in_reading_order(problems, str(path))


def _in_reading_order(problems: list[Problem], main_file: str) -> list[Problem]:
    """File-wide problems first, then the config's own lines top to bottom, then included files'."""

    def order(problem: Problem) -> tuple[int, int]:
        if problem.line is None:
            return (0, 0)
        return (1 if problem.file == main_file else 2, problem.line)

    return sorted(problems, key=order)


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return repr(value)


def _did_you_mean(value: object, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str):
        return ""
    close = difflib.get_close_matches(value, choices, n=1) or [
        choice for choice in choices if choice.lower() == value.lower()
    ]
    return f" (did you mean '{close[0]}'?)" if close else ""


class _YamlFile:
    """One YAML file read as nodes (for line numbers), collecting problems as they are found."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.name = str(path)
        self.dir = Path(os.path.abspath(path)).parent
        self.problems: list[Problem] = []
        self._loader: yaml.SafeLoader | None = None

    def problem(self, node: yaml.Node | None, key: str | None, message: str) -> None:
        line = node.start_mark.line + 1 if node is not None else None
        self.problems.append(Problem(self.name, line, key, message))

    def load(self) -> yaml.MappingNode | None:
        """The top-level mapping node, or None (with a problem recorded) when there is none."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except OSError as exc:
            self.problem(None, None, f"cannot read: {exc.strerror or exc}")
            return None
        except UnicodeDecodeError as exc:
            self.problem(None, None, f"not UTF-8 text ({exc.reason} at byte {exc.start})")
            return None
        self._loader = yaml.SafeLoader(text)
        try:
            root = self._loader.get_single_node()
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            line = mark.line + 1 if mark is not None else None
            self.problems.append(Problem(self.name, line, None, f"invalid YAML: {exc.problem or exc.context}"))
            return None
        except yaml.YAMLError as exc:
            self.problem(None, None, f"invalid YAML: {exc}")
            return None
        if root is None:
            self.problem(None, None, "the file is empty; it needs at least `watches:`")
            return None
        if not isinstance(root, yaml.MappingNode):
            self.problem(root, None, "expected a mapping of settings at the top level")
            return None
        return root

    def check_not_writable_by_others(self) -> None:
        # whoever can write the config decides what the daemon reads and overwrites
        try:
            mode = os.stat(self.path).st_mode
        except OSError as exc:
            self.problem(None, None, f"cannot stat: {exc.strerror}")
            return
        if mode & 0o022:
            self.problem(
                None,
                None,
                f"refusing a config writable by group or others (mode {stat.S_IMODE(mode):04o}); "
                f"run: chmod go-w {self.name}",
            )

    def value(self, node: yaml.Node) -> Any:
        assert self._loader is not None
        try:
            return self._loader.construct_object(node, deep=True)
        except yaml.YAMLError as exc:
            return _Unreadable(str(exc).splitlines()[0])

    def entries(self, node: yaml.Node, key: str) -> dict[str, tuple[yaml.Node, yaml.Node]] | None:
        """A mapping node's items by key name; flags non-string and duplicate keys."""
        if not isinstance(node, yaml.MappingNode):
            self.problem(node, key, f"expected a mapping, got {_describe(self.value(node))}")
            return None
        items: dict[str, tuple[yaml.Node, yaml.Node]] = {}
        for key_node, value_node in node.value:
            name = self.value(key_node)
            label = f"{key}.{name}" if key else str(name)
            if not isinstance(name, str):
                self.problem(key_node, key or None, f"keys must be strings, got {_describe(name)}")
            elif name in items:
                self.problem(key_node, label, "duplicate key (the earlier one would be ignored)")
            else:
                items[name] = (key_node, value_node)
        return items

    def unknown_keys(
        self, items: dict[str, tuple[yaml.Node, yaml.Node]], allowed: tuple[str, ...], prefix: str
    ) -> None:
        for name, (key_node, _) in items.items():
            if name not in allowed:
                label = f"{prefix}.{name}" if prefix else name
                self.problem(key_node, label, f"unknown key{_did_you_mean(name, allowed)}")


@dataclass(frozen=True)
class _Unreadable:
    reason: str

    def __repr__(self) -> str:
        return f"an unreadable value ({self.reason})"


_MISSING = object()


class _Section:
    """Typed getters over one mapping; a bad value records a problem and yields the default."""

    def __init__(self, file: _YamlFile, items: dict[str, tuple[yaml.Node, yaml.Node]], prefix: str) -> None:
        self.file = file
        self.items = items
        self.prefix = prefix

    def key(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def node(self, name: str) -> yaml.Node | None:
        item = self.items.get(name)
        return item[1] if item else None

    def raw(self, name: str) -> Any:
        node = self.node(name)
        return _MISSING if node is None else self.file.value(node)

    def _get(
        self, name: str, default: Any, accept: Callable[[Any], bool], expected: str, choices: tuple[str, ...] = ()
    ) -> Any:
        value = self.raw(name)
        if value is _MISSING:
            return default
        if not accept(value):
            hint = _did_you_mean(value, choices)
            self.file.problem(self.node(name), self.key(name), f"expected {expected}, got {_describe(value)}{hint}")
            return default
        return value

    def integer(self, name: str, default: int, minimum: int) -> int:
        def accept(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= minimum

        return self._get(name, default, accept, f"an integer >= {minimum}")

    def number(
        self,
        name: str,
        default: float | None,
        *,
        minimum: float,
        allow_null: bool = False,
        strictly_positive: bool = False,
    ) -> float | None:
        def accept(v: Any) -> bool:
            if v is None:
                return allow_null
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                return False
            return v > minimum if strictly_positive else v >= minimum

        bound = f"> {minimum:g}" if strictly_positive else f">= {minimum:g}"
        expected = f"a number {bound}" + (" or null" if allow_null else "")
        value = self._get(name, default, accept, expected)
        return None if value is None else float(value)

    def boolean(self, name: str, default: bool) -> bool:
        return self._get(name, default, lambda v: isinstance(v, bool), "true or false")

    def optional_boolean(self, name: str) -> bool | None:
        """true or false, or None where the key is absent (a default that depends on more than the config)."""
        return self._get(name, None, lambda v: isinstance(v, bool), "true or false")

    def choice(self, name: str, default: str, choices: tuple[str, ...]) -> str:
        return self._get(name, default, lambda v: v in choices, f"one of {', '.join(choices)}", choices)

    def string_list(self, name: str, default: tuple[str, ...]) -> tuple[str, ...]:
        def accept(v: Any) -> bool:
            return isinstance(v, list) and all(isinstance(item, str) and item for item in v)

        return tuple(self._get(name, list(default), accept, "a list of non-empty strings"))

    def path(self, name: str, default: str | None) -> Path | None:
        value = self._get(name, default, lambda v: isinstance(v, str) and v != "", "a path (a non-empty string)")
        return None if value is None else _resolve(self.file.dir, value)


def _resolve(base: Path, text: str) -> Path:
    return (base / os.path.expanduser(text)).resolve()


class _ConfigBuilder:
    def __init__(self, file: _YamlFile, check_filesystem: bool) -> None:
        self.file = file
        self.check_filesystem = check_filesystem
        self.mirror_lines: dict[int, int] = {}  # watch index -> line of its mirror, for safety messages

    def build(self, root: yaml.MappingNode) -> Config | None:
        items = self.file.entries(root, "")
        if items is None:
            return None
        self.file.unknown_keys(items, TOP_LEVEL_KEYS, "")
        top = _Section(self.file, items, "")
        workers = top.integer("workers", 2, minimum=1)
        settle = top.number("settle_seconds", 1.0, minimum=0.0)
        poll_interval = top.number("poll_interval", None, minimum=0.0, allow_null=True, strictly_positive=True)
        rescan_interval = top.number(
            "rescan_interval", DEFAULT_RESCAN_INTERVAL, minimum=0.0, allow_null=True, strictly_positive=True
        )
        stuck = top.number("stuck_worker_seconds", 1800.0, minimum=0.0, strictly_positive=True)
        hash_name = top.choice("hash", "xxh3_128", HASH_CHOICES)
        state_dir = top.path("state_dir", "./state")
        log = self._log(top)
        ignore = _ignore_list(top, DEFAULT_IGNORE)
        watches = self._watches(top, root, ignore)
        assert state_dir is not None and settle is not None and stuck is not None
        return Config(
            path=Path(os.path.abspath(self.file.path)),
            state_dir=state_dir,
            log=log,
            watches=watches,
            workers=workers,
            settle_seconds=settle,
            poll_interval=poll_interval,
            rescan_interval=rescan_interval,
            stuck_worker_seconds=stuck,
            hash_name=hash_name,
        )

    def _log(self, top: _Section) -> LogSettings:
        default_path = _resolve(self.file.dir, "./syncd.log.jsonl")
        node = top.node("log")
        if node is None or top.raw("log") is None:
            return LogSettings(path=default_path)
        items = self.file.entries(node, "log")
        if items is None:
            return LogSettings(path=default_path)
        self.file.unknown_keys(items, LOG_KEYS, "log")
        section = _Section(self.file, items, "log")
        path = section.path("path", "./syncd.log.jsonl")
        assert path is not None
        return LogSettings(
            path=path,
            max_bytes=section.integer("max_bytes", 10 * 1024 * 1024, minimum=0),
            backups=section.integer("backups", 5, minimum=0),
            level=section.choice("level", "info", LOG_LEVELS),
        )

    def _watches(self, top: _Section, root: yaml.Node, ignore: tuple[str, ...]) -> tuple[Watch, ...]:
        node = top.node("watches")
        if node is None:
            self.file.problem(root, "watches", "missing: at least one watch is required")
            return ()
        if not isinstance(node, yaml.SequenceNode) or not node.value:
            self.file.problem(
                node, "watches", f"expected a non-empty list of watches, got {_describe(self.file.value(node))}"
            )
            return ()
        watches = [self._watch(item, index, ignore) for index, item in enumerate(node.value)]
        return tuple(watch for watch in watches if watch is not None)

    def _watch(self, node: yaml.Node, index: int, ignore: tuple[str, ...]) -> Watch | None:
        """One watch; `ignore` is the config's global list, which the watch's own `ignore:` replaces."""
        prefix = f"watches[{index}]"
        items = self.file.entries(node, prefix)
        if items is None:
            return None
        self.file.unknown_keys(items, WATCH_KEYS, prefix)
        section = _Section(self.file, items, prefix)
        if "path" not in items:
            self.file.problem(node, f"{prefix}.path", "missing: every watch needs a directory")
            return None
        path = section.path("path", None)
        if path is None:
            return None
        if self.check_filesystem:
            self._check_directory(section.node("path"), f"{prefix}.path", path)
        module_map, modules_file = self._modules(section)
        output_node = section.node("output")
        if output_node is not None:
            self.mirror_lines[index] = output_node.start_mark.line + 1
        return Watch(
            path=path,
            recursive=section.boolean("recursive", True),
            include=section.string_list("include", Watch.include),
            exclude=section.string_list("exclude", ()),
            ignore=_ignore_list(section, ignore),
            direction=section.choice("direction", "both", tuple(DIRECTIONS)),
            mirror=self._mirror(section),
            on_exists=section.choice("on_exists", "skip", ON_EXISTS),
            layout=section.choice("layout", AUTO, LAYOUT_CHOICES),
            module_map=module_map,
            modules_file=modules_file,
            poll=section.boolean("poll", False),
            remap=_remap_rules(self.file, section),
            map_indices_contiguous=section.optional_boolean("map_indices_contiguous"),
            **_tensor_filter(self.file, section),
            precision=None if section.raw("precision") is None else section.choice("precision", None, PRECISIONS),
            shard_size=_shard_size(self.file, section),
            line=items["path"][1].start_mark.line + 1,
            index=index,
        )

    def _check_directory(self, node: yaml.Node | None, key: str, path: Path) -> None:
        if not path.exists():
            self.file.problem(node, key, f"{path} does not exist")
        elif not path.is_dir():
            self.file.problem(node, key, f"{path} is not a directory")

    def _mirror(self, section: _Section) -> Path | None:
        node = section.node("output")
        value = section.raw("output")
        key = section.key("output")
        if value is _MISSING or value == "beside":
            return None
        if isinstance(value, dict) and set(value) == {"mirror"} and node is not None:
            items = self.file.entries(node, key)
            mirror_section = _Section(self.file, items or {}, key)
            mirror = mirror_section.path("mirror", None)
            if mirror is not None and self.check_filesystem:
                self._check_directory(mirror_section.node("mirror"), f"{key}.mirror", mirror)
            return mirror
        self.file.problem(node, key, f"expected 'beside' or {{mirror: DIR}}, got {_describe(value)}")
        return None

    def _modules(self, section: _Section) -> tuple[ModuleMap | None, Path | None]:
        node = section.node("modules")
        value = section.raw("modules")
        key = section.key("modules")
        if value is _MISSING or value is None or node is None:
            return None, None
        if isinstance(value, str) and value:
            modules_file = _resolve(self.file.dir, value)
            return _load_modules_file(modules_file, self.file, node, key, self.check_filesystem), modules_file
        if isinstance(value, dict):
            # an inline map is the `modules:` part of a module-map file; its problems carry the watch's prefix
            module_map, problems = parse_module_map({"modules": value}, source=str(self.file.path))
            _report_map_problems(self.file, problems, key[: -len("modules")], whole=None, modules=node)
            return module_map, None
        self.file.problem(node, key, f"expected a mapping of pattern -> kind or a file path, got {_describe(value)}")
        return None, None


def _ignore_list(section: _Section, default: tuple[str, ...]) -> tuple[str, ...]:
    """`ignore:` as a list of file-name globs; an empty list (or null) ignores nothing."""
    if section.raw("ignore") is None:
        return ()
    return section.string_list("ignore", default)


def _remap_rules(file: _YamlFile, section: _Section) -> tuple[tuple[str, str], ...]:
    """`remap:` as a list of [pattern, replacement] pairs; each rule is compiled (problems at its line)."""
    node, key = section.node("remap"), section.key("remap")
    if node is None or section.raw("remap") is None:
        return ()
    if not isinstance(node, yaml.SequenceNode):
        file.problem(node, key, f"expected a list of [pattern, replacement] rules, got {_describe(file.value(node))}")
        return ()
    rules = []
    for position, item in enumerate(node.value):
        label = f"{key}[{position}]"
        pair = file.value(item)
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair) and pair[0]):
            file.problem(item, label, f"expected [pattern, replacement] (two strings), got {_describe(pair)}")
            continue
        try:
            compile_rule(pair[0], pair[1])
        except ValueError as exc:
            file.problem(item, label, str(exc))
            continue
        rules.append((pair[0], pair[1]))
    return tuple(rules)


def _tensor_filter(file: _YamlFile, section: _Section) -> dict[str, tuple[str, ...]]:
    """`tensors: {include: [...], exclude: [...]}`, every pattern compiled (problems at the list's line)."""
    node, key = section.node("tensors"), section.key("tensors")
    if node is None or section.raw("tensors") is None:
        return {}
    items = file.entries(node, key)
    if items is None:
        return {}
    file.unknown_keys(items, TENSOR_FILTER_KEYS, key)
    inner = _Section(file, items, key)
    result = {}
    for name in TENSOR_FILTER_KEYS:
        patterns = inner.string_list(name, ())
        for pattern in patterns:
            try:
                compile_filter(pattern)
            except ValueError as exc:
                file.problem(inner.node(name), inner.key(name), str(exc))
        result[f"tensor_{name}"] = patterns
    return result


def _shard_size(file: _YamlFile, section: _Section) -> int | None:
    """`shard_size:` as bytes (an integer) or a size such as 500MB / 2GiB."""
    value = section.raw("shard_size")
    if value is _MISSING or value is None:
        return None
    text = str(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else ""
    try:
        return parse_shard_size(text)
    except ValueError as exc:
        file.problem(section.node("shard_size"), section.key("shard_size"), str(exc))
        return None


def _load_modules_file(
    path: Path, parent: _YamlFile, node: yaml.Node, key: str, check_filesystem: bool
) -> ModuleMap | None:
    """A module-map file, read exactly as `syncd convert --modules FILE` reads it (`layout:` included).
    Problems name that file and its lines."""
    if not path.is_file():
        parent.problem(node, key, f"module map file {path} does not exist")
        return None
    file = _YamlFile(path)
    module_map = None
    root = file.load()
    if root is not None:
        if check_filesystem:
            file.check_not_writable_by_others()
        module_map, problems = parse_module_map(file.value(root), source=str(path))
        _report_map_problems(file, problems, "", whole=root, modules=_child(file, root, "modules"))
    parent.problems.extend(file.problems)
    return module_map


def _report_map_problems(
    file: _YamlFile, problems: list[MapProblem], prefix: str, whole: yaml.Node | None, modules: yaml.Node | None
) -> None:
    """Record the module-map parser's problems against `file`, each on the line of the node it is about.
    `whole` is the node of the whole map (a module-map file), `modules` that of its `modules:` mapping."""
    if modules is not None:
        _duplicate_patterns(file, modules, prefix + "modules")
    for problem in problems:
        location = problem.location
        node, rest = (modules, location[1:]) if location[:1] == ("modules",) and modules else (whole, location)
        for part in rest:
            node = _child(file, node, part) if node is not None else None
        label = prefix + problem.label if problem.key else None
        file.problem(node or modules or whole, label, problem.message)


def _duplicate_patterns(file: _YamlFile, node: yaml.Node, key: str) -> None:
    """YAML keeps the last of two equal keys; the earlier rule would silently vanish."""
    seen: set[str] = set()
    for key_node, _ in node.value if isinstance(node, yaml.MappingNode) else ():
        pattern = str(file.value(key_node))
        if pattern in seen:
            file.problem(key_node, f"{key}[{pattern!r}]", "duplicate key (the earlier one would be ignored)")
        seen.add(pattern)


def _child(file: _YamlFile, node: yaml.Node, name: str) -> yaml.Node | None:
    """The value node under key `name` of a mapping node (keys compared as text: `0:` is the path '0')."""
    if not isinstance(node, yaml.MappingNode):
        return None
    for key_node, value_node in node.value:
        if str(file.value(key_node)) == name:
            return value_node
    return None


# ---------------------------------------------------------------------------------------------- safety


def _check_watch_safety(config: Config, file: str, mirror_lines: Mapping[int, int]) -> list[Problem]:
    """Refuses watches on `/`, watches that claim the same files, and mirrors that overlap watched trees.

    `mirror_lines` maps a watch's index to the line of its `output:` value.
    """
    problems: list[Problem] = []
    watches = [watch for watch in config.watches if watch.path != Path(watch.path.anchor)]
    for watch in config.watches:
        if watch.path == Path(watch.path.anchor):
            key = f"watches[{watch.index}].path"
            problems.append(Problem(file, watch.line, key, "refusing to watch the root directory"))
    # the root is refused above; comparing the others against it would only repeat that
    for position, watch in enumerate(watches):
        key = f"watches[{watch.index}]"
        for other in watches[:position]:
            if _claims_same_files(watch, other) or _claims_same_files(other, watch):
                message = f"overlaps watches[{other.index}] ({other.path}); a file would be handled by two watches"
                problems.append(Problem(file, watch.line, f"{key}.path", message))
    for watch in watches:
        if watch.mirror is None:
            continue
        for other in watches:
            if _inside(watch.mirror, other.path) or _inside(other.path, watch.mirror):
                which = "its own watched tree" if other is watch else f"watches[{other.index}]"
                message = f"{watch.mirror} overlaps {which} ({other.path}); outputs would be picked up as new sources"
                line = mirror_lines.get(watch.index, watch.line)
                problems.append(Problem(file, line, f"watches[{watch.index}].output.mirror", message))
    return problems


def _inside(path: Path, tree: Path) -> bool:
    return path == tree or tree in path.parents


def _claims_same_files(inner: Watch, outer: Watch) -> bool:
    """True if a file under `inner` is also seen by `outer`: same directory, or inside a recursive one."""
    return inner.path == outer.path or (outer.recursive and outer.path in inner.path.parents)
