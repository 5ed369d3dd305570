"""The `syncd` command line."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("syncd: no commands yet", file=sys.stderr)
    return 2
