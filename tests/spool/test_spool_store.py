"""The spool store on its own: order, removal, the failed table, byte accounting, the lock,
damaged files. Crashes (SIGKILL) and a full disk have files of their own."""

from __future__ import annotations

import os
import random
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from reliable_amqp import ConfigurationError, PublishTimeout, SpoolError
from reliable_amqp._core.message import OutgoingMessage, as_message
from reliable_amqp._spool import Spool, _files, check, drop_failed, failed_entries, inspect
from support.spool import messages

OpenSpool = Callable[..., Spool]


def _size(sent: list[OutgoingMessage], seqs: range | list[int]) -> int:
    """Bytes the messages appended as ``seqs`` (the first of ``sent`` as 1) count against the
    limit: what the publisher passes with them to ``remove()``."""
    return sum(Spool.encode(sent[seq - 1])[1] for seq in seqs)


def _all(spool: Spool, chunk: int = 1000) -> list[OutgoingMessage]:
    out: list[OutgoingMessage]
    out, after = [], 0
    while True:
        entries = spool.read(after, chunk)
        if not entries:
            return out
        assert [e.seq for e in entries] == sorted(e.seq for e in entries)
        out.extend(as_message(e.message) for e in entries)
        after = entries[-1].seq


# --- order and contents ---------------------------------------------------------------------------


def test_entries_come_back_in_append_order_equal(open_spool: OpenSpool) -> None:
    spool = open_spool()
    sent = messages(2500, size=100, content_type="text/plain", headers={"n": 1})
    seqs = [spool.append(m) for m in sent]
    assert seqs == list(range(1, 2501))
    assert spool.persist() == 0
    assert _all(spool, chunk=333) == sent


def test_reopening_keeps_order_and_continues_the_numbering(open_spool: OpenSpool) -> None:
    spool = open_spool()
    first = messages(10)
    for m in first:
        spool.append(m)
    spool.remove([10], _size(first, [10]))
    spool.close()
    again = open_spool()
    assert again.pending == 9
    assert _all(again) == first[:9]
    new = again.append(messages(1, start=99)[0])
    assert new > 9  # after everything in the spool
    again.persist()
    assert [e.seq for e in again.read(0, 100)] == [*range(1, 10), new]


def test_appends_from_threads_are_all_stored_once(open_spool: OpenSpool) -> None:
    """Threads that take turns (as the sync publisher's callers do, under its lock) while the
    writer writes and a reader reads: every message stored once, in each thread's order."""
    spool = open_spool()
    seqs: list[list[int]] = [[] for _ in range(4)]
    turns = threading.Lock()

    def worker(n: int) -> None:
        for m in messages(500, start=n * 1000):
            with turns:
                seqs[n].append(spool.append(m))

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spool.persist()
    stored = _all(spool)
    assert len(stored) == 2000
    assert sorted(s for per in seqs for s in per) == list(range(1, 2001))
    for per in seqs:  # each thread's messages in its own order
        assert per == sorted(per)


# --- removal and failure --------------------------------------------------------------------------


def test_remove_takes_runs_and_single_entries(open_spool: OpenSpool) -> None:
    spool = open_spool()
    sent = messages(100)
    for m in sent:
        spool.append(m)
    spool.persist()
    gone = [*range(1, 41), 45, 47, *range(60, 101)]
    spool.remove(gone, _size(sent, gone))
    spool.persist()
    _wait(lambda: spool.pending == 100 - len(gone))
    left = [m for i, m in enumerate(sent, start=1) if i not in set(gone)]
    assert _all(spool) == left
    assert spool.pending_bytes == sum(len(m.body) for m in left) + sum(
        len(Spool.encode(m)[0]) for m in left
    )


@pytest.mark.parametrize("seed", range(40))
def test_runs_cut_from_rows_leave_exactly_the_rest(seed: int) -> None:
    # the writer drops rows confirmed before they were written by slicing, run by run
    rng = random.Random(seed)
    first = rng.randint(1, 50)
    rows = [b"%d" % seq for seq in range(first, first + rng.randint(0, 40))]
    seqs = {rng.randint(1, first + 50) for _ in range(rng.randint(0, 30))}
    # as publishers hand them over: runs in batches, possibly out of order and adjacent
    batches = [_files.runs(sorted(seqs)[i::3]) for i in range(3)]
    merged = _files.merge_runs([run for batch in batches for run in batch])
    assert merged == _files.runs(sorted(seqs))
    kept = _files.cut_runs(rows, first, merged) if merged else rows
    assert kept == [b"%d" % seq for seq in range(first, first + len(rows)) if seq not in seqs]


def test_messages_confirmed_before_the_writer_ran_are_never_written(
    open_spool: OpenSpool, monkeypatch: pytest.MonkeyPatch
) -> None:
    spool = open_spool()
    writer = spool._writer
    # Hold the writer thread off (it finds no work until the gate opens; appends still nudge
    # it, so the lock stays free), so that the appends and the removal of most of them land in
    # one batch; and see every record it writes.
    gate = threading.Event()
    has_work = writer._has_work
    monkeypatch.setattr(writer, "_has_work", lambda: gate.is_set() and has_work())
    written: list[int] = []
    write_rows = writer._write_rows

    def record(rows: list[bytes]) -> None:
        written.extend(_files.RECORD.unpack_from(row)[1] for row in rows)
        write_rows(rows)

    monkeypatch.setattr(writer, "_write_rows", record)
    sent = messages(200)
    seqs = [spool.append(m) for m in sent]
    confirmed, unconfirmed = seqs[:150], seqs[150:]
    spool.remove(confirmed, _size(sent, confirmed))
    time.sleep(0.1)  # (many LINGERs: a writer not held off would have taken the appends)
    assert spool.committed_seq == 0 and not written  # held off: nothing taken yet
    gate.set()
    assert spool.persist(timeout=10) == 0
    _wait(lambda: spool.pending == len(unconfirmed))
    assert written == unconfirmed  # the confirmed ones never reached a segment
    assert _all(spool) == sent[150:]
    spool.remove(unconfirmed, _size(sent, unconfirmed))
    spool.persist()
    _wait(lambda: spool.pending == 0)
    assert spool.pending_bytes == 0
    assert spool.read(0, 1000) == []


def test_failed_messages_move_to_the_failed_table(open_spool: OpenSpool, tmp_path: Path) -> None:
    spool = open_spool()
    sent = messages(5)
    for m in sent:
        spool.append(m)
    spool.persist()
    spool.fail(2, sent[1], "returned: 312 NO_ROUTE")
    spool.fail(4, sent[3], "rejected: 404 NOT_FOUND")
    spool.persist()
    _wait(lambda: spool.pending == 3)
    assert _all(spool) == [sent[0], sent[2], sent[4]]
    counts = spool.counts()
    assert (counts.pending, counts.failed) == (3, 2)
    spool.close()
    failed = list(failed_entries(tmp_path / "spool"))
    assert [(f.seq, f.message, f.reason) for f in failed] == [
        (2, sent[1], "returned: 312 NO_ROUTE"),
        (4, sent[3], "rejected: 404 NOT_FOUND"),
    ]
    assert all(f.failed_at > time.time() - 60 for f in failed)
    assert drop_failed(tmp_path / "spool") == 2
    assert inspect(tmp_path / "spool").failed == 0


# --- byte accounting and the wait for room --------------------------------------------------------


def test_bytes_are_counted_and_recounted_on_reopen(open_spool: OpenSpool) -> None:
    spool = open_spool()
    sent = messages(50, size=1000)
    for m in sent:
        spool.append(m)
    expected = sum(Spool.encode(m)[1] for m in sent)
    assert spool.pending_bytes == expected
    spool.close()
    again = open_spool()
    assert (again.pending, again.pending_bytes) == (50, expected)
    again.remove(range(1, 26), _size(sent, range(1, 26)))
    again.fail(30, sent[29], "nacked")
    again.persist()
    _wait(lambda: again.pending == 24)
    assert again.pending_bytes == sum(
        Spool.encode(m)[1] for i, m in enumerate(sent) if i >= 25 and i != 29
    )
    again.close()
    summary = inspect(again.directory)  # read from the files
    assert (summary.pending, summary.pending_bytes) == (24, again.pending_bytes)
    assert (summary.failed, summary.failed_bytes) == (1, Spool.encode(sent[29])[1])
    third = open_spool()
    assert (third.pending, third.pending_bytes) == (24, again.pending_bytes)


def test_a_full_spool_waits_for_room_then_raises_publish_timeout(open_spool: OpenSpool) -> None:
    one = Spool.encode(messages(1, size=1000)[0])[1]
    spool = open_spool(max_bytes=one * 10)
    for m in messages(10, size=1000):
        spool.append(m)
    extra = messages(1, size=1000, start=10)[0]
    started = time.monotonic()
    with pytest.raises(PublishTimeout) as info:
        spool.append(extra, timeout=0.3)
    assert 0.25 < time.monotonic() - started < 5
    assert "spool_max_bytes" in str(info.value)
    assert str(spool.directory) in str(info.value)
    assert spool.pending == 10
    with pytest.raises(PublishTimeout):
        spool.append(extra, timeout=0)
    assert not spool.has_room(one)
    assert not spool.wait_for_room(one, 0.05)


def test_a_confirm_makes_room_for_a_waiting_append(open_spool: OpenSpool) -> None:
    one = Spool.encode(messages(1, size=1000)[0])[1]
    spool = open_spool(max_bytes=one * 3)
    for m in messages(3, size=1000):
        spool.append(m)
    threading.Timer(0.2, spool.remove, args=([1], one)).start()
    started = time.monotonic()
    assert spool.append(messages(1, size=1000, start=3)[0], timeout=10) == 4
    assert 0.15 < time.monotonic() - started < 5


def test_one_message_larger_than_the_limit_is_let_in_alone(open_spool: OpenSpool) -> None:
    spool = open_spool(max_bytes=100)
    big = messages(2, size=1000)
    spool.append(big[0])  # empty spool: let in
    with pytest.raises(PublishTimeout):
        spool.append(big[1], timeout=0)


# --- the lock -------------------------------------------------------------------------------------


def test_a_second_opener_in_the_same_process_is_refused(open_spool: OpenSpool) -> None:
    open_spool()
    with pytest.raises(ConfigurationError) as info:
        open_spool()
    assert f"process {os.getpid()}" in str(info.value)
    assert "in use" in str(info.value)


def test_a_second_opener_in_another_process_is_refused_naming_the_pid(
    open_spool: OpenSpool, tmp_path: Path
) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from reliable_amqp._spool import Spool; "
            f"s = Spool({str(tmp_path / 'spool')!r}); print('open', flush=True); "
            "sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "open"
        with pytest.raises(ConfigurationError, match=f"in use by process {holder.pid}"):
            open_spool()
        assert inspect(tmp_path / "spool").in_use_by == holder.pid
        with pytest.raises(ConfigurationError, match=str(holder.pid)):
            drop_failed(tmp_path / "spool")
    finally:
        holder.kill()
        holder.wait()
    open_spool()  # a killed holder leaves no stale lock


def test_close_releases_the_lock(open_spool: OpenSpool) -> None:
    open_spool().close()
    open_spool().close()


# --- damaged and foreign files --------------------------------------------------------------------


def test_a_file_that_is_no_database_is_refused_naming_it(tmp_path: Path) -> None:
    directory = tmp_path / "spool"
    directory.mkdir()
    (directory / "spool.db").write_bytes(b"this is not a database, it is a text file\n" * 100)
    with pytest.raises(SpoolError) as info:
        Spool(directory)
    assert str(directory / "spool.db") in str(info.value)
    assert "not a database" in str(info.value)
    assert (directory / "spool.db").read_bytes().startswith(b"this is not")  # left as it was


def test_another_sqlite_database_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "spool"
    directory.mkdir()
    conn = sqlite3.connect(directory / "spool.db")
    conn.execute("CREATE TABLE customers (id INTEGER)")
    conn.commit()
    conn.close()
    with pytest.raises(SpoolError, match="not a reliable-amqp spool"):
        Spool(directory)


@pytest.mark.parametrize("which", ["ledger", "segment", "failed"])
def test_a_spool_from_a_newer_version_is_refused(
    open_spool: OpenSpool, tmp_path: Path, which: str
) -> None:
    spool = open_spool()
    sent = messages(3)
    for m in sent:
        spool.append(m)
    spool.persist()
    spool.fail(1, sent[0], "nacked")
    spool.close()
    directory = tmp_path / "spool"
    path = {
        "ledger": directory / _files.LEDGER_NAME,
        "failed": directory / _files.FAILED_NAME,
        "segment": directory / _files.segment_name(1),
    }[which]
    data = bytearray(path.read_bytes())
    data[7] = 2  # the format version in the magic
    path.write_bytes(bytes(data))
    with pytest.raises(SpoolError, match=f"{path}.*newer version of reliable-amqp") as info:
        Spool(directory)
    assert "upgrade to read it" in str(info.value)
    assert path.read_bytes() == bytes(data)  # left as it was


def test_a_truncated_file_is_refused(open_spool: OpenSpool, tmp_path: Path) -> None:
    spool = open_spool()
    for m in messages(3000, size=500):
        spool.append(m)
    spool.close()
    path = tmp_path / "spool" / _files.segment_name(1)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(SpoolError) as info:
        Spool(tmp_path / "spool")
    assert str(path) in str(info.value)
    assert "cut after it was written" in str(info.value)


@pytest.mark.parametrize("part", ["body", "meta", "header"])
def test_a_damaged_entry_is_named_and_left_in_place(
    open_spool: OpenSpool, tmp_path: Path, part: str
) -> None:
    spool = open_spool()
    sent = messages(5)
    for m in sent:
        spool.append(m)
    spool.close()
    path = tmp_path / "spool" / _files.segment_name(1)
    data = bytearray(path.read_bytes())
    third = [f for f in _files.records(str(path), 16, len(data)) if isinstance(f, _files.Found)][2]
    meta_at = third.offset + _files.RECORD.size
    at = {"header": third.offset + 5, "meta": meta_at + 3, "body": meta_at + len(third.meta) + 1}
    data[at[part]] ^= 0xFF
    path.write_bytes(bytes(data))
    # opening checks every pending entry: it refuses, rather than send the ones before
    with pytest.raises(SpoolError) as info:
        open_spool()
    assert f"entry {'3' if part != 'header' else ''}" in str(info.value)
    assert f"at byte {third.offset} is damaged" in str(info.value)
    assert str(path) in str(info.value)
    assert path.read_bytes() == bytes(data)  # nothing dropped or rewritten
    # reading it (as --check does) names it the same way
    assert check(tmp_path / "spool") == [str(info.value)]


def test_an_unreadable_directory_is_named(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SpoolError, match="cannot create the spool directory"):
        Spool(blocker / "spool")


def test_inspect_of_a_missing_spool_says_so(tmp_path: Path) -> None:
    with pytest.raises(SpoolError, match="no spool"):
        inspect(tmp_path)
    with pytest.raises(SpoolError, match="not a directory"):
        inspect(tmp_path / "nothing")


def test_fsync_policies(open_spool: OpenSpool, tmp_path: Path) -> None:
    for n, policy in enumerate(("commit", "persist", "never")):
        spool = open_spool(tmp_path / policy, fsync=policy)
        for m in messages(100, start=n * 100):
            spool.append(m)
        assert spool.persist(timeout=10) == 0
        spool.close()
    with pytest.raises(ValueError, match="fsync must be one of"):
        Spool(tmp_path / "x", fsync="always")


def test_an_emptied_spool_gives_its_space_back(open_spool: OpenSpool, tmp_path: Path) -> None:
    spool = open_spool()
    for m in messages(5000, size=2000):
        spool.append(m)
    spool.persist()
    spool.remove(range(1, 5001), _size(messages(5000, size=2000), range(1, 5001)))
    spool.close()
    summary = inspect(tmp_path / "spool")
    assert summary.pending == 0
    assert summary.file_bytes < 1024 * 1024


def _wait(predicate: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
