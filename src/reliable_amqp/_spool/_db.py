"""The spool's SQLite file: opening it (with every way that can fail named), its schema, pragmas.

A spool directory holds ``spool.db`` (with SQLite's ``spool.db-wal`` and ``spool.db-shm`` beside
it) and ``spool.lock``. The file is marked as a spool (``application_id``) and carries its schema
version (``user_version``): a file that is some other SQLite database, or a spool written by a
newer version of this library, is refused with an error that says so, never rewritten.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3

from reliable_amqp._core.errors import SpoolError

DB_NAME = "spool.db"
#: "RAMQ": marks the file as a reliable-amqp spool
APPLICATION_ID = 0x52414D51
SCHEMA_VERSION = 1
#: the WAL is cut back to this size after a checkpoint (it would otherwise keep its peak size)
JOURNAL_SIZE_LIMIT = 64 * 1024 * 1024
PAGE_SIZE = 16384
_SQLITE_FULL = 13  # sqlite3.SQLITE_FULL from Python 3.11 on

_SCHEMA = (
    # seq: the append order (recovery sends in it); size: bytes counted against spool_max_bytes
    # (meta + body); crc: CRC-32 of meta then body, checked when an entry is read back
    "CREATE TABLE pending (seq INTEGER PRIMARY KEY, size INTEGER NOT NULL, crc INTEGER NOT NULL,"
    " meta BLOB NOT NULL, body BLOB NOT NULL)",
    "CREATE TABLE failed (seq INTEGER PRIMARY KEY, size INTEGER NOT NULL, crc INTEGER NOT NULL,"
    " meta BLOB NOT NULL, body BLOB NOT NULL, reason TEXT NOT NULL, failed_at REAL NOT NULL)",
    "CREATE TABLE info (key TEXT PRIMARY KEY, value) WITHOUT ROWID",
    "INSERT INTO info (key, value) VALUES ('syncs', 0), ('pending_count', 0), ('pending_bytes', 0)",
)


def db_path(directory: str) -> str:
    """Where the spool's database file is."""
    return os.path.join(directory, DB_NAME)


def is_disk_full(exc: BaseException) -> bool:
    """Whether a sqlite3 or OS error means the disk (file system) is full."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    code = getattr(exc, "sqlite_errorcode", None)  # Python >= 3.11
    if code is not None:
        return bool(code & 0xFF == _SQLITE_FULL)
    return "disk is full" in str(exc)


def describe(exc: BaseException) -> str:
    """What went wrong, in words (sqlite3's text, with its error code name where known)."""
    name = getattr(exc, "sqlite_errorname", None)
    text = str(exc) or type(exc).__name__
    return f"{text} ({name})" if name else text


def connect(directory: str, *, create: bool, read_only: bool = False) -> sqlite3.Connection:
    """A checked connection to the directory's spool file, in WAL mode.

    ``create`` makes the file (and its schema) when there is none. Raises :class:`SpoolError`
    naming the file for anything that is not a usable spool.
    """
    path = db_path(directory)
    exists = os.path.exists(path)
    if not exists and not create:
        raise SpoolError(f"no spool in {directory} ({DB_NAME} does not exist)")
    if exists and not os.path.isfile(path):
        raise SpoolError(f"{path} is not a regular file")
    try:
        if read_only:
            uri = "file:" + _uri_path(path) + "?mode=ro"
            conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
        else:
            conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    except sqlite3.Error as exc:
        raise SpoolError(f"cannot open the spool file {path}: {describe(exc)}") from exc
    try:
        _check(conn, path, create=create and not read_only, read_only=read_only)
    except BaseException:
        conn.close()
        raise
    if create and not exists:
        _sync_directory(directory)
    return conn


def pending_counts(conn: sqlite3.Connection, path: str) -> tuple[int, int]:
    """(messages, bytes) in the pending table, as kept in the info table by every commit."""
    try:
        found = dict(
            conn.execute(
                "SELECT key, value FROM info WHERE key IN ('pending_count', 'pending_bytes')"
            ).fetchall()
        )
    except sqlite3.Error as exc:
        raise SpoolError(f"{path} cannot be read: {describe(exc)}") from exc
    count, size = found.get("pending_count"), found.get("pending_bytes")
    if not isinstance(count, int) or not isinstance(size, int) or count < 0 or size < 0:
        raise SpoolError(f"{path} is a damaged spool: its pending counts are {count!r}, {size!r}")
    return count, size


def _uri_path(path: str) -> str:
    from urllib.parse import quote

    return quote(os.path.abspath(path))


def _check(conn: sqlite3.Connection, path: str, *, create: bool, read_only: bool) -> None:
    try:
        conn.execute("PRAGMA busy_timeout = 10000")
        # reading the header: "file is not a database" for anything that is no SQLite file
        app_id = conn.execute("PRAGMA application_id").fetchone()[0]
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = {
            row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        }
    except sqlite3.Error as exc:
        raise SpoolError(f"{path} is not a readable spool: {describe(exc)}") from exc
    if app_id == 0 and version == 0 and not tables:
        if not create:
            raise SpoolError(f"{path} is an empty database, not a spool")
        _create(conn, path)
        return
    if app_id != APPLICATION_ID:
        raise SpoolError(
            f"{path} is an SQLite database but not a reliable-amqp spool (application_id "
            f"{app_id:#x}, expected {APPLICATION_ID:#x}); it was left untouched"
        )
    if version > SCHEMA_VERSION:
        raise SpoolError(
            f"{path} was written by a newer version of reliable-amqp (spool schema {version}; "
            f"this version reads {SCHEMA_VERSION}): upgrade to read it"
        )
    missing = {"pending", "failed", "info"} - tables
    if version != SCHEMA_VERSION or missing:
        raise SpoolError(
            f"{path} is a damaged spool: schema {version}"
            + (f", missing table(s) {', '.join(sorted(missing))}" if missing else "")
        )
    if read_only:
        return
    try:
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        conn.execute(f"PRAGMA journal_size_limit = {JOURNAL_SIZE_LIMIT}")
    except sqlite3.Error as exc:
        raise SpoolError(f"{path} is not a readable spool: {describe(exc)}") from exc
    if str(mode).lower() != "wal":
        raise SpoolError(f"{path}: cannot switch to WAL mode (journal_mode is {mode})")


def _create(conn: sqlite3.Connection, path: str) -> None:
    try:
        # before the first table. 16 KiB pages: 1 KiB messages were written 1.8x faster than
        # with 4 KiB pages and took 20% less space (smaller ones alike).
        conn.execute(f"PRAGMA page_size = {PAGE_SIZE}")
        # pages freed by confirms go back to the file system as the backlog drains
        # (Spool._give_back), not only when the spool is empty at close
        conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise SpoolError(f"{path}: cannot switch to WAL mode (journal_mode is {mode})")
        conn.execute(f"PRAGMA journal_size_limit = {JOURNAL_SIZE_LIMIT}")
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute("BEGIN IMMEDIATE")
        for statement in _SCHEMA:
            conn.execute(statement)
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except sqlite3.Error as exc:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        raise SpoolError(f"cannot create the spool {path}: {describe(exc)}") from exc


def _sync_directory(directory: str) -> None:
    """Make the new file's directory entry durable (a power loss must not lose the file)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
