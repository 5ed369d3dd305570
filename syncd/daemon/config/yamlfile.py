"""A YAML file read as nodes, so that every problem found in it names its line; typed getters over a mapping.

Nothing here knows syncd's settings: `YamlFile` loads one file and collects `Problem`s, `Section` reads one
mapping's values with a type and a default (a bad value records a problem and yields the default).
"""

from __future__ import annotations

import datetime
import difflib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from syncd.errors import ConfigError, yaml_problem

MISSING = object()  # `Section.raw` of a key that is not there

Items = dict[str, tuple[yaml.Node, yaml.Node]]  # a mapping's (key node, value node) by key name


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


def in_reading_order(problems: list[Problem], main_file: str) -> list[Problem]:
    """File-wide problems first, then the main file's own lines top to bottom, then included files'; each said
    once (a module map file shared by several watches is read for each of them)."""

    def order(problem: Problem) -> tuple[int, int]:
        if problem.line is None:
            return (0, 0)
        return (1 if problem.file == main_file else 2, problem.line)

    return sorted(dict.fromkeys(problems), key=order)


def describe(value: Any) -> str:
    """A value as a message names it: `null`, `true`, `a list`, `a mapping`, or its repr."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return "a list" if value else "an empty list"
    if isinstance(value, dict):
        return "a mapping" if value else "an empty mapping"
    if isinstance(value, datetime.date):  # YAML reads 2024-01-01 as a date; say it as written
        return f"the date {value.isoformat()}"
    return repr(value)


def did_you_mean(value: object, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str):
        return ""
    close = difflib.get_close_matches(value, choices, n=1) or [
        choice for choice in choices if choice.lower() == value.lower()
    ]
    return f" (did you mean '{close[0]}'?)" if close else ""


def resolve(base: Path, text: str) -> Path:
    """A path as written in a file: `~` expanded, relative to `base` (the file's directory)."""
    return (base / os.path.expanduser(text)).resolve()


@dataclass(frozen=True)
class _Unreadable:
    reason: str

    def __repr__(self) -> str:
        return f"an unreadable value ({self.reason})"


class YamlFile:
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

    def load(self, empty_ok: bool = False) -> yaml.MappingNode | None:
        """The top-level mapping node, or None (with a problem recorded, unless the file is empty and
        `empty_ok`) when there is none."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except OSError as exc:
            self.problem(None, None, f"cannot read: {exc.strerror or exc}")
            return None
        except UnicodeDecodeError as exc:
            self.problem(None, None, f"not UTF-8 text ({exc.reason} at byte {exc.start})")
            return None
        try:
            self._loader = yaml.SafeLoader(text)  # (its reader already refuses some characters)
            root = self._loader.get_single_node()
        except yaml.YAMLError as exc:
            line, problem = yaml_problem(exc)
            self.problems.append(Problem(self.name, line, None, f"invalid YAML: {problem}"))
            return None
        if root is None:
            if not empty_ok:
                self.problem(None, None, "the file is empty; it needs at least `watches:`")
            return None
        if not isinstance(root, yaml.MappingNode):
            self.problem(root, None, "expected a mapping of settings at the top level")
            return None
        return root

    def value(self, node: yaml.Node) -> Any:
        assert self._loader is not None
        try:
            return self._loader.construct_object(node, deep=True)
        except yaml.YAMLError as exc:
            return _Unreadable(str(exc).splitlines()[0])

    def entries(self, node: yaml.Node, key: str) -> Items | None:
        """A mapping node's items by key name; flags non-string and duplicate keys."""
        if not isinstance(node, yaml.MappingNode):
            self.problem(node, key, f"expected a mapping, got {describe(self.value(node))}")
            return None
        items: Items = {}
        for key_node, value_node in node.value:
            name = self.value(key_node)
            label = f"{key}.{name}" if key else str(name)
            if not isinstance(name, str):
                self.problem(key_node, key or None, f"keys must be strings, got {describe(name)}")
            elif name in items:
                self.problem(key_node, label, "duplicate key (the earlier one would be ignored)")
            else:
                items[name] = (key_node, value_node)
        return items

    def unknown_keys(self, items: Items, allowed: tuple[str, ...], prefix: str) -> None:
        for name, (key_node, _) in items.items():
            if name not in allowed:
                label = f"{prefix}.{name}" if prefix else name
                self.problem(key_node, label, f"unknown key{did_you_mean(name, allowed)}")

    def child(self, node: yaml.Node, name: str) -> yaml.Node | None:
        """The value node under key `name` of a mapping node (keys compared as text: `0:` is the path '0')."""
        if not isinstance(node, yaml.MappingNode):
            return None
        for key_node, value_node in node.value:
            if str(self.value(key_node)) == name:
                return value_node
        return None


class Section:
    """Typed getters over one mapping; a bad value records a problem and yields the default."""

    def __init__(self, file: YamlFile, items: Items, prefix: str) -> None:
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
        return MISSING if node is None else self.file.value(node)

    def _get(
        self, name: str, default: Any, accept: Callable[[Any], bool], expected: str, choices: tuple[str, ...] = ()
    ) -> Any:
        value = self.raw(name)
        if value is MISSING:
            return default
        if not accept(value):
            hint = did_you_mean(value, choices)
            self.file.problem(self.node(name), self.key(name), f"expected {expected}, got {describe(value)}{hint}")
            return default
        return value

    def integer(self, name: str, default: int, minimum: int, maximum: int | None = None) -> int:
        def accept(v: Any) -> bool:
            if not isinstance(v, int) or isinstance(v, bool):
                return False
            return v >= minimum and (maximum is None or v <= maximum)

        bound = f"an integer >= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
        return self._get(name, default, accept, bound)

    def number(
        self,
        name: str,
        default: float | None,
        *,
        minimum: float,
        maximum: float | None = None,
        allow_null: bool = False,
        strictly_positive: bool = False,
    ) -> float | None:
        def accept(v: Any) -> bool:
            if v is None:
                return allow_null
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                return False
            if maximum is not None and v > maximum:
                return False
            return v > minimum if strictly_positive else v >= minimum

        bound = f"> {minimum:g}" if strictly_positive else f">= {minimum:g}"
        bound += f" and <= {maximum:g}" if maximum is not None else ""
        expected = f"a number {bound}" + (" or null" if allow_null else "")
        value = self._get(name, default, accept, expected)
        return None if value is None else float(value)

    def boolean(self, name: str, default: bool) -> bool:
        return self._get(name, default, lambda v: isinstance(v, bool), "true or false")

    def optional_boolean(self, name: str) -> bool | None:
        """true or false, or None where the key is absent or null (a default that depends on more than the
        config): `null` writes that default out, as the example config does."""
        return self._get(name, None, lambda v: v is None or isinstance(v, bool), "true, false or null")

    def choice(self, name: str, default: str, choices: tuple[str, ...]) -> str:
        return self._get(name, default, lambda v: v in choices, f"one of {', '.join(choices)}", choices)

    def value_in(self, name: str, default: Any, values: tuple[Any, ...], expected: str) -> Any:
        """One of `values` compared by type and value (so `true` is not `1`)."""
        return self._get(name, default, lambda v: any(type(v) is type(x) and v == x for x in values), expected)

    def string_list(self, name: str, default: tuple[str, ...]) -> tuple[str, ...]:
        def accept(v: Any) -> bool:
            return isinstance(v, list) and all(isinstance(item, str) and item for item in v)

        return tuple(self._get(name, list(default), accept, "a list of non-empty strings"))

    def path(self, name: str, default: str | None) -> Path | None:
        value = self._get(name, default, _is_path_text, "a path (a non-empty string, no NUL byte, under 4096 bytes)")
        return None if value is None else resolve(self.file.dir, value)


def _is_path_text(value: object) -> bool:
    """A path the system can take (PATH_MAX is 4096 bytes with its NUL): other values made every use of it
    raise, and the error named no key."""
    return isinstance(value, str) and value != "" and "\0" not in value and len(os.fsencode(value)) < 4096
