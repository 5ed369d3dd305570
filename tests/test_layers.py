"""The package's layers, read from the source: no import cycle between modules, and no lower layer importing an
upper one (formats < adapters < engine < daemon < cli; errors and the package face below them all).

Every `import` and `from ... import` counts, wherever it stands: at module level, inside a function (a lazy
import is still a dependency) and under `if TYPE_CHECKING:` (a type a module needs is part of its design).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "syncd"

# Each package's layer, lowest first. A module may import its own layer (without a cycle) and lower ones.
LAYERS = {"formats": 1, "adapters": 2, "engine": 3, "daemon": 4, "cli": 5}
# Modules at the root of the package: the package face and the errors lie below every layer, the entry point
# above them all. Besides these, one small shared utility module may live at the root, below every layer.
ROOT_MODULES = {"syncd": 0, "syncd.errors": 0, "syncd.__main__": len(LAYERS) + 1}
MAX_ROOT_UTILITIES = 1


def module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(package: Path) -> dict[str, Path]:
    return {module_name(path, package): path for path in sorted(package.rglob("*.py"))}


def imported(tree: ast.AST, name: str, is_package: bool, known: dict[str, Path]) -> Iterator[str]:
    """The package's modules that `tree` (module `name`) imports: for `from X import y`, X.y when that is a
    module, else X itself (a name X defines or re-exports)."""
    top = name.split(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names if alias.name.split(".")[0] == top)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: counted from the importing module's package
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            if base.split(".")[0] != top:
                continue
            for alias in node.names:
                child = f"{base}.{alias.name}"
                yield child if child in known else base


def import_graph(package: Path) -> dict[str, set[str]]:
    known = modules(package)
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        found = imported(tree, name, path.name == "__init__.py", known)
        graph[name] = {target for target in found if target != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def layer_of(name: str, package: Path) -> int | None:
    """A module's layer, or None when it belongs to none (a new package or root module nobody placed)."""
    if name in ROOT_MODULES:
        return ROOT_MODULES[name]
    parts = name.split(".")
    if len(parts) == 2 and not (package / parts[1]).is_dir():
        return 0  # a shared utility module at the root (their number is checked on its own)
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def layer_violations(graph: dict[str, set[str]], package: Path) -> list[str]:
    problems = []
    for name in sorted(graph):
        own = layer_of(name, package)
        if own is None:
            problems.append(f"{name} belongs to no layer: give its package a place in LAYERS")
            continue
        for target in sorted(graph[name]):
            theirs = layer_of(target, package)
            if theirs is not None and theirs > own:
                problems.append(f"{name} (layer {own}) imports {target} (layer {theirs}), an upper layer")
    return problems


def root_utilities(package: Path) -> list[str]:
    return sorted(
        name
        for name in modules(package)
        if name.count(".") == 1 and name not in ROOT_MODULES and layer_of(name, package) == 0
    )


def test_no_module_of_syncd_is_part_of_an_import_cycle() -> None:
    found = cycles(import_graph(PACKAGE))
    assert found == [], "import cycles:\n" + "\n".join(" <-> ".join(cycle) for cycle in found)


def test_no_layer_imports_an_upper_one() -> None:
    problems = layer_violations(import_graph(PACKAGE), PACKAGE)
    assert problems == [], "\n".join(problems)


def test_the_root_of_the_package_holds_its_face_errors_and_at_most_one_utility_module() -> None:
    extra = root_utilities(PACKAGE)
    assert len(extra) <= MAX_ROOT_UTILITIES, f"root modules besides the face and errors: {extra}"


def test_the_checks_find_a_cycle_a_lazy_or_type_only_import_makes_and_an_upward_import(tmp_path: Path) -> None:
    """The checks themselves, on a small package written here: they must see what they are for."""
    package = tmp_path / "syncd"
    for folder in ("formats", "engine", "daemon"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "errors.py").write_text("")
    (package / "engine" / "convert.py").write_text("from syncd.engine.targets import TARGETS\nTARGETS = {}\n")
    (package / "engine" / "targets.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from syncd.engine.convert import Conversion\n"
    )
    (package / "daemon" / "config.py").write_text("def load():\n    from syncd.daemon import access\n")
    (package / "daemon" / "access.py").write_text("from syncd.daemon.config import load\n")
    (package / "formats" / "registry.py").write_text("from syncd.engine import convert\n")
    (package / "helpers.py").write_text("")
    (package / "more_helpers.py").write_text("")
    graph = import_graph(package)
    assert cycles(graph) == [
        ["syncd.daemon.access", "syncd.daemon.config"],
        ["syncd.engine.convert", "syncd.engine.targets"],
    ]
    assert layer_violations(graph, package) == [
        "syncd.formats.registry (layer 1) imports syncd.engine.convert (layer 3), an upper layer"
    ]
    assert root_utilities(package) == ["syncd.helpers", "syncd.more_helpers"]
