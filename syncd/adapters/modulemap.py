"""Module maps: the user's statement of which module is what, where a file's tensors cannot tell.

YAML form (the daemon config embeds the same mapping)::

    layout: pytorch            # optional: the layout the file is in (pytorch | burn)
    modules:
      "encoder.layers.*.attn.query": Linear
      "tok_emb": Embedding
      "**.norm": LayerNorm

Keys are glob patterns over *module paths* (a tensor name minus its last `.segment`, so `fc1.weight` is in
module `fc1`). Globs work segment by segment: `*` and `?` never cross a `.`, `[abc]`/`[!abc]` are character
classes, and a whole `**` segment matches zero or more segments (`**.norm` matches `norm` and `a.b.norm`).

Which rule wins: a pattern without wildcards that equals the module path wins over every glob; otherwise the
first matching glob in the map's order wins. Burn itself decides by module type, never by name
(docs/burn-adapters.md#how-burn-knows-a-module); this map is how a user hands us the types a file does not store.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from syncd.adapters.model import LAYOUTS, MAP_KINDS
from syncd.errors import ConfigError, yaml_problem

_GLOB_CHARS = frozenset("*?[")
_TOP_LEVEL_KEYS = ("modules", "layout")

# Spellings users bring from PyTorch, accepted for the canonical kind (matching is also case-insensitive).
_KIND_ALIASES = {
    **{kind.lower(): kind for kind in MAP_KINDS},
    **{f"batchnorm{n}d": "BatchNorm" for n in (1, 2, 3)},
    **{f"instancenorm{n}d": "InstanceNorm" for n in (1, 2, 3)},
}


@dataclass(frozen=True)
class ModuleRule:
    pattern: str
    kind: str
    regex: re.Pattern[str]

    @property
    def is_exact(self) -> bool:
        return not (_GLOB_CHARS & set(self.pattern))


class ModuleMap:
    """Ordered module-path patterns -> kind, plus an optional statement of the file's layout."""

    def __init__(self, rules: Sequence[ModuleRule] = (), layout: str | None = None, source: str = "module map"):
        self.rules = list(rules)
        self.layout = layout
        self.source = source

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "module map") -> ModuleMap:
        """Build from the parsed mapping; the first problem is raised as a ConfigError naming the key."""
        module_map, problems = parse_module_map(data, source=source)
        if problems:
            raise ConfigError(problems[0].text, source)
        return module_map

    @classmethod
    def from_yaml_text(cls, text: str, *, source: str = "module map") -> ModuleMap:
        import yaml  # here: only a module map needs it, not every conversion

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            line, problem = yaml_problem(exc)
            where = f" at line {line}" if line is not None else ""
            raise ConfigError(f"invalid YAML{where}: {problem}", source) from exc
        return cls.from_dict(data, source=source)

    @classmethod
    def from_yaml_file(cls, path: str | os.PathLike[str]) -> ModuleMap:
        source = os.fspath(path)
        try:
            with open(source, encoding="utf-8") as handle:
                text = handle.read()
        except OSError as exc:
            raise ConfigError(f"cannot read module map: {exc.strerror or exc}", source) from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(f"not UTF-8 text ({exc.reason} at byte {exc.start})", source) from None
        return cls.from_yaml_text(text, source=source)

    def lookup(self, module_path: str) -> ModuleRule | None:
        """The rule deciding this module: an exact path first, else the first matching glob."""
        for rule in self.rules:
            if rule.is_exact and rule.pattern == module_path:
                return rule
        for rule in self.rules:
            if not rule.is_exact and rule.regex.fullmatch(_match_subject(module_path)):
                return rule
        return None

    def unused_patterns(self, module_paths: Iterable[str]) -> list[str]:
        """Patterns that match none of these modules (worth a note: a typo is the usual cause)."""
        paths = list(module_paths)
        return [r.pattern for r in self.rules if not any(r.regex.fullmatch(_match_subject(p)) for p in paths)]

    def __repr__(self) -> str:
        return f"ModuleMap({[(r.pattern, r.kind) for r in self.rules]!r}, layout={self.layout!r})"


def canonical_kind(name: str) -> str | None:
    """The canonical spelling of a kind name, or None when it is not one."""
    return _KIND_ALIASES.get(name.strip().lower())


@dataclass(frozen=True)
class MapProblem:
    """One thing wrong in a module map. `key` names it for the message (() the map itself, ("layout",),
    ("modules",), ("modules", pattern)); `at` is where it is, so a YAML reader can give its line."""

    key: tuple[str, ...]
    message: str
    at: tuple[str, ...] | None = None

    @property
    def label(self) -> str:
        if not self.key:
            return ""
        head, *rest = self.key
        return head + "".join(f"[{part!r}]" for part in rest)

    @property
    def location(self) -> tuple[str, ...]:
        return self.key if self.at is None else self.at

    @property
    def text(self) -> str:
        return f"{self.label}: {self.message}" if self.key else self.message


def parse_module_map(data: Any, *, source: str = "module map") -> tuple[ModuleMap, list[MapProblem]]:
    """The one reading of a module map, for `--modules`, the config's `modules:` and `check-config` alike:
    the valid rules and layout, and every problem found (in the map's order)."""
    problems: list[MapProblem] = []
    if data is None:
        return ModuleMap(source=source), problems
    if not isinstance(data, Mapping):
        message = f"a module map must be a mapping with 'modules' (and optionally 'layout'), not {type(data).__name__}"
        return ModuleMap(source=source), [MapProblem((), message)]
    for key in data:
        if key not in _TOP_LEVEL_KEYS:
            hint = _did_you_mean(key, _TOP_LEVEL_KEYS)
            message = f"unknown key {key!r} in module map (expected: modules, layout){hint}"
            problems.append(MapProblem((), message, at=(str(key),)))
    layout = _parse_layout(data.get("layout"), problems)
    rules = _parse_modules(data.get("modules"), problems)
    return ModuleMap(rules, layout, source), problems


def _parse_layout(value: Any, problems: list[MapProblem]) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or value.strip().lower() not in LAYOUTS:
        problems.append(MapProblem(("layout",), f"expected one of {', '.join(LAYOUTS)}, got {value!r}"))
        return None
    return value.strip().lower()


def _parse_modules(value: Any, problems: list[MapProblem]) -> list[ModuleRule]:
    if value is None:
        return []
    if not isinstance(value, Mapping):
        message = f"expected a mapping of module path pattern -> kind, got {type(value).__name__}"
        problems.append(MapProblem(("modules",), message))
        return []
    rules = []
    for key, kind in value.items():
        # YAML reads an unquoted `0:` as an int; a Sequential index is a legitimate module path.
        pattern = str(key) if isinstance(key, int) and not isinstance(key, bool) else key
        if not isinstance(pattern, str):
            problems.append(MapProblem(("modules",), f"key {key!r} must be a module path pattern (text)"))
            continue
        found = canonical_kind(kind) if isinstance(kind, str) else None
        if found is None:
            message = f"expected a module kind, one of {', '.join(MAP_KINDS)}, got {kind!r}"
            problems.append(MapProblem(("modules", pattern), message + _did_you_mean(kind, MAP_KINDS)))
            continue
        regex = _compile(pattern)
        if regex is None:
            problems.append(MapProblem(("modules", pattern), "empty path segment in pattern"))
            continue
        rules.append(ModuleRule(pattern, found, regex))
    return rules


def _did_you_mean(value: object, choices: Sequence[str]) -> str:
    if not isinstance(value, str):
        return ""
    import difflib  # here: only a misspelt map needs it

    close = difflib.get_close_matches(value, choices, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _compile(pattern: str) -> re.Pattern[str] | None:
    """Translate a segment glob into a regex matched against '.'+path (see _match_subject); None when the
    pattern has an empty segment."""
    if pattern == "":  # the root module: tensors whose name has no '.'
        return re.compile("")
    segments = pattern.split(".")
    if any(segment == "" for segment in segments):
        return None
    parts = [r"(?:\.[^.]*)*" if seg == "**" else r"\." + _segment_regex(seg) for seg in segments]
    return re.compile("".join(parts))


def _match_subject(module_path: str) -> str:
    # Every segment regex starts with its own '\.', so `**` can stand for zero segments at either end.
    return "." + module_path if module_path else ""


def _segment_regex(segment: str) -> str:
    out, i = [], 0
    while i < len(segment):
        char = segment[i]
        end = _class_end(segment, i) if char == "[" else -1
        if char == "*":
            out.append("[^.]*")
        elif char == "?":
            out.append("[^.]")
        elif end > 0:
            out.append(_class_regex(segment[i + 1 : end]))
            i = end
        else:
            out.append(re.escape(char))
        i += 1
    return "".join(out)


def _class_end(segment: str, start: int) -> int:
    """Index of the ']' closing the class opened at `start`, or -1 (then '[' is literal, as in fnmatch)."""
    first = start + 1
    if segment[first : first + 1] == "!":
        first += 1
    if segment[first : first + 1] == "]":  # a leading ']' is a member, as in fnmatch
        first += 1
    return segment.find("]", first)


def _class_regex(body: str) -> str:
    negate = body.startswith("!")
    members = "".join("\\" + c if c in "\\^[]" else c for c in (body[1:] if negate else body))
    # a negated class must still not match the '.' between segments
    return f"[^{members}.]" if negate else f"[{members}]"
