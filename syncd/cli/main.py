"""The `syncd` command line: convert, inspect, run (the daemon), status, log, check-config, modules, completion.

Every error a user sees is one line naming the file and what is wrong (a JSON document with `--json`); exit
status 1 for bad input or a refused conversion, 2 for usage and configuration errors, 3 when the destination
already exists. A reader that goes away (`syncd log | head`) ends the command quietly.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import threading
from typing import Any, NoReturn

# syncd never multiplies matrices: an idle OpenBLAS thread pool only spins on the other core. Set before
# numpy is first imported (it is imported lazily, by the commands that need it).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
from pathlib import Path

from syncd import __version__
from syncd.errors import SyncdError, UsageError, one_line

EXIT_OK, EXIT_BAD_INPUT = 0, 1  # usage (2) and exists (3) come from the errors' exit_code
EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143  # 128 + SIGINT, 128 + SIGTERM, as a shell reports a signal's death
EXIT_CODES = """exit status:
  0    success
  1    bad input, a refused or failed conversion; for `status`: the daemon does not run
  2    usage or configuration error; for `status`: its status file is not the caller's to read
  3    the destination already exists (convert without --overwrite)
  130  interrupted (Ctrl-C)
  143  terminated (SIGTERM); like Ctrl-C, it leaves no scratch file"""
RUN_EXIT_CODES = """exit status:
  0    stopped by SIGTERM or Ctrl-C (work in flight finished, or abandoned leaving no scratch file)
  1    could not start (the state directory or a watched tree is another daemon's, a setting cannot be used)
  2    the configuration is not valid (the shipped units do not restart on it: RestartPreventExitStatus=2)"""
SHOWN_CARRIED = 3  # carried tensors listed by name without -v


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse's own usage errors: one line, status 2
        command = self.prog.removeprefix("syncd").strip()
        hint = f" (see syncd {command} --help)" if command else " (see syncd --help)"
        raise UsageError(f"{command + ': ' if command else ''}{message}{hint}")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with `command`, only that command's options are filled in, so a command imports
    nothing another one needs (`convert`'s choices come from the adapters, `status` and `log` from the daemon)."""
    parser = _Parser(
        prog="syncd",
        description="Keep Burn (.bpk) and PyTorch (.safetensors) checkpoints in sync.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"syncd {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    convert = _add_command(commands, "convert", help="convert one checkpoint to the other format and layout")
    if command in (None, "convert"):
        _add_convert_arguments(convert)

    inspect = _add_command(commands, "inspect", help="show a checkpoint's header, metadata and tensors")
    inspect.add_argument(
        "file",
        type=Path,
        help="a .bpk or .safetensors file, a PyTorch .pt/.pth/.bin/.ckpt/.pth.tar, or a sharded set's index or "
        "directory",
    )
    inspect.add_argument("--json", action="store_true", help="one JSON document")
    inspect.add_argument("--hash", action="store_true", help="add a sha256 per tensor")
    inspect.add_argument("--top-level-key", metavar="KEY", help="a PyTorch checkpoint's key holding the tensors")

    run = _add_command(commands, "run", help="run the daemon", epilog=RUN_EXIT_CODES)
    run.add_argument("-c", "--config", type=Path, required=True, help="the daemon's YAML configuration file")

    status = _add_command(commands, "status", help="what the running daemon does now, what waits, what failed")
    if command in (None, "status"):
        from syncd.daemon.config import DEFAULT_CONFIG_PATH

        status.add_argument("-c", "--config", type=Path, default=Path(DEFAULT_CONFIG_PATH), help="daemon config")
        status.add_argument("--json", action="store_true", help="one JSON document")

    retry = _add_command(commands, "retry", help="look again at files that failed, once their cause is fixed")
    retry.add_argument("-c", "--config", type=Path, required=True, help="the running daemon's configuration file")
    retry.add_argument("paths", nargs="*", type=Path, metavar="PATH", help="source files to look at again")
    retry.add_argument("--all-failed", action="store_true", help="every file that failed")
    retry.add_argument(
        "--adopt",
        action="store_true",
        help="after a lost state directory: take the outputs skipped as someone else's file that name their "
        "source (syncd.source; a set: the files its index lists) for the daemon's own, so it updates them (the "
        "PATHs' or, without PATHs, all)",
    )

    check = _add_command(commands, "check-config", help="validate a configuration file")
    check.add_argument("config", type=Path)
    check.add_argument("--user", help="warn about what this user (the service's) cannot read or write (needs root)")

    log = _add_command(commands, "log", help="show the sync log")
    if command in (None, "log"):
        from syncd.cli.log import add_log_arguments

        add_log_arguments(log)
    modules = _add_command(commands, "modules", help="write a model's exact module map from its definition")
    if command in (None, "modules"):
        from syncd.cli.modules import add_arguments

        add_arguments(modules)
    completion = _add_command(commands, "completion", help="print a shell completion script")
    completion.add_argument("shell", choices=["bash"])
    return parser


def _add_command(commands: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A subcommand whose --help ends with the exit statuses (the one-shot commands' unless `epilog` says)."""
    kwargs.setdefault("epilog", EXIT_CODES)
    parser: argparse.ArgumentParser = commands.add_parser(
        name, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs
    )
    return parser


def _add_convert_arguments(convert: argparse.ArgumentParser) -> None:
    from syncd.adapters import AUTO, LAYOUT_CHOICES
    from syncd.engine.hashing import DEFAULT_HASH, HASH_CHOICES
    from syncd.formats.registry import BY_SHORT

    convert.add_argument(
        "source",
        type=Path,
        help="the checkpoint to convert: a .bpk or .safetensors file, a PyTorch .pt/.pth/.bin/.ckpt/.pth.tar, or a "
        "sharded set's index or directory",
    )
    convert.add_argument(
        "-o", "--output", type=_output_path, help="destination (default: SOURCE with the other extension)"
    )
    convert.add_argument(
        "--to", choices=list(BY_SHORT), help="output format (default: from -o's extension, else the other one)"
    )
    convert.add_argument(
        "--layout",
        choices=LAYOUT_CHOICES,
        default=AUTO,
        help="layout of the source (auto: decide from the tensors); keep: convert the container only",
    )
    convert.add_argument("--modules", type=Path, help="YAML module map (path pattern -> module kind)")
    convert.add_argument(
        "--top-level-key",
        metavar="KEY",
        help="a PyTorch .pt/.pth/.bin/.ckpt/.pth.tar: the key of the saved dict that holds the tensors (default: the "
        "one of state_dict, model_state_dict, model that holds tensors, else the whole dict)",
    )
    stores = convert.add_argument_group("names, filters, precision and shards (as Burn's stores)")
    stores.add_argument(
        "--remap",
        action="append",
        default=[],
        metavar="PATTERN=REPLACEMENT",
        help="rename tensors as Burn's KeyRemapper (repeatable, applied in order; $1 for groups); the rules "
        "see the source's names as in the file, as in Burn: a .safetensors' norm1.weight, a .bpk's norm1.gamma; "
        "a rule set that moves part of a module is refused",
    )
    stores.add_argument(
        "--map-indices-contiguous",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="renumber indices 0..n-1 (fc.0, fc.2 -> fc.0, fc.1) as a Burn Vec expects; undone on the way back. "
        "Default: as Burn's store for the source's format (off for .safetensors and .bpk, as SafetensorsStore; "
        "on for .pt, as PytorchStore)",
    )
    stores.add_argument("--include", action="append", default=[], metavar="REGEX", help="only tensors matching")
    stores.add_argument("--exclude", action="append", default=[], metavar="REGEX", help="leave out tensors matching")
    stores.add_argument(
        "--precision", choices=["f16", "bf16", "f32"], help="cast float tensors as Burn's HalfPrecisionAdapter"
    )
    stores.add_argument(
        "--shard-size", metavar="SIZE", help="write safetensors as shards of at most SIZE (5GB, 500MB); none: one file"
    )
    convert.add_argument("--overwrite", action="store_true", help="replace the destination if it exists")
    convert.add_argument(
        "--hash",
        choices=HASH_CHOICES,
        default=DEFAULT_HASH,
        help=f"source hash recorded in the output (default {DEFAULT_HASH}, near memory speed; sha256 is cryptographic)",
    )
    convert.add_argument(
        "--verify",
        choices=["fast", "full"],
        default="fast",
        help="fast: checks taken while writing and a re-read of the written table; full: also re-read every tensor",
    )
    convert.add_argument("--json", action="store_true", help="print the result (or the error) as JSON")
    convert.add_argument("-v", "--verbose", action="store_true", help="print every layout decision")
    convert.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def _output_path(text: str) -> Path:
    """-o as a Path; one ending in `/` names a directory, which must exist (Path drops the slash, and the
    output was written as a file of that name)."""
    path = Path(text)
    if text.endswith(("/", "/.")) and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: no such directory")
    return path


def _command_word(argv: list[str]) -> str:
    """The subcommand named in `argv` (the first word not starting with '-'); "" when it names none
    (`syncd --version`, `syncd --help`), which needs no command's options, so imports none of their modules."""
    return next((arg for arg in argv if not arg.startswith("-")), "")


class _Terminated(KeyboardInterrupt):
    """SIGTERM to a one-shot command (kill, a job's time limit, a container stopping): it stops as Ctrl-C
    stops it, through every `finally`, so no scratch file is left (the default action would kill it at once,
    leaving a scratch file as large as the output)."""


def _terminate(signum: int, frame: object) -> None:
    raise _Terminated


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    as_json = "--json" in argv  # known before parsing, so argparse's own errors come out as JSON too
    command = _command_word(argv)
    if command != "run" and threading.current_thread() is threading.main_thread():  # the daemon has its own
        signal.signal(signal.SIGTERM, _terminate)
    try:
        parser = build_parser(command)
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help(sys.stderr)
            return UsageError.exit_code
        return _dispatch(args)
    except SyncdError as exc:
        # a refusal's module map that would settle it is what the user acts on: always printed; -v adds the
        # per-module reasons before it
        verbose = "-v" in argv or "--verbose" in argv
        details = getattr(exc, "details" if verbose else "suggestion", None) or getattr(exc, "details", None)
        return _report(as_json, exc.exit_code, str(exc), exc.path, details)
    except BrokenPipeError:
        return _reader_gone()
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        return _report(as_json, EXIT_BAD_INPUT, f"{where}{exc.strerror or exc}", exc.filename, None)
    except KeyboardInterrupt as exc:
        # a scratch file between its making and the `with` that would remove it: removed here
        publish = sys.modules.get("syncd.engine.publish")
        if publish is not None:
            publish.abandon_open_scratches()
        return EXIT_TERMINATED if isinstance(exc, _Terminated) else EXIT_INTERRUPTED
    except Exception as exc:  # a bug of ours: still one line for the user; SYNCD_DEBUG=1 shows the traceback
        if os.environ.get("SYNCD_DEBUG"):
            raise
        return _report(as_json, EXIT_BAD_INPUT, f"internal error: {type(exc).__name__}: {exc}", None, None)


def _report(as_json: bool, code: int, message: str, path: str | os.PathLike[str] | None, details: str | None) -> int:
    """An error for the user: one line on stderr (then any details), or one JSON document on stdout."""
    line = one_line(message) or "error"
    try:
        if as_json:
            doc = {
                "status": "error",
                "error": line,
                "file": None if path is None else os.fsdecode(path),
                "exit_code": code,
            }
            if details:
                doc["details"] = details
            print(json.dumps(doc), flush=True)
        else:
            print(f"syncd: {line}", file=sys.stderr)
            if details:
                print(details, file=sys.stderr)
    except BrokenPipeError:
        return _reader_gone(code)
    return code


def _reader_gone(code: int = EXIT_OK) -> int:
    """stdout's reader went away (`| head`): not worth a message. Point stdout at /dev/null so the
    interpreter's final flush does not complain either."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return code


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "inspect":
        return _inspect(args)
    if args.command == "convert":
        return _convert(args)
    if args.command == "run":
        from syncd.daemon.service import run_daemon

        return run_daemon(args.config)
    if args.command == "status":
        from syncd.cli.status import run_status_command

        return run_status_command(args.config, as_json=args.json)
    if args.command == "retry":
        from syncd.cli.retry import run_retry

        return run_retry(args.config, args.paths, all_failed=args.all_failed, adopt=args.adopt)
    if args.command == "check-config":
        from syncd.cli.check_config import run_check_config

        return run_check_config(args.config, user=args.user)
    if args.command == "log":
        from syncd.cli.log import run_log_command

        return run_log_command(args)
    if args.command == "modules":
        from syncd.cli.modules import run

        return run(args)
    if args.command == "completion":
        from syncd.cli.completion import bash_completion

        sys.stdout.write(bash_completion(build_parser()))
        return EXIT_OK
    raise UsageError(f"unknown command {args.command}")


def _inspect(args: argparse.Namespace) -> int:
    from syncd.engine.inspect import describe, print_json, print_table
    from syncd.formats.shards import find_index

    # a directory holding a sharded set stands for its index, as with `convert DIR`
    path = find_index(args.file) if args.file.is_dir() else str(args.file)
    doc = describe(path, with_hash=args.hash, top_level_key=args.top_level_key)
    (print_json if args.json else print_table)(doc, sys.stdout)
    sys.stdout.flush()  # a closed pipe shows here, inside main's handler, not at the interpreter's exit
    return EXIT_OK


def target_format(to: str | None, output: Path | None) -> str | None:
    """The output format: `--to`, else what `-o`'s extension names, else None (the other format). An
    extension naming the other format than `--to` is refused: the file's name would lie about its bytes."""
    from syncd.formats import SAFETENSORS
    from syncd.formats.registry import BY_NAME, BY_SHORT, FORMATS, format_for_path
    from syncd.formats.shards import is_index_name

    # a set's index names safetensors (its `.json` names no format): a .pt source got a .bpk under that name
    named = BY_NAME[SAFETENSORS] if output is not None and is_index_name(output) else None
    named = named or (format_for_path(output) if output is not None else None)
    # a suffix that names no format would lie about the bytes (`-o x.txt`); a name without one is taken as it is
    if output is not None and output.suffix and named is None and not is_index_name(output) and not output.is_dir():
        suffixes = " or ".join(fmt.extension for fmt in FORMATS)
        raise UsageError(
            f"convert: -o {output}: unknown output suffix {output.suffix!r}; "
            f"name the file {suffixes}, or give an existing directory"
        )
    wanted = BY_SHORT[to] if to else None
    if wanted and named and wanted != named:
        raise UsageError(f"--to {to} contradicts the extension of the output {output} ({named.name})")
    chosen = wanted or named
    return chosen.name if chosen else None


def _stop_cycle_collection() -> None:
    """A conversion builds a few objects per tensor that all live until it ends (a 10k-tensor checkpoint:
    hundreds of thousands); the cyclic collector's passes over them free nothing and took a fifth to a quarter
    of the CPU. It leaves about 15 objects in reference cycles whatever its size (measured on 10k-tensor
    safetensors and burnpack sources and a torch.save file), so this one-shot command converts with the
    collector off and the objects of the imports frozen out of its sight (the daemon pauses it while it
    converts: daemon/collector.py)."""
    gc.freeze()
    gc.disable()


def _convert(args: argparse.Namespace) -> int:
    from syncd.adapters import ModuleMap
    from syncd.engine.convert import ConvertRequest, convert
    from syncd.engine.progress import ProgressBar

    bar = ProgressBar.for_stream(sys.stderr, label=args.source.name, enabled=not (args.quiet or args.json))
    store, shard_size, one_file = _store_options(args)
    request = ConvertRequest(
        source=args.source,
        dest=args.output,
        to_format=target_format(args.to, args.output),
        layout=args.layout,
        module_map=ModuleMap.from_yaml_file(args.modules) if args.modules else None,
        overwrite=args.overwrite,
        progress=bar.update if bar else None,
        store=store,
        shard_size=shard_size,
        one_file=one_file,
        hash_name=args.hash,
        verify=args.verify,
        top_level_key=args.top_level_key,
    )
    _stop_cycle_collection()
    try:
        result = convert(request)
    finally:
        if bar:
            bar.close()
    if args.json:
        print(json.dumps(_result_doc(result)))
        return EXIT_OK
    verb = {"in_sync": "already in sync", "replaced": "replaced"}.get(result.status, "converted")
    print(
        f"{verb}: {result.source} -> {result.dest} ({result.tensors} tensors, {result.bytes} bytes, "
        f"{result.source_layout} -> {result.target_layout} layout, {result.seconds:.2f}s)"
    )
    if args.verbose:
        for line in result.decisions:
            print(f"  {line}")
    else:  # what of a PyTorch checkpoint was taken and what left, and what a user must check, even without -v
        for line in [*result.source_notes, *result.notes]:
            print(f"  {line}")
    if args.verbose or len(result.dropped) <= SHOWN_CARRIED:
        for name in result.dropped:
            print(f"  carried in metadata (no slot on the target side): {name}")
    else:  # a ResNet has one num_batches_tracked per BatchNorm: a count, not a hundred lines
        print(
            f"  carried in metadata (no slot on the target side): {len(result.dropped)} tensors, "
            f"e.g. {result.dropped[0]} (-v lists them)"
        )
    if result.left_out and not args.verbose:
        print(f"  left out by the tensor filter: {len(result.left_out)} tensors (-v lists them)")
    return EXIT_OK


def _result_doc(result: object) -> dict[str, object]:
    fields = (
        "status",
        "source",
        "dest",
        "tensors",
        "bytes",
        "seconds",
        "source_layout",
        "target_layout",
        "decisions",
        "dropped",
        "restored",
        "left_out",
        "cast",
        "source_notes",
    )
    doc = {name: getattr(result, name) for name in fields}
    doc["source"], doc["dest"] = str(doc["source"]), str(doc["dest"])
    doc["seconds"] = round(float(doc["seconds"]), 4)  # type: ignore[arg-type]
    doc["files"] = [str(path) for path in getattr(result, "files", [])]
    return doc


def _store_options(args: argparse.Namespace):  # -> tuple[StoreOptions, int | None, bool]
    """--remap/--include/--exclude/--precision/--shard-size, each bad pattern or size one usage error."""
    from syncd.adapters.keys import TensorFilter, parse_rule_argument
    from syncd.engine.options import StoreOptions
    from syncd.formats.shards import parse_shard_size

    try:
        rules = tuple(parse_rule_argument(text) for text in args.remap)
        tensors = TensorFilter.of(args.include, args.exclude)
        one_file = args.shard_size is not None and args.shard_size.lower() == "none"
        shard_size = parse_shard_size(args.shard_size) if args.shard_size is not None and not one_file else None
    except ValueError as exc:
        raise UsageError(f"convert: {exc}") from None
    options = StoreOptions(rules, args.map_indices_contiguous, tensors, args.precision)
    return options, shard_size, one_file
