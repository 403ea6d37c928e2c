"""Spools of the earlier format (an SQLite outbox, ``spool.db``) are converted when opened.

Before the segment files, in the development builds up to commit a3c0f14 (whose package version
was already 0.1.0, as now), a spool was an SQLite database in WAL mode (``DIR/spool.db``): tables
``pending`` and ``failed`` of ``(seq, size, crc, meta, body)`` rows, marked as a spool
(``application_id``) with its schema version (``user_version``). :func:`migrate` converts one,
under the spool's lock, the first time this version opens it: every pending entry is checked
(CRC-32 of meta then body, and size) and written to segments with its seq, the failed table to
the failed log with its reasons, and the ledger is written last (its presence marks the
conversion done); then ``spool.db`` is deleted. A conversion cut short is done again from the
start. A file that is not such a spool, or is damaged, is refused with an error that says so,
and left as it was.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import zlib
from collections.abc import Iterator
from typing import Any

from reliable_amqp._core.errors import SpoolError
from reliable_amqp._spool import _files

log = logging.getLogger("reliable_amqp.spool")

DB_NAME = "spool.db"
#: what ``spool.db`` is renamed to once converted, until the conversion is finished
CONVERTING_NAME = "spool.db.converting"
#: "RAMQ": marked the file as a reliable-amqp spool
APPLICATION_ID = 0x52414D51
SCHEMA_VERSION = 1
#: rows read at a time while converting
_CHUNK = 2000


def db_path(directory: str) -> str:
    """Where a spool of the earlier format keeps its database file."""
    return os.path.join(directory, DB_NAME)


def describe(exc: BaseException) -> str:
    """What went wrong, in words (sqlite3's text, with its error code name where known)."""
    name = getattr(exc, "sqlite_errorname", None)
    text = str(exc) or type(exc).__name__
    return f"{text} ({name})" if name else text


def waiting(directory: str) -> bool:
    """Whether the directory holds an SQLite spool to convert (or a conversion to finish)."""
    return os.path.lexists(db_path(directory)) or os.path.lexists(
        os.path.join(directory, CONVERTING_NAME)
    )


def migrate(directory: str) -> bool:
    """Convert the SQLite spool in ``directory``, if there is one (under the spool's lock).

    Returns whether one was converted. Raises :class:`SpoolError` (leaving ``spool.db`` as it
    was) for a file that is not a spool of the earlier format or holds a damaged entry, and for
    a directory that holds both formats (a build of the earlier format was run on it again
    after it was converted).

    The steps, each safe to be cut short: the segments and the failed log are written from
    ``spool.db``; ``spool.db`` is renamed ``spool.db.converting``; the ledger is written (from
    then on the spool is this version's); ``spool.db.converting`` is deleted. Opening again
    after a cut finishes or redoes it.
    """
    path = db_path(directory)
    converting = os.path.join(directory, CONVERTING_NAME)
    ledger = os.path.join(directory, _files.LEDGER_NAME)
    if os.path.lexists(converting):
        if os.path.exists(ledger):  # converted; deleting the old file was cut short
            _remove_db(converting)
            return False
        source = converting  # cut short before the ledger: again, from the start
    elif not os.path.lexists(path):
        return False
    elif os.path.exists(ledger):
        raise SpoolError(
            f"{directory} holds a spool of this version and {DB_NAME}, a spool of the "
            "earlier SQLite format written after the directory was converted (a build from "
            f"before the segment files was run on it again?); neither was changed. Move {DB_NAME} "
            f"(and {DB_NAME}-wal, if there is one) into an empty directory and open a publisher "
            "of this version on that directory: it converts the file and sends its messages"
        )
    else:
        source = path
    for _first, segment in _files.list_segments(directory):  # a conversion cut short
        os.unlink(segment)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(directory, _files.FAILED_NAME))
    conn = _connect(source)
    try:
        pending, failed, ledger_data = _convert(conn, source, directory)
        if source == path:  # fold the write-ahead log in: the file alone holds everything
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    except sqlite3.Error as exc:
        raise SpoolError(f"{source} cannot be read: {describe(exc)}") from exc
    finally:
        conn.close()
    _files.sync_directory(directory)
    if source == path:
        os.replace(path, converting)
        for suffix in ("-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path + suffix)
        _files.sync_directory(directory)
    _write_file(ledger, ledger_data)
    _files.sync_directory(directory)
    _remove_db(converting)
    _files.sync_directory(directory)
    log.info(
        "spool %s: converted from the earlier SQLite format (%d pending, %d failed messages)",
        directory,
        pending,
        failed,
    )
    return True


def _connect(path: str) -> sqlite3.Connection:
    if not os.path.isfile(path):
        raise SpoolError(f"{path} is not a regular file")
    try:
        # read-write: SQLite folds in the write-ahead log a crashed writer left
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    except sqlite3.Error as exc:
        raise SpoolError(f"cannot open the spool file {path}: {describe(exc)}") from exc
    try:
        conn.execute("PRAGMA busy_timeout = 10000")
        # reading the header: "file is not a database" for anything that is no SQLite file
        app_id = conn.execute("PRAGMA application_id").fetchone()[0]
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = {
            row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        }
    except sqlite3.Error as exc:
        conn.close()
        raise SpoolError(f"{path} is not a readable spool: {describe(exc)}") from exc
    problem = None
    if app_id == 0 and version == 0 and not tables:
        problem = f"{path} is an empty database, not a spool"
    elif app_id != APPLICATION_ID:
        problem = (
            f"{path} is an SQLite database but not a reliable-amqp spool (application_id "
            f"{app_id:#x}, expected {APPLICATION_ID:#x}); it was left untouched"
        )
    elif version > SCHEMA_VERSION:
        problem = (
            f"{path} was written by a newer version of reliable-amqp (spool schema {version}; "
            f"this version reads {SCHEMA_VERSION}): upgrade to read it"
        )
    elif version != SCHEMA_VERSION or {"pending", "failed"} - tables:
        missing = {"pending", "failed"} - tables
        problem = f"{path} is a damaged spool: schema {version}" + (
            f", missing table(s) {', '.join(sorted(missing))}" if missing else ""
        )
    if problem is not None:
        conn.close()
        raise SpoolError(problem)
    return conn


def _chunks(
    conn: sqlite3.Connection, path: str, table: str, columns: str
) -> Iterator[list[tuple[Any, ...]]]:
    """The rows of ``table`` in seq order, a checked chunk at a time."""
    after = 0
    while True:
        try:
            chunk = conn.execute(
                f"SELECT seq, size, crc, meta, body{columns} FROM {table} WHERE seq > ? "
                "ORDER BY seq LIMIT ?",
                (after, _CHUNK),
            ).fetchall()
        except sqlite3.Error as exc:
            raise SpoolError(f"{path} cannot be read: {describe(exc)}") from exc
        if not chunk:
            return
        for row in chunk:
            seq, size, crc, meta, body = row[:5]
            if (
                type(meta) is not bytes
                or type(body) is not bytes
                or zlib.crc32(body, zlib.crc32(meta)) != crc
                or len(meta) + len(body) != size
            ):
                raise SpoolError(
                    f"{path}: {table} entry {seq} is damaged (its checksum or size does not "
                    "match what was written); it was left in place"
                )
        yield chunk
        after = chunk[-1][0]


def _convert(conn: sqlite3.Connection, path: str, directory: str) -> tuple[int, int, bytes]:
    """Write the segments and the failed log; returns (pending, failed, the ledger to write).

    Streams: memory holds a chunk of rows and a segment's worth of bytes at most."""
    pending = failed = top = 0
    first_pending = 0
    parts: list[bytes] = []
    size = 0
    first = 0
    for chunk in _chunks(conn, path, "pending", ""):
        for seq, _size, _crc, meta, body in chunk:
            if not parts:
                first = seq
                parts.append(_files.SEGMENT_HEAD.pack(_files.SEGMENT_MAGIC, seq))
                size = len(parts[0])
            parts.append(_files.record(seq, meta, body))
            size += len(parts[-1])
            if size >= _files.SEGMENT_BYTES:
                _write_file(os.path.join(directory, _files.segment_name(first)), b"".join(parts))
                parts = []
            pending += 1
            first_pending = first_pending or seq
            top = seq
    if parts:
        _write_file(os.path.join(directory, _files.segment_name(first)), b"".join(parts))
    records = [_files.FAILED_MAGIC]
    for chunk in _chunks(conn, path, "failed", ", reason, failed_at"):
        for seq, _size, _crc, meta, body, reason, failed_at in chunk:
            records.append(_files.failed_record(seq, float(failed_at), str(reason), meta, body))
            failed += 1
            top = max(top, seq)
    if failed:
        _write_file(os.path.join(directory, _files.FAILED_NAME), b"".join(records))
    ledger = [_files.LEDGER_MAGIC]
    below = first_pending - 1 if pending else top
    if below >= 1:  # the numbering goes on above what the old spool gave
        ledger.append(_files.ledger_record(_files.REMOVED, 1, below))
    return pending, failed, b"".join(ledger)


def _write_file(path: str, data: bytes) -> None:
    """Write a file whole and durably (:func:`_files.replace_file`)."""
    try:
        _files.replace_file(path, data)
    except OSError as exc:
        raise SpoolError(f"cannot convert the spool into {path}: {_files.describe(exc)}") from exc


def _remove_db(path: str) -> None:
    for suffix in ("-wal", "-shm", ""):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path + suffix)
