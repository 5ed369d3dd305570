"""From the YAML nodes of a config file to a `Config`: each key read with its type and its default (from
`schema`), each problem recorded with its line.

A watch's module map (inline, or a module-map file as `syncd convert --modules` reads it, `layout:` included)
is read by the adapters' one parser, `parse_module_map`; this module only puts line numbers on its problems.
Burn's store vocabulary per watch: `remap:` ordered [pattern, replacement] rules (KeyRemapper),
`map_indices_contiguous:`, `tensors: {include, exclude}` (regexes, as PathFilter), `precision:` and
`shard_size:`. Rules and patterns are compiled here, so a bad one is reported with its line.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from syncd.adapters import AUTO, KEEP, LAYOUT_CHOICES, MapProblem, ModuleMap, parse_module_map
from syncd.adapters.keys import compile_filter, compile_rule
from syncd.adapters.precision import PRECISIONS
from syncd.daemon.config.safety import check_file_mode
from syncd.daemon.config.schema import (
    CLUSTER_KEYS,
    DEFAULT_CLUSTER_POLL_INTERVAL,
    DEFAULT_DIRECTION,
    DEFAULT_HASH_NAME,
    DEFAULT_IGNORE,
    DEFAULT_INCLUDE,
    DEFAULT_LOG_BACKUPS,
    DEFAULT_LOG_LEVEL,
    DEFAULT_LOG_MAX_BYTES,
    DEFAULT_LOG_PATH,
    DEFAULT_ON_EXISTS,
    DEFAULT_RESCAN_INTERVAL,
    DEFAULT_SETTLE_SECONDS,
    DEFAULT_SHARED,
    DEFAULT_STATE_DIR,
    DEFAULT_STUCK_WORKER_SECONDS,
    DEFAULT_UNLEASED_SETTLE_SECONDS,
    DEFAULT_WORKERS,
    LOG_KEYS,
    LOG_LEVELS,
    MAX_LOG_BACKUPS,
    MAX_SECONDS,
    MAX_WORKERS,
    METRICS_SUFFIX,
    ON_EXISTS,
    SHARED_CHOICES,
    TENSOR_FILTER_KEYS,
    TOP_LEVEL_KEYS,
    WATCH_KEYS,
    ClusterSettings,
    Config,
    LogSettings,
    Watch,
)
from syncd.daemon.config.yamlfile import MISSING, Section, YamlFile, describe, resolve
from syncd.engine.directions import DIRECTIONS
from syncd.engine.hashing import HASH_CHOICES
from syncd.formats import BURNPACK
from syncd.formats.pytorch_facts import DAEMON_PATTERNS as PYTORCH_PATTERNS
from syncd.formats.registry import BY_EXTENSION, PYTORCH_FORMAT
from syncd.formats.shards import parse_shard_size


class ConfigBuilder:
    """Builds a Config from `file`'s top-level mapping; problems go to `file.problems`."""

    def __init__(self, file: YamlFile, check_filesystem: bool, runs_as: int | None = None) -> None:
        self.file = file
        self.check_filesystem = check_filesystem
        self.runs_as = runs_as  # uid of the user the daemon runs as, who may edit a module-map file (None: ours)
        self.mirror_lines: dict[int, int] = {}  # watch index -> line of its mirror, for safety messages

    def build(self, root: yaml.MappingNode) -> Config | None:
        items = self.file.entries(root, "")
        if items is None:
            return None
        self.file.unknown_keys(items, TOP_LEVEL_KEYS, "")
        top = Section(self.file, items, "")
        workers = top.integer("workers", DEFAULT_WORKERS, minimum=1, maximum=MAX_WORKERS)
        settle = top.number("settle_seconds", DEFAULT_SETTLE_SECONDS, minimum=0.0, maximum=MAX_SECONDS)
        unleased = top.number(
            "unleased_settle_seconds", DEFAULT_UNLEASED_SETTLE_SECONDS, minimum=0.0, maximum=MAX_SECONDS
        )
        poll_interval = top.number(
            "poll_interval", None, minimum=0.0, maximum=MAX_SECONDS, allow_null=True, strictly_positive=True
        )
        rescan_interval = top.number(
            "rescan_interval",
            DEFAULT_RESCAN_INTERVAL,
            minimum=0.0,
            maximum=MAX_SECONDS,
            allow_null=True,
            strictly_positive=True,
        )
        stuck = top.number(
            "stuck_worker_seconds",
            DEFAULT_STUCK_WORKER_SECONDS,
            minimum=0.0,
            maximum=MAX_SECONDS,
            strictly_positive=True,
        )
        hash_name = top.choice("hash", DEFAULT_HASH_NAME, HASH_CHOICES)
        state_dir = top.path("state_dir", DEFAULT_STATE_DIR)
        if state_dir is not None and (blocked := _not_a_directory(state_dir)) is not None:
            self.file.problem(top.node("state_dir"), "state_dir", f"{blocked} exists and is not a directory")
        metrics = self._metrics(top)
        log = self._log(top)
        cluster = self._cluster(top)
        ignore = _ignore_list(top, DEFAULT_IGNORE)
        watches = self._watches(top, root, ignore)
        assert state_dir is not None and settle is not None and unleased is not None and stuck is not None
        return Config(
            path=Path(os.path.abspath(self.file.path)),
            state_dir=state_dir,
            log=log,
            watches=watches,
            workers=workers,
            settle_seconds=settle,
            unleased_settle_seconds=unleased,
            poll_interval=poll_interval,
            rescan_interval=rescan_interval,
            stuck_worker_seconds=stuck,
            hash_name=hash_name,
            metrics=metrics,
            cluster=cluster,
        )

    def _metrics(self, top: Section) -> Path | None:
        """`metrics:` the textfile node_exporter's collector reads: named *.prom, in a directory that exists."""
        if top.raw("metrics") is None:
            return None
        path = top.path("metrics", None)
        if path is None:
            return None
        node, key = top.node("metrics"), top.key("metrics")
        if path.suffix != METRICS_SUFFIX:
            self.file.problem(node, key, f"{path}: the textfile collector reads only files named *{METRICS_SUFFIX}")
        elif self.check_filesystem and not path.parent.is_dir():
            self.file.problem(node, key, f"{path.parent} is not a directory (node_exporter's textfile directory?)")
        return path

    def _log(self, top: Section) -> LogSettings:
        default_path = resolve(self.file.dir, DEFAULT_LOG_PATH)
        node = top.node("log")
        if node is None or top.raw("log") is None:
            return LogSettings(path=default_path)
        items = self.file.entries(node, "log")
        if items is None:
            return LogSettings(path=default_path)
        self.file.unknown_keys(items, LOG_KEYS, "log")
        section = Section(self.file, items, "log")
        path = section.path("path", DEFAULT_LOG_PATH)
        assert path is not None
        if os.path.isdir(path):
            self.file.problem(section.node("path"), "log.path", f"{path} is a directory, not a file to log to")
        elif (blocked := _not_a_directory(path.parent)) is not None:
            self.file.problem(section.node("path"), "log.path", f"{blocked} exists and is not a directory")
        return LogSettings(
            path=path,
            max_bytes=section.integer("max_bytes", DEFAULT_LOG_MAX_BYTES, minimum=0),
            backups=section.integer("backups", DEFAULT_LOG_BACKUPS, minimum=0, maximum=MAX_LOG_BACKUPS),
            level=section.choice("level", DEFAULT_LOG_LEVEL, LOG_LEVELS),
        )

    def _cluster(self, top: Section) -> ClusterSettings:
        node = top.node("cluster")
        if node is None or top.raw("cluster") is None:
            return ClusterSettings()
        items = self.file.entries(node, "cluster")
        if items is None:
            return ClusterSettings()
        self.file.unknown_keys(items, CLUSTER_KEYS, "cluster")
        section = Section(self.file, items, "cluster")
        shared = section.value_in("shared", DEFAULT_SHARED, SHARED_CHOICES, "auto, true or false")
        interval = section.number(
            "poll_interval", DEFAULT_CLUSTER_POLL_INTERVAL, minimum=0.0, maximum=MAX_SECONDS, strictly_positive=True
        )
        assert interval is not None
        return ClusterSettings(shared=shared, poll_interval=interval)

    def _watches(self, top: Section, root: yaml.Node, ignore: tuple[str, ...]) -> tuple[Watch, ...]:
        node = top.node("watches")
        if node is None:
            self.file.problem(root, "watches", "missing: at least one watch is required")
            return ()
        if not isinstance(node, yaml.SequenceNode) or not node.value:
            self.file.problem(
                node, "watches", f"expected a non-empty list of watches, got {describe(self.file.value(node))}"
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
        section = Section(self.file, items, prefix)
        if "path" not in items:
            self.file.problem(node, f"{prefix}.path", "missing: every watch needs a directory")
            return None
        path = section.path("path", None)
        if path is None:
            return None
        if self.check_filesystem and os.path.lexists(path):
            # a tree not there (yet) is no problem: a late mount, a job's output directory made by its first
            # save. The daemon watches it once it is made (service.py), as it does a tree removed and made again;
            # refusing it here stopped the service (exit 2 is not restarted) and every other tree with it.
            self._check_directory(section.node("path"), f"{prefix}.path", path)
        module_map, modules_file = self._modules(section)
        output_node = section.node("output")
        if output_node is not None:
            self.mirror_lines[index] = output_node.start_mark.line + 1
        direction = section.choice("direction", DEFAULT_DIRECTION, tuple(DIRECTIONS))
        include = section.string_list("include", _default_include(direction))
        if include is not None and not any(_could_take(pattern, direction) for pattern in include):
            sources = ", ".join(f"*{ext}" for ext in _source_extensions(direction))
            self.file.problem(
                section.node("include"),
                section.key("include"),
                f"matches no file direction {direction} converts ({sources}): the watch would convert nothing",
            )
        layout = section.choice("layout", AUTO, LAYOUT_CHOICES)
        shard_size = _shard_size(self.file, section)
        if layout == KEEP and shard_size is not None and BURNPACK in DIRECTIONS[direction]:
            # (the engine refuses each such .bpk: a set holds PyTorch's layout, as save_pretrained writes it)
            self.file.problem(
                section.node("shard_size"),
                section.key("shard_size"),
                "with layout: keep, a Burn-layout .bpk (what Burn saves) keeps its layout, which a sharded set cannot "
                "hold (save_pretrained's sets are PyTorch's): each would fail; drop shard_size or layout: keep",
            )
        return Watch(
            path=path,
            recursive=section.boolean("recursive", True),
            include=include,
            exclude=section.string_list("exclude", ()),
            ignore=_ignore_list(section, ignore),
            direction=direction,
            mirror=self._mirror(section),
            on_exists=section.choice("on_exists", DEFAULT_ON_EXISTS, ON_EXISTS),
            layout=layout,
            module_map=module_map,
            modules_file=modules_file,
            poll=section.boolean("poll", False),
            remap=_remap_rules(self.file, section),
            map_indices_contiguous=section.optional_boolean("map_indices_contiguous"),
            **_tensor_filter(self.file, section),
            precision=_precision(section),
            shard_size=shard_size,
            top_level_key=_top_level_key(section),
            line=items["path"][1].start_mark.line + 1,
            index=index,
        )

    def _check_directory(self, node: yaml.Node | None, key: str, path: Path) -> None:
        if not path.exists():
            self.file.problem(node, key, f"{path} does not exist")
        elif not path.is_dir():
            self.file.problem(node, key, f"{path} is not a directory")

    def _mirror(self, section: Section) -> Path | None:
        node = section.node("output")
        value = section.raw("output")
        key = section.key("output")
        if value is MISSING or value == "beside":
            return None
        if isinstance(value, dict) and set(value) == {"mirror"} and node is not None:
            items = self.file.entries(node, key)
            mirror_section = Section(self.file, items or {}, key)
            mirror = mirror_section.path("mirror", None)
            if mirror is not None and self.check_filesystem:
                self._check_directory(mirror_section.node("mirror"), f"{key}.mirror", mirror)
            return mirror
        self.file.problem(node, key, f"expected 'beside' or {{mirror: DIR}}, got {describe(value)}")
        return None

    def _modules(self, section: Section) -> tuple[ModuleMap | None, Path | None]:
        node = section.node("modules")
        value = section.raw("modules")
        key = section.key("modules")
        if value is MISSING or value is None or node is None:
            return None, None
        if isinstance(value, str) and value:
            modules_file = resolve(self.file.dir, value)
            loaded = _load_modules_file(modules_file, self.file, node, key, self.check_filesystem, self.runs_as)
            return loaded, modules_file
        if isinstance(value, dict):
            # an inline map is the `modules:` part of a module-map file; its problems carry the watch's prefix
            module_map, problems = parse_module_map({"modules": value}, source=str(self.file.path))
            _report_map_problems(self.file, problems, key[: -len("modules")], whole=None, modules=node)
            return module_map, None
        self.file.problem(node, key, f"expected a mapping of pattern -> kind or a file path, got {describe(value)}")
        return None, None


def _ignore_list(section: Section, default: tuple[str, ...]) -> tuple[str, ...]:
    """`ignore:` as a list of file-name globs; an empty list (or null) ignores nothing."""
    if section.raw("ignore") is None:
        return ()
    return section.string_list("ignore", default)


def _source_extensions(direction: str) -> list[str]:
    return sorted(ext for ext, fmt in BY_EXTENSION.items() if fmt.name in DIRECTIONS[direction])


def _could_take(pattern: str, direction: str) -> bool:
    """Whether an `include` glob can match a name of a format the direction converts, or of a set's index of
    one: the literal text after its last wildcard must fit the end of such a name (`*.safetensors` never
    matches a .bpk; `model*` may; `*.index.json` takes sets)."""
    tail = re.split(r"[*?\]]", pattern)[-1]
    ends = [end for ext in _source_extensions(direction) for end in (ext, ext + ".index.json")]
    return any(tail.endswith(end) or end.endswith(tail) for end in ends)


def _default_include(direction: str) -> tuple[str, ...]:
    """The file names a watch takes when its `include:` is not given: its direction's formats' (a direction
    from PyTorch's own checkpoints takes `*.pt`, `*.pth`, `pytorch_model*.bin`; `both` takes the formats syncd
    also writes, as it always has)."""
    if DIRECTIONS[direction] == {PYTORCH_FORMAT.name}:
        return PYTORCH_PATTERNS
    return DEFAULT_INCLUDE


def _unless_null(section: Section, key: str, parse: Callable[[Any], str | None]) -> str | None:
    """An optional setting whose absence and null both mean "as the source is": None; else what `parse`
    makes of the value (None after reporting a problem)."""
    value = section.raw(key)
    return None if value is MISSING or value is None else parse(value)


def _top_level_key(section: Section) -> str | None:
    """`top_level_key:` a key of a PyTorch checkpoint's saved dict; absent or null: found as the reader does."""

    def a_key(value: Any) -> str | None:
        if isinstance(value, str) and value:
            return value
        expected = f"expected a key (a non-empty string) or null, got {describe(value)}"
        section.file.problem(section.node("top_level_key"), section.key("top_level_key"), expected)
        return None

    return _unless_null(section, "top_level_key", a_key)


def _precision(section: Section) -> str | None:
    """`precision:` one of PRECISIONS; absent or null: as the source is."""
    return _unless_null(section, "precision", lambda _: section.choice("precision", "", PRECISIONS) or None)


def _remap_rules(file: YamlFile, section: Section) -> tuple[tuple[str, str], ...]:
    """`remap:` as a list of [pattern, replacement] pairs; each rule is compiled (problems at its line)."""
    node, key = section.node("remap"), section.key("remap")
    if node is None or section.raw("remap") is None:
        return ()
    if not isinstance(node, yaml.SequenceNode):
        file.problem(node, key, f"expected a list of [pattern, replacement] rules, got {describe(file.value(node))}")
        return ()
    rules = []
    for position, item in enumerate(node.value):
        label = f"{key}[{position}]"
        pair = file.value(item)
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair) and pair[0]):
            file.problem(item, label, f"expected [pattern, replacement] (two strings), got {describe(pair)}")
            continue
        try:
            compile_rule(pair[0], pair[1])
        except ValueError as exc:
            file.problem(item, label, str(exc))
            continue
        rules.append((pair[0], pair[1]))
    return tuple(rules)


def _tensor_filter(file: YamlFile, section: Section) -> dict[str, tuple[str, ...]]:
    """`tensors: {include: [...], exclude: [...]}`, every pattern compiled (problems at the list's line)."""
    node, key = section.node("tensors"), section.key("tensors")
    if node is None or section.raw("tensors") is None:
        return {}
    items = file.entries(node, key)
    if items is None:
        return {}
    file.unknown_keys(items, TENSOR_FILTER_KEYS, key)
    inner = Section(file, items, key)
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


def _shard_size(file: YamlFile, section: Section) -> int | None:
    """`shard_size:` as bytes (an integer) or a size such as 500MB / 2GiB."""
    value = section.raw("shard_size")
    if value is MISSING or value is None:
        return None
    text = str(value) if isinstance(value, str | int | float) and not isinstance(value, bool) else describe(value)
    try:
        return parse_shard_size(text)
    except ValueError as exc:
        file.problem(section.node("shard_size"), section.key("shard_size"), str(exc))
        return None


def _load_modules_file(
    path: Path, parent: YamlFile, node: yaml.Node, key: str, check_filesystem: bool, runs_as: int | None
) -> ModuleMap | None:
    """A module-map file, read exactly as `syncd convert --modules FILE` reads it (`layout:` included).
    Problems name that file and its lines."""
    if not path.is_file():
        what = (
            "is a directory"
            if path.is_dir()
            else "is not a regular file"
            if os.path.lexists(path)
            else "does not exist"
        )
        parent.problem(node, key, f"module map file {path} {what}")
        return None
    file = YamlFile(path)
    module_map = None
    root = file.load(empty_ok=True)
    if root is None and not file.problems:  # an empty file maps nothing, as `convert --modules` reads it
        module_map, _ = parse_module_map({}, source=str(path))
    elif root is not None:
        if check_filesystem:
            check_file_mode(file, runs_as)
        module_map, problems = parse_module_map(file.value(root), source=str(path))
        _report_map_problems(file, problems, "", whole=root, modules=file.child(root, "modules"))
    parent.problems.extend(file.problems)
    return module_map


def _report_map_problems(
    file: YamlFile, problems: list[MapProblem], prefix: str, whole: yaml.Node | None, modules: yaml.Node | None
) -> None:
    """Record the module-map parser's problems against `file`, each on the line of the node it is about.
    `whole` is the node of the whole map (a module-map file), `modules` that of its `modules:` mapping."""
    if modules is not None:
        _duplicate_patterns(file, modules, prefix + "modules")
    for problem in problems:
        location = problem.location
        node, rest = (modules, location[1:]) if location[:1] == ("modules",) and modules else (whole, location)
        for part in rest:
            node = file.child(node, part) if node is not None else None
        label = prefix + problem.label if problem.key else None
        file.problem(node or modules or whole, label, problem.message)


def _duplicate_patterns(file: YamlFile, node: yaml.Node, key: str) -> None:
    """YAML keeps the last of two equal keys; the earlier rule would silently vanish."""
    seen: set[str] = set()
    for key_node, _ in node.value if isinstance(node, yaml.MappingNode) else ():
        pattern = str(file.value(key_node))
        if pattern in seen:
            file.problem(key_node, f"{key}[{pattern!r}]", "duplicate key (the earlier one would be ignored)")
        seen.add(pattern)


def _not_a_directory(directory: Path) -> Path | None:
    """The first of `directory` and the directories above it that exists, when it is not a directory (a
    state_dir `./afile/sub` under a file `afile`): the daemon could not create or use it."""
    for candidate in (directory, *directory.parents):
        if os.path.lexists(candidate):
            return None if os.path.isdir(candidate) else candidate
    return None
