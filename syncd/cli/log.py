"""`syncd log`: prints the sync log's records (read by syncd.daemon.logread) as an aligned table or as the raw
JSON lines; `--follow` keeps printing new lines across rotations. Corrupt lines are counted and reported on
stderr at the end, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from syncd.daemon.config import DEFAULT_CONFIG_PATH, load_locations
from syncd.daemon.logread import (
    Entry,
    LineParser,
    LogFilter,
    Tail,
    log_files,
    parse_all,
    parse_since,
    parse_statuses,
    read_whole,
)
from syncd.daemon.statuses import STATUSES
from syncd.engine.progress import human_bytes
from syncd.errors import SyncdError, UsageError

# ---------------------------------------------------------------------------------------------- rendering


def human_duration(milliseconds: float) -> str:
    if milliseconds < 1000:
        return f"{milliseconds:.0f} ms"
    seconds = milliseconds / 1000
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, seconds = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def printable(text: str) -> str:
    """Control characters and undecodable bytes (surrogate escapes) shown as escapes, so one record stays
    on one line and printing never fails."""
    out = []
    for char in text:
        code = ord(char)
        if 0xDC80 <= code <= 0xDCFF:
            out.append(f"\\x{code - 0xDC00:02x}")
        elif 0xD800 <= code <= 0xDFFF:
            out.append(f"\\u{code:04x}")
        elif char.isprintable() or char == " ":
            out.append(char)
        else:
            out.append(char.encode("unicode_escape").decode("ascii"))
    return "".join(out)


COLUMNS = ("TIME (UTC)", "STATUS", "SOURCE -> DEST", "TENSORS", "SIZE", "DURATION", "REASON")
_RIGHT_ALIGNED = {"TENSORS", "SIZE", "DURATION"}


def short_path(path: object, watch: object) -> str:
    """A path relative to its watch (`run1/ckpt.bpk`), or as logged when it lies elsewhere (a mirror)."""
    text = str(path)
    if isinstance(watch, str) and watch and text.startswith(watch.rstrip("/") + "/"):
        return text[len(watch.rstrip("/")) + 1 :]
    return text


def table_row(entry: Entry) -> tuple[str, ...]:
    record = entry.record

    def number(key: str, render: Callable[[Any], str]) -> str:
        value = record.get(key)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return render(value) if ok else ""

    watch = record.get("watch")
    source, dest = record.get("source"), record.get("dest")
    files = " -> ".join(printable(short_path(path, watch)) for path in (source, dest) if path is not None)
    return (
        entry.moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S"),
        printable(record["status"]),
        files or printable(str(watch or record.get("config") or "")),  # a refused reload: the config and line
        number("tensors", lambda v: str(int(v))),
        number("bytes", lambda v: human_bytes(int(v))),
        number("duration_ms", human_duration),
        reason_text(record)[0],
    )


def reason_text(record: dict[str, Any]) -> list[str]:
    """The REASON cell, then any lines to print under the row: the error first (what went wrong), then the
    reason's first line; the rest of a multi-line reason (a suggested module map) on lines of its own."""
    error, reason = record.get("error"), record.get("reason")
    reason_lines = str(reason).split("\n") if reason else []
    source = record.get("source")
    if error and source:
        error = str(error).removeprefix(f"{source}: ")  # the error names its file, already in the row
    head = [printable(str(error))] if error else []
    if reason_lines:
        head.append(printable(reason_lines[0]))
    return ["; ".join(head), *(f"    {printable(line)}" for line in reason_lines[1:])]


@dataclass
class TableFormatter:
    """Aligned columns whose widths only grow, so rows printed while following stay lined up."""

    widths: list[int] = field(default_factory=lambda: [len(name) for name in COLUMNS])
    header_done: bool = False

    def render(self, rows: list[tuple[str, ...]]) -> list[str]:
        for row in rows:
            # the last column (reason) is never padded
            for index, cell in enumerate(row[:-1]):
                self.widths[index] = max(self.widths[index], len(cell))
        lines = []
        if rows and not self.header_done:
            lines.append(self._line(COLUMNS))
            self.header_done = True
        lines.extend(self._line(row) for row in rows)
        return lines

    def _line(self, cells: tuple[str, ...]) -> str:
        parts = []
        for name, width, cell in zip(COLUMNS[:-1], self.widths[:-1], cells[:-1], strict=True):
            parts.append(cell.rjust(width) if name in _RIGHT_ALIGNED else cell.ljust(width))
        parts.append(cells[-1])
        return "  ".join(parts).rstrip()


# ---------------------------------------------------------------------------------------------- command


def show_log(
    log_path: str | os.PathLike[str],
    *,
    statuses: Iterable[str] | None = None,
    since: str | datetime | None = None,
    path_glob: str | None = None,
    as_json: bool = False,
    follow: bool = False,
    out: TextIO | None = None,
    err: TextIO | None = None,
    stop: Callable[[], bool] | None = None,
    timeout: float | None = None,
    poll_interval: float = 0.2,
) -> int:
    """Print the matching records of the log at `log_path`. 0 on success, 1 when there is no log (and not
    following), 2 for a bad filter. With `follow`, keeps printing until `stop()` is true, `timeout` seconds
    have passed, or Ctrl-C."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        log_filter = LogFilter(
            statuses=parse_statuses(statuses),
            since=parse_since(since) if isinstance(since, str) else since,
            path_glob=path_glob,
        )
    except UsageError as exc:
        return _error(out if as_json else err, as_json, str(exc), exc.exit_code)
    path = Path(log_path)
    files = log_files(path)
    if not files and not follow:
        message = (
            f"{path}: no sync log yet (the daemon writes it when it starts; a log.path changed since it started takes "
            "effect at its restart)"
        )
        return _error(out if as_json else err, as_json, message, 1)
    parser = LineParser()
    printer = _Printer(out, as_json, log_filter)
    tail = Tail(path)
    try:
        backups = [file for file in files if file != path]
        printer.emit(parse_all(parser, (line for file in backups for line in read_whole(file))))
        # the current file is read through the tail, so following starts exactly where this stops
        printer.emit(parse_all(parser, tail.read_new() + ([] if follow else tail.buffer.flush())))
        if follow:
            _follow(tail, parser, printer, stop, timeout, poll_interval)
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:
        # the reader went away (`syncd log | head`): not an error; keep the interpreter's final flush quiet
        _silence(out)
        return 0
    finally:
        tail.close()
    if parser.corrupt:
        plural = "s" if parser.corrupt != 1 else ""
        print(f"syncd log: {path}: skipped {parser.corrupt} corrupt line{plural}", file=err)
    return 0


def _error(stream: TextIO, as_json: bool, message: str, code: int) -> int:
    """One error line, or with --json one JSON document (on stdout, where the records would have gone)."""
    if as_json:
        stream.write(json.dumps({"status": "error", "error": message, "exit_code": code}) + "\n")
    else:
        stream.write(f"syncd log: {message}\n")
    stream.flush()
    return code


def _silence(out: TextIO) -> None:
    try:
        fileno = out.fileno()
    except (AttributeError, OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fileno)
    os.close(devnull)


class _Printer:
    def __init__(self, out: TextIO, as_json: bool, log_filter: LogFilter) -> None:
        self.out = out
        self.as_json = as_json
        self.filter = log_filter
        self.table = TableFormatter()
        self.watch: str | None = None  # the watch the paths of the rows printed last are relative to

    CHUNK = 1000  # records rendered and written at once: a whole log (100,000 lines) took 4.6 s and 450 MB first

    def emit(self, entries: Iterable[Entry]) -> None:
        """Print the matching entries as they are read, a chunk at a time (columns only widen, as when
        following)."""
        chunk: list[Entry] = []
        for entry in entries:
            if self.filter.matches(entry.record, entry.moment):
                chunk.append(entry)
                if len(chunk) >= self.CHUNK:
                    self._write(chunk)
                    chunk = []
        self._write(chunk)

    def _write(self, matching: list[Entry]) -> None:
        if self.as_json:
            lines = [entry.raw for entry in matching]
        else:
            lines = self.table.render([table_row(entry) for entry in matching])
            if lines and len(lines) > len(matching):  # the header came first
                lines = lines[:1] + self._with_extra_lines(lines[1:], matching)
            else:
                lines = self._with_extra_lines(lines, matching)
        for line in lines:
            self.out.write(line + "\n")
        self.out.flush()

    def _with_extra_lines(self, rows: list[str], entries: list[Entry]) -> list[str]:
        """Each row with the lines under it, and a `watch DIR:` line before a row whose paths are relative to
        another watch than the row before (as `tail` names each file it follows): with several watches, a
        relative `run1/ckpt.bpk` alone would not say which tree it is in."""
        out = []
        for row, entry in zip(rows, entries, strict=True):
            watch = entry.record.get("watch")
            if isinstance(watch, str) and watch and watch != self.watch:
                out.append(f"watch {printable(watch)}:")
                self.watch = watch
            out.append(row)
            out.extend(reason_text(entry.record)[1:])
        return out


def _follow(
    tail: Tail,
    parser: LineParser,
    printer: _Printer,
    stop: Callable[[], bool] | None,
    timeout: float | None,
    poll_interval: float,
) -> None:
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        printer.emit(parse_all(parser, tail.read_new()))
        if (stop is not None and stop()) or (deadline is not None and time.monotonic() >= deadline):
            return
        time.sleep(poll_interval)


def add_log_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `syncd log`, for the CLI to attach to its subcommand."""
    parser.add_argument("-c", "--config", default=None, help=f"daemon config whose log to read ({DEFAULT_CONFIG_PATH})")
    parser.add_argument("--file", default=None, help="read this sync log file instead of the config's")
    status = parser.add_argument(
        "--status",
        action="append",
        metavar="STATUS[,STATUS]",
        help=f"only these statuses (repeatable): {', '.join(STATUSES)}",
    )
    status.completions = STATUSES  # type: ignore[attr-defined]  # what `syncd completion` offers (not choices: a,b is valid)
    parser.add_argument(
        "--since",
        help="only records newer than 30s, 15m, 1h, 2d or an ISO time (UTC, as shown, unless it has an offset)",
    )
    parser.add_argument("--path", dest="path_glob", metavar="GLOB", help="only records whose source or dest match")
    parser.add_argument("--json", action="store_true", help="print the raw JSON lines")
    parser.add_argument("-f", "--follow", action="store_true", help="keep printing new records, like tail -f")


def run_log_command(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    err = err or sys.stderr
    log_path = args.file
    if log_path is None:
        try:
            config = load_locations(args.config or DEFAULT_CONFIG_PATH)
        except SyncdError as exc:
            return _error((out or sys.stdout) if args.json else err, args.json, str(exc), exc.exit_code)
        log_path = config.log.path
    return show_log(
        log_path,
        statuses=args.status,
        since=args.since,
        path_glob=args.path_glob,
        as_json=args.json,
        follow=args.follow,
        out=out,
        err=err,
    )
