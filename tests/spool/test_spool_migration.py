"""A spool of the SQLite format (the development builds before the segment files) is converted
when opened: every pending message delivered in order with its id, the failed table kept with its
reasons, ``spool.db`` gone afterwards. Two spools:

- ``data/sqlite-spool.tar.gz``: made by the SQLite spool code itself (the last commit before the
  segment store, ``Spool`` of ``_spool/_store.py`` at a3c0f14): 300 messages appended, 35 of
  them confirmed (gaps in the seqs), 3 moved to the failed table, and the files copied while it
  was open (``spool.db`` and an unfolded ``spool.db-wal``: what a crash leaves);
- one written row by row by ``support.spool.write_v1_spool``, as the format before it
  (``auto_vacuum`` off) had them.
"""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

import pytest

from reliable_amqp import SpoolError
from reliable_amqp._core.builder import build_message
from reliable_amqp._spool import Spool, _files, failed_entries, inspect
from support.broker import BrokerAdmin
from support.spool import Kind, write_v1_spool

pytestmark = pytest.mark.broker

DATA = Path(__file__).parent / "data" / "sqlite-spool.tar.gz"


def _unpack(into: Path) -> Path:
    with tarfile.open(DATA) as tar:
        tar.extractall(into, filter="data")
    return into / "spool"


def _converted(directory: Path) -> None:
    names = set(os.listdir(directory))
    assert not names & {"spool.db", "spool.db-wal", "spool.db-shm"}, names
    assert _files.LEDGER_NAME in names


def test_a_spool_made_by_the_sqlite_code_is_delivered_and_kept(
    kind: Kind, amqp_url: str, broker: BrokerAdmin, tmp_path: Path
) -> None:
    directory = _unpack(tmp_path)
    # the messages were published to "legacy-q" through the default exchange
    broker.queue("legacy-q")
    broker.purge("legacy-q")
    kept_ids = [f"old-{i}" for i in range(300) if not (i % 50 < 7 and i >= 7)]
    assert inspect(directory).pending == len(kept_ids) == 265  # converts (takes the lock)
    _converted(directory)
    with kind(amqp_url, spool=directory) as publisher:
        assert publisher.flush(60) == 0
    got = broker.drain("legacy-q")
    assert [props.message_id for props, _ in got] == kept_ids
    assert [body for _, body in got] == [b"body %s" % i.split("-")[1].encode() for i in kept_ids]
    assert got[0][0].headers == {"n": 0, "tag": "é"}
    assert got[0][0].content_type == "text/plain"
    kept = list(failed_entries(directory))
    assert [(e.message.message_id, e.reason) for e in kept] == [
        (f"f-{n}", f"MessageReturned: 312 NO_ROUTE ({n})") for n in range(3)
    ]
    summary = inspect(directory)
    assert (summary.pending, summary.failed) == (0, 3)


def test_a_conversion_cut_short_is_done_again(tmp_path: Path) -> None:
    directory = _unpack(tmp_path)
    # what a conversion killed before it wrote the ledger leaves: segments, no ledger
    (directory / _files.segment_name(1)).write_bytes(b"RAMQSEG\x01" + b"\x00" * 100)
    spool = Spool(directory)
    try:
        assert spool.pending == 265
        assert spool.counts().failed == 3
        entries = spool.read(0, 1000)
        assert [e.message.message_id for e in entries][:8] == [f"old-{i}" for i in range(8)]
    finally:
        spool.close()
    _converted(directory)


def test_a_spool_of_the_previous_format_is_delivered_and_kept(
    kind: Kind, amqp_url: str, broker: BrokerAdmin, tmp_path: Path
) -> None:
    queue = broker.queue()
    directory = tmp_path / "spool"
    sent = [
        build_message(
            "",
            queue,
            b"body %d" % i,
            properties={
                "message_id": f"old-{i}",
                "headers": {"n": i, "tag": "é"},
                "content_type": "text/plain",
            },
        )
        for i in range(300)
    ]
    # seqs with gaps, as confirms before the crash left them; three failed before
    pending = [(1 + i + i // 50 * 7, message) for i, message in enumerate(sent)]
    failed = [
        (1000 + n, build_message("", "gone", b"failed %d" % n, properties={"message_id": f"f-{n}"}),
         f"MessageReturned: 312 NO_ROUTE ({n})")
        for n in range(3)
    ]  # fmt: skip
    write_v1_spool(directory, pending, failed)
    with kind(amqp_url, spool=directory) as publisher:
        assert publisher.flush(60) == 0
        publisher.publish("", queue, b"new", message_id="new")
        assert publisher.flush(60) == 0
    _converted(directory)
    got = broker.drain(queue)
    assert [props.message_id for props, _ in got] == [f"old-{i}" for i in range(300)] + ["new"]
    assert [body for _, body in got][:300] == [b"body %d" % i for i in range(300)]
    assert got[5][0].headers == {"n": 5, "tag": "é"}
    kept = list(failed_entries(directory))
    assert [(e.message.message_id, e.reason) for e in kept] == [
        (f"f-{n}", f"MessageReturned: 312 NO_ROUTE ({n})") for n in range(3)
    ]
    assert [e.seq for e in kept] == [1000, 1001, 1002]
    summary = inspect(directory)
    assert (summary.pending, summary.failed) == (0, 3)


def _pending_ids(directory: Path) -> list[str]:
    spool = Spool(directory)
    try:
        return [e.message.message_id for e in spool.read(0, 10_000)]
    finally:
        spool.close()


KEPT = [f"old-{i}" for i in range(300) if not (i % 50 < 7 and i >= 7)]


@pytest.mark.parametrize("step", ["segments", "renamed", "ledger"])
def test_a_conversion_cut_after_each_step_is_finished_or_redone(
    tmp_path: Path, step: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed after writing the segments, after renaming spool.db, after writing the ledger:
    the next open has every message once, in order, and no SQLite file left."""
    from reliable_amqp._spool import _legacy

    directory = _unpack(tmp_path)

    class Cut(Exception):
        pass

    real_replace, real_write, real_remove = os.replace, _legacy._write_file, _legacy._remove_db

    def replace(src: str, dst: str) -> None:
        real_replace(src, dst)
        if dst.endswith(_legacy.CONVERTING_NAME) and step == "renamed":
            raise Cut

    def write(path: str, data: bytes) -> None:
        if path.endswith(_files.LEDGER_NAME) and step == "segments":
            raise Cut
        real_write(path, data)

    def remove(path: str) -> None:
        if step == "ledger":
            raise Cut
        real_remove(path)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(_legacy, "_write_file", write)
    monkeypatch.setattr(_legacy, "_remove_db", remove)
    with pytest.raises(Cut):
        Spool(directory)
    monkeypatch.undo()
    assert _pending_ids(directory) == KEPT
    assert [e.message.message_id for e in failed_entries(directory)] == [f"f-{n}" for n in range(3)]
    _converted(directory)


def test_a_directory_with_both_formats_is_refused(tmp_path: Path) -> None:
    """A build of the SQLite format run again on a converted directory writes a new spool.db
    beside the segments: neither is touched, and the error says what to do."""
    directory = _unpack(tmp_path / "a")
    assert _pending_ids(directory) == KEPT  # converted
    again = _unpack(tmp_path / "b")  # what such a build wrote afterwards
    os.replace(again / "spool.db", directory / "spool.db")
    os.replace(again / "spool.db-wal", directory / "spool.db-wal")
    before = {name: (directory / name).read_bytes() for name in os.listdir(directory)}
    with pytest.raises(SpoolError, match=r"holds a spool of this version and spool\.db") as info:
        Spool(directory)
    assert "into an empty directory" in str(info.value)
    with pytest.raises(SpoolError, match=r"holds a spool of this version and spool\.db"):
        inspect(directory)
    after = {name: (directory / name).read_bytes() for name in os.listdir(directory)}
    assert after == before
