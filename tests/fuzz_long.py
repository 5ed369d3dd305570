"""The long, pre-release fuzz run: the same properties as tests/test_fuzz.py, with fresh random inputs and
many more of them.

    .venv/bin/python tests/fuzz_long.py                      # 100000 inputs per reader test (~1-2 h on 2 cores)
    .venv/bin/python tests/fuzz_long.py --examples 20000     # a shorter run
    .venv/bin/python tests/fuzz_long.py -- -k convert        # extra arguments go to pytest

It sets SYNCD_FUZZ_EXAMPLES (inputs per reader test; the conversion tests get half, the CLI tests --cli),
SYNCD_FUZZ_RANDOM=1 (new inputs each run instead of CI's fixed ones) and
SYNCD_FUZZ_SAVE=tests/data/regressions/incoming, where every failing input is written as bpk-<sha8>.bpk /
st-<sha8>.safetensors. Hypothesis shrinks a failure before reporting it; the file named in the final error
message is the shrunk one. After fixing the bug, move that file into tests/data/regressions/ and add its one-line
note to tests/data/regressions/README.md (test_corpus_is_listed checks), so test_corpus_replay keeps it fixed;
delete the rest of incoming/.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=100_000, help="inputs per reader test (default 100000)")
    parser.add_argument("--cli", type=int, default=2_000, help="CLI subprocess runs in all (default 2000)")
    parser.add_argument(
        "--save", type=Path, default=TESTS / "data" / "regressions" / "incoming", help="where failing inputs go"
    )
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args()
    env = {
        **os.environ,
        "SYNCD_FUZZ_EXAMPLES": str(args.examples),
        "SYNCD_FUZZ_CLI_EXAMPLES": str(args.cli),
        "SYNCD_FUZZ_RANDOM": "1",
        "SYNCD_FUZZ_SAVE": str(args.save),
    }
    command = [
        sys.executable,
        "-m",
        "pytest",
        str(TESTS / "test_fuzz.py"),
        "-s",
        "-p",
        "no:cacheprovider",
        *args.pytest_args,
    ]
    print(f"fuzz_long: {args.examples} inputs per reader test, failures saved in {args.save}", flush=True)
    status = subprocess.call(command, env=env, cwd=TESTS.parent)
    saved = sorted(args.save.glob("*")) if args.save.is_dir() else []
    if saved:
        print(
            f"fuzz_long: {len(saved)} failing input(s) in {args.save} (the shrunk ones are those named in the "
            "pytest failures); move each into tests/data/regressions/ with a line in its README.md"
        )
    return status


if __name__ == "__main__":
    sys.exit(main())
