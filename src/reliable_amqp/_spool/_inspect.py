"""Looking into a spool from outside its publisher: counts, failed messages, dropping them.

Reading (:func:`inspect`, :func:`failed_entries`) works while a publisher has the spool open
(SQLite's WAL lets a reader see the last commit beside a writer) and takes no lock. Dropping
failed messages (:func:`drop_failed`) changes the file, so it takes the spool's lock: it is
refused, naming the pid, while a publisher holds it.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from reliable_amqp._core.errors import SpoolError
from reliable_amqp._core.message import OutgoingMessage
from reliable_amqp._spool import _db
from reliable_amqp._spool._lock import DirectoryLock, in_use_by
from reliable_amqp._spool._read import read_entries


@dataclass(frozen=True, slots=True)
class SpoolSummary:
    """What a spool directory holds, read from its file."""

    directory: str
    #: messages waiting to be confirmed, and their bytes (as counted against spool_max_bytes)
    pending: int
    pending_bytes: int
    #: messages that failed for good (returned, rejected, nacked after retries)
    failed: int
    failed_bytes: int
    #: bytes the spool's files take on disk (database and write-ahead log)
    file_bytes: int
    #: the pid of the process that has the spool open (-1: one does, pid unknown), else None
    in_use_by: int | None


@dataclass(frozen=True, slots=True)
class FailedEntry:
    """A message in the failed table: why it failed and when (POSIX seconds)."""

    seq: int
    message: OutgoingMessage
    reason: str
    failed_at: float


def _directory(directory: str | os.PathLike[str]) -> str:
    path = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(path):
        raise SpoolError(f"no spool in {path}: not a directory")
    return path


def inspect(directory: str | os.PathLike[str]) -> SpoolSummary:
    """Counts and sizes of a spool directory; raises :class:`SpoolError` if it is no spool."""
    path = _directory(directory)
    holder = in_use_by(path)
    conn = _db.connect(path, create=False, read_only=True)
    try:
        pending, pending_bytes = _db.pending_counts(conn, _db.db_path(path))
        failed, failed_bytes = conn.execute("SELECT count(*), total(size) FROM failed").fetchone()
    except sqlite3.Error as exc:
        raise SpoolError(f"{_db.db_path(path)} cannot be read: {_db.describe(exc)}") from exc
    finally:
        conn.close()
    files = 0
    for suffix in ("", "-wal"):
        with contextlib.suppress(OSError):
            files += os.stat(_db.db_path(path) + suffix).st_size
    return SpoolSummary(
        path, int(pending), int(pending_bytes), int(failed), int(failed_bytes), files, holder
    )


def failed_entries(directory: str | os.PathLike[str], chunk: int = 1000) -> Iterator[FailedEntry]:
    """Every message of the failed table, in order, read ``chunk`` at a time.

    Raises :class:`SpoolError` naming the entry when one cannot be read back.
    """
    path = _directory(directory)
    conn = _db.connect(path, create=False, read_only=True)
    lock = threading.Lock()
    try:
        after = 0
        while True:
            entries = read_entries(
                conn, lock, _db.db_path(path), after=after, limit=chunk, table="failed"
            )
            if not entries:
                return
            seqs = [entry.seq for entry in entries]
            try:
                details = {
                    seq: (str(reason), float(failed_at))
                    for seq, reason, failed_at in conn.execute(
                        "SELECT seq, reason, failed_at FROM failed WHERE seq BETWEEN ? AND ?",
                        (seqs[0], seqs[-1]),
                    )
                }
            except sqlite3.Error as exc:
                raise SpoolError(
                    f"{_db.db_path(path)} cannot be read: {_db.describe(exc)}"
                ) from exc
            for entry in entries:
                reason, failed_at = details.get(entry.seq, ("", 0.0))
                yield FailedEntry(entry.seq, entry.message, reason, failed_at)
            after = seqs[-1]
    finally:
        conn.close()


def check(directory: str | os.PathLike[str]) -> list[str]:
    """Read the whole spool the hard way: SQLite's ``quick_check`` of every page, then every
    entry read back (checksum, decoding) and the kept counts compared with the table.

    Returns what is wrong, one problem a line (empty: nothing). Takes no lock and changes
    nothing; it takes as long as reading the file does.
    """
    path = _directory(directory)
    conn = _db.connect(path, create=False, read_only=True)
    file = _db.db_path(path)
    problems: list[str] = []
    try:
        try:
            problems += [
                f"{file}: {row[0]}"
                for row in conn.execute("PRAGMA quick_check").fetchall()
                if row[0] != "ok"
            ]
            counted, counted_bytes = conn.execute(
                "SELECT count(*), total(size) FROM pending"
            ).fetchone()
        except sqlite3.Error as exc:
            return [f"{file} cannot be read: {_db.describe(exc)}"]
        kept = _db.pending_counts(conn, file)
        if kept != (counted, int(counted_bytes)):
            problems.append(
                f"{file}: the kept counts say {kept[0]:,} pending messages of {kept[1]:,} bytes, "
                f"the table holds {counted:,} of {int(counted_bytes):,}"
            )
        lock = threading.Lock()
        for table in ("pending", "failed"):
            after = 0
            while True:
                try:
                    seqs = [
                        seq
                        for (seq,) in conn.execute(
                            f"SELECT seq FROM {table} WHERE seq > ? ORDER BY seq LIMIT 1000",
                            (after,),
                        )
                    ]
                except sqlite3.Error as exc:
                    problems.append(f"{file} cannot be read: {_db.describe(exc)}")
                    break
                if not seqs:
                    break
                try:
                    read_entries(conn, lock, file, after=after, limit=len(seqs), table=table)
                except SpoolError:  # one by one, to name every damaged entry
                    for seq in seqs:
                        try:
                            read_entries(conn, lock, file, after=seq - 1, limit=1, table=table)
                        except SpoolError as exc:
                            problems.append(str(exc))
                after = seqs[-1]
    finally:
        conn.close()
    return problems


def drop_failed(directory: str | os.PathLike[str], up_to: int | None = None) -> int:
    """Empty the failed table (only entries with seq <= ``up_to`` when given); returns how many.

    Takes the spool's lock: raises :class:`~reliable_amqp.ConfigurationError` naming the pid
    while a publisher has the spool open.
    """
    path = _directory(directory)
    lock = DirectoryLock(path)
    lock.acquire("reliable-amqp spool --drop-failed")
    try:
        conn = _db.connect(path, create=False)
        try:
            conn.execute("PRAGMA synchronous = FULL")
            if up_to is None:
                cursor = conn.execute("DELETE FROM failed")
            else:
                cursor = conn.execute("DELETE FROM failed WHERE seq <= ?", (up_to,))
            dropped = cursor.rowcount
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error as exc:
            raise SpoolError(
                f"cannot drop the failed messages of {_db.db_path(path)}: {_db.describe(exc)}"
            ) from exc
        finally:
            conn.close()
    finally:
        lock.release()
    return int(dropped)
