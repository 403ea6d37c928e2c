"""Reading a spool's entries back: checked (CRC-32 and size) and decoded, or only checked.

Shared by the spool a publisher has open (:class:`~reliable_amqp._spool._store.Spool`) and by
the tools that look into one from outside (:mod:`reliable_amqp._spool._inspect`): one wording
for a damaged entry, whoever finds it.
"""

from __future__ import annotations

import sqlite3
import threading
import zlib
from dataclasses import dataclass

from reliable_amqp._core.errors import SpoolError
from reliable_amqp._core.message import OutgoingMessage, new_outgoing
from reliable_amqp._spool import _codec, _db

#: how many rows one read of pending entries returns at most
READ_LIMIT_MAX = 100_000


@dataclass(frozen=True, slots=True)
class SpoolEntry:
    """One message in the spool: ``seq`` is its place in the append order."""

    seq: int
    message: OutgoingMessage
    size: int


def read_entries(
    conn: sqlite3.Connection,
    lock: threading.Lock,
    path: str,
    *,
    after: int,
    limit: int,
    table: str = "pending",
    build: _codec.Build = new_outgoing,
) -> list[SpoolEntry]:
    """Entries of ``table`` with a seq above ``after``, in order, checked (CRC) and decoded (each
    message made by ``build``: see :func:`_codec.decode`)."""
    limit = max(1, min(limit, READ_LIMIT_MAX))
    with lock:
        try:
            rows = conn.execute(
                f"SELECT seq, size, crc, meta, body FROM {table} WHERE seq > ? "
                "ORDER BY seq LIMIT ?",
                (after, limit),
            ).fetchall()
        except sqlite3.Error as exc:
            raise SpoolError(f"{path} cannot be read: {_db.describe(exc)}") from exc
    return [_entry(path, table, row, build) for row in rows]


def damaged(path: str, table: str, seq: int) -> SpoolError:
    """The error for an entry whose checksum or size does not match (``--check`` lists the
    same words)."""
    return SpoolError(
        f"{path}: {table} entry {seq} is damaged (its checksum or size does not match what was "
        "written); it was left in place"
    )


def verify_pending(conn: sqlite3.Connection, path: str) -> None:
    """Check every pending entry's checksum and size; raise :func:`damaged`'s error for the
    first that does not match. Opening a spool does this, so that a damaged message stops the
    publisher before anything is sent, rather than when its turn comes."""
    try:
        rows = conn.execute("SELECT seq, size, crc, meta, body FROM pending ORDER BY seq")
        crc32 = zlib.crc32
        for seq, size, crc, meta, body in rows:
            if (
                type(meta) is not bytes
                or type(body) is not bytes
                or crc32(body, crc32(meta)) != crc
                or len(meta) + len(body) != size
            ):
                raise damaged(path, "pending", seq)
    except sqlite3.Error as exc:
        raise SpoolError(f"{path} cannot be read: {_db.describe(exc)}") from exc


def _entry(
    path: str,
    table: str,
    row: tuple[int, int, int, bytes, bytes],
    build: _codec.Build = new_outgoing,
) -> SpoolEntry:
    seq, size, crc, meta, body = row
    if not isinstance(meta, bytes) or not isinstance(body, bytes):
        raise SpoolError(f"{path}: {table} entry {seq} is damaged (a record is not a blob)")
    if zlib.crc32(body, zlib.crc32(meta)) != crc or len(meta) + len(body) != size:
        raise damaged(path, table, seq)
    try:
        message = _codec.decode(meta, body, build)
    except _codec.CodecError as exc:
        raise SpoolError(f"{path}: {table} entry {seq} cannot be decoded: {exc}") from None
    return SpoolEntry(seq, message, size)
