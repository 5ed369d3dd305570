"""The command line, the only layer that prints: `main` parses the arguments and runs one command."""

from syncd.cli.main import main

__all__ = ["main"]
