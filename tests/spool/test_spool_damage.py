"""What a spool does with a file cut short or damaged (issue 21).

- The tail: the spool's last write (its last commit: frames appended to SQLite's write-ahead
  log) cut short, as a power loss can leave it, reopens as exactly a prefix of what was
  appended: everything before that commit, never a part of it, never anything damaged. Cut at
  every byte of the frame headers and of the write's end, and every 61st byte inside the pages
  (all cuts inside a page are one case: the frame is incomplete), about 900 cuts.
- A flipped byte inside an older record: ``check()`` (``reliable-amqp spool DIR --check``)
  names the file and the entry, and opening the spool refuses with the same words, dropping
  nothing.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import threading
from pathlib import Path

import pytest

from reliable_amqp import SpoolError
from reliable_amqp._spool import Spool, check
from reliable_amqp._spool._db import PAGE_SIZE
from reliable_amqp._spool._read import read_entries
from spool_support import messages


def _ids(directory: Path) -> list[str]:
    """The message ids of the pending entries, read back (checksums checked) through a read-only
    SQLite connection: it recovers the write-ahead log as SQLite does after a crash, and being
    read-only it neither checkpoints the log into the file nor deletes it when it closes."""
    uri = f"file:{directory / 'spool.db'}?mode=ro"
    conn = sqlite3.connect(uri, uri=True, isolation_level=None)
    try:
        path = str(directory / "spool.db")
        entries = read_entries(conn, threading.Lock(), path, after=0, limit=100_000)
        return [entry.message.message_id for entry in entries]
    finally:
        conn.close()


#: SQLite's write-ahead log: a 32-byte header, then frames of a 24-byte header and a page
_WAL_HEADER, _FRAME_HEADER = 32, 24
#: every byte of the frame headers is a cut of its own; inside a page, every STRIDE-th byte
#: (a cut anywhere in a page leaves that frame incomplete, and SQLite ignores it whole)
STRIDE = 61


def _offsets(before: int, after: int, page_size: int) -> list[int]:
    """The cuts of the last write, from ``before`` to ``after`` (the log's sizes): every byte
    of each frame header and of the last 64 bytes, every STRIDE-th byte of each page."""
    frame = _FRAME_HEADER + page_size
    assert (before - _WAL_HEADER) % frame == 0 and (after - _WAL_HEADER) % frame == 0
    offsets = set(range(max(before, after - 64), after + 1))
    for start in range(before, after, frame):
        offsets.update(range(start, start + _FRAME_HEADER + 1))
        offsets.update(range(start + _FRAME_HEADER, start + frame, STRIDE))
    return sorted(offsets, reverse=True)


def test_the_last_write_cut_at_every_offset_reopens_as_a_prefix(tmp_path: Path) -> None:
    directory = tmp_path / "spool"
    spool = Spool(directory, fsync="commit")
    try:
        first = messages(40, size=100)
        for message in first:
            spool.append(message)
        assert spool.persist() == 0
        wal = directory / "spool.db-wal"
        before = wal.stat().st_size
        last = messages(3, size=100, start=40)
        for message in last:
            spool.append(message)
        assert spool.persist() == 0
        after = wal.stat().st_size
        assert after > before  # the last commit is in the log, not yet folded into the file
        # the files as the process left them (a copy: the spool stays open, uncheckpointed)
        cut = tmp_path / "cut"
        cut.mkdir()
        shutil.copy(directory / "spool.db", cut / "spool.db")
        shutil.copy(wal, cut / "spool.db-wal")
    finally:
        spool.close()
    want_first = [m.message_id for m in first]
    offsets = _offsets(before, after, PAGE_SIZE)
    assert len(offsets) > 3 * _FRAME_HEADER
    for offset in offsets:  # from the whole write down: each cut only shortens the log
        os.truncate(cut / "spool.db-wal", offset)
        (cut / "spool.db-shm").unlink(missing_ok=True)  # rebuilt from the log, as after a crash
        got = _ids(cut)
        if offset < after:
            assert got == want_first, offset
        else:
            assert got == want_first + [m.message_id for m in last]


def test_a_flipped_byte_in_an_older_record_is_named_and_refused(tmp_path: Path) -> None:
    directory = tmp_path / "spool"
    spool = Spool(directory)
    for message in messages(50, size=64):
        spool.append(message)
    spool.close()  # folded into spool.db
    path = directory / "spool.db"
    data = bytearray(path.read_bytes())
    body = messages(1, size=64, start=7)[0].body  # entry 8's body: distinct digits
    at = data.find(body)
    assert at > 0 and data.find(body, at + 1) < 0
    data[at + 10] ^= 0x20
    path.write_bytes(bytes(data))
    problems = check(directory)
    assert len(problems) == 1, problems
    assert str(path) in problems[0] and "pending entry 8 is damaged" in problems[0]
    with pytest.raises(SpoolError) as info:
        Spool(directory)
    assert str(info.value) == problems[0]
    # nothing was dropped or rewritten: the same bytes, and the next opener refuses the same way
    assert path.read_bytes() == bytes(data)
    with pytest.raises(SpoolError, match="pending entry 8 is damaged"):
        Spool(directory)
