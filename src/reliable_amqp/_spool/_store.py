"""The durable spool: an outbox on local disk that a publisher appends to and confirms empty.

Threads: :meth:`Spool.append`, :meth:`~Spool.remove` and :meth:`~Spool.fail` only queue work
under a lock (``append`` encodes the message first, on the caller's thread, so a message the
spool cannot store is refused at ``publish()``); one writer thread takes everything queued at
once and commits it in one SQLite transaction. While it commits, new work piles up behind it and
goes into the next transaction: commits are batched by load, with no timer and no per-message
fsync. A message appended and confirmed before the writer got to it is never written at all.

Durability (``fsync``): SQLite in WAL mode; a commit is in the operating system's hands once it
returns, which is what survives the process being killed. What survives a power loss is what
was fsynced: every commit with ``"commit"``, everything before a :meth:`~Spool.persist` or
:meth:`~Spool.close` with ``"persist"`` (the default), nothing guaranteed with ``"never"``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from reliable_amqp._core.errors import (
    InvalidMessage,
    PublishTimeout,
    SpoolError,
    SpoolFull,
    SpoolWriteError,
)
from reliable_amqp._core.message import OutgoingMessage, new_outgoing
from reliable_amqp._core.options import SPOOL_FSYNC_POLICIES
from reliable_amqp._spool import _codec, _db
from reliable_amqp._spool._lock import DirectoryLock
from reliable_amqp._spool._read import (
    SpoolEntry,
    read_entries,
    verify_pending,
)

log = logging.getLogger("reliable_amqp.spool")
_encode = _codec.encode
_crc32 = zlib.crc32

#: the values of the ``spool_fsync`` option, from the safest to the fastest
FSYNC_POLICIES = SPOOL_FSYNC_POLICIES
DEFAULT_FSYNC = "persist"
DEFAULT_MAX_BYTES = 1024**3
#: how long the writer waits before it tries a failed commit (a full disk) again, at most
_RETRY_MAX = 2.0
#: free pages (16 KiB) at which the writer gives them back to the file system: 16 MiB
GIVE_BACK_PAGES = 1024
#: bytes queued for the writer at most: beyond, append() waits for the disk (a producer faster
#: than the disk would otherwise hold the difference in memory)
QUEUE_MAX_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class SpoolCounts:
    """How many messages (and bytes) a spool holds, pending and failed."""

    pending: int
    pending_bytes: int
    failed: int
    failed_bytes: int


#: a queued append, as the INSERT takes it: (seq, size, crc, meta, body)
_Append = tuple[int, int, int, bytes, bytes]


class Spool:
    """A spool directory opened for writing: the durable outbox of one publisher.

    Opening takes the directory's lock (a second opener gets a :class:`ConfigurationError`
    naming the holder's pid), creates or checks ``spool.db`` and starts the writer thread.
    ``on_commit``, when given, is called on the writer thread after every commit (keep it quick;
    the async publisher uses it to wake its event loop).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        fsync: str = DEFAULT_FSYNC,
        on_commit: Callable[[], None] | None = None,
    ) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {', '.join(FSYNC_POLICIES)}, got {fsync!r}")
        self.directory = os.path.abspath(os.fspath(directory))
        self.path = _db.db_path(self.directory)
        self.max_bytes = max_bytes
        self.fsync = fsync
        #: called on the writer thread after every commit (settable after opening)
        self.on_commit = on_commit
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise SpoolError(f"cannot create the spool directory {self.directory}: {exc}") from exc
        self._lock_file = DirectoryLock(self.directory)
        self._lock_file.acquire()
        try:
            self._conn = _db.connect(self.directory, create=True)
            self._reader = _db.connect(self.directory, create=False)
            counts = self._read_counts(self._conn)
            if counts[1]:
                verify_pending(self._reader, self.path)
        except BaseException:
            for name in ("_reader", "_conn"):
                with contextlib.suppress(Exception):
                    getattr(self, name).close()
            self._lock_file.release()
            raise
        self._sync_full = False
        self._set_synchronous(fsync == "commit")
        #: the file gives freed pages back as it goes (spools made before this are compacted
        #: when closed empty)
        self._incremental = self._conn.execute("PRAGMA auto_vacuum").fetchone()[0] == 2
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # the writer waits on it
        self._changed = threading.Condition(self._lock)  # callers wait on it (room, persist)
        self._read_lock = threading.Lock()
        # caller-side state, under _lock
        self._appends: list[_Append] = []
        self._queued_bytes = 0  # of _appends
        self._removes: list[int] = []
        self._fails: list[tuple[int, str]] = []
        self._next_seq = counts[0] + 1
        self._count = counts[1]
        self._bytes = counts[2]
        self._committed_seq = counts[0]  # every append up to it is committed (or was removed)
        self._synced_seq = counts[0]  # ... and fsynced
        self._persist_target = 0
        self._error: BaseException | None = None
        self._closing = False
        self._abandon = False  # close() timed out: the writer stops trying
        self._closed = False
        self._writer_idle = False
        self._writer = threading.Thread(
            target=self._run, name=f"reliable-amqp-spool {self.directory}", daemon=True
        )
        self._writer.start()

    def __repr__(self) -> str:
        return f"Spool({self.directory!r}, pending={self._count}, bytes={self._bytes})"

    def _read_counts(self, conn: sqlite3.Connection) -> tuple[int, int, int]:
        """(highest seq in the file, pending count, pending bytes)."""
        try:
            (top,) = conn.execute("SELECT max(seq) FROM pending").fetchone()
            (failed_top,) = conn.execute("SELECT max(seq) FROM failed").fetchone()
        except sqlite3.Error as exc:
            raise SpoolError(f"{self.path} cannot be read: {_db.describe(exc)}") from exc
        count, size = _db.pending_counts(conn, self.path)
        return max(top or 0, failed_top or 0), count, size

    # --- the caller's side ----------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Messages in the spool (appended and not yet removed or failed)."""
        return self._count

    @property
    def pending_bytes(self) -> int:
        """Bytes counted against ``max_bytes``: stored record plus body of each pending message."""
        return self._bytes

    @property
    def last_seq(self) -> int:
        """The seq of the last message appended (0 when none ever was)."""
        return self._next_seq - 1

    @property
    def committed_seq(self) -> int:
        """Every message appended up to this seq is committed (readable by :meth:`read`)."""
        return self._committed_seq

    @staticmethod
    def encode(message: OutgoingMessage) -> tuple[bytes, int]:
        """The stored record of ``message`` (all but its body) and its size against the limit.

        Raises :class:`InvalidMessage` for a value the spool cannot store.
        """
        try:
            meta = _codec.encode(message)
        except _codec.Unstorable as exc:
            raise InvalidMessage(
                exc.path, f"cannot be stored in the spool: {exc.problem}"
            ) from None
        return meta, len(meta) + len(message.body)

    def append(
        self,
        message: OutgoingMessage,
        timeout: float | None = None,
        encoded: bytes | None = None,
    ) -> int:
        """Queue ``message`` for the spool; returns its seq. Cheap: the writer thread commits it.

        ``encoded`` is the record :meth:`encode` made of it, if the caller has it already.
        Waits while the spool holds ``max_bytes`` already (one message larger than that is let in
        when the spool is empty), at most ``timeout`` seconds (None: no limit, 0: not at all),
        then raises :class:`PublishTimeout`. Raises :class:`SpoolFull` (or
        :class:`SpoolWriteError`) while the writer cannot write (disk full, I/O error).
        """
        if encoded is not None:
            meta = encoded
        else:
            try:
                meta = _encode(message)
            except _codec.Unstorable as exc:
                raise InvalidMessage(
                    exc.path, f"cannot be stored in the spool: {exc.problem}"
                ) from None
        body = message.body
        size = len(meta) + len(body)
        crc = _crc32(body, _crc32(meta))
        with self._lock:
            if (
                self._error is not None
                or self._closing
                or self._queued_bytes > QUEUE_MAX_BYTES
                or (self._bytes and self._bytes + size > self.max_bytes)
            ):
                self._before_append(message, size, timeout)
            seq = self._next_seq
            self._next_seq = seq + 1
            self._appends.append((seq, size, crc, meta, body))
            self._queued_bytes += size
            self._bytes += size
            self._count += 1
            if self._writer_idle:
                self._writer_idle = False
                self._work.notify()
        return seq

    def _before_append(self, message: OutgoingMessage, size: int, timeout: float | None) -> None:
        """Under the lock, when append() cannot go ahead at once: raise, or wait."""
        if self._error is not None:
            raise self._write_error(message)
        if self._closing:
            raise SpoolError(f"the spool {self.directory} is closed")
        if self._bytes and self._bytes + size > self.max_bytes:
            self._wait_for_room(size, timeout, message)
        if self._queued_bytes > QUEUE_MAX_BYTES:
            self._wait_for_writer(message)

    def _wait_for_room(self, size: int, timeout: float | None, message: OutgoingMessage) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._bytes and self._bytes + size > self.max_bytes:
            if self._error is not None:
                raise self._write_error(message)
            if self._closing:
                raise SpoolError(f"the spool {self.directory} is closed")
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise PublishTimeout(
                    f"the spool {self.directory} held {self._bytes:,} of its {self.max_bytes:,} "
                    f"bytes (spool_max_bytes) for {timeout:g} s: no room for a message of "
                    f"{size:,} bytes; the broker is not confirming (down or blocked?)"
                )
            self._changed.wait(left)

    def _wait_for_writer(self, message: OutgoingMessage) -> None:
        """The writer is behind by more than QUEUE_MAX_BYTES: wait for it (the disk)."""
        while self._queued_bytes > QUEUE_MAX_BYTES:
            if self._error is not None:
                raise self._write_error(message)
            if self._closing:
                raise SpoolError(f"the spool {self.directory} is closed")
            if self._writer_idle:
                self._writer_idle = False
                self._work.notify()
            self._changed.wait(1.0)

    def ready(self, size: int) -> bool:
        """Whether :meth:`append` of a message of ``size`` bytes would not wait (room in the
        spool, the writer not behind): :meth:`has_room` and not :attr:`writer_behind`."""
        current = self._bytes
        return (not current or current + size <= self.max_bytes) and (
            self._queued_bytes <= QUEUE_MAX_BYTES
        )

    @property
    def writer_behind(self) -> bool:
        """Whether :meth:`append` would wait for the writer (more than QUEUE_MAX_BYTES queued)."""
        return self._queued_bytes > QUEUE_MAX_BYTES

    def wait_for_writer(self, timeout: float | None = None) -> None:
        """Wait until the writer is no longer behind (or it failed, or ``timeout`` passed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._queued_bytes > QUEUE_MAX_BYTES and self._error is None:
                if self._closing:
                    return
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return
                self._changed.wait(left)

    def has_room(self, size: int) -> bool:
        """Whether a message of ``size`` bytes (see :meth:`encode`) fits without waiting."""
        current = self._bytes
        return not current or current + size <= self.max_bytes

    def wait_for_room(self, size: int, timeout: float | None) -> bool:
        """Wait until a message of ``size`` bytes fits; False when ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._bytes and self._bytes + size > self.max_bytes and not self._closing:
                if self._error is not None:
                    return True  # append() raises the error itself
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._changed.wait(left)
        return True

    def _write_error(self, message: OutgoingMessage) -> SpoolWriteError:
        error = self._error
        assert error is not None
        cls = SpoolFull if _db.is_disk_full(error) else SpoolWriteError
        reason = "is on a full disk" if cls is SpoolFull else "cannot be written"
        exc = cls(message, self.directory, f"{reason}: {_db.describe(error)}")
        exc.__cause__ = error
        return exc

    def remove(self, seqs: Iterable[int]) -> None:
        """Drop confirmed messages (batched: the writer deletes them with its next commit)."""
        with self._lock:
            self._removes.extend(seqs)
            if self._writer_idle:
                self._writer_idle = False
                self._work.notify()

    def fail(self, seq: int, reason: str) -> None:
        """Move a message that failed for good to the failed table, with why."""
        with self._lock:
            self._fails.append((seq, reason))
            if self._writer_idle:
                self._writer_idle = False
                self._work.notify()

    def persist(self, timeout: float | None = None) -> int:
        """Wait until every message appended so far is durable: committed, and fsynced unless
        ``fsync="never"``. Returns how many are not yet (0: all are) when ``timeout`` passes.

        Raises :class:`SpoolError` when the writer cannot write (the disk is full, say); the
        messages stay queued and are written once it can.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            target = self._next_seq - 1
            if target > self._done_seq():
                self._persist_target = max(self._persist_target, target)
                if self._writer_idle:
                    self._writer_idle = False
                    self._work.notify()
            while (done := self._done_seq()) < target:
                if self._error is not None:
                    raise SpoolError(
                        f"the spool {self.path} cannot be written, {target - done:,} messages "
                        f"are not durable: {_db.describe(self._error)}"
                    ) from self._error
                if self._closed:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._changed.wait(left)
            return max(0, target - self._done_seq())

    def _done_seq(self) -> int:
        return self._committed_seq if self.fsync == "never" else self._synced_seq

    def read(
        self, after: int = 0, limit: int = 1000, build: _codec.Build = new_outgoing
    ) -> list[SpoolEntry]:
        """Committed pending entries with a seq above ``after``, in order, at most ``limit``.

        Raises :class:`SpoolError` naming the file and the entry when one cannot be read back.
        """
        return read_entries(
            self._reader, self._read_lock, self.path, after=after, limit=limit, build=build
        )

    def counts(self) -> SpoolCounts:
        """What the spool holds now (pending as the publisher counts it, failed from the file)."""
        with self._read_lock:
            try:
                failed, failed_bytes = self._reader.execute(
                    "SELECT count(*), total(size) FROM failed"
                ).fetchone()
            except sqlite3.Error as exc:
                raise SpoolError(f"{self.path} cannot be read: {_db.describe(exc)}") from exc
        return SpoolCounts(self._count, self._bytes, int(failed), int(failed_bytes))

    def close(self, timeout: float | None = None) -> None:
        """Write everything queued, make it durable (unless ``fsync="never"``), release the lock.

        Raises :class:`SpoolError` when that cannot be done within ``timeout`` (the disk is full,
        say): what was committed stays; the lock is released unless the writer is stuck in a
        system call (then it goes with the process).
        """
        with self._lock:
            if self._closed:
                return
            self._closing = True
            self._writer_idle = False
            self._work.notify()
            self._changed.notify_all()
        self._writer.join(timeout)
        if self._writer.is_alive():
            with self._lock:
                self._abandon = True
                queued = len(self._appends)
                error = self._error
            self._writer.join(_RETRY_MAX + 1.0)
        if self._writer.is_alive():
            raise SpoolError(
                f"the spool {self.path} could not be closed in time: {queued:,} messages not "
                "written yet" + (f" ({_db.describe(error)})" if error else "")
            )
        with self._read_lock:
            self._reader.close()
        self._lock_file.release()
        if self._error is not None:
            raise SpoolError(
                f"the spool {self.path} closed with {len(self._appends):,} messages not "
                f"written: {_db.describe(self._error)}"
            ) from self._error

    # --- the writer thread ----------------------------------------------------------------------

    def _set_synchronous(self, full: bool) -> None:
        if full != self._sync_full:
            self._conn.execute(f"PRAGMA synchronous = {'FULL' if full else 'NORMAL'}")
            self._sync_full = full

    def _run(self) -> None:
        delay = 0.05
        try:
            while True:
                with self._lock:
                    while not (
                        self._appends
                        or self._removes
                        or self._fails
                        or self._persist_target > self._done_seq()
                        or self._closing
                    ):
                        self._writer_idle = True
                        self._work.wait()
                    self._writer_idle = False
                    appends, self._appends = self._appends, []
                    self._queued_bytes = 0
                    removes, self._removes = self._removes, []
                    fails, self._fails = self._fails, []
                    persist = self._persist_target > self._synced_seq
                    closing = self._closing
                durable = self.fsync == "commit" or (
                    self.fsync == "persist" and (persist or closing)
                )
                try:
                    freed, freed_count = self._commit(appends, removes, fails, durable)
                except (sqlite3.Error, OSError) as exc:
                    with contextlib.suppress(sqlite3.Error):
                        self._conn.execute("ROLLBACK")
                    with self._lock:
                        # keep the work, in order, ahead of anything queued since
                        self._appends[:0] = appends
                        self._queued_bytes += sum(entry[1] for entry in appends)
                        self._removes[:0] = removes
                        self._fails[:0] = fails
                        if self._error is None:
                            log.error("spool %s: cannot write: %s", self.path, _db.describe(exc))
                        self._error = exc
                        self._changed.notify_all()
                        if self._abandon:
                            self._conn.close()
                            return
                    time.sleep(delay)
                    delay = min(delay * 2, _RETRY_MAX)
                    continue
                delay = 0.05
                with self._lock:
                    if self._error is not None:
                        log.warning("spool %s: writing again", self.path)
                    self._error = None
                    if appends:
                        self._committed_seq = appends[-1][0]
                    if durable:
                        self._synced_seq = self._committed_seq
                    self._bytes -= freed
                    self._count -= freed_count
                    self._changed.notify_all()
                    done = closing and not (self._appends or self._removes or self._fails)
                on_commit = self.on_commit
                if on_commit is not None:
                    try:
                        on_commit()
                    except Exception:
                        log.exception("spool %s: on_commit failed", self.path)
                if freed_count and self._incremental:
                    self._give_back()
                if done:
                    self._shutdown()
                    return
        finally:
            with self._lock:
                self._closed = True
                self._changed.notify_all()

    def _commit(
        self,
        appends: list[_Append],
        removes: list[int],
        fails: list[tuple[int, str]],
        durable: bool,
    ) -> tuple[int, int]:
        """One transaction; returns (bytes, messages) that left the pending table."""
        conn = self._conn
        gone = set(removes)
        freed = freed_count = 0  # all that left the pending count
        stored = stored_bytes = 0  # the change of what the table holds
        rows = appends
        if gone and appends:
            rows = []
            for entry in appends:
                if entry[0] in gone:  # confirmed before it was ever written
                    freed += entry[1]
                    freed_count += 1
                    gone.discard(entry[0])
                else:
                    rows.append(entry)
        self._set_synchronous(durable)
        conn.execute("BEGIN")
        if rows:
            conn.executemany(
                "INSERT INTO pending (seq, size, crc, meta, body) VALUES (?, ?, ?, ?, ?)", rows
            )
            stored = len(rows)
            stored_bytes = sum(row[1] for row in rows)
        now = time.time()
        for seq, reason in fails:
            found = conn.execute("SELECT size FROM pending WHERE seq = ?", (seq,)).fetchone()
            if found is None:
                continue
            conn.execute(
                "INSERT OR REPLACE INTO failed (seq, size, crc, meta, body, reason, failed_at) "
                "SELECT seq, size, crc, meta, body, ?, ? FROM pending WHERE seq = ?",
                (reason, now, seq),
            )
            conn.execute("DELETE FROM pending WHERE seq = ?", (seq,))
            freed += found[0]
            freed_count += 1
            stored -= 1
            stored_bytes -= found[0]
        for low, high in _runs(sorted(gone)):
            count, size = conn.execute(
                "SELECT count(*), total(size) FROM pending WHERE seq BETWEEN ? AND ?", (low, high)
            ).fetchone()
            if count:
                conn.execute("DELETE FROM pending WHERE seq BETWEEN ? AND ?", (low, high))
                freed += int(size)
                freed_count += count
                stored -= count
                stored_bytes -= int(size)
        if stored or stored_bytes:
            # the counts kept beside the table, in the same transaction: opening a spool of
            # a million messages reads two numbers rather than scanning a gigabyte
            conn.executemany(
                "UPDATE info SET value = value + ? WHERE key = ?",
                ((stored, "pending_count"), (stored_bytes, "pending_bytes")),
            )
        elif durable and not rows and not fails and not gone:
            # nothing to write, but earlier commits must reach the disk: a commit in FULL mode
            # fsyncs the whole WAL
            conn.execute("UPDATE info SET value = value + 1 WHERE key = 'syncs'")
        conn.execute("COMMIT")
        return freed, freed_count

    def _give_back(self) -> None:
        """Return the pages confirms freed to the file system once there are GIVE_BACK_PAGES of
        them: the file shrinks as the backlog drains (SQLite moves the pages still in use from
        the end of the file into the free ones, then truncates it)."""
        try:
            (free,) = self._conn.execute("PRAGMA freelist_count").fetchone()
            if free >= GIVE_BACK_PAGES:
                # through sqlite3_exec: it frees one page a step, and execute() steps once
                self._conn.executescript(f"PRAGMA incremental_vacuum({free});")
        except sqlite3.Error as exc:  # the next commit says it if the file is in trouble
            log.debug("spool %s: cannot give pages back: %s", self.path, exc)

    def _shutdown(self) -> None:
        """Give the pages freed by confirms back to the file system, fold the WAL in, close.

        Only an empty spool is compacted (``VACUUM`` copies what is left, the failed table): a
        spool the broker emptied after an outage would otherwise keep its peak size on disk. A
        spool made before pages were given back as it drains (``auto_vacuum`` off) is switched
        to that then, which takes a ``VACUUM`` too.
        """
        try:
            if self._count == 0:
                free, total = (
                    self._conn.execute("PRAGMA freelist_count").fetchone()[0],
                    self._conn.execute("PRAGMA page_count").fetchone()[0],
                )
                if not self._incremental:
                    self._conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
                    self._conn.execute("VACUUM")
                elif free * 2 > total > 64:
                    self._conn.execute("VACUUM")
            self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error as exc:
            log.warning("spool %s: cannot compact at close: %s", self.path, exc)
        finally:
            self._conn.close()


def _runs(seqs: list[int]) -> list[tuple[int, int]]:
    """Sorted seqs as (first, last) runs of consecutive numbers: one DELETE per run."""
    runs: list[tuple[int, int]] = []
    if not seqs:
        return runs
    low = high = seqs[0]
    for seq in seqs[1:]:
        if seq == high + 1:
            high = seq
        elif seq != high:
            runs.append((low, high))
            low = high = seq
    runs.append((low, high))
    return runs
