"""Start-up cost: each CLI command imports only what it needs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import MNIST_BPK, REPO

from syncd.engine.write.kernels import compiled

PROBE = """
import contextlib, io, json, sys
from syncd.cli import main
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    try:
        status = main(sys.argv[1:])
    except SystemExit as exc:  # --help
        status = exc.code
print(json.dumps([status, sorted(m for m in sys.modules if m.split('.')[0] in
                  ('numpy', 'yaml', 'watchdog', 'xxhash', 'syncd', 'cbor2', 'hashlib'))]))
"""


def _imports(*argv: str, root: Path = REPO, env: dict[str, str] | None = None) -> tuple[int, set[str]]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *argv],
        cwd=root,
        env={"PYTHONPATH": str(root), **(env or {})},
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    status, modules = json.loads(out)
    return status, set(modules)


def test_inspect_reads_a_table_without_numpy_yaml_or_the_daemon() -> None:
    status, modules = _imports("inspect", str(MNIST_BPK))
    assert status == 0
    assert "cbor2" in modules  # it did read the burnpack
    assert not {m for m in modules if m.split(".")[0] in ("numpy", "yaml", "watchdog", "xxhash", "hashlib")}
    assert not {m for m in modules if m.startswith(("syncd.daemon", "syncd.adapters", "syncd.engine.convert"))}


def test_the_log_command_still_gets_its_options() -> None:
    status, modules = _imports("log", "--help")
    assert status == 0
    assert "syncd.cli.log" in modules


def test_a_conversion_without_transposes_does_not_import_numpy_or_yaml(tmp_path: Path) -> None:
    status, modules = _imports("convert", str(MNIST_BPK), "-o", str(tmp_path / "out.safetensors"), "--layout", "keep")
    assert status == 0 and (tmp_path / "out.safetensors").exists()
    assert "syncd.engine.write.onepass" in modules and "xxhash" in modules
    # hashlib (OpenSSL's bindings): only --hash sha256 needs it
    assert not {m for m in modules if m.split(".")[0] in ("numpy", "yaml", "watchdog", "hashlib")}
    assert not {m for m in modules if m.startswith("syncd.daemon")}


def test_a_transposing_conversion_with_the_compiled_kernel_does_not_import_numpy(
    tmp_path: Path, compiled_kernel: compiled.Library
) -> None:
    root = tmp_path / "installed"  # the package as pip installs it with a compiler: the kernel beside the code
    shutil.copytree(REPO / "syncd", root / "syncd", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(compiled_kernel.path, root / "syncd" / "engine" / "write" / "kernels")
    argv = ("convert", str(MNIST_BPK), "-o", str(tmp_path / "out.safetensors"), "--layout", "burn")
    status, modules = _imports(*argv, root=root)
    assert status == 0 and (tmp_path / "out.safetensors").exists()
    assert "syncd.engine.write.kernels" in modules  # it did transpose, and without numpy: the compiled kernel
    assert not {m for m in modules if m.split(".")[0] == "numpy"}
    (tmp_path / "out.safetensors").unlink()
    status, modules = _imports(*argv, root=root, env={"SYNCD_KERNEL": "numpy"})  # the fallback needs numpy
    assert status == 0 and "numpy" in modules


def test_the_version_and_the_top_level_help_import_no_commands_modules() -> None:
    for argv in (["--version"], ["--help"], []):
        status, modules = _imports(*argv)
        assert status in (0, 2), argv  # (no command at all: the help, as a usage error)
        assert modules <= {"syncd", "syncd.cli", "syncd.cli.main", "syncd.errors"}, (argv, modules)
