"""The sync log writer (line-atomic JSON lines, rotation) and `syncd log` (reading, filters, table, follow)."""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from conftest import fill_up
from convcheck import cli_env
from daemonutil import NOBODY, as_nobody

from syncd.cli.log import (
    add_log_arguments,
    human_bytes,
    human_duration,
    log_files,
    parse_since,
    run_log_command,
    show_log,
)
from syncd.daemon.synclog import SyncLog, encode_record, parse_timestamp, utc_timestamp

ISO_MS_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="ascii").splitlines()]


# ---------------------------------------------------------------------------------------------- writer


def test_a_record_is_one_ascii_json_line_with_fields_in_order_and_nones_dropped(tmp_path: Path) -> None:
    log_path = tmp_path / "sync.jsonl"
    with SyncLog(log_path) as log:
        written = log.log(
            "converted",
            error=None,
            reason="new file",
            source=Path("/runs/a.bpk"),
            dest="/runs/a.safetensors",
            watch="/runs",
            tensors=3,
            bytes=1024,
            duration_ms=12.5,
            layout=["linear: transposed"],
            direction="bpk->safetensors",
        )
    (record,) = read_lines(log_path)
    assert record == {
        key: (str(value) if isinstance(value, Path) else value) for key, value in written.items() if value is not None
    }
    assert list(record) == [
        "time",
        "status",
        "watch",
        "source",
        "dest",
        "direction",
        "tensors",
        "bytes",
        "duration_ms",
        "layout",
        "reason",
    ]
    assert ISO_MS_UTC.match(record["time"])
    assert abs(parse_timestamp(record["time"]) - datetime.now(UTC)) < timedelta(seconds=5)


def test_timestamps_are_utc_with_milliseconds() -> None:
    moment = datetime(2025, 3, 4, 5, 6, 7, 891234, tzinfo=timezone(timedelta(hours=2)))
    assert utc_timestamp(moment) == "2025-03-04T03:06:07.891Z"
    assert parse_timestamp("2025-03-04T03:06:07.891Z") == moment.replace(microsecond=891000)


def test_undecodable_bytes_and_newlines_in_paths_stay_on_one_line_and_round_trip(tmp_path: Path) -> None:
    raw_name = b"/runs/caf\xe9\nnew\tline.bpk"  # Latin-1 byte, not UTF-8
    log_path = tmp_path / "sync.jsonl"
    with SyncLog(log_path) as log:
        log.log("error", source=raw_name, dest=os.fsdecode(b"/runs/\xff.safetensors"), error="bad\nthing")
    data = log_path.read_bytes()
    assert data.count(b"\n") == 1 and data.isascii()
    (record,) = read_lines(log_path)
    assert os.fsencode(record["source"]) == raw_name
    assert os.fsencode(record["dest"]) == b"/runs/\xff.safetensors"
    assert record["error"] == "bad\nthing"


def test_concurrent_writers_never_interleave_or_lose_lines(tmp_path: Path) -> None:
    log_path = tmp_path / "sync.jsonl"
    log = SyncLog(log_path, max_bytes=0)
    padding = "x" * 3000  # longer than a pipe buffer line, so torn writes would show

    def writer(worker: int) -> None:
        for index in range(200):
            log.log("converted", source=f"/w{worker}/{index}", reason=padding)

    threads = [threading.Thread(target=writer, args=(worker,)) for worker in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    log.close()
    records = read_lines(log_path)
    assert len(records) == 800
    assert {record["source"] for record in records} == {f"/w{w}/{i}" for w in range(4) for i in range(200)}
    for worker in range(4):  # each thread's lines keep their order
        mine = [int(r["source"].rsplit("/", 1)[1]) for r in records if r["source"].startswith(f"/w{worker}/")]
        assert mine == sorted(mine)


def test_rotation_keeps_the_newest_lines_in_the_configured_number_of_backups(tmp_path: Path) -> None:
    log_path = tmp_path / "sync.jsonl"
    line_size = len(encode_record({"time": utc_timestamp(), "status": "in_sync", "source": "/r/000"}))
    with SyncLog(log_path, max_bytes=line_size * 10, backups=3) as log:  # exactly 10 lines per file
        for index in range(100):
            log.log("in_sync", source=f"/r/{index:03d}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sync.jsonl", "sync.jsonl.1", "sync.jsonl.2", "sync.jsonl.3"]
    assert all(path.stat().st_size == line_size * 10 for path in log_files(log_path))
    kept = [record["source"] for path in log_files(log_path) for record in read_lines(path)]
    assert kept == [f"/r/{index:03d}" for index in range(60, 100)]


def test_rotation_under_concurrent_writers_loses_only_the_oldest_whole_lines(tmp_path: Path) -> None:
    log_path = tmp_path / "sync.jsonl"
    log = SyncLog(log_path, max_bytes=4000, backups=2)

    def write(worker: int) -> None:
        for index in range(100):
            log.log("in_sync", source=f"/w{worker}/{index:03d}")

    threads = [threading.Thread(target=write, args=(worker,)) for worker in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    log.close()
    files = log_files(log_path)
    assert len(files) == 3 and all(path.stat().st_size <= 4000 for path in files)
    kept = [record["source"] for path in files for record in read_lines(path)]  # a torn line would not parse
    assert len(kept) == len(set(kept)) and len(kept) > 50
    for worker in range(4):  # what is kept of each writer is the tail of what it wrote, in order
        mine = [int(source.rsplit("/", 1)[1]) for source in kept if source.startswith(f"/w{worker}/")]
        assert mine == list(range(100 - len(mine), 100))


def test_rotation_numbers_backups_oldest_last(tmp_path: Path) -> None:
    log_path = tmp_path / "sync.jsonl"
    with SyncLog(log_path, max_bytes=1, backups=5) as log:  # every line gets its own file
        for index in range(3):
            log.log("started", reason=str(index))
    assert [read_lines(p)[0]["reason"] for p in log_files(log_path)] == ["0", "1", "2"]
    assert read_lines(tmp_path / "sync.jsonl.2")[0]["reason"] == "0"


def test_a_log_moved_away_by_someone_else_is_reopened(tmp_path: Path) -> None:
    log_path = tmp_path / "sync.jsonl"
    with SyncLog(log_path) as log:
        log.log("started")
        log_path.rename(tmp_path / "old.jsonl")
        log.log("stopped")
    assert [r["status"] for r in read_lines(log_path)] == ["stopped"]
    assert [r["status"] for r in read_lines(tmp_path / "old.jsonl")] == ["started"]


@pytest.mark.root
def test_a_line_the_disk_had_room_for_only_part_of_leaves_nothing_behind(small_fs: Path) -> None:
    """A full disk took part of a line: the next line, written once there was room, was fused to that piece
    and both were lost to `syncd log` ("skipped 1 corrupt line")."""
    log_path = small_fs / "sync.jsonl"
    page = small_fs / "page"
    with SyncLog(log_path) as log:
        log.log("started")
        page.write_bytes(b"\0" * 8192)
        filler = fill_up(small_fs)
        page.unlink()  # two pages of room left: part of the next line fits
        log.log("converted", reason="x" * 20000)
        assert log_path.read_bytes().endswith(b"\n")
        filler.unlink()
        log.log("updated")
    assert [r["status"] for r in read_lines(log_path)] == ["started", "updated"]


@pytest.mark.root
def test_a_log_directory_made_unreadable_still_takes_lines_in_the_file_held_open(tmp_path: Path) -> None:
    """chmod 000 on the log's directory: the file the daemon holds is still its to append to (every line went
    to the journal as an error, the file still writable)."""
    directory = Path(tempfile.mkdtemp(prefix="syncd-log-", dir="/tmp"))
    try:
        os.chown(directory, NOBODY, NOBODY)
        script = (
            "import os, sys\n"
            "from syncd.daemon.synclog import SyncLog\n"
            "log = SyncLog(sys.argv[1] + '/sync.jsonl')\n"
            "log.log('started')\n"
            "os.chmod(sys.argv[1], 0)\n"
            "log.log('converted')\n"
            "os.chmod(sys.argv[1], 0o755)\n"
        )
        done = as_nobody([sys.executable, "-c", script, str(directory)], cli_env())
        assert done.returncode == 0 and "cannot write the sync log" not in done.stderr, done.stderr
        assert [r["status"] for r in read_lines(directory / "sync.jsonl")] == ["started", "converted"]
    finally:
        os.chmod(directory, 0o755)
        shutil.rmtree(directory)


# ---------------------------------------------------------------------------------------------- reader


def write_records(path: Path, records: list[dict]) -> None:
    with open(path, "ab") as file:
        for record in records:
            file.write(encode_record(record))


def record(status: str, minutes_ago: float, **fields: object) -> dict:
    moment = datetime.now(UTC) - timedelta(minutes=minutes_ago)
    return {"time": utc_timestamp(moment), "status": status, **fields}


@pytest.fixture
def sample_log(tmp_path: Path) -> Path:
    log_path = tmp_path / "sync.jsonl"
    write_records(tmp_path / "sync.jsonl.2", [record("started", 300, watch="/runs")])
    write_records(
        tmp_path / "sync.jsonl.1",
        [
            record(
                "converted",
                120,
                source="/runs/exp1/a.bpk",
                dest="/runs/exp1/a.safetensors",
                tensors=12,
                bytes=5 * 1024 * 1024,
                duration_ms=1500.0,
            ),
            record("error", 90, source="/runs/exp2/b.bpk", error="FormatError: truncated header"),
        ],
    )
    write_records(
        log_path,
        [
            record("in_sync", 10, source="/runs/exp1/a.safetensors", dest="/runs/exp1/a.bpk", duration_ms=4),
            record("conflict", 1, source="/runs/exp2/c.bpk", dest="/runs/exp2/c.safetensors", reason="dest differs"),
        ],
    )
    return log_path


def run_show(log_path: Path, **options: object) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = show_log(log_path, out=out, err=err, **options)
    return code, out.getvalue(), err.getvalue()


def test_json_output_is_the_raw_lines_oldest_file_first(sample_log: Path) -> None:
    code, out, err = run_show(sample_log, as_json=True)
    assert code == 0 and err == ""
    expected = b"".join(
        p.read_bytes() for p in [sample_log.with_name("sync.jsonl.2"), sample_log.with_name("sync.jsonl.1"), sample_log]
    )
    assert out == expected.decode()
    assert [json.loads(line)["status"] for line in out.splitlines()] == [
        "started",
        "converted",
        "error",
        "in_sync",
        "conflict",
    ]


def test_table_is_aligned_and_human_readable(sample_log: Path) -> None:
    code, out, _ = run_show(sample_log)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == [
        "TIME",
        "(UTC)",
        "STATUS",
        "SOURCE",
        "->",
        "DEST",
        "TENSORS",
        "SIZE",
        "DURATION",
        "REASON",
    ]
    converted = next(line for line in lines if "converted" in line)
    assert "/runs/exp1/a.bpk -> /runs/exp1/a.safetensors" in converted
    assert "5.0 MiB" in converted and "1.5 s" in converted and " 12 " in converted
    assert "FormatError: truncated header" in next(line for line in lines if " error " in line)
    assert "4 ms" in next(line for line in lines if "in_sync" in line)
    # columns line up: statuses start under STATUS, sizes end under the end of SIZE
    status_start = lines[0].index("STATUS")
    assert lines[1] == "watch /runs:"  # what the rows' paths are relative to, before the first row of a watch
    for line, status in zip(lines[2:], ["started", "converted", "error", "in_sync", "conflict"], strict=True):
        assert line[status_start:].startswith(status + " ")
    size_end = lines[0].index("SIZE") + len("SIZE")
    assert converted[:size_end].endswith("5.0 MiB")


def test_a_line_names_the_watch_whenever_the_rows_paths_change_tree(tmp_path: Path) -> None:
    """With several watches, `run1/a.bpk` alone would not say which tree it is in: a `watch DIR:` line comes
    before the first row of each run of rows from one watch, as `tail` names each file it follows."""
    log_path = tmp_path / "sync.jsonl"

    def converted(watch: str, name: str, minutes_ago: float) -> dict:
        source, dest = f"{watch}/run1/{name}.safetensors", f"{watch}/run1/{name}.bpk"
        return record("converted", minutes_ago, watch=watch, source=source, dest=dest)

    write_records(
        log_path,
        [
            record("started", 9, config="/etc/syncd/syncd.yaml"),
            converted("/data/team-a", "a", 8),
            converted("/data/team-a", "b", 7),
            converted("/data/team-b", "a", 6),
            record("reload", 5, config="/etc/syncd/syncd.yaml"),
            converted("/data/team-b", "c", 4),
            converted("/data/team-a", "c", 3),
        ],
    )
    code, out, _ = run_show(log_path)
    assert code == 0
    shown = [line.split()[2] if not line.startswith("watch ") else line for line in out.splitlines()[1:]]
    assert shown == [
        "started",
        "watch /data/team-a:",
        "converted",
        "converted",
        "watch /data/team-b:",
        "converted",
        "reload",
        "converted",
        "watch /data/team-a:",
        "converted",
    ]
    assert "run1/a.safetensors -> run1/a.bpk" in out and "/data/team-a/run1" not in out
    # following: a row read later from the watch of the last row printed is not preceded by its name again
    followed = io.StringIO()
    appended: list[bool] = []

    def append_once_then_stop() -> bool:  # called after each read of the file
        if not appended:
            with open(log_path, "a") as log:
                log.write(json.dumps(converted("/data/team-a", "d", 2)) + "\n")
            appended.append(True)
            return False
        return True

    assert show_log(log_path, follow=True, out=followed, stop=append_once_then_stop, poll_interval=0.01) == 0
    assert "run1/d.safetensors -> run1/d.bpk" in followed.getvalue()
    assert followed.getvalue().count("watch /data/team-a:") == 2


def test_filter_by_status_repeatable_and_comma_separated(sample_log: Path) -> None:
    _, out, _ = run_show(sample_log, statuses=["error,conflict", "started"], as_json=True)
    assert [json.loads(line)["status"] for line in out.splitlines()] == ["started", "error", "conflict"]


def test_filter_since_relative_and_absolute(sample_log: Path) -> None:
    _, out, _ = run_show(sample_log, since="100m", as_json=True)
    assert [json.loads(line)["status"] for line in out.splitlines()] == ["error", "in_sync", "conflict"]
    _, out, _ = run_show(sample_log, since="30s", as_json=True)
    assert out == ""
    boundary = utc_timestamp(datetime.now(UTC) - timedelta(minutes=5))
    _, out, _ = run_show(sample_log, since=boundary, as_json=True)
    assert [json.loads(line)["status"] for line in out.splitlines()] == ["conflict"]


def test_parse_since() -> None:
    now = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert parse_since("30s", now) == now - timedelta(seconds=30)
    assert parse_since("15m", now) == now - timedelta(minutes=15)
    assert parse_since("1h", now) == now - timedelta(hours=1)
    assert parse_since("2d", now) == now - timedelta(days=2)
    assert parse_since("2025-01-01T00:00:00Z") == datetime(2025, 1, 1, tzinfo=UTC)
    assert parse_since("2025-01-01T00:00:00+02:00") == datetime(2024, 12, 31, 22, tzinfo=UTC)
    # UTC, as `syncd log` shows its times, whatever the reader's zone
    assert parse_since("2025-01-01 00:00") == datetime(2025, 1, 1, tzinfo=UTC)
    # past the start of datetime's range (it raised OverflowError, an internal error): everything
    earliest = datetime.min.replace(tzinfo=UTC)
    assert parse_since("3000000d", now) == parse_since("999999999999999999999s", now) == earliest
    assert parse_since("0001-01-01") <= datetime(1, 1, 2, tzinfo=UTC)
    assert parse_since("9999-12-31T23:59:59") >= datetime(9999, 12, 31, tzinfo=UTC)  # nothing, in any zone


def test_bad_since_is_a_usage_error_not_a_traceback(sample_log: Path) -> None:
    code, out, err = run_show(sample_log, since="yesterday")
    assert code == 2 and out == ""
    assert err.startswith("syncd log: --since: expected a duration") and err.count("\n") == 1


def test_filter_by_path_glob_matches_source_or_dest(sample_log: Path) -> None:
    _, out, _ = run_show(sample_log, path_glob="exp1/*.safetensors", as_json=True)
    assert [json.loads(line)["status"] for line in out.splitlines()] == ["converted", "in_sync"]
    _, out, _ = run_show(sample_log, path_glob="/runs/exp2/*", as_json=True)
    assert [json.loads(line)["status"] for line in out.splitlines()] == ["error", "conflict"]
    _, out, _ = run_show(sample_log, path_glob="/elsewhere/*", as_json=True)
    assert out == ""


def test_corrupt_lines_are_skipped_and_counted(sample_log: Path) -> None:
    with open(sample_log, "ab") as file:
        file.write(b'not json\n{"status": "converted"}\n[1, 2]\n\xff\xfe\x00garbage\n')
        file.write(b'{"time": "yesterday", "status": "error"}\n{"time": "2025-01-01T00:00:00.000Z", "status": 5}\n')
        file.write(encode_record(record("stopped", 0)))
        file.write(b'{"time": "2025-01-01T00:00:00.000Z", "sta')  # a torn last line (no newline)
    code, out, err = run_show(sample_log, as_json=True)
    assert code == 0
    assert [json.loads(line)["status"] for line in out.splitlines()][-1] == "stopped"
    assert len(out.splitlines()) == 6
    assert err == f"syncd log: {sample_log}: skipped 7 corrupt lines\n"


def test_control_characters_and_undecodable_bytes_are_escaped_in_the_table(tmp_path: Path) -> None:
    log_path = tmp_path / "sync.jsonl"
    with SyncLog(log_path) as log:
        log.log("error", source=b"/runs/a\nb\xff.bpk", error="line1\nline2")
    _, out, _ = run_show(log_path)
    lines = out.splitlines()
    assert len(lines) == 2
    assert "/runs/a\\nb\\xff.bpk" in lines[1] and "line1\\nline2" in lines[1]
    out.encode("ascii")  # printable on any terminal encoding


def test_missing_log_is_reported(tmp_path: Path) -> None:
    code, out, err = run_show(tmp_path / "absent.jsonl")
    assert code == 1 and out == "" and "no sync log yet" in err


HANG = 30.0  # seconds: catches a follower that hangs; never a measure of speed


class Terminal(io.StringIO):
    """A follower's output whose reader the test can pause, as a terminal or pipe nobody reads: while paused,
    a write waits. The test can wait for lines to arrive and for a write to be waiting."""

    def __init__(self) -> None:
        super().__init__()
        self._cond = threading.Condition()
        self._paused = False
        self._waiting = False

    def write(self, text: str) -> int:
        with self._cond:
            self._waiting = True
            self._cond.notify_all()
            assert self._cond.wait_for(lambda: not self._paused, HANG), "the terminal was never resumed"
            self._waiting = False
            written = super().write(text)
            self._cond.notify_all()
            return written

    def pause(self) -> None:
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def wait_for_lines(self, count: int) -> None:
        with self._cond:
            arrived = self._cond.wait_for(lambda: self.getvalue().count("\n") >= count, HANG)
            assert arrived, f"{count} lines expected, got:\n{self.getvalue()}"

    def wait_for_a_waiting_write(self) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self._waiting and self._paused, HANG), "no write waited"


@pytest.mark.parametrize("rotations_unread", [1, 2])
def test_follow_prints_every_record_across_rotations_even_those_made_while_it_was_not_reading(
    tmp_path: Path, rotations_unread: int
) -> None:
    log_path = tmp_path / "sync.jsonl"
    log = SyncLog(log_path, max_bytes=400, backups=2)  # 400 bytes: three ~110-byte records to a file
    log.log("started", watch="/runs")
    terminal, err, finished = Terminal(), io.StringIO(), threading.Event()
    sources: list[str] = []

    def converted() -> bool:
        """Log the next record; True if the log rotated to make room for it."""
        before = log_path.stat().st_ino
        sources.append(f"/runs/{len(sources):02d}.bpk")
        log.log("converted", source=sources[-1], dest=sources[-1].replace(".bpk", ".safetensors"))
        return log_path.stat().st_ino != before

    def follower() -> None:
        show_log(log_path, as_json=True, follow=True, out=terminal, err=err, stop=finished.is_set, poll_interval=0.01)

    thread = threading.Thread(target=follower)
    thread.start()
    try:
        terminal.wait_for_lines(1)
        rotations = 0
        while rotations < 3:  # a follower that keeps up: each record printed before the next is logged
            rotations += converted()
            terminal.wait_for_lines(1 + len(sources))
        # the last record began a new file. The follower stops reading (its terminal paused) holding that
        # file; the file fills and the log rotates: the file's rest is read through the old descriptor, and
        # any file rotated out after it whole
        terminal.pause()
        assert not converted()
        terminal.wait_for_a_waiting_write()  # it has read that record, and nothing after it
        rotated = 0
        while rotated < rotations_unread:  # two: a whole file came and went between two of its reads
            rotated += converted()
        terminal.resume()
        terminal.wait_for_lines(1 + len(sources))
    finally:
        finished.set()
        terminal.resume()
        thread.join(HANG)
        log.close()
    records = [json.loads(line) for line in terminal.getvalue().splitlines()]
    assert records[0]["status"] == "started"
    assert [r["source"] for r in records[1:]] == sources
    assert err.getvalue() == ""


def test_follow_waits_for_a_log_that_does_not_exist_yet(tmp_path: Path) -> None:
    log_path = tmp_path / "sync.jsonl"
    out = io.StringIO()
    looked = 0

    def stop() -> bool:
        """Asked after every look at the log: the log is created after the first look found none."""
        nonlocal looked
        looked += 1
        if looked == 1:
            assert not log_path.exists() and out.getvalue() == ""
            SyncLog(log_path).log("started")
        return "started" in out.getvalue()

    code = show_log(log_path, follow=True, out=out, err=io.StringIO(), stop=stop, poll_interval=0.01)
    assert code == 0 and looked >= 2
    assert "started" in out.getvalue() and out.getvalue().startswith("TIME (UTC)")


def test_follow_stops_after_its_timeout(sample_log: Path) -> None:
    started = time.monotonic()
    code, out, _ = run_show(sample_log, follow=True, timeout=0.3, poll_interval=0.02)
    assert code == 0 and time.monotonic() - started >= 0.3  # it followed for the time asked, then stopped
    assert out.startswith("TIME (UTC)")


def test_log_command_reads_the_log_named_by_the_config(sample_log: Path, tmp_path: Path) -> None:
    config = tmp_path / "syncd.yaml"
    config.write_text(f"log: {{path: {sample_log.name}}}\nwatches:\n  - path: runs\n")  # runs/ need not exist
    parser = argparse.ArgumentParser()
    add_log_arguments(parser)
    out, err = io.StringIO(), io.StringIO()
    args = parser.parse_args(["-c", str(config), "--status", "conflict", "--json"])
    assert run_log_command(args, out=out, err=err) == 0
    assert [json.loads(line)["status"] for line in out.getvalue().splitlines()] == ["conflict"]
    args = parser.parse_args(["-c", str(tmp_path / "missing.yaml")])
    assert run_log_command(args, out=out, err=err) == 2
    assert err.getvalue().startswith("syncd log: ") and "missing.yaml: cannot read" in err.getvalue()


def test_human_units() -> None:
    assert [human_bytes(n) for n in (0, 1023, 1024, 1536, 5 * 1024**3)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "1.5 KiB",
        "5.0 GiB",
    ]
    assert [human_duration(ms) for ms in (4, 999, 1500, 125_000, 7_300_000)] == [
        "4 ms",
        "999 ms",
        "1.5 s",
        "2m05s",
        "2h01m",
    ]


def test_a_reader_that_goes_away_is_not_an_error(sample_log: Path) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # as `syncd log | head` once head has exited
    with open(write_end, "w") as out:
        err = io.StringIO()
        assert show_log(sample_log, out=out, err=err) == 0
        assert err.getvalue() == ""


def test_a_long_log_is_printed_as_it_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole log (100,000 lines by default) was parsed and rendered before its first line was printed:
    4.6 s and 450 MB, and `syncd log | head` waited as long."""
    from syncd.daemon import logread

    log_path = tmp_path / "sync.jsonl"
    write_records(log_path, [record("converted", 5000 - n, source=f"/runs/m{n}.bpk") for n in range(5000)])
    parsed = []
    parse = logread.LineParser.parse
    monkeypatch.setattr(logread.LineParser, "parse", lambda self, line: (parsed.append(1), parse(self, line))[1])

    class Closed(io.StringIO):
        def write(self, text: str) -> int:
            raise BrokenPipeError

    assert show_log(log_path, out=Closed()) == 0  # the reader went at the first line
    assert len(parsed) <= 1000
    code, whole, _ = run_show(log_path)
    assert code == 0 and len(whole.splitlines()) == 5001  # the header and every record
    assert len({line.index("converted") for line in whole.splitlines()[1:]}) == 1  # one column, aligned
