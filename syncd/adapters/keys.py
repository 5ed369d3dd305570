"""Tensor names (keys): Burn's KeyRemapper rules, its contiguous-index option, PathFilter-style filters, and the
inverse of a remapping. Pure functions over names (docs/burn-adapters.md#store-options).

KeyRemapper: an ordered list of (regex, replacement). For each name, every rule whose pattern matches replaces
all of its matches in the name *as the rules before it left it*. Replacements use Rust's syntax: `$1`,
`${1}`, `$name`, `${name}`, `$$` for a dollar; `$1x` names a group called `1x` (write `${1}x`). Patterns are
Python regexes: Rust's `regex` crate has no look-around and no backreferences, so a rule using them works here
but not in Burn. A replacement naming a group the pattern lacks is refused (Rust would silently insert nothing).

map_indices_contiguous: every all-digit segment is renumbered 0..n-1 among the indices seen after the same
prefix (the name's segments before it, as they were), keeping their order: `fc.0`, `fc.2`, `fc.4` become
`fc.0`, `fc.1`, `fc.2`. Applied after the rules, as Burn does.

Two source names mapped to one output name are refused, naming both; `renames()` returns only the names that
changed, which the converter carries so the way back (`invert`) restores the originals exactly.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from syncd.errors import SyncdError, one_line

_GROUP_NAME = re.compile(r"[_0-9A-Za-z]+")
_INDEX = re.compile(r"\+?[0-9]+")  # what Rust's usize::from_str accepts
_USIZE_LIMIT = 1 << 64


class NameCollisionError(SyncdError):
    """Two tensors would get the same name."""


@dataclass(frozen=True)
class RemapRule:
    pattern: str
    replacement: str
    regex: re.Pattern[str]
    parts: tuple[str | int, ...]  # literal text (str) or a group reference (int index; named groups resolved)

    def apply(self, name: str) -> str:
        if self.regex.search(name) is None:
            return name
        return self.regex.sub(self._expand, name)

    def _expand(self, match: re.Match[str]) -> str:
        return "".join(part if isinstance(part, str) else (match.group(part) or "") for part in self.parts)


def compile_rule(pattern: str, replacement: str) -> RemapRule:
    """Compile one rule; ValueError (one line) for a pattern that does not compile or a replacement naming a
    group the pattern does not have."""
    try:
        regex = re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"pattern '{one_line(pattern)}' does not compile: {exc}") from None
    parts: list[str | int] = []
    for literal, ref in _replacement_tokens(replacement):
        if literal:
            parts.append(literal)
        if ref is None:
            continue
        if ref.isdigit():
            index = int(ref)
            if index > regex.groups:
                raise ValueError(_missing_group(pattern, replacement, ref, regex.groups))
            parts.append(index)
        elif ref in regex.groupindex:
            parts.append(regex.groupindex[ref])
        else:
            raise ValueError(_missing_group(pattern, replacement, ref, regex.groups))
    return RemapRule(pattern, replacement, regex, tuple(parts))


def _missing_group(pattern: str, replacement: str, ref: str, groups: int) -> str:
    digits = len(ref) - len(ref.lstrip("0123456789"))
    lead = ref[:digits]
    hint = f" (to follow group {lead} with text write ${{{lead}}}{ref[digits:]})" if 0 < digits < len(ref) else ""
    return (
        f"replacement '{one_line(replacement)}' names group ${ref}, but pattern '{one_line(pattern)}' has "
        f"{groups} group{'s' if groups != 1 else ''}{hint}"
    )


def _replacement_tokens(replacement: str) -> list[tuple[str, str | None]]:
    """Split a Rust replacement into (literal, group reference or None) pairs."""
    tokens: list[tuple[str, str | None]] = []
    literal: list[str] = []
    i = 0
    while i < len(replacement):
        char = replacement[i]
        ref, width = _reference_at(replacement, i) if char == "$" else (None, 0)
        if char == "$" and replacement.startswith("$$", i):
            literal.append("$")
            i += 2
        elif ref is not None:
            tokens.append(("".join(literal), ref))
            literal = []
            i += width
        else:
            literal.append(char)
            i += 1
    tokens.append(("".join(literal), None))
    return tokens


def _reference_at(text: str, i: int) -> tuple[str | None, int]:
    """`$name` / `${name}` at text[i]: (name, characters used), or (None, 0) when the `$` is literal."""
    if text.startswith("${", i):
        end = text.find("}", i + 2)
        name = text[i + 2 : end] if end >= 0 else ""
        return (name, end - i + 1) if name and _GROUP_NAME.fullmatch(name) else (None, 0)
    match = _GROUP_NAME.match(text, i + 1)
    return (match.group(), len(match.group()) + 1) if match else (None, 0)


def parse_rule_argument(text: str) -> RemapRule:
    """`--remap 'PATTERN=REPLACEMENT'`: split at the first `=`."""
    pattern, sep, replacement = text.partition("=")
    if not sep or not pattern:
        raise ValueError(f"--remap '{one_line(text)}' is not PATTERN=REPLACEMENT")
    return compile_rule(pattern, replacement)


def apply_rules(name: str, rules: Sequence[RemapRule]) -> str:
    for rule in rules:
        name = rule.apply(name)
    return name


def contiguous_indices(names: Sequence[str]) -> dict[str, str]:
    """Burn's map_indices_contiguous over a set of names: original name -> renumbered name."""
    seen: dict[str, set[int]] = {}
    for name in names:
        parts = name.split(".")
        for i, part in enumerate(parts):
            index = _index(part)
            if index is not None:
                seen.setdefault(_prefix(parts, i), set()).add(index)
    new_index = {prefix: {old: new for new, old in enumerate(sorted(found))} for prefix, found in seen.items()}
    result = {}
    for name in names:
        parts = name.split(".")
        out = [
            str(new_index[_prefix(parts, i)][index]) if (index := _index(part)) is not None else part
            for i, part in enumerate(parts)
        ]
        result[name] = ".".join(out)
    return result


def _index(part: str) -> int | None:
    if not _INDEX.fullmatch(part):
        return None
    value = int(part)
    return value if value < _USIZE_LIMIT else None


def _prefix(parts: list[str], i: int) -> str:
    return ".".join(parts[:i]) + "." if i else ""


def rename_all(names: Sequence[str], rules: Sequence[RemapRule], contiguous: bool = False) -> dict[str, str]:
    """Every name -> its new name (rules in order, then contiguous indices); refuses two names made one."""
    mapped = {name: apply_rules(name, rules) for name in names}
    if contiguous:
        renumbered = contiguous_indices(list(dict.fromkeys(mapped.values())))
        mapped = {name: renumbered[new] for name, new in mapped.items()}
    check_unique(mapped)
    return mapped


def check_unique(mapping: dict[str, str]) -> None:
    """Refuse two sources sharing one output name, naming both."""
    if len(set(mapping.values())) == len(mapping):  # (the common case, told in C)
        return
    first: dict[str, str] = {}
    for source, target in mapping.items():
        if target in first:
            raise NameCollisionError(
                f"tensors '{first[target]}' and '{source}' would both be named '{target}'; "
                "change the remap rules so the names stay distinct"
            )
        first[target] = source


def renames(mapping: dict[str, str]) -> dict[str, str]:
    """The changed names only, new -> original: what a converted file carries to be undone later."""
    return {new: old for old, new in mapping.items() if new != old}


def invert(names: Iterable[str], carried: dict[str, str]) -> dict[str, str]:
    """Undo carried renames (new -> original) on `names`; names not renamed stay as they are. Refuses a name
    that is restored onto one present in the file already."""
    mapping = {name: carried.get(name, name) for name in names}
    check_unique(mapping)
    return mapping


@dataclass(frozen=True)
class TensorFilter:
    """`include`/`exclude` regex lists. As Burn's PathFilter, a pattern *searches* the name (unanchored); no
    include list means every name is included, and an exclude match always wins."""

    include: tuple[re.Pattern[str], ...] = ()
    exclude: tuple[re.Pattern[str], ...] = ()

    @classmethod
    def of(cls, include: Iterable[str] = (), exclude: Iterable[str] = ()) -> TensorFilter:
        return cls(tuple(compile_filter(p) for p in include), tuple(compile_filter(p) for p in exclude))

    @property
    def keeps_all(self) -> bool:
        """No pattern at all: every name is kept."""
        return not self.include and not self.exclude

    def keeps(self, name: str) -> bool:
        included = not self.include or any(p.search(name) for p in self.include)
        return included and not any(p.search(name) for p in self.exclude)

    def describe(self) -> str:
        """The patterns as a user gave them: `include: a, b; exclude: c`."""
        sides = (("include", self.include), ("exclude", self.exclude))
        return "; ".join(f"{side}: {', '.join(p.pattern for p in patterns)}" for side, patterns in sides if patterns)

    def split(self, names: Iterable[str]) -> tuple[list[str], list[str]]:
        """(kept, left out), each in the order given."""
        kept: list[str] = []
        left_out: list[str] = []
        for name in names:
            (kept if self.keeps(name) else left_out).append(name)
        return kept, left_out


def compile_filter(pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"pattern '{one_line(pattern)}' does not compile: {exc}") from None
