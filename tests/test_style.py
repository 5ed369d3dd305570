"""The code stays `ruff` clean, `ruff format`ted and `mypy` clean: checked as part of the suite so CI catches it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_tool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_check_is_clean() -> None:
    result = run_tool("ruff", "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_is_applied() -> None:
    result = run_tool("ruff", "format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_is_clean() -> None:
    result = run_tool("mypy")  # what it checks and how: [tool.mypy] in pyproject.toml
    assert result.returncode == 0, result.stdout + result.stderr


# A path of one machine (a home, a work tree, a venv outside the clone) or of a directory beside the repository.
# Recorded benchmark JSON is exempt: it records where a run happened, as data.
MACHINE_PATH = re.compile(
    r"(?<![\w.~-])/(?:work|root|home|Users|tmp/[\w.-]+)/[\w.-]+|\.\./shared\b|"
    r"parents\[[2-9]\]"
)


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    paths = [ROOT / os.fsdecode(name) for name in names if name]
    return [p for p in paths if p.suffix not in (".bpk", ".safetensors", ".png", ".json") and p.is_file()]


def machine_paths_in(text: str) -> list[str]:
    return [m.group(0) for m in MACHINE_PATH.finditer(text)]


def test_machine_path_pattern_catches_what_it_must() -> None:
    work, shared = "/" + "work", ".." + "/shared"  # spelled in pieces so this file holds no such path itself
    assert machine_paths_in(f'FIXTURES = Path("{work}/shared/fixtures")') == [f"{work}/shared"]
    assert machine_paths_in(f"SHARED = REPO.parent / '{shared}'") == [shared]
    assert machine_paths_in("Path(__file__).resolve().parents[2]") == ["parents[2]"]
    assert machine_paths_in("/root/.venv/bin/python x.py") == ["/root/.venv"]
    assert machine_paths_in("bench/work/, .venv/bin/python, /usr/bin/env, /etc/syncd/x.yaml, /srv/ckpt") == []


def test_no_tracked_file_names_a_path_outside_the_repository() -> None:
    found = []
    for path in tracked_text_files():
        if path == Path(__file__).resolve() or path.is_relative_to(ROOT / "tests" / "data"):
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        found += [f"{path.relative_to(ROOT)}: {hit}" for hit in machine_paths_in(text)]
    assert found == [], "machine paths in tracked files (tests carry their data in tests/data/):\n" + "\n".join(found)
