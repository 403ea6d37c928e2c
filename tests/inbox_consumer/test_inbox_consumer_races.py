"""Issue 40, "Races", at the consumer's level: two consumer processes at once on one queue of
duplicates (the two copies of each id side by side, so that the broker hands them to the two
consumers together): exactly one effect per id, on PostgreSQL, MariaDB and SQLite."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest

from broker_support import BrokerAdmin, unique
from inbox_consumer.inbox_consumer_support import Children, publish_copies
from inbox_support import Database

pytestmark = [pytest.mark.broker]

COUNT = 400


def test_two_consumers_racing_on_duplicates_give_one_effect_per_id(
    any_db: Database,
    amqp_url: str,
    broker: BrokerAdmin,
    children: Callable[..., Children],
) -> None:
    queue = broker.queue(unique("inbox-race"))
    ids = [f"r{i:04d}" for i in range(COUNT)]
    copies = {(m, c) for m in ids for c in "ab"}
    # prefetch 1: the broker deals the queue out one message at a time, alternately
    group = children(queue, any_db, prefetch=1)
    first, second = group.start(), group.start()
    group.wait(lambda r: r.subscribed == 2, 60, "both consumers subscribed")
    publish_copies(amqp_url, queue, ids, lag=0)  # a0 b0 a1 b1 ...: copies dealt to both
    group.wait(lambda r: r.handled_copies() == copies, 180, "every copy handled")
    for proc in (first, second):
        assert group.terminate(proc) == 0, group.errors()
    record = group.record()
    assert broker.count(queue) == 0
    assert broker.count(f"{queue}.dead") == 0
    conn = any_db.connect()
    try:
        effects = Counter(any_db.effects(conn))
    finally:
        conn.close()
    assert set(effects) == set(ids)
    assert max(effects.values()) == 1, [m for m, n in effects.items() if n > 1][:10]
    # both consumers worked, and each skipped copies that the other had claimed
    exits = record.exits
    assert len(exits) == 2 and all(e["claimed"] > 0 and e["duplicates"] > 0 for e in exits), exits
    assert sum(e["claimed"] for e in exits) == COUNT
    raced = record.races()
    print(f"{any_db.dialect}: {raced} ids were in both consumers' handlers at once; {exits}")
    assert raced > 0, "no two copies were ever handled at the same time: the test raced nothing"
