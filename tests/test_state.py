"""The state database: up-to-date checks, failures once per version, schema versioning, corruption recovery."""

from __future__ import annotations

import dataclasses
import logging
import os
import sqlite3
import threading
from pathlib import Path

import pytest

from syncd.daemon.state import DB_NAME, SCHEMA_VERSION, StateDB
from syncd.formats.fileio import FileStamp


@pytest.fixture
def db(tmp_path: Path):
    with StateDB(tmp_path / "state") as state:
        yield state


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path]:
    source = tmp_path / "model.bpk"
    dest = tmp_path / "model.safetensors"
    source.write_bytes(b"source bytes")
    dest.write_bytes(b"dest bytes")
    return source, dest


def bump_mtime(path: Path) -> None:
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


def test_fresh_database_is_created_with_wal_and_schema_version(tmp_path: Path) -> None:
    StateDB(tmp_path / "deep" / "state").close()
    path = tmp_path / "deep" / "state" / DB_NAME
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert (path.parent.stat().st_mode & 0o777) == 0o700


def test_recorded_conversion_is_up_to_date_until_source_or_dest_changes(db: StateDB, pair: tuple[Path, Path]) -> None:
    source, dest = pair
    version = FileStamp.of_path(source)
    assert not db.is_up_to_date(source, version, dest)
    db.record(source, version, dest)
    assert db.is_up_to_date(source, version, dest)
    assert not db.is_up_to_date(source, version, dest.with_suffix(".other"))  # another output
    bump_mtime(source)
    assert not db.is_up_to_date(source, FileStamp.of_path(source), dest)
    assert db.is_up_to_date(source, version, dest)
    dest.write_bytes(b"edited by someone")  # the published output changed
    assert not db.is_up_to_date(source, version, dest)
    db.record(source, version, dest)
    dest.unlink()
    assert not db.is_up_to_date(source, version, dest)


def test_replaced_source_with_same_size_and_mtime_is_a_new_version(db: StateDB, pair: tuple[Path, Path]) -> None:
    source, dest = pair
    old = FileStamp.of_path(source)
    db.record(source, old, dest)
    replacement = source.with_name("incoming.bpk")
    replacement.write_bytes(b"other bytes!")  # same length
    os.utime(replacement, ns=(old.mtime_ns, old.mtime_ns))
    os.replace(replacement, source)  # a new inode, as an atomic save makes
    assert not db.is_up_to_date(source, FileStamp.of_path(source), dest)


def test_ctime_is_compared_when_both_sides_know_it(db: StateDB, pair: tuple[Path, Path]) -> None:
    """A chmod, or a rewrite whose mtime was set back, shows only in ctime; a row from before schema 2 has none."""
    source, dest = pair
    version = FileStamp.of_path(source)
    db.record(source, version, dest)
    assert db.is_up_to_date(source, dataclasses.replace(version, ctime_ns=0), dest)
    assert not db.is_up_to_date(source, dataclasses.replace(version, ctime_ns=version.ctime_ns + 1), dest)


def test_get_returns_what_was_recorded(db: StateDB, pair: tuple[Path, Path]) -> None:
    source, dest = pair
    version = FileStamp.of_path(source)
    db.record(source, version, dest, status="in_sync")
    state = db.get(source)
    assert state is not None
    assert (state.source, state.dest, state.status) == (str(source), str(dest), "in_sync")
    assert state.version == version and state.dest_version == FileStamp.of_path(dest)
    assert state.error is None and state.attempts == 0
    with pytest.raises(ValueError):
        db.record(source, version, dest, status="failed")


def test_own_outputs_are_recognised_until_modified(db: StateDB, pair: tuple[Path, Path]) -> None:
    source, dest = pair
    db.record(source, FileStamp.of_path(source), dest)
    assert db.is_own_output(dest, FileStamp.of_path(dest))
    assert not db.is_own_output(source, FileStamp.of_path(source))
    dest.write_bytes(b"the user's own edit")
    assert not db.is_own_output(dest, FileStamp.of_path(dest))


def test_failure_is_reported_once_per_version(db: StateDB, pair: tuple[Path, Path]) -> None:
    source, _ = pair
    version = FileStamp.of_path(source)
    assert not db.failed_same_version(source, version)
    assert db.record_failure(source, version, "FormatError: bad magic", transient=False) is True
    assert db.failed_same_version(source, version)
    assert db.record_failure(source, version, "FormatError: bad magic", transient=False) is False
    state = db.get(source)
    assert state is not None and state.status == "failed" and state.attempts == 2
    assert state.error == "FormatError: bad magic" and state.dest is None
    bump_mtime(source)
    new_version = FileStamp.of_path(source)
    assert not db.failed_same_version(source, new_version)
    assert db.record_failure(source, new_version, "FormatError: still bad", transient=False) is True


def test_transient_failures_are_retried_but_logged_once(db: StateDB, pair: tuple[Path, Path]) -> None:
    source, dest = pair
    version = FileStamp.of_path(source)
    assert db.record_failure(source, version, "OSError: disk full", transient=True) is True
    assert not db.failed_same_version(source, version)  # retry it
    assert db.record_failure(source, version, "OSError: disk full", transient=True) is False
    db.record(source, version, dest)  # the retry worked
    assert db.is_up_to_date(source, version, dest) and not db.failed_same_version(source, version)
    assert db.record_failure(source, version, "OSError: disk full", transient=True) is True


def test_state_survives_reopening_and_keys_non_utf8_paths_exactly(tmp_path: Path) -> None:
    directory = os.fsencode(tmp_path)
    source = directory + b"/caf\xe9.bpk"
    dest = directory + b"/caf\xe9.safetensors"
    with open(source, "wb") as file:
        file.write(b"x")
    with open(dest, "wb") as file:
        file.write(b"y")
    version = FileStamp.of_path(source)
    with StateDB(tmp_path / "state") as db:
        db.record(source, version, dest)
    with StateDB(tmp_path / "state") as db:
        assert db.is_up_to_date(source, version, dest)
        assert db.is_up_to_date(os.fsdecode(source), version, os.fsdecode(dest))
        state = db.get(source)
        assert state is not None and os.fsencode(state.source) == source
        assert not db.is_up_to_date(directory + b"/caf\xc3\xa9.bpk", version, dest)  # the UTF-8 spelling


def test_unsigned_64_bit_device_and_inode_numbers_round_trip(db: StateDB, pair: tuple[Path, Path]) -> None:
    source, dest = pair
    huge = FileStamp(dev=2**64 - 1, ino=2**63 + 5, size=12, mtime_ns=1, ctime_ns=2)
    db.record(source, huge, dest)
    state = db.get(source)
    assert state is not None and state.version == huge
    assert db.is_up_to_date(source, huge, dest)


def test_threads_share_one_database(db: StateDB, tmp_path: Path) -> None:
    dest = tmp_path / "out"
    dest.write_bytes(b"")
    errors: list[BaseException] = []

    def work(worker: int) -> None:
        try:
            for index in range(50):
                version = FileStamp(worker, index, index, index, index)
                db.record(f"/src/{worker}/{index}", version, dest)
                assert db.is_up_to_date(f"/src/{worker}/{index}", version, dest)
        except BaseException as exc:  # handed to the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(worker,)) for worker in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert all(db.get(f"/src/{w}/{i}") is not None for w in range(4) for i in range(50))


def test_corrupt_database_is_moved_aside_and_replaced(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    garbage = b"this is not an sqlite database at all" * 200
    (state_dir / DB_NAME).write_bytes(garbage)
    with caplog.at_level(logging.WARNING, logger="syncd.state"), StateDB(state_dir) as db:
        assert db.get("/anything") is None
        db.record_failure("/anything", FileStamp(1, 2, 3, 4, 5), "written to the new database", transient=False)
        assert db.get("/anything") is not None
    aside = [p for p in state_dir.iterdir() if p.name.startswith(f"{DB_NAME}.corrupt-")]
    assert len(aside) == 1 and aside[0].read_bytes() == garbage
    assert "unusable" in caplog.text and str(aside[0]) in caplog.text


def test_damaged_pages_are_detected_and_the_database_replaced(tmp_path: Path, pair: tuple[Path, Path]) -> None:
    source, dest = pair
    state_dir = tmp_path / "state"
    with StateDB(state_dir) as db:
        for index in range(300):
            db.record(f"/src/{index:04d}/" + "x" * 100, FileStamp.of_path(source), dest)
    path = state_dir / DB_NAME
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    data = bytearray(path.read_bytes())
    page_size = int.from_bytes(data[16:18], "big")
    for offset in range(page_size * 2, len(data), page_size):  # scribble over every page but the header's
        data[offset : offset + 64] = b"\xa5" * 64
    path.write_bytes(bytes(data))
    with StateDB(state_dir) as db:
        assert db.get(f"/src/0001/{'x' * 100}") is None
        db.record(source, FileStamp.of_path(source), dest)
        assert db.is_up_to_date(source, FileStamp.of_path(source), dest)
    assert any(p.name.startswith(f"{DB_NAME}.corrupt-") for p in state_dir.iterdir())


def test_database_from_a_newer_syncd_is_moved_aside(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    with sqlite3.connect(state_dir / DB_NAME) as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with StateDB(state_dir) as db:
        assert db.get("/x") is None
    aside = [p for p in state_dir.iterdir() if ".corrupt-" in p.name]
    assert len(aside) == 1
    with sqlite3.connect(aside[0]) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION + 1
