"""Helpers of the spool tests."""

from __future__ import annotations

import sqlite3
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reliable_amqp._core.builder import build_message
from reliable_amqp._core.message import OutgoingMessage
from reliable_amqp._spool import _codec as codec
from support.aio_blocking import BlockingAsyncPublisher


def messages(
    count: int, size: int = 16, start: int = 0, **properties: Any
) -> list[OutgoingMessage]:
    """``count`` messages with ids ``m-<start>``, ``m-<start+1>``, ...; bodies of ``size`` bytes."""
    return [
        build_message(
            "",
            "q",
            f"{i:0{size}d}".encode()[-size:] if size else b"",
            properties={"message_id": f"m-{i}", **properties},
        )
        for i in range(start, start + count)
    ]


class SpooledAsync(BlockingAsyncPublisher):
    """The blocking AsyncPublisher driver, with ``persist()``."""

    def persist(self, timeout: float | None = None) -> int:
        """``AsyncPublisher.persist``."""
        return self._call(self._publisher.persist(timeout))


#: a publisher class under test: Publisher, or AsyncPublisher behind a blocking driver
Kind = Callable[..., Any]


def write_v1_spool(
    directory: Path,
    pending: list[tuple[int, OutgoingMessage]],
    failed: list[tuple[int, OutgoingMessage, str]],
) -> None:
    """A spool directory in format 1 as the writer before issue 21 made it: ``spool.db`` with
    16 KiB pages, WAL, ``auto_vacuum`` off (what changed since), the schema and markers of
    ``_db`` version 1, rows as ``Spool._commit`` inserted them (``(seq, message)`` each, the
    seqs with the gaps confirms leave), the kept counts, then closed and checkpointed."""
    directory.mkdir(mode=0o700, parents=True)
    conn = sqlite3.connect(directory / "spool.db", isolation_level=None)
    conn.execute("PRAGMA page_size = 16384")
    assert conn.execute("PRAGMA journal_mode = WAL").fetchone()[0] == "wal"
    conn.execute("BEGIN IMMEDIATE")
    for statement in (
        "CREATE TABLE pending (seq INTEGER PRIMARY KEY, size INTEGER NOT NULL, crc INTEGER NOT "
        "NULL, meta BLOB NOT NULL, body BLOB NOT NULL)",
        "CREATE TABLE failed (seq INTEGER PRIMARY KEY, size INTEGER NOT NULL, crc INTEGER NOT "
        "NULL, meta BLOB NOT NULL, body BLOB NOT NULL, reason TEXT NOT NULL, failed_at REAL NOT "
        "NULL)",
        "CREATE TABLE info (key TEXT PRIMARY KEY, value) WITHOUT ROWID",
        "INSERT INTO info (key, value) VALUES ('syncs', 0), ('pending_count', 0), "
        "('pending_bytes', 0)",
    ):
        conn.execute(statement)
    conn.execute(f"PRAGMA application_id = {0x52414D51}")
    conn.execute("PRAGMA user_version = 1")
    conn.execute("COMMIT")

    def row(seq: int, message: OutgoingMessage) -> tuple[int, int, int, bytes, bytes]:
        meta = codec.encode(message)
        return (
            seq,
            len(meta) + len(message.body),
            zlib.crc32(message.body, zlib.crc32(meta)),
            meta,
            message.body,
        )

    rows = [row(seq, message) for seq, message in pending]
    conn.execute("BEGIN")
    conn.executemany(
        "INSERT INTO pending (seq, size, crc, meta, body) VALUES (?, ?, ?, ?, ?)", rows
    )
    conn.executemany(
        "UPDATE info SET value = value + ? WHERE key = ?",
        ((len(rows), "pending_count"), (sum(r[1] for r in rows), "pending_bytes")),
    )
    conn.executemany(
        "INSERT INTO failed (seq, size, crc, meta, body, reason, failed_at) "
        "VALUES (?, ?, ?, ?, ?, ?, ?)",
        [(*row(seq, message), reason, 1_700_000_000.0) for seq, message, reason in failed],
    )
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
