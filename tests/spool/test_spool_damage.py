"""What a spool does with a file cut short or damaged (issue 21).

- The tail: the spool's last write (records appended to the last segment, not yet made durable)
  cut short at every byte offset, as a crash can leave it, reopens as exactly a prefix of what
  was appended: everything before that write and the whole records of it before the cut, never
  a part of a record, never anything damaged. The ledger's last write, cut likewise, loses
  nothing pending.
- A flipped byte inside an older record: ``check()`` (``reliable-amqp spool DIR --check``)
  names the file and the entry, and opening the spool refuses with the same words, dropping
  nothing. A file cut below what was made durable is refused too.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from reliable_amqp import SpoolError
from reliable_amqp._spool import Spool, _files, check
from support.spool import messages


def _ids(directory: Path) -> list[str]:
    """The message ids of the pending entries, read back (checksums checked) by a spool opened
    on the directory (which repairs a cut tail), closed again."""
    spool = Spool(directory)
    try:
        ids: list[str] = []
        after = 0
        while entries := spool.read(after, 10_000):
            ids.extend(entry.message.message_id for entry in entries)
            after = entries[-1].seq
        return ids
    finally:
        spool.close()


def _segment(directory: Path) -> Path:
    (found,) = [Path(path) for _first, path in _files.list_segments(str(directory))]
    return found


def _crash_image(spool: Spool, directory: Path, into: Path) -> None:
    """The spool's files as the process leaves them if it dies now (copies: it stays open)."""
    into.mkdir()
    for name in os.listdir(directory):
        if name != "spool.lock":
            shutil.copy(directory / name, into / name)


def test_the_last_write_cut_at_every_offset_reopens_as_a_prefix(tmp_path: Path) -> None:
    directory = tmp_path / "spool"
    spool = Spool(directory)
    try:
        first = messages(40, size=100)
        for message in first:
            spool.append(message)
        assert spool.persist() == 0  # durable: the ledger marks it
        before = _segment(directory).stat().st_size
        last = messages(3, size=100, start=40)
        for message in last:
            spool.append(message)
        while spool.committed_seq < spool.last_seq:  # written, not made durable
            time.sleep(0.001)
        image = tmp_path / "image"
        _crash_image(spool, directory, image)
    finally:
        spool.close()
    segment = _segment(image)
    after = segment.stat().st_size
    # where each record of the last write ends
    ends = [
        item.end
        for item in _files.records(str(segment), before, after)
        if isinstance(item, _files.Found)
    ]
    assert len(ends) == 3 and ends[-1] == after
    want = [m.message_id for m in first + last]
    for offset in range(before, after + 1):
        cut = tmp_path / f"cut-{offset}"
        shutil.copytree(image, cut)
        os.truncate(cut / segment.name, offset)
        whole = sum(1 for end in ends if end <= offset)
        assert _ids(cut) == want[: 40 + whole], offset
        shutil.rmtree(cut)


def test_the_ledger_cut_at_every_offset_loses_nothing_pending(tmp_path: Path) -> None:
    directory = tmp_path / "spool"
    spool = Spool(directory)
    try:
        sent = messages(30, size=20)
        sizes = [spool.encode(m)[1] for m in sent]
        for message in sent:
            spool.append(message)
        assert spool.persist() == 0
        ledger = directory / _files.LEDGER_NAME
        before = ledger.stat().st_size
        spool.remove([1, 2, 3, 7, 8], sizes[0] + sizes[1] + sizes[2] + sizes[6] + sizes[7])
        while ledger.stat().st_size == before:
            time.sleep(0.001)
        image = tmp_path / "image"
        _crash_image(spool, directory, image)
    finally:
        spool.close()
    after = (image / _files.LEDGER_NAME).stat().st_size
    assert after > before
    ids = [m.message_id for m in sent]
    for offset in range(before, after + 1):
        cut = tmp_path / f"cut-{offset}"
        shutil.copytree(image, cut)
        os.truncate(cut / _files.LEDGER_NAME, offset)
        got = _ids(cut)
        # what is pending is every message but some of the removed ones: nothing else is lost
        assert set(got) >= set(ids) - {ids[i] for i in (0, 1, 2, 6, 7)}, offset
        assert got == [i for i in ids if i in set(got)], offset  # in order
        shutil.rmtree(cut)


def _closed_spool(directory: Path) -> Path:
    """A spool of 50 messages of 64 bytes, closed (made durable); its one segment."""
    spool = Spool(directory)
    for message in messages(50, size=64):
        spool.append(message)
    spool.close()
    return _segment(directory)


def test_a_flipped_byte_in_an_older_record_is_named_and_refused(tmp_path: Path) -> None:
    directory = tmp_path / "spool"
    path = _closed_spool(directory)
    data = bytearray(path.read_bytes())
    body = messages(1, size=64, start=7)[0].body  # entry 8's body: distinct digits
    at = data.find(body)
    assert at > 0 and data.find(body, at + 1) < 0
    data[at + 10] ^= 0x20
    path.write_bytes(bytes(data))
    problems = check(directory)
    assert len(problems) == 1, problems
    assert str(path) in problems[0] and "entry 8 at byte" in problems[0], problems
    assert "is damaged" in problems[0]
    with pytest.raises(SpoolError) as info:
        Spool(directory)
    assert str(info.value) == problems[0]
    # nothing was dropped or rewritten: the same bytes, and the next opener refuses the same way
    assert path.read_bytes() == bytes(data)
    with pytest.raises(SpoolError, match=r"entry 8 at byte \d+ is damaged"):
        Spool(directory)


def test_a_segment_cut_below_what_was_made_durable_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "spool"
    path = _closed_spool(directory)
    size = path.stat().st_size
    os.truncate(path, size - 30)
    with pytest.raises(SpoolError, match="made durable: the file was cut after it was written"):
        Spool(directory)
    assert path.stat().st_size == size - 30
    assert "made durable" in check(directory)[0]


@pytest.mark.parametrize("policy", ["persist", "never"])
def test_a_segment_is_durable_before_the_next_one_starts(
    tmp_path: Path, policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever the fsync policy, only the last segment can hold a tail a power loss cut: a
    segment is fsynced, and marked durable in the ledger, when the next one starts."""
    monkeypatch.setattr(_files, "SEGMENT_BYTES", 4096)
    directory = tmp_path / "spool"
    spool = Spool(directory, fsync=policy)
    try:
        for n in range(10):  # batches of 20 (a segment is not split inside a batch)
            for message in messages(20, size=100, start=n * 20):
                spool.append(message)
            while spool.committed_seq < spool.last_seq:
                time.sleep(0.001)
        spool.remove([], 0)  # a ledger write: the marks go with it
        time.sleep(0.1)
        segments = _files.list_segments(str(directory))
        assert len(segments) >= 3
        ledger = _files.read_ledger(str(directory / _files.LEDGER_NAME))
        assert ledger is not None
        for first, path in segments[:-1]:
            assert ledger.synced.get(first) == os.path.getsize(path), path
    finally:
        spool.close()
