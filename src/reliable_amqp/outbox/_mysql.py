"""MariaDB and MySQL through PyMySQL: the writer's statements (on the caller's connection) and
the relay's store (on connections of its own). Moves rows; decides nothing.

**Ownership.** A relay's session holds its partitions as user-level locks (``GET_LOCK(name, 0)``,
one name per partition, derived from the database and the table: lock names are server-wide)
and one of :data:`MEMBER_SLOTS` membership locks, which count the relays alive
(``IS_USED_LOCK``; MariaDB has no shared locks). All of them die with the session, so a relay
killed -9, or whose session is killed or cut off, owns nothing any more, at once.

**Nothing skipped.** InnoDB takes an ``AUTO_INCREMENT`` id when the row is inserted, not when
its transaction commits, so rows commit out of id order here as on PostgreSQL (and InnoDB has
no ``xid8``): the relay's passes (``_plan.ReadCursor``) close the gap. The relay's session runs
in autocommit with READ COMMITTED, so every read is a statement of its own that sees every
commit made before it (the default REPEATABLE READ inside one transaction would keep a snapshot
that hides late commits).

**Wake-ups.** MariaDB has no NOTIFY. A watcher session reads ``SELECT MAX(id)`` (one index dive:
the optimizer answers it from the primary key's last entry) every :data:`WATCH_INTERVAL`
(:data:`IDLE_WATCH_INTERVAL` once nothing new came for :data:`IDLE_AFTER` seconds) and wakes
the relay when it grew; a row added in the relay's own process makes the watcher look every
:data:`HOT_INTERVAL` for the next second. A row that commits after a higher id was seen
does not grow the maximum: the relay's next read (``poll_interval``) or next wake-up takes it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import threading
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from typing import Any

from reliable_amqp._core.errors import ConfigurationError
from reliable_amqp.outbox._rows import PendingRow, RowValues
from reliable_amqp.outbox._schema import (
    PARTITIONS,
    READ_COLUMNS,
    WRITE_COLUMNS,
    Tables,
    mysql_columns,
    mysql_ddl,
    mysql_quote,
)
from reliable_amqp.outbox._status import OpenWriter, RelayInfo

pymysql: Any
try:
    pymysql = importlib.import_module("pymysql")
    for _sub in ("connections", "constants.SERVER_STATUS", "cursors", "err"):
        importlib.import_module(f"pymysql.{_sub}")
except ImportError:  # pragma: no cover - the outbox-mysql extra is missing
    pymysql = None

__all__ = [
    "MEMBER_SLOTS",
    "MysqlRelayStore",
    "install",
    "open_writers",
    "status_rows",
    "sync_writer",
    "wake_local",
]

#: membership locks: each relay holds one while it is alive; more relays than partitions could
#: own nothing anyway
MEMBER_SLOTS = PARTITIONS
#: how often a relay's watcher reads the table's highest id ...
WATCH_INTERVAL = 0.005
#: ... once it saw no new row for IDLE_AFTER seconds (a quiet outbox costs the server less)
IDLE_WATCH_INTERVAL = 0.025
IDLE_AFTER = 10.0
#: ... and for a second after a row was added in the relay's process (its commit is near)
HOT_INTERVAL = 0.001
#: seconds a relay's statement waits for a row lock (fail() moving rows) before it gives up
LOCK_WAIT_TIMEOUT = 20

# Stores of this process (their watchers look often for a while when a row is added here).
_local_stores: set[MysqlRelayStore] = set()
_local_lock = threading.Lock()


def require_pymysql() -> Any:
    """The pymysql module, or :class:`~reliable_amqp.ConfigurationError` with the install hint."""
    if pymysql is None:
        raise ConfigurationError(
            "MariaDB and MySQL need PyMySQL: install the 'outbox-mysql' extra "
            "(in a checkout: pip install '.[outbox-mysql]')"
        )
    return pymysql


def wake_local() -> None:
    """A row was added in this process: its relays' watchers look often until it commits."""
    until = time.monotonic() + 1.0
    for store in list(_local_stores):
        store.hot_until = until
        store.poke.set()


# --- the writer -------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def insert_sql(tables: Tables) -> str:
    """The INSERT of one row (PyMySQL's ``executemany`` turns it into multi-row INSERTs)."""
    marks = ", ".join(["%s"] * len(WRITE_COLUMNS))
    return (
        f"INSERT INTO {mysql_quote(tables.name)} ({mysql_columns(WRITE_COLUMNS)}) VALUES ({marks})"
    )


def check_writable(conn: Any, what: str = "add()") -> None:
    """Refuse a PyMySQL connection whose write would commit on its own: autocommit with no
    transaction open (the server's SERVER_STATUS_IN_TRANS flag, as of its last reply)."""
    mysql = require_pymysql()
    if not conn.open:
        raise ConfigurationError(f"{what}: the connection is closed")
    in_trans = conn.server_status & mysql.constants.SERVER_STATUS.SERVER_STATUS_IN_TRANS
    if conn.get_autocommit() and not in_trans:
        raise ConfigurationError(
            f"{what}: this PyMySQL connection is in autocommit mode with no transaction open, so "
            "the row would commit on its own, not with your transaction: call conn.begin() "
            "first, or use a connection without autocommit (PyMySQL's default)"
        )


class _Writer:
    """PyMySQL ``Connection``: ``execute`` for one row, ``executemany`` (multi-row INSERTs of
    up to 1 MB each) for ``add_many()``; wakes this process's relays."""

    def dialect(self, conn: Any) -> str:
        return "mysql"

    def run(self, conn: Any, sql: str, params: Sequence[Any] = (), check: str | None = None) -> int:
        if check:
            check_writable(conn, check)
        with conn.cursor() as cur:
            return int(cur.execute(sql, tuple(params) or None))

    def fetch(self, conn: Any, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with conn.cursor() as cur:
            cur.execute(sql, tuple(params) or None)
            return [tuple(row) for row in cur.fetchall()]

    def in_transaction(self, conn: Any) -> bool:
        status = require_pymysql().constants.SERVER_STATUS.SERVER_STATUS_IN_TRANS
        return bool(conn.server_status & status)

    @contextlib.contextmanager
    def transaction(self, conn: Any) -> Iterator[Any]:
        conn.begin()
        try:
            yield conn
        except BaseException:
            conn.rollback()
            raise
        conn.commit()

    def install(self, conn: Any, tables: Tables) -> None:
        install(conn, tables)

    def write(self, conn: Any, tables: Tables, rows: Sequence[RowValues], notify: bool) -> None:
        check_writable(conn)
        with conn.cursor() as cur:
            if len(rows) == 1:
                cur.execute(insert_sql(tables), rows[0])
            else:
                cur.executemany(insert_sql(tables), rows)
        if notify:
            wake_local()


def sync_writer(conn: object) -> _Writer | None:
    """The writer for a PyMySQL ``Connection`` (None for anything else)."""
    if pymysql is not None and isinstance(conn, pymysql.connections.Connection):
        return _Writer()
    return None


def install(conn: Any, tables: Tables) -> None:
    """Create the outbox tables if missing, on the caller's connection. DDL commits implicitly
    on MariaDB and MySQL: run it outside a transaction that holds other work."""
    with conn.cursor() as cur:
        for statement in mysql_ddl(tables):
            cur.execute(statement)


# --- connections of the relay and the tools -----------------------------------------------------

_QUERY_OPTIONS = {"unix_socket", "connect_timeout", "ssl_ca", "charset"}


def connect_args(dsn: str) -> dict[str, Any]:
    """PyMySQL's ``connect()`` arguments for ``mysql://user:password@host:port/database``
    (``mariadb://`` alike; query options: unix_socket, connect_timeout, ssl_ca, charset)."""
    try:
        url = urllib.parse.urlsplit(dsn)
        port = url.port
    except ValueError as exc:
        raise ConfigurationError(f"--db: not a mysql:// DSN ({exc})") from None
    if url.scheme not in {"mysql", "mariadb"}:
        raise ConfigurationError("--db: expected mysql://user@host:port/database")
    database = urllib.parse.unquote(url.path.lstrip("/"))
    if not database or "/" in database:
        raise ConfigurationError(
            "--db: a mysql:// DSN names its database: mysql://user@host:port/database"
        )
    args: dict[str, Any] = {
        "host": url.hostname or "127.0.0.1",
        "port": port or 3306,
        "user": urllib.parse.unquote(url.username) if url.username else None,
        "password": urllib.parse.unquote(url.password or ""),
        "database": database,
        "charset": "utf8mb4",
        "connect_timeout": 10,
    }
    for option, values in urllib.parse.parse_qs(url.query).items():
        if option not in _QUERY_OPTIONS:
            raise ConfigurationError(
                f"--db: unknown option {option!r} (known: {', '.join(sorted(_QUERY_OPTIONS))})"
            )
        value = values[-1]
        if option == "connect_timeout":
            args[option] = float(value)
        elif option == "ssl_ca":
            args["ssl"] = {"ca": value}
        else:
            args[option] = value
    return args


def open_connection(args: dict[str, Any], *, autocommit: bool = True) -> Any:
    """A session of the relay's (or a tool's): READ COMMITTED, so that no statement reads from
    an old snapshot; bounded waits, so that a frozen server shows as an error."""
    mysql = require_pymysql()
    conn = mysql.connect(
        **args,
        autocommit=autocommit,
        binary_prefix=True,
        cursorclass=mysql.cursors.Cursor,
        read_timeout=60,
        write_timeout=60,
    )
    try:
        with conn.cursor() as cur:
            cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
            cur.execute(f"SET SESSION innodb_lock_wait_timeout = {LOCK_WAIT_TIMEOUT}")
    except BaseException:
        conn.close()
        raise
    return conn


#: server and client error numbers that mean the session is gone or the statement may simply be
#: tried again (lost connection, server shutting down, killed session, lock wait timeout,
#: deadlock, read-only during failover): the relay reconnects. PyMySQL raises OperationalError
#: for many SQL errors as well (1052 ambiguous column, ...); those are bugs or a damaged schema,
#: and stop the relay instead of being retried forever.
_SESSION_ERRORS = frozenset(
    (1040, 1053, 1077, 1080, 1152, 1153, 1154, 1158, 1159, 1160, 1161, 1205, 1213, 1290, 1836,
     1927, 2002, 2003, 2005, 2006, 2011, 2013, 2014, 2026, 2055, 4031)
)  # fmt: skip


class MysqlStatementError(RuntimeError):
    """A statement of the relay failed for a reason that retrying will not cure."""


def _checked(exc: BaseException) -> BaseException:
    """``exc`` if it means the session went away (retried), else a MysqlStatementError."""
    if isinstance(exc, pymysql.err.OperationalError) and exc.args:
        code = exc.args[0]
        if isinstance(code, int) and code not in _SESSION_ERRORS:
            return MysqlStatementError(f"MySQL error {code}: {exc.args[1:] or ''}")
    return exc


def _rows(conn: Any, sql: str, params: Sequence[Any] | None = None) -> list[tuple[Any, ...]]:
    try:
        with conn.cursor() as cur:
            cur.execute(sql, params)
            return list(cur.fetchall())
    except pymysql.err.OperationalError as exc:
        raise _checked(exc) from exc


def _run(conn: Any, sql: str, params: Sequence[Any] | None = None) -> int:
    try:
        with conn.cursor() as cur:
            return int(cur.execute(sql, params))
    except pymysql.err.OperationalError as exc:
        raise _checked(exc) from exc


def _ints(values: Sequence[int]) -> str:
    return ", ".join(str(int(v)) for v in values)


class ToolConnection:
    """A PyMySQL connection with ``execute()`` returning its cursor, as psycopg's and sqlite3's
    do (what the operator tools use); ``raw`` is the connection."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def execute(self, sql: str, params: Sequence[Any] | None = None) -> Any:
        cur = self.raw.cursor()
        cur.execute(sql, params or None)
        return cur


@contextlib.contextmanager
def tool_connection(dsn: str) -> Iterator[ToolConnection]:
    """A transaction on a connection of its own: committed when the block ends well."""
    conn = open_connection(connect_args(dsn), autocommit=False)
    try:
        yield ToolConnection(conn)
        conn.commit()
    except BaseException:
        with contextlib.suppress(Exception):
            conn.rollback()
        raise
    finally:
        with contextlib.suppress(Exception):
            conn.close()


# --- locks ------------------------------------------------------------------------------------


class LockNames:
    """The user-level lock names of one outbox (server-wide names, so the database is part of
    them; hashed to stay within the 64 characters MySQL allows)."""

    def __init__(self, database: str, tables: Tables) -> None:
        schema, _, name = tables.name.rpartition(".")
        where = f"{schema or database}.{name}".encode()
        base = f"reliable_amqp.{hashlib.sha1(where, usedforsecurity=False).hexdigest()[:20]}"
        self.partitions = [f"{base}.p{n}" for n in range(PARTITIONS)]
        self.members = [f"{base}.r{n}" for n in range(MEMBER_SLOTS)]
        self.members_sql = "SELECT " + ", ".join(f"IS_USED_LOCK('{m}')" for m in self.members)
        self.all_sql = "SELECT " + ", ".join(
            f"IS_USED_LOCK('{m}')" for m in (*self.partitions, *self.members)
        )


def database_of(args: dict[str, Any], tables: Tables) -> str:
    """The database that holds the outbox table (its schema when the name is qualified)."""
    schema, _, _ = tables.name.rpartition(".")
    return schema or str(args["database"])


def check_tables(conn: Any, tables: Tables, database: str) -> None:
    """Raise :class:`~reliable_amqp.ConfigurationError` unless the outbox's tables exist."""
    names = [t.rpartition(".")[2] for t in (tables.name, tables.failed)]
    (found,) = _rows(
        conn,
        "SELECT count(*) FROM information_schema.TABLES WHERE TABLE_SCHEMA = %s"
        " AND TABLE_NAME IN (%s, %s)",
        (database, *names),
    )[0]
    if int(found) < 2:
        raise ConfigurationError(
            f"no outbox table {tables.name} (or {tables.failed}) in database {database}: create "
            "it with `reliable-amqp outbox init --db DSN` or Outbox().install(conn)"
        )


class MysqlRelayStore:
    """A relay's access to the outbox on MariaDB or MySQL: one session that holds its locks,
    reads and deletes, and one (the watcher) that notices new rows."""

    dialect = "mysql"

    def __init__(self, dsn: str, tables: Tables, name: str) -> None:
        require_pymysql()
        self.args = connect_args(dsn)
        self.tables = tables
        self.name = name
        self.database = database_of(self.args, tables)
        self.locks = LockNames(self.database, tables)
        self._conn: Any = None
        self._table = mysql_quote(tables.name)
        self._read_cols = mysql_columns(READ_COLUMNS)
        self._closing = threading.Event()
        self._watch: threading.Thread | None = None
        #: set by wake_local(): the watcher looks every HOT_INTERVAL until then
        self.hot_until = 0.0
        self.poke = threading.Event()

    # --- sessions -----------------------------------------------------------------------------

    def connect(self) -> None:
        """Open the relay's session and join the relays of this outbox (a membership slot)."""
        conn = open_connection(self.args)
        try:
            check_tables(conn, self.tables, self.database)
            for start in range(0, MEMBER_SLOTS, 16):
                names = self.locks.members[start : start + 16]
                got = _rows(conn, "SELECT " + ", ".join(f"GET_LOCK('{n}', 0)" for n in names))[0]
                taken = [n for n, ok in zip(names, got, strict=True) if ok == 1]
                if taken:  # keep one, give back the others
                    if len(taken) > 1:
                        _rows(
                            conn, "SELECT " + ", ".join(f"RELEASE_LOCK('{n}')" for n in taken[1:])
                        )
                    break
        except BaseException:
            with contextlib.suppress(Exception):
                conn.close()
            raise
        self._conn = conn

    @property
    def connected(self) -> bool:
        return self._conn is not None and bool(self._conn.open)

    def close(self) -> None:
        """Close both sessions (every lock goes with them)."""
        self._closing.set()
        self.poke.set()
        with _local_lock:
            _local_stores.discard(self)
        self.drop()
        thread = self._watch
        if thread is not None and thread is not threading.current_thread():
            thread.join(5)

    def drop(self) -> None:
        """Forget a session that failed (its locks are gone with it)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def start_wakeups(self, wake: threading.Event) -> None:
        """Watch the table's highest id in a thread; wake the relay when it grows."""
        self._closing.clear()
        with _local_lock:
            _local_stores.add(self)
        self._watch = threading.Thread(
            target=self._watcher, args=(wake,), name="reliable-amqp-outbox-watch", daemon=True
        )
        self._watch.start()

    def _watcher(self, wake: threading.Event) -> None:
        sql = f"SELECT MAX(id) FROM {self._table}"
        errors = (pymysql.err.Error, OSError)
        conn: Any = None
        seen = -1
        changed = time.monotonic()
        while not self._closing.is_set():
            try:
                if conn is None:
                    conn = open_connection(self.args)
                    seen = -1  # ids may have been reused (old servers reset AUTO_INCREMENT)
                (top,) = _rows(conn, sql)[0]
                top = int(top or 0)
                if top > seen:
                    seen = top
                    changed = time.monotonic()
                    wake.set()
            except errors:
                if conn is not None:
                    with contextlib.suppress(Exception):
                        conn.close()
                conn = None
                wake.set()  # the relay finds out about the database itself
                self._closing.wait(0.5)
                continue
            now = time.monotonic()
            if now < self.hot_until:
                interval = HOT_INTERVAL
            elif now - changed < IDLE_AFTER:
                interval = WATCH_INTERVAL
            else:
                interval = IDLE_WATCH_INTERVAL
            self.poke.wait(interval)
            self.poke.clear()
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    # --- ownership ----------------------------------------------------------------------------

    def relays(self) -> int:
        """How many relays of this outbox are alive (sessions holding a membership lock)."""
        used = _rows(self._conn, self.locks.members_sql)[0]
        return max(1, sum(1 for holder in used if holder is not None))

    def try_lock(self, parts: Sequence[int], want: int) -> list[int]:
        """Lock up to ``want`` of ``parts`` (in order); the ones locked."""
        got: list[int] = []
        todo = list(parts)
        while todo and len(got) < want:
            chunk, todo = todo[: want - len(got)], todo[want - len(got) :]
            names = [self.locks.partitions[p] for p in chunk]
            answers = _rows(self._conn, "SELECT " + ", ".join(f"GET_LOCK('{n}', 0)" for n in names))
            got += [p for p, ok in zip(chunk, answers[0], strict=True) if ok == 1]
        return got

    def unlock(self, parts: Sequence[int]) -> None:
        if parts:
            names = [self.locks.partitions[p] for p in parts]
            _rows(self._conn, "SELECT " + ", ".join(f"RELEASE_LOCK('{n}')" for n in names))

    # --- rows ---------------------------------------------------------------------------------

    def read(
        self, after: int, parts: Sequence[int] | None, skip: Sequence[int], limit: int
    ) -> list[PendingRow]:
        """Pending rows with ids above ``after`` in ``parts`` (None: all), but ``skip``, by id."""
        where = f"id > {int(after)}"
        if parts is not None:
            where += f" AND part IN ({_ints(parts)})"
        if skip:
            where += f" AND id NOT IN ({_ints(skip)})"
        rows = _rows(
            self._conn,
            f"SELECT {self._read_cols} FROM {self._table} WHERE {where}"
            f" ORDER BY id LIMIT {int(limit)}",
        )
        return [PendingRow.of(r) for r in rows]

    def delete(self, ids: Sequence[int]) -> None:
        for start in range(0, len(ids), 1000):
            _run(
                self._conn,
                f"DELETE FROM {self._table} WHERE id IN ({_ints(ids[start : start + 1000])})",
            )

    def fail(self, failures: Sequence[tuple[int, int, str]]) -> None:
        """Move rows to the failed table: (id, attempts, reason) each, in one transaction."""
        now = time.time()
        cols = self._read_cols
        failed = mysql_quote(self.tables.failed)
        conn = self._conn
        conn.begin()
        try:
            for row_id, attempts, reason in failures:
                _run(
                    conn,
                    f"INSERT INTO {failed} ({cols}, failed_at, attempts, reason)"
                    f" SELECT {cols}, %s, %s, %s FROM {self._table} WHERE id = %s"
                    f" ON DUPLICATE KEY UPDATE {failed}.id = {failed}.id",
                    (now, attempts, reason, row_id),
                )
                _run(conn, f"DELETE FROM {self._table} WHERE id = %s", (row_id,))
            conn.commit()
        except BaseException:
            with contextlib.suppress(Exception):
                conn.rollback()
            raise

    def any_pending(self) -> bool:
        return bool(_rows(self._conn, f"SELECT EXISTS (SELECT 1 FROM {self._table})")[0][0])

    def backlog(self, cap: int) -> tuple[int, float | None]:
        """(pending rows, counted up to ``cap``; the oldest pending row's created_at)."""
        ((count,),) = _rows(
            self._conn, f"SELECT count(*) FROM (SELECT 1 FROM {self._table} LIMIT {int(cap)}) p"
        )
        oldest = _rows(self._conn, f"SELECT created_at FROM {self._table} ORDER BY id LIMIT 1")
        return int(count), (float(oldest[0][0]) if oldest else None)

    def open_writers(self) -> list[OpenWriter]:
        """Open transactions that have written rows, in sessions using the outbox's database:
        see :func:`open_writers` for what MariaDB can and cannot tell."""
        relays = {int(h) for h in _rows(self._conn, self.locks.members_sql)[0] if h is not None}
        return open_writers(self._conn, self.database, relays)


def open_writers(conn: Any, database: str, relays: set[int]) -> list[OpenWriter]:
    """Transactions still open that have modified rows (``information_schema.INNODB_TRX``) in
    sessions whose current database is the outbox's, relays excluded, oldest first.

    What it cannot tell: which tables a transaction wrote (MariaDB lists a transaction's locks
    only while another waits on them), so an open transaction that wrote other tables of the
    database shows too, and one that wrote the outbox from a session using another database
    (``db.amqp_outbox``) does not; ages are in whole seconds (``trx_started``).
    """
    rows = _rows(
        conn,
        "SELECT t.trx_mysql_thread_id, TIMESTAMPDIFF(SECOND, t.trx_started, NOW()),"
        " coalesce(p.USER, ''), coalesce(p.HOST, ''), coalesce(p.COMMAND, '')"
        " FROM information_schema.INNODB_TRX t"
        " JOIN information_schema.PROCESSLIST p ON p.ID = t.trx_mysql_thread_id"
        " WHERE t.trx_rows_modified > 0 AND p.DB = %s AND p.ID <> CONNECTION_ID()",
        (database,),
    )
    return sorted(
        (
            OpenWriter(str(tid), float(age or 0), f"{user}@{host}", command.lower())
            for tid, age, user, host, command in rows
            if int(tid) not in relays
        ),
        key=lambda w: -w.age_s,
    )


def status_rows(
    conn: Any, tables: Tables, database: str
) -> tuple[int, int, float | None, list[RelayInfo], set[int]]:
    """(pending, failed, oldest pending row's created_at, relays, the relays' sessions)."""
    table, failed = mysql_quote(tables.name), mysql_quote(tables.failed)
    pending, oldest = _rows(conn, f"SELECT count(*), min(created_at) FROM {table}")[0]
    ((failed_count,),) = _rows(conn, f"SELECT count(*) FROM {failed}")
    locks = LockNames(database, tables)
    holders = _rows(conn, locks.all_sql)[0]
    parts: dict[int, int] = {}
    for holder in holders[:PARTITIONS]:
        if holder is not None:
            parts[int(holder)] = parts.get(int(holder), 0) + 1
    members = {int(h) for h in holders[PARTITIONS:] if h is not None}
    sessions = sorted(members | set(parts))
    hosts: dict[int, str] = {}
    if sessions:
        hosts = {
            int(pid): str(host)
            for pid, host in _rows(
                conn,
                "SELECT ID, HOST FROM information_schema.PROCESSLIST"
                f" WHERE ID IN ({_ints(sessions)})",
            )
        }
    relays = [
        RelayInfo(
            # MariaDB shows no name or start time of another session: its id stands for both
            name=f"session {pid}",
            session=str(pid),
            host=hosts.get(pid, "?").rsplit(":", 1)[0],
            up_s=0.0,
            partitions=parts.get(pid, 0),
        )
        for pid in sessions
    ]
    oldest_at = None if oldest is None else float(oldest)
    return int(pending), int(failed_count), oldest_at, relays, members | set(parts)
