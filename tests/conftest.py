"""Where the suite's data lives, and the helpers every test file shares.

Every file a test reads is inside this repository, under `tests/data/` (see its README): a clone anywhere runs
the suite with nothing beside it. Test modules import these names (`from conftest import MNIST_BPK`) rather than
spelling paths of their own.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

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


@pytest.fixture(scope="session")
def transpose_extension(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The compiled transpose kernel, built from the shipped C source with the project's own setup.py (into a
    temporary directory): tests cover it whether or not the checkout was built with a compiler present."""
    build = tmp_path_factory.mktemp("build")
    subprocess.run(
        [
            sys.executable,
            "setup.py",
            "-q",
            "build_ext",
            "--build-lib",
            str(build / "lib"),
            "--build-temp",
            str(build / "tmp"),
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    (so,) = (build / "lib" / "syncd" / "engine" / "write" / "kernels").glob("_transpose*.so")
    spec = importlib.util.spec_from_file_location("syncd.engine.write.kernels._transpose", so)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
