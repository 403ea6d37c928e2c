"""The spool's writer thread: it takes what the callers queued, writes it, and keeps the files.

It takes everything queued at once (:class:`~reliable_amqp._spool._shared.Shared`: records,
removals, failures) and writes it in one ``write()`` per file: the records to the active
segment (a new one every ``SEGMENT_BYTES``, the one before made durable first), the failures to
the failed log, the removals and durability marks to the ledger (compacted once it is
``LEDGER_MAX_BYTES``). A segment whose every record left is deleted whole. A failed write (a
full disk) is kept and tried again, with a growing pause, until it goes through or the spool
is abandoned; the callers see the error meanwhile. At close it writes what is left, compacts
the ledger of an emptied spool and closes the files.

Everything here but :class:`Shared`'s fields is this thread's own (but for :meth:`unwritten`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

from reliable_amqp._spool import _codec, _files, _scan
from reliable_amqp._spool._files import Segment
from reliable_amqp._spool._shared import QUEUE_MAX_BYTES, Fail, Shared

log = logging.getLogger("reliable_amqp.spool")

#: how long the writer waits before it tries a failed write (a full disk) again, at most
RETRY_MAX = 2.0
#: how long the writer lets appends pile up into one batch (a process killed loses at most
#: this much of what was not persisted: it is in no file yet)
LINGER = 0.005
#: the ledger is rewritten (what it says, compacted) once it is this large
LEDGER_MAX_BYTES = 256 * 1024

#: the seq a record holds (its header's second field)
_seq_of = _files.RECORD.unpack_from


class SpoolWriter:
    """The writer thread's side of a spool directory: :meth:`run` is the thread.

    Opening it opens the files it appends to (the ledger; the last segment and the failed log
    when first written); ``state`` is what the scan at opening found.
    """

    def __init__(self, directory: str, fsync: str, state: _scan.State, shared: Shared) -> None:
        self.directory = directory
        self.fsync = fsync
        self._shared = shared
        self._active_fd: int | None = None
        #: the active segment (the only one written to: the one before was made durable when
        #: it started) was written since the last fsync
        self._active_dirty = False
        self._dir_dirty = False
        ledger = os.path.join(directory, _files.LEDGER_NAME)
        self._ledger_fd = os.open(ledger, os.O_WRONLY | os.O_CLOEXEC)
        self._ledger_size = state.ledger_bytes
        if self._ledger_size < len(_files.LEDGER_MAGIC):
            self._rewrite_ledger()
        self._failed_fd: int | None = None
        self._failed_size = state.failed_log_bytes
        # work taken from the callers that a failed write left to do again
        self._todo_rows: list[bytes] = []
        self._todo_fails: list[tuple[int, bytes]] = []
        self._todo_ranges: list[tuple[int, int]] = []
        #: ledger marks of segments made durable (fsynced), to write
        self._todo_marks: list[bytes] = []
        #: the last seq the writer took from the callers
        self._taken_seq = state.top

    def unwritten(self) -> int:
        """Messages appended and not written yet (exact once the thread has ended)."""
        return len(self._shared.queue) + len(self._todo_rows)

    def run(self) -> None:
        """The thread: wait for work, take it, write it; until closed (or abandoned)."""
        shared = self._shared
        lock = shared.lock
        delay = 0.05
        try:
            while True:
                with lock:
                    while not self._has_work():
                        shared.writer_idle = True
                        # appends and removals take no lock: one made before the flag was
                        # set did not nudge, and is seen here
                        if self._has_work():
                            break
                        shared.work.wait()
                    shared.writer_idle = False
                    if not (
                        shared.persist_target > shared.durable_seq
                        or shared.closing
                        or shared.fails
                        or shared.queued_bytes > QUEUE_MAX_BYTES // 2
                    ):
                        # let a batch pile up (one write for many messages, not one each);
                        # persist(), close() and a writer falling behind cut it short
                        shared.lingering = True
                        shared.work.wait(LINGER)
                        shared.lingering = False
                    fails, shared.fails = shared.fails, []
                    persist = shared.persist_target > shared.durable_seq
                    closing = shared.closing
                queue = shared.queue
                appends = [queue.popleft() for _ in range(len(queue))]
                removals = shared.removals
                removes: list[tuple[int, int]] = []
                freed = count = 0
                for _ in range(len(removals)):
                    runs, n, size = removals.popleft()
                    removes += runs
                    count += n
                    freed += size
                shared.out_bytes += sum(map(len, appends)) - _files.RECORD.size * len(appends)
                shared.freed_bytes += freed
                shared.freed_count += count
                self._take(appends, removes, fails)
                durable = self.fsync == "commit" or (
                    self.fsync == "persist" and (persist or closing)
                )
                try:
                    self._write(durable)
                except OSError as exc:
                    with lock:
                        if shared.error is None:
                            log.error(
                                "spool %s: cannot write: %s", self.directory, _files.describe(exc)
                            )
                        shared.error = exc
                        shared.changed.notify_all()
                        if shared.abandon:
                            return
                    time.sleep(delay)
                    delay = min(delay * 2, RETRY_MAX)
                    continue
                delay = 0.05
                with lock:
                    if shared.error is not None:
                        log.warning("spool %s: writing again", self.directory)
                    shared.error = None
                    # every append taken is written now (or was confirmed before it had to be)
                    shared.committed_seq = max(shared.committed_seq, self._taken_seq)
                    if durable or self.fsync == "never":
                        shared.durable_seq = shared.committed_seq
                    shared.changed.notify_all()
                    done = closing and not (shared.queue or shared.removals or shared.fails)
                on_commit = shared.on_commit
                if on_commit is not None:
                    try:
                        on_commit()
                    except Exception:
                        log.exception("spool %s: on_commit failed", self.directory)
                if done:
                    self._shutdown()
                    return
        finally:
            with lock:
                shared.closed = True
                shared.changed.notify_all()

    def _has_work(self) -> bool:
        shared = self._shared
        return bool(
            shared.queue
            or shared.removals
            or shared.fails
            or self._todo_rows
            or self._todo_fails
            or self._todo_ranges
            or self._todo_marks
            or shared.persist_target > shared.durable_seq
            or shared.closing
        )

    def _take(
        self, appends: list[bytes], removes: list[tuple[int, int]], fails: list[Fail]
    ) -> None:
        """Work taken from the callers becomes the writer's to do (kept across failed writes).
        ``removes``: runs of seqs confirmed; the appends among them are never written."""
        shared = self._shared
        first = self._taken_seq + 1
        self._taken_seq += len(appends)
        gone = _files.merge_runs(removes)
        self._todo_rows += _files.cut_runs(appends, first, gone) if gone else appends
        now = time.time()
        for seq, message, reason in fails:
            meta = _codec.encode(message)
            self._todo_fails.append(
                (seq, _files.failed_record(seq, now, reason, meta, message.body))
            )
            with shared.lock:
                size = len(meta) + len(message.body)
                shared.freed_count += 1
                shared.freed_bytes += size
                shared.failed += 1
                shared.failed_bytes += size
        if fails:
            gone = _files.merge_runs(gone + [(seq, seq) for seq, _m, _r in fails])
        if gone:
            with shared.lock:
                for low, high in gone:
                    shared.removed.add(low, high)
            self._todo_ranges += gone

    def _write(self, durable: bool) -> None:
        """Write what is to do: records, failures, the ledger; fsync when ``durable``."""
        if self._todo_rows:
            self._write_rows(self._todo_rows)
            self._todo_rows = []
        if self._todo_fails:
            fd = self._failed_file()
            data = b"".join(record for _seq, record in self._todo_fails)
            _append(fd, data, self._failed_size)
            self._failed_size += len(data)
            self._todo_fails = []
        if durable:
            self._todo_marks += self._sync()
        if self._todo_ranges or self._todo_marks:
            marks = self._todo_marks
            data = b"".join(
                [_files.ledger_record(_files.REMOVED, low, high) for low, high in self._todo_ranges]
                + marks
            )
            _append(self._ledger_fd, data, self._ledger_size)
            self._ledger_size += len(data)
            self._todo_ranges = []
            self._todo_marks = []
            if marks:
                os.fsync(self._ledger_fd)
            self._drop_segments()
            if self._ledger_size > LEDGER_MAX_BYTES:
                self._rewrite_ledger()

    def _write_rows(self, rows: list[bytes]) -> None:
        """Append records to the active segment in one write; start a new segment after it
        when it holds SEGMENT_BYTES (a segment is never split inside a batch)."""
        segments = self._shared.segments
        segment = segments[-1] if segments and self._active_fd is not None else None
        if segment is None or segment.size >= _files.SEGMENT_BYTES:
            segment = self._new_segment(_seq_of(rows[0])[1])
        data = b"".join(rows)
        fd = self._active_fd
        assert fd is not None
        _append(fd, data, segment.size)
        with self._shared.lock:
            segment.size += len(data)
            segment.last = _seq_of(rows[-1])[1]
        self._active_dirty = True

    def _new_segment(self, first: int) -> Segment:
        if self._active_fd is not None:
            # whole and durable before the next one starts, whatever the fsync policy (one
            # fsync a SEGMENT_BYTES): only the last segment can hold a tail a power loss cut
            done = self._shared.segments[-1]
            os.fsync(self._active_fd)
            done.synced = done.size
            self._todo_marks.append(_files.ledger_record(_files.SYNCED, done.first, done.size))
            self._active_dirty = False
            os.close(self._active_fd)
            self._active_fd = None
        path = os.path.join(self.directory, _files.segment_name(first))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            _files.write_all(fd, _files.SEGMENT_HEAD.pack(_files.SEGMENT_MAGIC, first))
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        self._active_fd = fd
        self._dir_dirty = True
        head = _files.SEGMENT_HEAD.size
        segment = Segment(path, first, first - 1, head, 0)
        with self._shared.lock:
            self._shared.segments.append(segment)
        return segment

    def _failed_file(self) -> int:
        if self._failed_fd is None:
            path = os.path.join(self.directory, _files.FAILED_NAME)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
            if self._failed_size < len(_files.FAILED_MAGIC):
                os.ftruncate(fd, 0)
                _files.write_all(fd, _files.FAILED_MAGIC)
                self._failed_size = len(_files.FAILED_MAGIC)
                self._dir_dirty = True
            self._failed_fd = fd
        return self._failed_fd

    def _sync(self) -> list[bytes]:
        """fsync what was written since the last time; the ledger's marks of it."""
        marks = []
        if self._active_dirty and self._active_fd is not None:
            os.fsync(self._active_fd)
            active = self._shared.segments[-1]
            active.synced = active.size
            marks.append(_files.ledger_record(_files.SYNCED, active.first, active.size))
        self._active_dirty = False
        if self._failed_fd is not None:
            os.fsync(self._failed_fd)
        if self._dir_dirty:
            _files.sync_directory(self.directory)
            self._dir_dirty = False
        if not marks:  # the ledger's removals reach the disk with the ledger's fsync
            marks.append(b"")
        return marks

    def _drop_segments(self) -> None:
        """Delete the segments whose every record left the pending set (the active one too:
        the next append starts a new one)."""
        shared = self._shared
        removed = shared.removed
        segments = shared.segments
        gone = []
        for segment in segments:
            if not removed.covers(segment.first, segment.last):
                break  # confirms come in order, near enough: the rest are newer
            gone.append(segment)
        if not gone:
            return
        with shared.lock:
            del segments[: len(gone)]
        if not segments and self._active_fd is not None:  # the active one went too
            os.close(self._active_fd)
            self._active_fd = None
            self._active_dirty = False
        for segment in gone:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(segment.path)

    def _rewrite_ledger(self) -> None:
        """Write what the ledger says, compacted, to a new file and rename it over the old."""
        removed = self._shared.removed
        # the floor's range, (1, floor - 1), keeps the numbering going with no segment left
        records = [_files.LEDGER_MAGIC]
        for low, high in removed.ranges():
            records.append(_files.ledger_record(_files.REMOVED, low, high))
        for segment in self._shared.segments:
            if segment.synced:
                records.append(_files.ledger_record(_files.SYNCED, segment.first, segment.synced))
        data = b"".join(records)
        path = os.path.join(self.directory, _files.LEDGER_NAME)
        fd = _files.replace_file(path, data, keep_open=True)
        assert fd is not None
        os.close(self._ledger_fd)
        self._ledger_fd = fd
        self._ledger_size = len(data)

    def _shutdown(self) -> None:
        """Compact the ledger of an emptied spool and close the files."""
        try:
            if self._shared.pending == 0 and self._ledger_size > len(_files.LEDGER_MAGIC) + 64:
                self._rewrite_ledger()
        except OSError as exc:
            log.warning("spool %s: cannot compact at close: %s", self.directory, exc)
        finally:
            for fd in (self._active_fd, self._failed_fd, self._ledger_fd):
                if fd is not None:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            self._active_fd = self._failed_fd = None


def _append(fd: int, data: bytes, size: int) -> None:
    """Write ``data`` at the end of a file of ``size`` whole bytes; on failure, cut what was
    written of it, so that a retry writes it whole again."""
    try:
        os.lseek(fd, size, os.SEEK_SET)
        _files.write_all(fd, data)
    except OSError:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, size)
        raise
