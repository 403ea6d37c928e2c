"""PostgreSQL through psycopg 3: the writer's statements (on the caller's connection) and the
relay's store (on connections of its own). Moves rows; decides nothing.

The relay's session holds its partition locks (``pg_try_advisory_lock(space, part)``) and a
shared membership lock (``pg_advisory_lock_shared(space, PARTITIONS)``): both die with the
session, so a relay killed -9, or cut off from the database, owns nothing any more, at once.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Sequence
from typing import Any

from reliable_amqp._core.errors import ConfigurationError
from reliable_amqp.outbox._plan import id_ranges
from reliable_amqp.outbox._rows import PendingRow, RowValues
from reliable_amqp.outbox._schema import (
    PARTITIONS,
    READ_COLUMNS,
    WRITE_COLUMNS,
    Tables,
    postgresql_ddl,
)
from reliable_amqp.outbox._status import OpenWriter, RelayInfo

psycopg: Any
try:
    import psycopg
except ImportError:  # pragma: no cover - the outbox extra is missing
    psycopg = None

__all__ = [
    "APPLICATION",
    "PgRelayStore",
    "async_writer",
    "install",
    "open_writers",
    "psycopg",
    "status_rows",
    "sync_writer",
]

#: the application_name relays connect with (status lists the sessions that carry it)
APPLICATION = "reliable-amqp relay"


def require_psycopg() -> Any:
    """The psycopg module, or :class:`~reliable_amqp.ConfigurationError` with the install hint."""
    if psycopg is None:
        raise ConfigurationError(
            "PostgreSQL needs psycopg 3: install the 'outbox' extra "
            "(in a checkout: pip install '.[outbox]')"
        )
    return psycopg


@functools.lru_cache(maxsize=64)
def insert_sql(tables: Tables, notify: bool) -> str:
    """One statement that inserts a row and, with ``notify``, wakes the relays at commit (one
    round trip either way; PostgreSQL folds a transaction's identical notifications into one)."""
    columns = ", ".join(WRITE_COLUMNS)
    marks = ", ".join(["%s"] * len(WRITE_COLUMNS))
    insert = f"INSERT INTO {tables.name} ({columns}) VALUES ({marks})"
    if not notify:
        return insert
    return f"WITH _ AS ({insert}) SELECT pg_notify('{tables.channel}', '')"


#: the PostgreSQL type of each written column, for the arrays of insert_many_sql()
_ARRAY_TYPES = ("text", "text", "smallint", "text", "text", "bytea", "bytea", "text", "text",
                "float8")  # fmt: skip


@functools.lru_cache(maxsize=64)
def insert_many_sql(tables: Tables, notify: bool) -> str:
    """One statement for any number of rows (``add_many()``): one array a column, unnested in
    order. A VALUES list of 1,000 rows is parsed anew each call (10,000 placeholders: most of
    add_many()'s time, measured); this text is the same for every call, and prepared once."""
    columns = ", ".join(WRITE_COLUMNS)
    arrays = ", ".join(f"%s::{kind}[]" for kind in _ARRAY_TYPES)
    names = ", ".join(f"c{i}" for i in range(len(WRITE_COLUMNS)))
    insert = (
        f"INSERT INTO {tables.name} ({columns}) SELECT {names} FROM unnest({arrays})"
        f" WITH ORDINALITY AS u({names}, n) ORDER BY n"
    )
    if not notify:
        return insert
    return f"WITH _ AS ({insert}) SELECT pg_notify('{tables.channel}', '')"


def columns_of(rows: Sequence[RowValues]) -> list[list[Any]]:
    """``rows`` as one list a column (the arrays of :func:`insert_many_sql`)."""
    return [list(column) for column in zip(*rows, strict=True)]


def check_writable(conn: Any, what: str = "add()") -> None:
    """Refuse a psycopg connection whose write would commit on its own: autocommit and no
    transaction open (``with conn.transaction():`` opens one)."""
    pq = require_psycopg().pq
    if conn.closed:
        raise ConfigurationError(f"{what}: the connection is closed")
    if conn.autocommit and conn.info.transaction_status == pq.TransactionStatus.IDLE:
        raise ConfigurationError(
            f"{what}: this psycopg connection is in autocommit mode with no transaction open, so "
            "the row would commit on its own, not with your transaction: write inside "
            "`with conn.transaction():`, or use a connection without autocommit"
        )


def in_transaction(conn: Any) -> bool:
    """Whether a transaction is open on a psycopg connection (sync or async)."""
    return bool(conn.info.transaction_status != require_psycopg().pq.TransactionStatus.IDLE)


class _Statements:
    """What both psycopg writers answer without I/O."""

    def dialect(self, conn: Any) -> str:
        return "postgresql"

    def in_transaction(self, conn: Any) -> bool:
        return in_transaction(conn)

    def transaction(self, conn: Any) -> Any:
        # on a connection without autocommit and idle, psycopg begins and commits this block
        return conn.transaction()


class _Writer(_Statements):
    """psycopg 3 ``Connection``: one statement a row (inserting and notifying), one per 1,000
    rows for ``add_many()``."""

    def run(self, conn: Any, sql: str, params: Sequence[Any] = (), check: str | None = None) -> int:
        if check:
            check_writable(conn, check)
        return int(conn.execute(sql, params or None).rowcount)

    def fetch(self, conn: Any, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return list(conn.execute(sql, params or None).fetchall())

    def install(self, conn: Any, tables: Tables) -> None:
        install(conn, tables)

    def write(self, conn: Any, tables: Tables, rows: Sequence[RowValues], notify: bool) -> None:
        check_writable(conn)
        if len(rows) == 1:
            conn.execute(insert_sql(tables, notify), rows[0], prepare=True)
            return
        for start in range(0, len(rows), 10_000):
            chunk = rows[start : start + 10_000]
            conn.execute(insert_many_sql(tables, notify), columns_of(chunk), prepare=True)


class _AsyncWriter(_Statements):
    """psycopg 3 ``AsyncConnection``: as :class:`_Writer`, awaited."""

    async def run(
        self, conn: Any, sql: str, params: Sequence[Any] = (), check: str | None = None
    ) -> int:
        if check:
            check_writable(conn, check)
        return int((await conn.execute(sql, params or None)).rowcount)

    async def fetch(self, conn: Any, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return list(await (await conn.execute(sql, params or None)).fetchall())

    async def install(self, conn: Any, tables: Tables) -> None:
        for statement in postgresql_ddl(tables):
            await conn.execute(statement)

    async def write(
        self, conn: Any, tables: Tables, rows: Sequence[RowValues], notify: bool
    ) -> None:
        check_writable(conn)
        if len(rows) == 1:
            await conn.execute(insert_sql(tables, notify), rows[0], prepare=True)
            return
        for start in range(0, len(rows), 10_000):
            chunk = rows[start : start + 10_000]
            await conn.execute(insert_many_sql(tables, notify), columns_of(chunk), prepare=True)


def sync_writer(conn: object) -> _Writer | None:
    """The writer for a psycopg ``Connection`` (None for anything else)."""
    if psycopg is not None and isinstance(conn, psycopg.Connection):
        return _Writer()
    return None


def async_writer(conn: object) -> _AsyncWriter | None:
    """The writer for a psycopg ``AsyncConnection`` (None for anything else)."""
    if psycopg is not None and isinstance(conn, psycopg.AsyncConnection):
        return _AsyncWriter()
    return None


class PgRelayStore:
    """A relay's access to the outbox on PostgreSQL: one session that holds its locks, reads and
    deletes, and one that listens for the writers' notifications."""

    dialect = "postgresql"

    def __init__(self, dsn: str, tables: Tables, name: str) -> None:
        self.dsn = dsn
        self.tables = tables
        self.name = name
        self._conn: Any = None
        self._listener: Any = None
        self._listen_thread: threading.Thread | None = None
        self._closing = False

    # --- sessions -----------------------------------------------------------------------------

    def connect(self) -> None:
        """Open the relay's session and join the relays of this outbox."""
        pg = require_psycopg()
        self._conn = pg.connect(
            self.dsn, autocommit=True, application_name=f"{APPLICATION} {self.name}"[:63]
        )
        check_tables(self._conn, self.tables)
        self._conn.execute(
            "SELECT pg_advisory_lock_shared(%s, %s)", (self.tables.lock_space, PARTITIONS)
        )

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.closed

    def close(self) -> None:
        """Close both sessions (every lock goes with them)."""
        self._closing = True
        for conn in (self._conn, self._listener):
            if conn is not None:
                try:  # noqa: SIM105
                    conn.close()
                except Exception:  # closing what may be broken already
                    pass
        self._conn = None
        thread = self._listen_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5)

    def drop(self) -> None:
        """Forget a session that failed (its locks are gone with it)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def start_wakeups(self, wake: threading.Event) -> None:
        """LISTEN on the outbox's channel in a thread; each notification sets ``wake``. Lost
        notifications only cost latency: the relay also reads every ``poll_interval``."""
        self._closing = False

        def listen() -> None:
            pg = require_psycopg()
            while not self._closing:
                try:
                    conn = pg.connect(
                        self.dsn,
                        autocommit=True,
                        application_name=f"{APPLICATION} {self.name} listener"[:63],
                    )
                except Exception:
                    if self._closing:
                        return
                    time.sleep(0.5)
                    continue
                self._listener = conn
                try:
                    conn.execute(f'LISTEN "{self.tables.channel}"')
                    wake.set()  # what was notified while nobody listened
                    for _ in conn.notifies():
                        wake.set()
                        if self._closing:
                            break
                except Exception:
                    pass
                finally:
                    with contextlib.suppress(Exception):
                        conn.close()
                if not self._closing:
                    time.sleep(0.2)

        self._listen_thread = threading.Thread(
            target=listen, name="reliable-amqp-outbox-listen", daemon=True
        )
        self._listen_thread.start()

    # --- ownership ----------------------------------------------------------------------------

    def relays(self) -> int:
        """How many relays of this outbox are alive (sessions holding the membership lock)."""
        row = self._conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            " AND classid = %s AND objid = %s AND objsubid = 2",
            (self.tables.lock_space, PARTITIONS),
        ).fetchone()
        return int(row[0])

    def try_lock(self, parts: Sequence[int], want: int) -> list[int]:
        """Lock up to ``want`` of ``parts`` (in order); the ones locked."""
        got: list[int] = []
        for part in parts:
            if len(got) >= want:
                break
            row = self._conn.execute(
                "SELECT pg_try_advisory_lock(%s, %s)", (self.tables.lock_space, part)
            ).fetchone()
            if row[0]:
                got.append(part)
        return got

    def unlock(self, parts: Sequence[int]) -> None:
        for part in parts:
            self._conn.execute("SELECT pg_advisory_unlock(%s, %s)", (self.tables.lock_space, part))

    # --- rows ---------------------------------------------------------------------------------

    def read(
        self, after: int, parts: Sequence[int] | None, skip: Sequence[int], limit: int
    ) -> list[PendingRow]:
        """Pending rows with ids above ``after`` in ``parts`` (None: all), but ``skip``, by id."""
        where = ["id > %s"]
        params: list[Any] = [after]
        if parts is not None:
            where.append("part = ANY(%s)")
            params.append(list(parts))
        if skip:
            # runs of consecutive ids, not the ids: "= ANY" of the window's thousands of ids
            # searches the array once a row (150-200 ms a read measured at 5,000)
            where.append(
                "NOT EXISTS (SELECT 1 FROM unnest(%s::bigint[], %s::bigint[]) AS r(lo, hi)"
                " WHERE id BETWEEN r.lo AND r.hi)"
            )
            params.extend(id_ranges(skip))
        params.append(limit)
        rows = self._conn.execute(
            f"SELECT {', '.join(READ_COLUMNS)} FROM {self.tables.name}"
            f" WHERE {' AND '.join(where)} ORDER BY id LIMIT %s",
            params,
            prepare=True,
        ).fetchall()
        return [PendingRow.of(r) for r in rows]

    def delete(self, ids: Sequence[int]) -> None:
        self._conn.execute(
            f"DELETE FROM {self.tables.name} WHERE id = ANY(%s)", (list(ids),), prepare=True
        )

    def fail(self, failures: Sequence[tuple[int, int, str]]) -> None:
        """Move rows to the failed table: (id, attempts, reason) each, in one transaction."""
        now = time.time()
        cols = ", ".join(READ_COLUMNS)
        with self._conn.transaction():
            for row_id, attempts, reason in failures:
                self._conn.execute(
                    f"INSERT INTO {self.tables.failed} ({cols}, failed_at, attempts, reason)"
                    f" SELECT {cols}, %s, %s, %s FROM {self.tables.name} WHERE id = %s"
                    " ON CONFLICT (id) DO NOTHING",
                    (now, attempts, reason, row_id),
                )
                self._conn.execute(f"DELETE FROM {self.tables.name} WHERE id = %s", (row_id,))

    def any_pending(self) -> bool:
        row = self._conn.execute(f"SELECT EXISTS (SELECT 1 FROM {self.tables.name})").fetchone()
        return bool(row[0])

    def backlog(self, cap: int) -> tuple[int, float | None]:
        """(pending rows, counted up to ``cap``; the oldest pending row's created_at)."""
        return backlog(self._conn, self.tables, cap)

    def open_writers(self) -> list[OpenWriter]:
        """Other sessions in a transaction that has written to the outbox and not ended: rows
        the relay cannot see yet (they hold a RowExclusiveLock on the table until they end)."""
        return open_writers(self._conn, self.tables)


def backlog(conn: Any, tables: Tables, cap: int) -> tuple[int, float | None]:
    """Pending rows counted up to ``cap`` (a capped count stays cheap on a huge backlog) and
    the created_at of the lowest id (the oldest row, through the primary key)."""
    (count,) = conn.execute(
        f"SELECT count(*) FROM (SELECT 1 FROM {tables.name} LIMIT %s) AS pending", (cap,)
    ).fetchone()
    row = conn.execute(f"SELECT created_at FROM {tables.name} ORDER BY id LIMIT 1").fetchone()
    return int(count), (float(row[0]) if row else None)


def open_writers(conn: Any, tables: Tables) -> list[OpenWriter]:
    rows = conn.execute(
        "SELECT a.pid, extract(epoch FROM clock_timestamp() - a.xact_start),"
        " coalesce(a.application_name, ''), coalesce(a.state, '')"
        " FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
        " WHERE l.locktype = 'relation' AND l.relation = %s::regclass"
        " AND l.mode = 'RowExclusiveLock' AND l.granted AND a.pid <> pg_backend_pid()"
        " AND a.xact_start IS NOT NULL"
        " AND coalesce(a.application_name, '') NOT LIKE %s",
        (tables.name, APPLICATION + "%"),
    ).fetchall()
    return sorted(
        (OpenWriter(str(pid), float(age or 0.0), app, state) for pid, age, app, state in rows),
        key=lambda w: -w.age_s,
    )


def status_rows(conn: Any, tables: Tables) -> tuple[int, int, float | None, list[RelayInfo]]:
    """(pending, failed, oldest pending row's created_at, relays) on PostgreSQL."""
    pending, oldest = conn.execute(
        f"SELECT count(*), min(created_at) FROM {tables.name}"
    ).fetchone()
    (failed,) = conn.execute(f"SELECT count(*) FROM {tables.failed}").fetchone()
    rows = conn.execute(
        "SELECT l.pid, coalesce(a.application_name, ''), coalesce(host(a.client_addr), 'local'),"
        " extract(epoch FROM clock_timestamp() - a.backend_start),"
        " count(*) FILTER (WHERE l.objid < %s)"
        " FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
        " WHERE l.locktype = 'advisory' AND l.granted AND l.classid = %s AND l.objsubid = 2"
        " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        " GROUP BY l.pid, a.application_name, a.client_addr, a.backend_start ORDER BY l.pid",
        (PARTITIONS, tables.lock_space),
    ).fetchall()
    relays = [
        RelayInfo(
            name=app.removeprefix(APPLICATION).strip() or str(pid),
            session=str(pid),
            host=host,
            up_s=float(up or 0.0),
            partitions=int(parts),
        )
        for pid, app, host, up, parts in rows
    ]
    return int(pending), int(failed), oldest, relays


def check_tables(conn: Any, tables: Tables) -> None:
    """Raise :class:`~reliable_amqp.ConfigurationError` unless the outbox's tables exist."""
    row = conn.execute(
        "SELECT to_regclass(%s) IS NOT NULL AND to_regclass(%s) IS NOT NULL",
        (tables.name, tables.failed),
    ).fetchone()
    if not row[0]:
        raise ConfigurationError(
            f"no outbox table {tables.name} (or {tables.failed}) in this database: create it "
            "with `reliable-amqp outbox init --db DSN` or Outbox().install(conn)"
        )


def install(conn: Any, tables: Tables) -> None:
    """Create the outbox tables if missing, on the caller's connection (the caller commits)."""
    for statement in postgresql_ddl(tables):
        conn.execute(statement)
