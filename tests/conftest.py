"""Where the suite's data lives, and the helpers every test file shares.

Every file a test reads is inside this repository, under `tests/data/` (see its README): a clone anywhere runs
the suite with nothing beside it. Test modules import these names (`from conftest import MNIST_BPK`) rather than
spelling paths of their own.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from syncd.engine.write.kernels import compiled

if TYPE_CHECKING:  # daemonutil imports this module's paths: import it where used
    from daemonutil import DaemonRun

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
DATA = TESTS / "data"

# Real checkpoints written by Burn and PyTorch (tests/data/fixtures/README.md).
FIXTURES = DATA / "fixtures"
MNIST_BPK = FIXTURES / "burn" / "mnist_web.bpk"
MNIST_ST = FIXTURES / "pytorch" / "mnist.safetensors"
MULTI_LAYER_ST = FIXTURES / "pytorch" / "multi_layer.safetensors"

# Files written by other people's software, copied from public history (tests/data/corpus/MANIFEST.md).
CORPUS = DATA / "corpus"
ASTERINAS_BPK = CORPUS / "bpk" / "ldos-project_asterinas__mlp_weights.bpk"

# Inputs that once broke syncd, kept so they never do again (tests/data/regressions/README.md).
REGRESSIONS = DATA / "regressions"


def corpus_files() -> list[Path]:
    """Every checkpoint in the corpus, in a stable order."""
    return sorted(p for p in CORPUS.glob("*/*") if p.suffix in (".bpk", ".safetensors"))


def fixture_files() -> list[Path]:
    """Every checkpoint among the fixtures, in a stable order."""
    return sorted(p for p in FIXTURES.glob("*/*") if p.suffix in (".bpk", ".safetensors"))


@pytest.fixture(autouse=True)
def _a_test_that_starts_a_daemon_is_marked_daemon(request: pytest.FixtureRequest) -> Iterator[None]:
    """The fast tier (`-m "not slow and not daemon"`, docs/testing.md) leaves daemon tests out by their mark:
    one that starts a daemon without it fails here, so the tier cannot grow slow unnoticed."""
    from daemonutil import DaemonRun

    before = DaemonRun.starts
    yield
    if DaemonRun.starts > before and request.node.get_closest_marker("daemon") is None:
        pytest.fail("this test starts a daemon: mark it `daemon` (pytest.mark.daemon)", pytrace=False)


@pytest.fixture
def make_daemon(tmp_path: Path) -> Iterator[Callable[..., DaemonRun]]:
    """Makes real daemons (`python -m syncd run`, tests/daemonutil.py), each on its own tree under tmp_path:
    `make_daemon(watches, **settings)`; every one still running is killed at the end of the test."""
    from daemonutil import DaemonRun

    runs: list[DaemonRun] = []

    def make(watches: list[dict] | None = None, **settings: object) -> DaemonRun:
        run = DaemonRun(tmp_path / f"d{len(runs)}", watches, **settings)
        runs.append(run)
        return run

    yield make
    for run in runs:
        run.close()


def build_kernel(directory: Path, env: dict[str, str] | None = None) -> Path:
    """Build the compiled transpose kernel from the shipped C source with the project's own setup.py into
    `directory` (with `env` added to the environment); the library's path."""
    subprocess.run(
        [
            sys.executable,
            "setup.py",
            "-q",
            "build_ext",
            "--build-lib",
            str(directory / "lib"),
            "--build-temp",
            str(directory / "tmp"),
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
        env={**os.environ, **(env or {})},
    )
    (library,) = (directory / "lib" / "syncd" / "engine" / "write" / "kernels").glob("_transpose*.so")
    return library


@pytest.fixture(scope="session")
def compiled_kernel(tmp_path_factory: pytest.TempPathFactory) -> compiled.Library:
    """The compiled transpose kernel, built here: tests cover it whether or not the checkout was installed with
    a compiler present."""
    library = compiled.load(build_kernel(tmp_path_factory.mktemp("build")))
    assert library is not None
    return library


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs: writes past it fail with a real ENOSPC from the kernel (needs root, which we have)."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    assert done.returncode == 0, f"cannot mount a tmpfs for the ENOSPC test: {done.stderr.strip()}"
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


def fill_up(directory: Path) -> Path:
    """Fill the file system holding `directory` with one file (returned) until the kernel says ENOSPC."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    with contextlib.suppress(OSError):
        while True:
            os.write(fd, b"\0" * 4096)
    os.close(fd)
    return filler
