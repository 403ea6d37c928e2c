"""SQLite through the standard library's sqlite3: the writer's statements and the relay's store.

SQLite has one writer at a time, and a row's id is taken inside the write transaction, so rows
commit in id order there. One relay works a SQLite outbox at a time: it holds an exclusive
``flock`` on ``<database>.relay.lock``, which dies with its process; a second relay waits for it
(a standby). The relay notices commits through ``PRAGMA data_version`` (which changes when
another connection commits), checked every few milliseconds without reading the table, and at
once for rows added in its own process.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from reliable_amqp._core.errors import ConfigurationError
from reliable_amqp.outbox._adapters import marks
from reliable_amqp.outbox._rows import PendingRow, RowValues
from reliable_amqp.outbox._schema import (
    PARTITIONS,
    READ_COLUMNS,
    WRITE_COLUMNS,
    Tables,
    sqlite_ddl,
)
from reliable_amqp.outbox._status import RelayInfo

#: how often an idle relay looks at PRAGMA data_version
_WATCH_INTERVAL = 0.002
#: how long a relay's statement waits for a writer's lock before it retries later
BUSY_TIMEOUT = 5.0

# Rows added in this process wake this process's relays at once (set by Outbox.add).
_local_wakeups: set[threading.Event] = set()
_local_lock = threading.Lock()


def wake_local() -> None:
    """A row was added in this process: its relays look now (it commits soon)."""
    for event in list(_local_wakeups):
        event.set()


@functools.lru_cache(maxsize=64)
def insert_sql(tables: Tables) -> str:
    marks = ", ".join(["?"] * len(WRITE_COLUMNS))
    return f"INSERT INTO {tables.name} ({', '.join(WRITE_COLUMNS)}) VALUES ({marks})"


def check_writable(conn: sqlite3.Connection, what: str = "add()") -> None:
    """Refuse a connection whose write would commit on its own (autocommit, no transaction)."""
    autocommit = getattr(conn, "autocommit", None)  # Python 3.12+
    in_txn = conn.in_transaction
    if not in_txn and (
        autocommit is True or (autocommit is not False and conn.isolation_level is None)
    ):
        raise ConfigurationError(
            f"{what}: this sqlite3 connection is in autocommit mode with no transaction open, so "
            "the row would commit on its own, not with your transaction: run BEGIN first, or "
            "use a connection with the default isolation_level"
        )


class _Writer:
    """``sqlite3.Connection``: ``executemany`` in the caller's transaction; wakes this
    process's relays."""

    def dialect(self, conn: sqlite3.Connection) -> str:
        return "sqlite"

    def run(
        self,
        conn: sqlite3.Connection,
        sql: str,
        params: Sequence[Any] = (),
        check: str | None = None,
    ) -> int:
        if check:
            check_writable(conn, check)
        return conn.execute(marks(sql, "qmark"), tuple(params)).rowcount

    def fetch(
        self, conn: sqlite3.Connection, sql: str, params: Sequence[Any] = ()
    ) -> list[tuple[Any, ...]]:
        return conn.execute(marks(sql, "qmark"), tuple(params)).fetchall()

    def in_transaction(self, conn: sqlite3.Connection) -> bool:
        return conn.in_transaction

    @contextlib.contextmanager
    def transaction(self, conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
        if getattr(conn, "autocommit", None) is False:  # Python 3.12+: always in a transaction
            try:
                yield conn
            except BaseException:
                conn.rollback()
                raise
            conn.commit()
            return
        # IMMEDIATE: take the write lock now (waiting up to the busy timeout), rather than
        # failing at the first write of a block that read first while another writer committed
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def install(self, conn: sqlite3.Connection, tables: Tables) -> None:
        install(conn, tables)

    def write(
        self, conn: sqlite3.Connection, tables: Tables, rows: Sequence[RowValues], notify: bool
    ) -> None:
        check_writable(conn)
        conn.executemany(insert_sql(tables), rows)
        if notify:
            wake_local()


def sync_writer(conn: object) -> _Writer | None:
    """The writer for a ``sqlite3.Connection`` (None for anything else)."""
    return _Writer() if isinstance(conn, sqlite3.Connection) else None


def install(conn: sqlite3.Connection, tables: Tables) -> None:
    for statement in sqlite_ddl(tables):
        conn.execute(statement)


def check_tables(conn: sqlite3.Connection, tables: Tables) -> None:
    """Raise :class:`~reliable_amqp.ConfigurationError` unless the outbox's tables exist."""
    found = {
        row[0]
        for row in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name IN (?, ?)",
            (tables.name, tables.failed),
        )
    }
    if len(found) < 2:
        raise ConfigurationError(
            f"no outbox table {tables.name} (or {tables.failed}) in this database: create it "
            "with `reliable-amqp outbox init --db DSN` or Outbox().install(conn)"
        )


def path_of(dsn: str) -> str:
    """The file of a ``sqlite:///relative/path`` or ``sqlite:////absolute/path`` DSN."""
    path = dsn[len("sqlite:///") :]
    if not path or path == ":memory:":
        raise ConfigurationError(
            f"--db {dsn!r}: a relay needs a database file (sqlite:///path/to/file.db)"
        )
    return path


def connect(path: str) -> sqlite3.Connection:
    # isolation_level=None: each statement commits on its own unless BEGIN opened a transaction
    # (the journal mode is the application's choice: WAL lets the relay read while it writes)
    return sqlite3.connect(
        path, timeout=BUSY_TIMEOUT, isolation_level=None, check_same_thread=False
    )


class SqliteRelayStore:
    """A relay's access to a SQLite outbox."""

    dialect = "sqlite"

    def __init__(self, path: str, tables: Tables, name: str) -> None:
        self.path = path
        self.tables = tables
        self.name = name
        self._conn: sqlite3.Connection | None = None
        self._lock_fd: int | None = None
        self._watch: threading.Thread | None = None
        self._closing = False
        self._wake: threading.Event | None = None

    @property
    def lock_path(self) -> str:
        return self.path + ".relay.lock"

    def connect(self) -> None:
        if not os.path.exists(self.path):
            raise ConfigurationError(f"no SQLite database at {self.path!r}")
        self._conn = connect(self.path)
        check_tables(self._conn, self.tables)

    @property
    def connected(self) -> bool:
        return self._conn is not None

    def close(self) -> None:
        self._closing = True
        if self._wake is not None:
            with _local_lock:
                _local_wakeups.discard(self._wake)
        self.unlock(list(range(PARTITIONS)))
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._watch is not None and self._watch is not threading.current_thread():
            self._watch.join(2)

    def drop(self) -> None:
        """Close the connection after an error (a writer holding the lock past the busy
        timeout); the relay's file lock and its watcher stay."""
        if self._conn is not None:
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()
            self._conn = None

    def start_wakeups(self, wake: threading.Event) -> None:
        self._closing = False
        self._wake = wake
        with _local_lock:
            _local_wakeups.add(wake)

        def watch() -> None:
            conn = connect(self.path)
            try:
                last = None
                while not self._closing:
                    version = conn.execute("PRAGMA data_version").fetchone()[0]
                    if version != last:
                        last = version
                        wake.set()
                    time.sleep(_WATCH_INTERVAL)
            except sqlite3.Error:
                wake.set()
            finally:
                conn.close()

        self._watch = threading.Thread(target=watch, name="reliable-amqp-outbox-watch", daemon=True)
        self._watch.start()

    # --- ownership: all or nothing, through one file lock ---------------------------------------

    def relays(self) -> int:
        return 1  # a standby does not count: it owns nothing until the lock is free

    def try_lock(self, parts: Sequence[int], want: int) -> list[int]:
        if self._lock_fd is None:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                return []
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()} {self.name} {time.time():.3f}\n".encode())
            self._lock_fd = fd
        return list(parts)  # one relay owns every partition

    def unlock(self, parts: Sequence[int]) -> None:
        if self._lock_fd is not None and len(parts) > 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    # --- rows ---------------------------------------------------------------------------------

    def _c(self) -> sqlite3.Connection:
        if self._conn is None:
            raise sqlite3.OperationalError("not connected")
        return self._conn

    def read(
        self, after: int, parts: Sequence[int] | None, skip: Sequence[int], limit: int
    ) -> list[PendingRow]:
        where = "id > ?"
        params: list[Any] = [after]
        if skip:
            where += f" AND id NOT IN ({', '.join('?' * len(skip))})"
            params.extend(skip)
        params.append(limit)
        rows = (
            self._c()
            .execute(
                f"SELECT {', '.join(READ_COLUMNS)} FROM {self.tables.name} WHERE {where}"
                " ORDER BY id LIMIT ?",
                params,
            )
            .fetchall()
        )
        return [PendingRow.of(r) for r in rows]

    def delete(self, ids: Sequence[int]) -> None:
        conn = self._c()
        conn.execute("BEGIN IMMEDIATE")
        try:
            for start in range(0, len(ids), 500):
                chunk = ids[start : start + 500]
                conn.execute(
                    f"DELETE FROM {self.tables.name} WHERE id IN ({', '.join('?' * len(chunk))})",
                    chunk,
                )
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def fail(self, failures: Sequence[tuple[int, int, str]]) -> None:
        conn = self._c()
        cols = ", ".join(READ_COLUMNS)
        now = time.time()
        conn.execute("BEGIN IMMEDIATE")
        try:
            for row_id, attempts, reason in failures:
                conn.execute(
                    f"INSERT OR IGNORE INTO {self.tables.failed} ({cols}, failed_at, attempts,"
                    f" reason) SELECT {cols}, ?, ?, ? FROM {self.tables.name} WHERE id = ?",
                    (now, attempts, reason, row_id),
                )
                conn.execute(f"DELETE FROM {self.tables.name} WHERE id = ?", (row_id,))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def any_pending(self) -> bool:
        row = self._c().execute(f"SELECT EXISTS (SELECT 1 FROM {self.tables.name})").fetchone()
        return bool(row[0])

    def backlog(self, cap: int) -> tuple[int, float | None]:
        """(pending rows, counted up to ``cap``; the oldest pending row's created_at)."""
        conn = self._c()
        (count,) = conn.execute(
            f"SELECT count(*) FROM (SELECT 1 FROM {self.tables.name} LIMIT ?)", (cap,)
        ).fetchone()
        row = conn.execute(
            f"SELECT created_at FROM {self.tables.name} ORDER BY id LIMIT 1"
        ).fetchone()
        return int(count), (float(row[0]) if row else None)

    def open_writers(self) -> list[Any]:
        return []  # SQLite cannot tell; a writer holding the lock shows as a busy relay


def lock_holder(path: str) -> RelayInfo | None:
    """The relay holding a SQLite outbox's lock file, if any."""
    lock_path = path + ".relay.lock"
    if not os.path.exists(lock_path):
        return None
    fd = os.open(lock_path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            with open(lock_path, encoding="utf-8", errors="replace") as file:
                text = file.read().split()
            pid = text[0] if text else "?"
            name = text[1] if len(text) > 1 else pid
            started = float(text[2]) if len(text) > 2 else time.time()
            return RelayInfo(
                name=name,
                session=pid,
                host="local",
                up_s=time.time() - started,
                partitions=PARTITIONS,
            )
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def status_rows(
    conn: sqlite3.Connection, tables: Tables, path: str | None
) -> tuple[int, int, float | None, list[RelayInfo]]:
    pending, oldest = conn.execute(
        f"SELECT count(*), min(created_at) FROM {tables.name}"
    ).fetchone()
    (failed,) = conn.execute(f"SELECT count(*) FROM {tables.failed}").fetchone()
    holder = lock_holder(path) if path else None
    return int(pending), int(failed), oldest, [holder] if holder else []
