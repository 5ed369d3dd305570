"""What the daemon has done, kept across restarts: a small sqlite database in `state_dir/state.sqlite3`.

For each source path it remembers the version it last handled (a FileStamp: device, inode, size, mtime,
ctime), the output it published and that output's version, the outcome, and for failures the error, so a
file that keeps failing is reported once per version instead of on every event. (The `sha256` columns of the
first schema were never filled; they stay so that existing databases need no migration.)

Paths are stored as bytes (os.fsencode), so names that are not valid UTF-8 round-trip exactly. One
connection serves all threads behind a lock: the statements are tiny and the daemon's work is elsewhere.
The database is a cache: if it is corrupt (or from a newer syncd) it is moved aside and a fresh one started,
with a warning. Outputs are then re-checked against their sources: one that is no longer the conversion of its
source as it is now is no longer provably syncd's, unless a claim's record proves it (docs/daemon.md).
"""

from __future__ import annotations

import fcntl
import logging
import os
import sqlite3
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

from syncd.daemon.synclog import utc_timestamp
from syncd.errors import SyncdError
from syncd.formats.fileio import FileStamp

log = logging.getLogger("syncd.state")

DB_NAME = "state.sqlite3"
SCHEMA_VERSION = 4
LOCK_NAME = "lock"
SUCCESS_STATUSES = ("converted", "in_sync")
RECHECK = "recheck"  # a failure a reload looks at again: logged again only if its reason changed

# one list of statements per version: MIGRATIONS[n] takes a database from version n to n + 1
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """
        CREATE TABLE sources (
            source        BLOB PRIMARY KEY,
            dev           INTEGER NOT NULL,
            ino           INTEGER NOT NULL,
            size          INTEGER NOT NULL,
            mtime_ns      INTEGER NOT NULL,
            sha256        TEXT,
            status        TEXT NOT NULL,
            dest          BLOB,
            dest_dev      INTEGER,
            dest_ino      INTEGER,
            dest_size     INTEGER,
            dest_mtime_ns INTEGER,
            dest_sha256   TEXT,
            error         TEXT,
            transient     INTEGER NOT NULL DEFAULT 0,
            attempts      INTEGER NOT NULL DEFAULT 0,
            updated       TEXT NOT NULL
        )
        """,
        "CREATE INDEX sources_by_dest ON sources (dest)",
    ),
    (
        # ctime: the kernel changes it on every write, even when mtime is set back
        "ALTER TABLE sources ADD COLUMN ctime_ns INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE sources ADD COLUMN dest_ctime_ns INTEGER",
        # the declared kind of a failure (syncd/errors.py): config failures are looked at again after a reload
        "ALTER TABLE sources ADD COLUMN kind TEXT",
    ),
    (
        # an output about to be put in place, recorded before it is (see StateDB.record_placing)
        """
        CREATE TABLE placing (
            dest         BLOB PRIMARY KEY,
            source       BLOB NOT NULL,
            dev          INTEGER NOT NULL,
            ino          INTEGER NOT NULL,
            size         INTEGER NOT NULL,
            mtime_ns     INTEGER NOT NULL,
            ctime_ns     INTEGER NOT NULL,
            out_dev      INTEGER NOT NULL,
            out_ino      INTEGER NOT NULL,
            out_size     INTEGER NOT NULL,
            out_mtime_ns INTEGER NOT NULL,
            out_ctime_ns INTEGER NOT NULL,
            updated      TEXT NOT NULL
        )
        """,
    ),
    (
        # every file of a sharded set published as one output (the index included), with its identity
        """
        CREATE TABLE members (
            member   BLOB PRIMARY KEY,
            dest     BLOB NOT NULL,
            dev      INTEGER NOT NULL,
            ino      INTEGER NOT NULL,
            size     INTEGER NOT NULL,
            mtime_ns INTEGER NOT NULL,
            ctime_ns INTEGER NOT NULL
        )
        """,
        "CREATE INDEX members_by_dest ON members (dest)",
    ),
)
assert len(MIGRATIONS) == SCHEMA_VERSION

PathArg = str | bytes | os.PathLike[str] | os.PathLike[bytes]
T = TypeVar("T")


def _key(path: PathArg) -> bytes:
    return os.fsencode(path)


def _to_sqlite(number: int) -> int:
    # st_dev and st_ino are unsigned 64-bit; sqlite integers are signed
    return number - (1 << 64) if number >= (1 << 63) else number


def _from_sqlite(number: int) -> int:
    return number + (1 << 64) if number < 0 else number


@dataclass(frozen=True)
class SourceState:
    """The stored row for one source."""

    source: str
    version: FileStamp
    status: str  # converted | in_sync | failed
    dest: str | None
    dest_version: FileStamp | None
    error: str | None
    transient: bool
    attempts: int  # consecutive failures of this version
    updated: datetime
    kind: str | None = None  # of a failure: input | config | environment | busy (syncd/errors.py)


@dataclass(frozen=True)
class Placing:
    """An output recorded right before it was put in place: the source version it is the conversion of,
    and the finished file's identity (its ctime aside: linking or renaming the file into place changes it)."""

    source: str
    version: FileStamp
    output: FileStamp


_MEMBER_SQL = (
    "INSERT OR REPLACE INTO members (member, dest, dev, ino, size, mtime_ns, ctime_ns) "
    "VALUES (:member, :dest, :dev, :ino, :size, :mtime_ns, :ctime_ns)"
)


class StateDB:
    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(state_dir)
        self.path = self.dir / DB_NAME
        self._lock = threading.Lock()
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._conn = self._open_or_recover()

    # -------------------------------------------------------------------------------------- queries

    def get(self, source: PathArg) -> SourceState | None:
        row = self._run(lambda db: db.execute("SELECT * FROM sources WHERE source = ?", (_key(source),)).fetchone())
        return None if row is None else _row_to_state(row)

    def is_up_to_date(self, source: PathArg, version: FileStamp, dest: PathArg) -> bool:
        """True if this version of `source` was converted to `dest` and `dest` is still what was published."""
        state = self.get(source)
        if state is None or state.status not in SUCCESS_STATUSES or state.version.changed(version):
            return False
        if state.dest is None or _key(state.dest) != _key(dest):
            return False
        try:
            current_dest = FileStamp.of_path(dest)
        except FileNotFoundError:
            return False
        return state.dest_version is None or not state.dest_version.changed(current_dest)

    def is_own_output(self, path: PathArg, version: FileStamp) -> bool:
        """True if `path`, as it is now, is an output this daemon published (so not a new source)."""
        rows = self._run(lambda db: db.execute("SELECT * FROM sources WHERE dest = ?", (_key(path),)).fetchall())
        versions = [state.dest_version for state in map(_row_to_state, rows)]
        return any(ours is not None and not ours.changed(version) for ours in versions)

    def failed_same_version(self, source: PathArg, version: FileStamp) -> bool:
        """True if this exact version already failed for a reason retrying will not fix."""
        state = self.get(source)
        if state is None or state.status != "failed" or state.transient:
            return False
        return not state.version.changed(version)

    def placing(self, dest: PathArg) -> Placing | None:
        """The output last recorded as about to be put in place at `dest` and not recorded as published since
        (the daemon was killed in between), if any."""
        row = self._run(lambda db: db.execute("SELECT * FROM placing WHERE dest = ?", (_key(dest),)).fetchone())
        return None if row is None else _placing(row)

    def placed_from(self, source: PathArg) -> dict[str, Placing]:
        """Every output recorded as about to be put in place from `source` and not recorded as published
        since, by the path it was to take."""
        rows = self._run(lambda db: db.execute("SELECT * FROM placing WHERE source = ?", (_key(source),)).fetchall())
        return {os.fsdecode(row["dest"]): _placing(row) for row in rows}

    def members(self, dest: PathArg) -> dict[str, FileStamp]:
        """Every file of the set last recorded as published at `dest` (its index), with its identity then;
        empty for a single-file output."""
        rows = self._run(lambda db: db.execute("SELECT * FROM members WHERE dest = ?", (_key(dest),)).fetchall())
        found = {os.fsdecode(row["member"]): _row_version(row, "") for row in rows}
        return {member: version for member, version in found.items() if version is not None}

    # -------------------------------------------------------------------------------------- updates

    def record_placing(self, source: PathArg, version: FileStamp, dest: PathArg, output: FileStamp) -> None:
        """Remember, before it is put in place, the finished output of `source` at `version` about to become
        `dest`. A daemon killed after placing it and before `record` would otherwise leave an output no
        record proves its own; this one does (`record` forgets it)."""
        values = {
            **_version_columns("", version),
            **_version_columns("out_", output),
            "dest": _key(dest),
            "source": _key(source),
            "updated": utc_timestamp(),
        }
        columns = ", ".join(values)
        placeholders = ", ".join(f":{name}" for name in values)
        sql = f"INSERT OR REPLACE INTO placing ({columns}) VALUES ({placeholders})"
        self._run(lambda db: db.execute(sql, values))

    def record(
        self,
        source: PathArg,
        version: FileStamp,
        dest: PathArg,
        *,
        dest_version: FileStamp | None = None,
        status: str = "converted",
        members: Mapping[Path, FileStamp] | None = None,
    ) -> None:
        """Remember a success: `source` at `version` is published as `dest` (whose version is stat'ed now
        unless given); `members`: a set's files (its index included) as published, which replace those
        recorded for `dest` before."""
        if status not in SUCCESS_STATUSES:
            raise ValueError(f"record() is for {', '.join(SUCCESS_STATUSES)}; use record_failure() for failures")
        if dest_version is None:
            dest_version = FileStamp.of_path(dest)
        values = {
            **_version_columns("", version),
            **_version_columns("dest_", dest_version),
            "source": _key(source),
            "status": status,
            "dest": _key(dest),
            "error": None,
            "transient": 0,
            "kind": None,
            "attempts": 0,
            "updated": utc_timestamp(),
        }
        self._upsert(values, placed=_key(dest), members={_key(m): stamp for m, stamp in (members or {}).items()})

    def record_failure(
        self, source: PathArg, version: FileStamp, error: str, *, transient: bool, kind: str | None = None
    ) -> bool:
        """Remember a failure; True if it is the first for this version of `source` (so worth logging). A
        version that differs only in its ctime (a chmod, a chown) and fails with the same error is not new.

        A transient failure (file busy, disk full) is retried on the next event; a permanent one is not
        retried until the file changes (see failed_same_version).
        """
        previous = self.get(source)
        repeated = (
            previous is not None
            and (previous.status == "failed" or previous.status == RECHECK and previous.error == error)
            # the same version, or only its attributes changed (a chmod that did not help) and it failed alike
            and (
                not previous.version.changed(version)
                or (_same_but_ctime(previous.version, version) and previous.error == error)
            )
        )
        # the output last published from this source stays known as ours: a later save replaces it
        values = {
            **_version_columns("", version),
            **_version_columns("dest_", previous.dest_version if previous else None),
            "source": _key(source),
            "status": "failed",
            "dest": _key(previous.dest) if previous and previous.dest is not None else None,
            "error": error,
            "transient": int(transient),
            "kind": kind,
            "attempts": (previous.attempts + 1) if repeated and previous is not None else 1,
            "updated": utc_timestamp(),
        }
        self._upsert(values)
        return not repeated

    def retry_failures(
        self, sources: Sequence[PathArg] | None = None, *, kind: str | None = None, recheck: bool = False
    ) -> list[str]:
        """Make failures retryable (all, those of `sources`, or those of one `kind`); returns their paths.

        Their status becomes "retry": the next look is a first look (a failure that repeats is logged again,
        which is what asking again means). `recheck` (a reload looking again at what a setting decided): a
        failure that repeats with the same reason is not new, and not logged again at every reload.
        """
        where = "status = 'failed' AND transient = 0"
        params: list[str | bytes] = []
        if kind is not None:
            where += " AND kind = ?"
            params.append(kind)
        if sources is not None:
            where += f" AND source IN ({', '.join('?' for _ in sources)})"
            params += [_key(source) for source in sources]

        def mark(db: sqlite3.Connection) -> list[str]:
            rows = db.execute(f"SELECT source FROM sources WHERE {where}", params).fetchall()
            status = RECHECK if recheck else "retry"
            db.execute(f"UPDATE sources SET status = ?, attempts = 0 WHERE {where}", [status, *params])
            return [os.fsdecode(row[0]) for row in rows]

        return self._run(mark)

    def failed_with(self, error: str) -> list[str]:
        """The sources whose last look failed with exactly `error`."""
        sql = "SELECT source FROM sources WHERE status = 'failed' AND error = ?"
        return self._run(lambda db: [os.fsdecode(row[0]) for row in db.execute(sql, (error,)).fetchall()])

    def adopt_output(
        self,
        source: PathArg,
        dest: PathArg,
        dest_version: FileStamp,
        members: Mapping[Path, FileStamp] | None = None,
    ) -> bool:
        """Record `dest`, as it is now (`dest_version`; a set: its index, and `members`, every file of it), as
        the output this daemon published from `source`, whose failure is made retryable; True if `source` had
        failed. For `syncd retry --adopt`: after a lost state, the operator vouches for them (daemon/retry.py)."""
        values = {**_version_columns("dest_", dest_version), "dest": _key(dest), "source": _key(source)}
        assignments = ", ".join(f"{name} = :{name}" for name in values if name != "source")
        sql = f"UPDATE sources SET {assignments}, status = 'retry', attempts = 0 WHERE source = :source"

        def adopt(db: sqlite3.Connection) -> bool:
            if db.execute(sql + " AND status = 'failed'", values).rowcount != 1:
                return False
            if members is not None:
                db.execute("DELETE FROM members WHERE dest = ?", (values["dest"],))
                for member, stamp in members.items():
                    db.execute(
                        _MEMBER_SQL, {"member": _key(member), "dest": values["dest"], **_version_columns("", stamp)}
                    )
            return True

        return self._run(adopt)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> StateDB:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -------------------------------------------------------------------------------------- plumbing

    def _upsert(
        self, values: dict[str, object], placed: bytes | None = None, members: dict[bytes, FileStamp] | None = None
    ) -> None:
        """Write one source's row; `placed`: a destination now recorded as published, whose records of
        placing (its set's files' too) are forgotten, and its set's `members` recorded, in the same
        transaction."""
        columns = ", ".join(values)
        placeholders = ", ".join(f":{name}" for name in values)
        sql = f"INSERT OR REPLACE INTO sources ({columns}) VALUES ({placeholders})"

        def write(db: sqlite3.Connection) -> None:
            db.execute(sql, values)
            if placed is None:
                return
            db.execute("DELETE FROM placing WHERE dest = ?", (placed,))
            db.execute("DELETE FROM members WHERE dest = ?", (placed,))
            for member, stamp in (members or {}).items():
                db.execute("DELETE FROM placing WHERE dest = ?", (member,))
                db.execute(_MEMBER_SQL, {"member": member, "dest": placed, **_version_columns("", stamp)})

        self._run(write)

    def _run(self, operation: Callable[[sqlite3.Connection], T]) -> T:
        """Runs `operation` in a transaction; on corruption found mid-run, starts a fresh db and retries once."""
        with self._lock:
            try:
                with self._conn:
                    return operation(self._conn)
            except sqlite3.DatabaseError as exc:
                if not _is_corruption(exc):
                    # full, read-only or failing disk, locked by someone else: the machine's fault, not the
                    # database's; the caller logs it and retries later
                    raise SyncdError(
                        f"state database: {exc}", str(self.path), kind="environment", transient=True
                    ) from exc
                self._conn.close()
                self._move_aside(str(exc))
                self._conn = self._open_checked()
                with self._conn:
                    return operation(self._conn)

    def _open_or_recover(self) -> sqlite3.Connection:
        try:
            return self._open_checked()
        except sqlite3.DatabaseError as exc:
            if not _is_corruption(exc):
                raise
            self._move_aside(str(exc))
        except _NewerSchema as exc:
            self._move_aside(str(exc))
        return self._open_checked()

    def _open_checked(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        try:
            conn.execute("PRAGMA busy_timeout = 5000")
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")  # WAL keeps it consistent; a crash loses a last record
            result = conn.execute("PRAGMA quick_check").fetchone()
            if result is None or result[0] != "ok":
                raise sqlite3.DatabaseError(f"quick_check: {result[0] if result else 'no answer'}")
            _migrate(conn)
        except BaseException:
            conn.close()
            raise
        conn.row_factory = sqlite3.Row
        conn.isolation_level = "DEFERRED"  # `with conn:` then wraps each operation in a transaction
        return conn

    def _move_aside(self, reason: str) -> None:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
        aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        for suffix in ("", "-wal", "-shm"):
            companion = Path(f"{self.path}{suffix}")
            if companion.exists():
                os.replace(companion, f"{aside}{suffix}")
        log.warning(
            "state database %s is unusable (%s); moved it to %s and started a fresh one", self.path, reason, aside
        )


def lock_state_dir(state_dir: Path) -> int:
    """Take the state directory for this daemon: an flock on `state_dir/lock` held until the process ends
    (the kernel drops it when the process dies, however it dies), holding our PID for the message a second
    daemon prints. Returns the lock's descriptor; raises SyncdError naming the holder's PID."""
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = state_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        raise SyncdError(
            f"another syncd (pid {holder}) is running on this state directory; one daemon per state directory",
            str(state_dir),
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
    return fd


def lock_holder(state_dir: Path) -> int | None:
    """The PID of the daemon holding `state_dir`, or None when none does."""
    try:
        fd = os.open(state_dir / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        return int(text) if text.isdigit() else None
    else:
        return None
    finally:
        os.close(fd)


class _NewerSchema(Exception):
    pass


_SQLITE_CORRUPT = 11
_SQLITE_NOTADB = 26


def _is_corruption(exc: sqlite3.DatabaseError) -> bool:
    """The file is damaged or not a database, as opposed to locked, full or read-only (not its fault)."""
    code = getattr(exc, "sqlite_errorcode", None)  # Python 3.11+
    if code is not None:
        return code & 0xFF in (_SQLITE_CORRUPT, _SQLITE_NOTADB)
    return type(exc) is sqlite3.DatabaseError


def _migrate(conn: sqlite3.Connection) -> None:
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise _NewerSchema(f"schema version {version} is newer than this syncd's {SCHEMA_VERSION}")
    for target in range(version, SCHEMA_VERSION):
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in MIGRATIONS[target]:
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {target + 1}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise


def _version_columns(prefix: str, version: FileStamp | None) -> dict[str, object]:
    if version is None:
        return {f"{prefix}{name}": None for name in ("dev", "ino", "size", "mtime_ns", "ctime_ns")}
    return {
        f"{prefix}dev": _to_sqlite(version.dev),
        f"{prefix}ino": _to_sqlite(version.ino),
        f"{prefix}size": version.size,
        f"{prefix}mtime_ns": version.mtime_ns,
        f"{prefix}ctime_ns": version.ctime_ns,
    }


def _row_version(row: sqlite3.Row, prefix: str) -> FileStamp | None:
    if row[f"{prefix}dev"] is None:
        return None
    return FileStamp(
        dev=_from_sqlite(row[f"{prefix}dev"]),
        ino=_from_sqlite(row[f"{prefix}ino"]),
        size=row[f"{prefix}size"],
        mtime_ns=row[f"{prefix}mtime_ns"],
        ctime_ns=row[f"{prefix}ctime_ns"] or 0,
    )


def _placing(row: sqlite3.Row) -> Placing:
    version, output = _row_version(row, ""), _row_version(row, "out_")
    assert version is not None and output is not None
    return Placing(os.fsdecode(row["source"]), version, output)


def _row_to_state(row: sqlite3.Row) -> SourceState:
    version = _row_version(row, "")
    assert version is not None
    return SourceState(
        source=os.fsdecode(row["source"]),
        version=version,
        status=row["status"],
        dest=None if row["dest"] is None else os.fsdecode(row["dest"]),
        dest_version=_row_version(row, "dest_"),
        error=row["error"],
        transient=bool(row["transient"]),
        attempts=row["attempts"],
        updated=datetime.fromisoformat(row["updated"].replace("Z", "+00:00")),
        kind=row["kind"],
    )


def _same_but_ctime(a: FileStamp, b: FileStamp) -> bool:
    return (a.dev, a.ino, a.size, a.mtime_ns) == (b.dev, b.ino, b.size, b.mtime_ns)
