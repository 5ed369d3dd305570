"""The `syncd` command line: convert, inspect, run (the daemon), log, check-config.

Every error a user sees is one line naming the file and what is wrong; exit status 1 for bad input or a
refused conversion, 2 for usage and configuration errors, 3 when the destination already exists.
"""

from __future__ import annotations

import argparse
import os
import sys

# syncd never multiplies matrices: an idle OpenBLAS thread pool only spins on the other core. Set before
# numpy is first imported (it is imported lazily, by the commands that need it).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
from pathlib import Path

from syncd import __version__
from syncd.errors import SyncdError, UsageError

EXIT_OK, EXIT_BAD_INPUT = 0, 1  # usage (2) and exists (3) come from the errors' exit_code


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own usage errors: one line, status 2
        raise UsageError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    from syncd.adapters import AUTO, LAYOUT_CHOICES
    from syncd.formats.registry import BY_SHORT

    parser = _Parser(prog="syncd", description="Keep Burn (.bpk) and PyTorch (.safetensors) checkpoints in sync.")
    parser.add_argument("--version", action="version", version=f"syncd {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    inspect = commands.add_parser("inspect", help="show a checkpoint's header, metadata and tensors")
    inspect.add_argument("file", type=Path)
    inspect.add_argument("--json", action="store_true", help="one JSON document")
    inspect.add_argument("--hash", action="store_true", help="add a sha256 per tensor")

    convert = commands.add_parser("convert", help="convert one checkpoint to the other format and layout")
    convert.add_argument("source", type=Path)
    convert.add_argument("-o", "--output", type=Path, help="destination (default: SOURCE with the other extension)")
    convert.add_argument("--to", choices=list(BY_SHORT), help="output format (default: the other one)")
    convert.add_argument(
        "--layout",
        choices=LAYOUT_CHOICES,
        default=AUTO,
        help="layout of the source (auto: decide from the tensors); keep: convert the container only",
    )
    convert.add_argument("--modules", type=Path, help="YAML module map (path pattern -> module kind)")
    convert.add_argument("--overwrite", action="store_true", help="replace the destination if it exists")
    convert.add_argument("--json", action="store_true", help="print the result as JSON")
    convert.add_argument("-v", "--verbose", action="store_true", help="print every layout decision")

    run = commands.add_parser("run", help="run the daemon")
    run.add_argument("-c", "--config", type=Path, required=True)

    check = commands.add_parser("check-config", help="validate a configuration file")
    check.add_argument("config", type=Path)

    from syncd.daemon.logview import add_log_arguments

    add_log_arguments(commands.add_parser("log", help="show the sync log"))
    return parser


def main(argv: list[str] | None = None) -> int:
    verbose = False
    try:
        args = build_parser().parse_args(argv)
        verbose = getattr(args, "verbose", False)
        return _dispatch(args)
    except SyncdError as exc:
        print(f"syncd: {_one_line(str(exc))}", file=sys.stderr)
        details = getattr(exc, "details", None)  # e.g. the module map that would settle an ambiguous layout
        if verbose and details:
            print(details, file=sys.stderr)
        return exc.exit_code
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"syncd: {where}{exc.strerror or exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a bug of ours: still one line for the user; SYNCD_DEBUG=1 shows the traceback
        if os.environ.get("SYNCD_DEBUG"):
            raise
        print(f"syncd: internal error: {type(exc).__name__}: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _one_line(text: str) -> str:
    return text.splitlines()[0] if text else "error"


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "inspect":
        return _inspect(args)
    if args.command == "convert":
        return _convert(args)
    if args.command == "run":
        from syncd.daemon.service import run_daemon

        return run_daemon(args.config)
    if args.command == "check-config":
        from syncd.daemon.config import run_check_config

        return run_check_config(args.config)
    if args.command == "log":
        from syncd.daemon.logview import run_log_command

        return run_log_command(args)
    raise UsageError(f"unknown command {args.command}")


def _inspect(args: argparse.Namespace) -> int:
    from syncd.inspect import describe, print_json, print_table

    doc = describe(str(args.file), with_hash=args.hash)
    (print_json if args.json else print_table)(doc, sys.stdout)
    return EXIT_OK


def _convert(args: argparse.Namespace) -> int:
    import json

    from syncd.adapters import ModuleMap
    from syncd.convert import ConvertRequest, convert
    from syncd.formats.registry import BY_SHORT

    request = ConvertRequest(
        source=args.source,
        dest=args.output,
        to_format=BY_SHORT[args.to].name if args.to else None,
        layout=args.layout,
        module_map=ModuleMap.from_yaml_file(args.modules) if args.modules else None,
        overwrite=args.overwrite,
    )
    result = convert(request)
    if args.json:
        print(
            json.dumps(
                {
                    "status": result.status,
                    "source": str(result.source),
                    "dest": str(result.dest),
                    "tensors": result.tensors,
                    "bytes": result.bytes,
                    "seconds": round(result.seconds, 4),
                    "source_layout": result.source_layout,
                    "target_layout": result.target_layout,
                    "decisions": result.decisions,
                    "dropped": result.dropped,
                    "restored": result.restored,
                }
            )
        )
        return EXIT_OK
    verb = {"in_sync": "already in sync", "replaced": "replaced"}.get(result.status, "converted")
    print(
        f"{verb}: {result.source} -> {result.dest} ({result.tensors} tensors, {result.bytes} bytes, "
        f"{result.source_layout} -> {result.target_layout} layout, {result.seconds:.2f}s)"
    )
    if args.verbose:
        for line in result.decisions:
            print(f"  {line}")
    for name in result.dropped:
        print(f"  carried in metadata (no slot on the target side): {name}")
    return EXIT_OK
