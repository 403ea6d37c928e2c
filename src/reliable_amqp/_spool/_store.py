"""The durable spool: an outbox on local disk that a publisher appends to and confirms empty.

Storage (:mod:`reliable_amqp._spool._files`): a log, not a database. Records are appended to
segment files in seq order; what the broker confirmed is written to a small ledger as ranges of
seqs; a segment whose every record was confirmed is deleted whole, so the directory shrinks as a
backlog drains. Reading back is sequential.

Threads: two sides, one object between them (:class:`~reliable_amqp._spool._shared.Shared`,
which says who writes each of its fields, under which lock). The caller's side is
:class:`Spool`: :meth:`~Spool.append`, :meth:`~Spool.remove` and :meth:`~Spool.fail` only
queue work (``append`` encodes the message first, on the caller's thread, so a message the
spool cannot store is refused at ``publish()``), back-pressure waits for room or for the disk,
:meth:`~Spool.persist` waits for durability. The writer thread's side is
:class:`~reliable_amqp._spool._writer.SpoolWriter`: it takes everything queued at once and
writes it in one ``write()`` per file. While it writes, new work piles up behind it and goes
into the next batch: writes are batched by load, with no timer and no per-message fsync. A
message appended and confirmed before the writer got to it is never written at all.

Durability (``fsync``): a written batch is in the operating system's hands once ``write()``
returns, which is what survives the process being killed. What survives a power loss is what
was fsynced: every batch with ``"commit"``, everything before a :meth:`~Spool.persist` or
:meth:`~Spool.close` with ``"persist"`` (the default), nothing guaranteed with ``"never"``. After
each fsync the ledger records how far each segment is durable: a record before that mark that
does not check is damage (opening refuses, naming it); one after it is the tail of a write a
crash cut short, cut off when the spool opens.
"""

from __future__ import annotations

import bisect
import os
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
from reliable_amqp._core.message import MessageParts, as_message, new_outgoing
from reliable_amqp._core.options import SPOOL_FSYNC_POLICIES
from reliable_amqp._spool import _codec, _files, _legacy, _scan
from reliable_amqp._spool._lock import DirectoryLock
from reliable_amqp._spool._read import SpoolEntry, undecodable
from reliable_amqp._spool._shared import QUEUE_MAX_BYTES, Shared
from reliable_amqp._spool._writer import RETRY_MAX, SpoolWriter

_encode = _codec.encode
_crc32 = zlib.crc32  # a module global: the append below is the hot path
_pack_record = _files.RECORD.pack


def encode_record(message: MessageParts) -> bytes:
    """The stored record of ``message``, all but its body (:func:`_codec.encode`).

    Raises :class:`InvalidMessage` for a value the spool cannot store.
    """
    try:
        return _encode(message)
    except _codec.Unstorable as exc:
        raise InvalidMessage(exc.path, f"cannot be stored in the spool: {exc.problem}") from None


#: the values of the ``spool_fsync`` option, from the safest to the fastest
FSYNC_POLICIES = SPOOL_FSYNC_POLICIES
DEFAULT_FSYNC = "persist"
DEFAULT_MAX_BYTES = 1024**3


@dataclass(frozen=True, slots=True)
class SpoolCounts:
    """How many messages (and bytes) a spool holds, pending and failed."""

    pending: int
    pending_bytes: int
    failed: int
    failed_bytes: int


class Spool:
    """A spool directory opened for writing: the durable outbox of one publisher, as its
    caller's side (see the module docstring; the writer thread is a :class:`SpoolWriter`).

    Opening takes the directory's lock (a second opener gets a :class:`ConfigurationError`
    naming the holder's pid), converts a spool of the earlier SQLite format, reads every pending
    record once (checking its checksum: a damaged one raises :class:`SpoolError` naming the file
    and the entry, and nothing is dropped) and starts the writer thread. ``on_commit``, when
    given, is called on the writer thread after every batch it wrote (keep it quick; the async
    publisher uses it to wake its event loop).
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
        #: the file that names the spool in errors: its ledger
        self.path = os.path.join(self.directory, _files.LEDGER_NAME)
        self.max_bytes = max_bytes
        self.fsync = fsync
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise SpoolError(f"cannot create the spool directory {self.directory}: {exc}") from exc
        self._lock_file = DirectoryLock(self.directory)
        self._lock_file.acquire()
        try:
            _legacy.migrate(self.directory)
            if not _scan.exists(self.directory):
                _new_spool(self.directory)
            state = _scan.scan(self.directory, repair=True)
            # what was pending at opening counts as appended and taken by the writer
            self._shared = shared = Shared(
                next_seq=state.top + 1,
                in_bytes=state.pending_bytes,
                on_commit=on_commit,
                out_bytes=state.pending_bytes,
                freed_count=state.top - state.pending,
                committed_seq=state.top,
                durable_seq=state.top,
                failed=state.failed,
                failed_bytes=state.failed_bytes,
                segments=state.segments,
                removed=state.removed,
            )
            self._writer = SpoolWriter(self.directory, fsync, state, shared)
        except BaseException:
            self._lock_file.release()
            raise
        #: where the last read() stopped: (seq, segment first seq, byte offset); read() is
        #: the caller's, it takes the lock only against a read() from another thread
        self._cursor = (-1, 0, 0)
        self._thread = threading.Thread(
            target=self._writer.run, name=f"reliable-amqp-spool {self.directory}", daemon=True
        )
        self._thread.start()

    def __repr__(self) -> str:
        return f"Spool({self.directory!r}, pending={self.pending}, bytes={self.pending_bytes})"

    @property
    def on_commit(self) -> Callable[[], None] | None:
        """Called on the writer thread after every batch (settable after opening)."""
        return self._shared.on_commit

    @on_commit.setter
    def on_commit(self, on_commit: Callable[[], None] | None) -> None:
        self._shared.on_commit = on_commit

    @property
    def pending(self) -> int:
        """Messages in the spool (appended and not yet removed or failed)."""
        return self._shared.pending

    @property
    def pending_bytes(self) -> int:
        """Bytes counted against ``max_bytes``: stored record plus body of each pending message."""
        return self._shared.pending_bytes

    @property
    def last_seq(self) -> int:
        """The seq of the last message appended (0 when none ever was)."""
        return self._shared.next_seq - 1

    @property
    def committed_seq(self) -> int:
        """Every message appended up to this seq is written (readable by :meth:`read`)."""
        return self._shared.committed_seq

    # --- append ---------------------------------------------------------------------------------

    @staticmethod
    def encode(message: MessageParts) -> tuple[bytes, int]:
        """The stored record of ``message`` (all but its body) and its size against the limit.

        Raises :class:`InvalidMessage` for a value the spool cannot store.
        """
        meta = encode_record(message)
        return meta, len(meta) + len(message.body)

    def append(
        self,
        message: MessageParts,
        timeout: float | None = None,
        encoded: bytes | None = None,
    ) -> int:
        """Queue ``message`` for the spool; returns its seq. Cheap: the writer thread writes it.
        Not to be called from two threads at once (the publishers never do).

        ``encoded`` is the record :meth:`encode` made of it, if the caller has it already.
        Waits while the spool holds ``max_bytes`` already (one message larger than that is let in
        when the spool is empty), at most ``timeout`` seconds (None: no limit, 0: not at all),
        then raises :class:`PublishTimeout`. Raises :class:`SpoolFull` (or
        :class:`SpoolWriteError`) while the writer cannot write (disk full, I/O error).
        """
        meta = encoded if encoded is not None else encode_record(message)
        size = len(meta) + len(message.body)
        while True:
            seq = self.try_append(meta, message.body, size)
            if seq:
                return seq
            with self._shared.lock:
                self._wait_to_append(message, size, timeout)  # raises, or waits

    def try_append(self, meta: bytes, body: bytes, size: int) -> int:
        """:meth:`append` of a message whose stored record is ``meta`` (``size``: as
        :meth:`encode` counts it), when it can go ahead at once: its seq. 0 when it cannot (no
        room, the writer behind, or failed, or the spool closing): :meth:`append` then waits,
        or raises saying why. One call where a publisher's usual case is quickest."""
        shared = self._shared
        in_bytes = shared.in_bytes
        held = in_bytes - shared.freed_bytes
        if (
            shared.error is not None
            or shared.closing
            or in_bytes - shared.out_bytes > QUEUE_MAX_BYTES
            or (held and held + size > self.max_bytes)
        ):
            return 0
        seq = shared.next_seq
        # the whole record, here: the writer only joins records (_files.record, inline)
        meta_size = len(meta)
        data = meta + body  # one crc over both: the crc of meta then body (_files.record_crc)
        crc = _crc32(data) ^ (seq ^ seq >> 32) & 0xFFFFFFFF
        record = _pack_record(crc, seq, meta_size, size - meta_size) + data
        # no call from here to the append: a Ctrl-C (taken where a call returns) lands before
        # the seq is taken or after the record is queued, never between (a seq with no record)
        shared.next_seq = seq + 1
        shared.in_bytes = in_bytes + size
        shared.queue.append(record)
        if shared.writer_idle:
            with shared.lock:
                shared.nudge()
        return seq

    def check_writable(self, message: MessageParts) -> None:
        """Raise what refuses ``message`` for good, if anything: :class:`SpoolFull` (or
        :class:`SpoolWriteError`) while the writer cannot write, :class:`SpoolError` once the
        spool is closing. (What :meth:`try_append` refused otherwise is worth waiting for.)"""
        shared = self._shared
        if shared.error is not None or shared.closing:
            with shared.lock:
                self._check_open(message)

    def _check_open(self, message: MessageParts) -> None:
        """Under the lock: raise what refuses ``message`` for good, if anything."""
        error = self._shared.error
        if error is not None:
            cls = SpoolFull if _files.is_disk_full(error) else SpoolWriteError
            reason = "is on a full disk" if cls is SpoolFull else "cannot be written"
            exc = cls(as_message(message), self.directory, f"{reason}: {_files.describe(error)}")
            exc.__cause__ = error
            raise exc
        if self._shared.closing:
            raise SpoolError(f"the spool {self.directory} is closed")

    # --- back-pressure --------------------------------------------------------------------------

    def _wait_to_append(self, message: MessageParts, size: int, timeout: float | None) -> None:
        """Under the lock, when append() cannot go ahead at once: raise, or wait for room (at
        most ``timeout``), then for the writer."""
        shared = self._shared
        self._check_open(message)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.has_room(size):
            self._check_open(message)
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise self.timeout_error(size, timeout or 0.0)
            shared.changed.wait(left)
        while shared.queued_bytes > QUEUE_MAX_BYTES:  # the writer is behind: wait for the disk
            self._check_open(message)
            shared.nudge()
            shared.changed.wait(1.0)

    def timeout_error(self, size: int, waited: float) -> PublishTimeout:
        """The :class:`PublishTimeout` of a publish() of ``size`` bytes (as :meth:`encode`
        counts them) that waited ``waited`` seconds for the spool: for its writer (the disk), or
        for room (confirms)."""
        if self.writer_behind:
            return PublishTimeout(
                f"the spool {self.directory} could not write what was queued for it fast "
                f"enough for {waited:g} s (the disk is slower than the producer)"
            )
        return PublishTimeout(
            f"the spool {self.directory} held {self.pending_bytes:,} of its "
            f"{self.max_bytes:,} bytes (spool_max_bytes) for {waited:g} s: no room for a "
            f"message of {size:,} bytes; the broker is not confirming (down or blocked?)"
        )

    @property
    def writer_behind(self) -> bool:
        """Whether :meth:`append` would wait for the writer (more than QUEUE_MAX_BYTES queued)."""
        return self._shared.queued_bytes > QUEUE_MAX_BYTES

    def wait_for_writer(self, timeout: float | None = None) -> None:
        """Wait until the writer is no longer behind (or it failed, or ``timeout`` passed)."""
        shared = self._shared
        deadline = None if timeout is None else time.monotonic() + timeout
        with shared.lock:
            while shared.queued_bytes > QUEUE_MAX_BYTES and shared.error is None:
                if shared.closing:
                    return
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return
                shared.changed.wait(left)

    def has_room(self, size: int) -> bool:
        """Whether a message of ``size`` bytes (see :meth:`encode`) fits without waiting."""
        current = self._shared.pending_bytes
        return not current or current + size <= self.max_bytes

    def wait_for_room(self, size: int, timeout: float | None) -> bool:
        """Wait until a message of ``size`` bytes fits; False when ``timeout`` passed first."""
        shared = self._shared
        deadline = None if timeout is None else time.monotonic() + timeout
        with shared.lock:
            while not self.has_room(size) and not shared.closing:
                if shared.error is not None:
                    return True  # append() raises the error itself
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                shared.changed.wait(left)
        return True

    # --- removing, failing, persisting ------------------------------------------------------------

    def remove(self, seqs: Iterable[int], size: int) -> None:
        """Drop confirmed messages, ``size`` bytes in all (their sizes as :meth:`encode` gave
        them): batched, the writer records them with its next batch."""
        seqs = list(seqs)
        self.remove_runs(_files.runs(seqs), len(set(seqs)), size)

    def remove_runs(self, runs: list[tuple[int, int]], count: int, size: int) -> None:
        """:meth:`remove` of ``count`` messages given as (first, last) runs of seqs (disjoint),
        what a publisher has at hand: the writer's work is then per run, not per message."""
        shared = self._shared
        shared.removals.append((runs, count, size))
        if shared.writer_idle:
            with shared.lock:
                shared.nudge()

    def fail(self, seq: int, message: MessageParts, reason: str) -> None:
        """Move a message that failed for good (``seq``, read back as ``message``) to the failed
        log, with why."""
        shared = self._shared
        with shared.lock:
            shared.fails.append((seq, message, reason))
            shared.nudge()

    def persist(self, timeout: float | None = None) -> int:
        """Wait until every message appended so far is durable: written, and fsynced unless
        ``fsync="never"``. Returns how many are not yet (0: all are) when ``timeout`` passes.

        Raises :class:`SpoolError` when the writer cannot write (the disk is full, say); the
        messages stay queued and are written once it can.
        """
        shared = self._shared
        deadline = None if timeout is None else time.monotonic() + timeout
        with shared.lock:
            target = shared.next_seq - 1
            if target > shared.durable_seq:
                shared.persist_target = max(shared.persist_target, target)
                shared.nudge()
            while (done := shared.durable_seq) < target:
                if shared.error is not None:
                    raise SpoolError(
                        f"the spool {self.directory} cannot be written, {target - done:,} "
                        f"messages are not durable: {_files.describe(shared.error)}"
                    ) from shared.error
                if shared.closed:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                shared.changed.wait(left)
            return max(0, target - shared.durable_seq)

    # --- reading back, counting, closing --------------------------------------------------------

    def read(
        self, after: int = 0, limit: int = 1000, build: _codec.Build = new_outgoing
    ) -> list[SpoolEntry]:
        """Written pending entries with a seq above ``after``, in order, at most ``limit``.

        Raises :class:`SpoolError` naming the file and the entry when one cannot be read back.
        """
        shared = self._shared
        with shared.lock:
            spans = [(s.first, s.path, s.size) for s in shared.segments]
            removed = shared.removed.copy()
            cursor = self._cursor
        if not spans:
            return []
        entries: list[SpoolEntry] = []
        firsts = [span[0] for span in spans]
        at = max(0, bisect.bisect_right(firsts, after + 1) - 1)
        head = _files.SEGMENT_HEAD.size
        offset, floor = head, spans[at][0] - 1  # floor: the seqs rise above it
        if cursor[0] == after and spans[at][0] == cursor[1]:
            offset, floor = cursor[2], after  # go on where the last read stopped
        last = cursor
        # below gone_floor every seq left; from check_at on, some may have (a run above)
        gone_floor, check_at = removed.floor, removed.first_low_above(after)
        decode = _codec.decode
        add = entries.append
        for first, path, size in spans[at:]:
            found = None
            try:
                # each record: checked, skipped if it left, decoded (a drain is this loop)
                for found in _files.records(path, offset, size, after=floor):
                    seq, _at, _end, meta, body = found
                    if seq <= after or seq < gone_floor or (seq >= check_at and seq in removed):
                        continue
                    add(
                        _new_tuple(
                            SpoolEntry, (seq, decode(meta, body, build), len(meta) + len(body))
                        )
                    )
                    if len(entries) >= limit:
                        break
            except _files.BadRecord as bad:
                raise _files.damaged(path, bad.seq, bad.offset) from None
            except _codec.CodecError as exc:
                assert found is not None
                raise undecodable(path, found[0], exc) from None
            if found is not None:
                last = (found[0], first, found[2])
            if len(entries) >= limit:
                break
            offset = head
            floor = first  # the next segment's seqs are above this one's
        with shared.lock:
            self._cursor = last
        return entries

    def counts(self) -> SpoolCounts:
        """What the spool holds now."""
        shared = self._shared
        return SpoolCounts(self.pending, self.pending_bytes, shared.failed, shared.failed_bytes)

    def close(self, timeout: float | None = None) -> None:
        """Write everything queued, make it durable (unless ``fsync="never"``), release the lock.

        Raises :class:`SpoolError` when that cannot be done within ``timeout`` (the disk is full,
        say): what was written stays; the lock is released unless the writer is stuck in a
        system call (then it goes with the process).
        """
        shared = self._shared
        with shared.lock:
            if shared.closed:
                return
            shared.closing = True
            shared.nudge()
            shared.changed.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            with shared.lock:
                shared.abandon = True
                queued = self._writer.unwritten()
                error = shared.error
            self._thread.join(RETRY_MAX + 1.0)
        if self._thread.is_alive():
            raise SpoolError(
                f"the spool {self.directory} could not be closed in time: {queued:,} messages "
                "not written yet" + (f" ({_files.describe(error)})" if error else "")
            )
        self._lock_file.release()
        if shared.error is not None:
            raise SpoolError(
                f"the spool {self.directory} closed with {self._writer.unwritten():,} messages "
                f"not written: {_files.describe(shared.error)}"
            ) from shared.error


def _new_spool(directory: str) -> None:
    """A new spool: its ledger (written whole, then renamed into place)."""
    path = os.path.join(directory, _files.LEDGER_NAME)
    try:
        _files.replace_file(path, _files.LEDGER_MAGIC)
    except OSError as exc:
        raise SpoolError(f"cannot create the spool {directory}: {_files.describe(exc)}") from exc


_new_tuple = tuple.__new__
