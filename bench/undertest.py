"""The syncd being measured, and how to run it: the working tree's, or a snapshot of HEAD (`--snapshot`).

A snapshot is syncd/ as committed at HEAD, extracted under bench/work/ and run through `bench/syncd_at.py`, so
edits made while the benchmark runs do not change the code under test halfway.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results"
WORK = BENCH / "work"
PYTHON = sys.executable


@dataclass(frozen=True)
class SyncdUnderTest:
    """`snapshot`: the `git archive HEAD` copy of syncd/ that is measured; None: the working tree."""

    snapshot: Path | None = None

    def argv(self) -> list[str]:
        """The command line of `syncd`, to which its arguments are appended."""
        if self.snapshot is not None:
            return [PYTHON, str(BENCH / "syncd_at.py"), str(self.snapshot)]
        script = Path(sys.executable).parent / "syncd"
        return [str(script)] if script.exists() else [PYTHON, "-m", "syncd"]

    def startup_argv(self) -> list[str]:
        """A command that starts Python and imports what every `syncd convert` imports, and nothing more."""
        if self.snapshot is not None:
            return [PYTHON, str(BENCH / "syncd_at.py"), str(self.snapshot), "--where"]
        return [PYTHON, "-c", "import syncd.cli, syncd.engine.convert"]

    def kernel_name(self) -> str:
        """Which transpose kernel this syncd uses: compiled or numpy (syncd/kernels)."""
        code = "from syncd.engine.write import kernels; print(kernels.KERNEL_NAME)"
        if self.snapshot is not None:
            unhook = "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in getattr(f, '__module__', '')]"
            argv = [PYTHON, "-c", f"import sys; {unhook}; sys.path.insert(0, {str(self.snapshot)!r}); {code}"]
        else:
            argv = [PYTHON, "-c", code]
        out = subprocess.run(argv, capture_output=True, text=True)
        return out.stdout.strip() or "unknown"

    def import_argv(self, module: str) -> list[str]:
        """A command that exits 0 if this syncd can import `module`."""
        if self.snapshot is not None:
            return [PYTHON, str(BENCH / "syncd_at.py"), str(self.snapshot), "--import", module]
        return [PYTHON, "-c", f"import {module}"]


def make_snapshot() -> tuple[SyncdUnderTest, str]:
    """syncd/ as committed at HEAD, extracted under bench/work/; checked to be what syncd_at.py imports."""
    root = WORK / "syncd-snapshot"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    commit = head.stdout.strip()
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", commit, "syncd", "setup.py", "pyproject.toml", "README.md"],
        capture_output=True,
        check=True,
    )
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive.stdout, check=True)
    # the compiled transpose kernel, as `pip install` builds it (optional there too: without a compiler the
    # snapshot runs the numpy kernel, and kernel_name() says so)
    subprocess.run([PYTHON, "setup.py", "-q", "build_ext", "--inplace"], cwd=root, capture_output=True)
    # and its bytecode, as `pip install` compiles it: without it (PYTHONDONTWRITEBYTECODE, or a tree nobody
    # ran yet) every run would compile every module it imports, ~0.15 s that no installed syncd pays
    subprocess.run([PYTHON, "-m", "compileall", "-q", str(root / "syncd")], check=True)
    where = subprocess.run([PYTHON, str(BENCH / "syncd_at.py"), str(root), "--where"], capture_output=True, text=True)
    if not where.stdout.strip().startswith(str(root)):
        raise SystemExit(f"--snapshot: syncd_at.py imports {where.stdout.strip() or where.stderr.strip()}, not {root}")
    return SyncdUnderTest(root), commit[:12]


def git_state() -> dict:
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "--", "syncd"], capture_output=True, text=True
    ).stdout.splitlines()
    changed = {}
    for line in dirty:
        path = REPO / line[3:]
        with contextlib.suppress(OSError):
            changed[line[3:]] = path.stat().st_mtime_ns
    return {"head": head.stdout.strip(), "uncommitted": changed}
