"""Looking into a spool from outside its publisher: counts, failed messages, dropping them.

Reading (:func:`inspect`, :func:`failed_entries`, :func:`check`) works while a publisher has the
spool open (it reads the files as the writer left them, a write in progress aside) and takes no
lock. Dropping failed messages (:func:`drop_failed`) changes the files, so it takes the spool's
lock: it is refused, naming the pid, while a publisher holds it. A spool of the earlier SQLite
format is converted first (which takes the lock too).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

from reliable_amqp._core.errors import SpoolError
from reliable_amqp._core.message import OutgoingMessage, as_message
from reliable_amqp._spool import _codec, _files, _legacy, _scan
from reliable_amqp._spool._files import Found
from reliable_amqp._spool._lock import DirectoryLock, in_use_by


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
    #: bytes the spool's files take on disk (segments, ledger, failed log)
    file_bytes: int
    #: the pid of the process that has the spool open (-1: one does, pid unknown), else None
    in_use_by: int | None
    #: damage found on the way (the counts stop at a damaged record): see :func:`check`
    problems: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class FailedEntry:
    """A message in the failed log: why it failed and when (POSIX seconds)."""

    seq: int
    message: OutgoingMessage
    reason: str
    failed_at: float


def _directory(directory: str | os.PathLike[str]) -> str:
    path = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(path):
        raise SpoolError(f"no spool in {path}: not a directory")
    if _legacy.waiting(path):
        lock = DirectoryLock(path)
        lock.acquire("reliable-amqp spool (to convert a spool of the earlier format)")
        try:
            _legacy.migrate(path)
        finally:
            lock.release()
    return path


def inspect(directory: str | os.PathLike[str]) -> SpoolSummary:
    """Counts and sizes of a spool directory; raises :class:`SpoolError` if it is no spool.

    Reads every record's header and checksum (about a second a gigabyte); damage it meets is
    listed in :attr:`SpoolSummary.problems`, and what is past it not counted."""
    path = _directory(directory)
    holder = in_use_by(path)
    state = _scan.scan(path, repair=False, problems=True)
    files = 0
    for name in os.listdir(path):
        if name in (_files.LEDGER_NAME, _files.FAILED_NAME) or _files.segment_first(name):
            with contextlib.suppress(OSError):
                files += os.stat(os.path.join(path, name)).st_size
    return SpoolSummary(
        path,
        state.pending,
        state.pending_bytes,
        state.failed,
        state.failed_bytes,
        files,
        holder,
        tuple(state.problems),
    )


def failed_entries(directory: str | os.PathLike[str]) -> Iterator[FailedEntry]:
    """Every message of the failed log, in order.

    Raises :class:`SpoolError` naming the entry when one cannot be read back.
    """
    path = _directory(directory)
    if not _scan.exists(path):
        raise SpoolError(f"no spool in {path} ({_files.LEDGER_NAME} does not exist)")
    file = os.path.join(path, _files.FAILED_NAME)
    found = _files.read_failed(file)
    for record in found[0] if found is not None else []:
        try:
            message = _codec.decode(record.meta, record.body)
        except _codec.CodecError as exc:
            raise SpoolError(
                f"{file}: failed entry {record.seq} cannot be decoded: {exc}"
            ) from None
        yield FailedEntry(record.seq, as_message(message), record.reason, record.failed_at)


def check(directory: str | os.PathLike[str]) -> list[str]:
    """Read the whole spool the hard way: every record's checksum, every pending and failed
    message decoded.

    Returns what is wrong, one problem a line (empty: nothing). Takes no lock and changes
    nothing; it takes as long as reading the files does.
    """
    path = _directory(directory)

    def decodes(found: Found) -> str | None:
        try:
            _codec.decode(found.meta, found.body)
        except _codec.CodecError as exc:
            return f"cannot be decoded: {exc}"
        return None

    try:
        state = _scan.scan(path, repair=False, problems=True, check=decodes)
    except SpoolError as exc:
        return [str(exc)]
    problems = state.problems
    try:
        for _entry in failed_entries(path):
            pass
    except SpoolError as exc:
        if str(exc) not in problems:
            problems.append(str(exc))
    return problems


def drop_failed(directory: str | os.PathLike[str], up_to: int | None = None) -> int:
    """Empty the failed log (only entries with seq <= ``up_to`` when given); returns how many.

    Takes the spool's lock: raises :class:`~reliable_amqp.ConfigurationError` naming the pid
    while a publisher has the spool open.
    """
    path = _directory(directory)
    lock = DirectoryLock(path)
    lock.acquire("reliable-amqp spool --drop-failed")
    try:
        state = _scan.scan(path, repair=True)  # the ledger's tail whole before appending to it
        file = os.path.join(path, _files.FAILED_NAME)
        found = _files.read_failed(file)
        records = found[0] if found is not None else []
        dropped: list[_files.FailedRecord] = []
        kept: list[_files.FailedRecord] = []
        for record in records:
            (dropped if up_to is None or record.seq <= up_to else kept).append(record)
        if not dropped:
            return 0
        try:
            # first the ledger: a dropped message must not come back as pending, whatever
            # happens between the two writes
            ledger = os.path.join(path, _files.LEDGER_NAME)
            with open(ledger, "r+b") as out:
                out.seek(state.ledger_bytes)
                out.write(
                    b"".join(
                        _files.ledger_record(_files.REMOVED, low, high)
                        for low, high in _files.runs([r.seq for r in dropped])
                    )
                )
                out.truncate()
                out.flush()
                os.fsync(out.fileno())
            kept_records = [
                _files.failed_record(r.seq, r.failed_at, r.reason, r.meta, r.body) for r in kept
            ]
            _files.replace_file(file, b"".join([_files.FAILED_MAGIC, *kept_records]))
        except OSError as exc:
            raise SpoolError(
                f"cannot drop the failed messages of {file}: {_files.describe(exc)}"
            ) from exc
    finally:
        lock.release()
    return len(dropped)
