"""A spool in the format written before issue 21 (``auto_vacuum`` off) opens, drains in order with
its message ids, keeps its failed table, and is switched to giving pages back once closed empty.

The spool is made by ``spool_support.write_v1_spool``: the old writer's file, byte for byte what
changed aside (nothing in the schema or the records did; the file's ``auto_vacuum`` did).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from broker_support import BrokerAdmin
from reliable_amqp._core.message import build_message
from reliable_amqp._spool import failed_entries, inspect
from spool_support import Kind, write_v1_spool

pytestmark = pytest.mark.broker


def _auto_vacuum(directory: Path) -> int:
    conn = sqlite3.connect(directory / "spool.db")
    try:
        return int(conn.execute("PRAGMA auto_vacuum").fetchone()[0])
    finally:
        conn.close()


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
    assert _auto_vacuum(directory) == 0  # the old file
    assert inspect(directory).pending == 300
    with kind(amqp_url, spool=directory) as publisher:
        assert publisher.flush(60) == 0
    got = broker.drain(queue)
    assert [props.message_id for props, _ in got] == [f"old-{i}" for i in range(300)]
    assert [body for _, body in got] == [b"body %d" % i for i in range(300)]
    assert got[5][0].headers == {"n": 5, "tag": "é"}
    kept = list(failed_entries(directory))
    assert [(e.message.message_id, e.reason) for e in kept] == [
        (f"f-{n}", f"MessageReturned: 312 NO_ROUTE ({n})") for n in range(3)
    ]
    summary = inspect(directory)
    assert (summary.pending, summary.failed) == (0, 3)
    assert _auto_vacuum(directory) == 2  # closed empty: switched to giving pages back
