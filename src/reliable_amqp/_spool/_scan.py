"""Reading a whole spool directory: what is pending, what failed, whether anything is damaged.

Opening a spool (:class:`~reliable_amqp._spool._store.Spool`), looking into one from outside
(:mod:`~reliable_amqp._spool._inspect`) and ``--check`` all read it here, so that a damaged
record is named in the same words whoever finds it. Every pending record is read once and its
checksum checked: a damaged message stops the publisher before anything is sent.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from reliable_amqp._core.errors import SpoolError
from reliable_amqp._spool import _files
from reliable_amqp._spool._files import Found, Removed, Segment

log = logging.getLogger("reliable_amqp.spool")


@dataclass
class State:
    """What a spool directory holds."""

    directory: str
    segments: list[Segment] = field(default_factory=list)
    removed: Removed = field(default_factory=Removed)
    pending: int = 0
    pending_bytes: int = 0
    failed: int = 0
    failed_bytes: int = 0
    #: the highest seq the spool ever gave (the next append gets the one after)
    top: int = 0
    #: bytes of whole records in the ledger and the failed log (appends go after them)
    ledger_bytes: int = 0
    failed_log_bytes: int = 0
    #: what was found wrong (only when scanning with ``problems``; otherwise the first raises)
    problems: list[str] = field(default_factory=list)


def exists(directory: str) -> bool:
    """Whether the directory holds a spool in this format (its ledger)."""
    return os.path.exists(os.path.join(directory, _files.LEDGER_NAME))


def scan(
    directory: str,
    *,
    repair: bool,
    problems: bool = False,
    check: Callable[[Found], str | None] | None = None,
) -> State:
    """Read the spool in ``directory`` (its ledger must exist).

    ``repair`` (under the spool's lock only): cut a tail a crash left half-written, delete
    segments whose every record left. ``problems``: collect what is damaged in
    :attr:`State.problems` instead of raising at the first. ``check`` is called for each pending
    record and returns what is wrong with it (``--check`` decodes every one).
    """
    state = State(directory)
    ledger_path = os.path.join(directory, _files.LEDGER_NAME)
    ledger = _files.read_ledger(ledger_path)
    if ledger is None:
        raise SpoolError(f"no spool in {directory} ({_files.LEDGER_NAME} does not exist)")
    state.removed = removed = ledger.removed
    state.ledger_bytes = ledger.good_bytes
    if repair and ledger.good_bytes < ledger.size:
        _cut(ledger_path, ledger.good_bytes, "ledger", ledger.size)
    failed_path = os.path.join(directory, _files.FAILED_NAME)
    failed_problem = None
    try:
        found = _files.read_failed(failed_path)
    except SpoolError as exc:
        if not problems:
            raise
        failed_problem = str(exc)  # listed after the segments': the order of the files
        found = None
    if found is not None:
        failed, good = found
        state.failed_log_bytes = good
        state.failed = len(failed)
        state.failed_bytes = sum(record.size for record in failed)
        for record in failed:
            removed.add(record.seq, record.seq)
            state.top = max(state.top, record.seq)
        size = os.path.getsize(failed_path)
        if repair and good < size:
            _cut(failed_path, good, "failed log", size)
    state.top = max(state.top, removed.top)
    listed = _files.list_segments(directory)
    after = 0
    for number, (first, path) in enumerate(listed):
        last_one = number == len(listed) - 1
        try:
            segment, after = _segment(
                state,
                path,
                first=first,
                after=after,
                synced=ledger.synced.get(first, 0),
                last_one=last_one,
                repair=repair,
                collect=problems,
                check=check,
            )
        except SpoolError as exc:
            if not problems:
                raise
            state.problems.append(str(exc))
            continue
        if segment is None:
            continue
        state.top = max(state.top, segment.last)
        if repair and removed.covers(segment.first, segment.last):
            _delete(segment.path)
            continue
        state.segments.append(segment)
    if failed_problem is not None:
        state.problems.append(failed_problem)
    return state


def _segment(
    state: State,
    path: str,
    *,
    first: int,
    after: int,
    synced: int,
    last_one: bool,
    repair: bool,
    collect: bool,
    check: Callable[[Found], str | None] | None,
) -> tuple[Segment | None, int]:
    size = _files.segment_header(path, first)
    head = _files.SEGMENT_HEAD.size
    if first <= after:
        raise SpoolError(f"{path} starts at seq {first}, inside the segment before it")
    if size < head:  # made, its header never written whole: nothing in it
        if repair:
            _delete(path)
        return None, after
    if synced > size:
        raise SpoolError(
            f"{path} is {size:,} bytes, but {synced:,} of it were made durable: the file was "
            "cut after it was written; it was left in place"
        )
    removed = state.removed
    last = first - 1
    end = head
    start: int | None = head
    while start is not None:
        items = _files.records(path, start, size, after=max(after, last))
        start = None
        try:
            for item in items:
                last = item.seq
                end = item.end
                if item.seq not in removed:
                    state.pending += 1
                    state.pending_bytes += len(item.meta) + len(item.body)
                    if check is not None and (problem := check(item)) is not None:
                        state.problems.append(f"{path}: entry {item.seq} {problem}")
        except _files.BadRecord as bad:
            if last_one and bad.offset >= max(synced, head):
                # past what was made durable, in the last segment: the tail of a write a crash
                # cut short (or the disk lost, unsynced); what is before it is whole
                if repair:
                    _cut(path, bad.offset, "segment", size)
                break
            error = _files.damaged(path, bad.seq, bad.offset)
            if not collect:
                raise error from None
            state.problems.append(str(error))
            # name every damaged entry: go on from the next record that checks, if any
            start = _files.any_whole_record(path, bad.offset, size, max(after, last))
    return Segment(path, first, last, end, max(synced, head)), max(after, last)


def _cut(path: str, good: int, what: str, size: int) -> None:
    log.warning(
        "spool: %s: the last write of its %s was cut short (a crash): %d bytes after byte %d "
        "dropped, everything before them kept",
        path,
        what,
        size - good,
        good,
    )
    try:
        with open(path, "r+b") as file:
            file.truncate(good)
            os.fsync(file.fileno())
    except OSError as exc:
        raise SpoolError(f"cannot repair {path}: {_files.describe(exc)}") from exc


def _delete(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise SpoolError(f"cannot delete {path}: {_files.describe(exc)}") from exc
