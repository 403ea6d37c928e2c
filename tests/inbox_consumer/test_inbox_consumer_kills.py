"""Issue 40, "Duplicates and kills", at the consumer's level: every id published twice (the same
``message_id``), a child ``Consumer`` whose handler is ``Inbox.handler`` killed -9 twice mid-run
(the broker redelivers what it had not acked, committed or not), then run clean until the queue
is empty: each id's effect is committed exactly once, in a table with no unique key of its own.
On PostgreSQL, MariaDB and SQLite."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from support.broker import BrokerAdmin, unique
from support.inbox import Database
from support.inbox_consumer import Children, publish_copies

pytestmark = [pytest.mark.broker, pytest.mark.faults, pytest.mark.slow]

#: ids (each published twice), on each database
COUNT = 2000
PREFETCH = 50


def _handled_at_least(n: int) -> Callable[[Any], bool]:
    """A wait predicate: at least ``n`` deliveries handled, over every child."""
    return lambda record: len(record.handled) >= n


def test_duplicates_and_two_kills_give_each_effect_once(
    any_db: Database,
    amqp_url: str,
    broker: BrokerAdmin,
    children: Callable[..., Children],
) -> None:
    count = COUNT
    queue = broker.queue(unique("inbox-kill"))
    ids = [f"k{i:05d}" for i in range(count)]
    copies = {(m, c) for m in ids for c in "ab"}
    publish_copies(amqp_url, queue, ids)
    group = children(queue, any_db, prefetch=PREFETCH)
    for fraction in (0.3, 0.65):  # of the deliveries handled, cumulated over the children
        group.start()
        kill_at = int(len(copies) * fraction)
        group.wait(_handled_at_least(kill_at), 180, f"{kill_at} deliveries handled")
        group.kill9()
        assert len(group.record().handled_copies()) < len(copies), "the kill came after the run"
    group.start()
    group.wait(lambda r: r.handled_copies() == copies, 240, "every copy handled")
    assert group.terminate() == 0, group.errors()
    record = group.record()
    assert broker.count(queue) == 0  # the last consumer acked everything it was given
    assert broker.count(f"{queue}.dead") == 0
    # the kills made the broker redeliver (and with them, some duplicates of committed work)
    assert any(redelivered for _, _, _, redelivered in record.handled)
    conn = any_db.connect()
    try:
        effects = any_db.effects(conn)
    finally:
        conn.close()
    per_id = Counter(effects)
    assert set(per_id) == set(ids)
    assert max(per_id.values()) == 1, [m for m, n in per_id.items() if n > 1][:10]
    assert len(effects) == count
    exit_ = record.exits[-1]
    print(
        f"{any_db.dialect}: {len(record.handled)} handler calls returned for {len(copies)} "
        f"deliveries; last run: {exit_}"
    )
