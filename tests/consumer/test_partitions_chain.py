"""Issue 46, "the chain, in order", on the local RabbitMQ and PostgreSQL: outbox -> relay ->
consistent-hash exchange -> 8 partitions -> member processes handling through the inbox.

Two writer threads commit 20,000 events over 500 keys into the transactional outbox (each
transaction locks its keys' aggregate rows, sorted, and numbers their events: a key's ``seq``
is its commit order), a relay (``OutboxRelay`` in a thread) publishes them to the exchange
``NAME`` with the key as routing key, and the members (``partition_child.py``, each
``Consumer(url, NAME, partitions=8, key="routing_key", declare=True)`` whose handler is
``Inbox.handler``: claim + effect row in one transaction on one long-lived connection) consume
them. Three members start at once (they race for the free partitions: the broker's 403 on a
second exclusive subscription settles each race); mid-run one is killed -9 and started again,
then a fourth joins.

Checked: every event's effect exactly once; each key's effects in commit order (seq ascending by
effect row id) and from one partition; a partition's turns (one member after another) never
overlap in time; throughout the run, no partition queue ever has two consumers (the broker's
consumer counts every 50 ms, and its consumer list every 0.1 s); after each
change the members' shares settle within floor/ceil of 8/members, and at the end the broker's
own list (consumer -> channel -> connection name) shows the four members with two partitions
each, and a second exclusive subscription to a held partition is refused; nothing left in the
queues, the outbox or the dead letters. Printed: the take-over time (kill -9 -> every partition
held again, by the broker and by the members), the slowest hand-overs of a partition whose queue
had messages waiting (one holder's last effect -> the next one's first) and the figures. About
25-40 s on a loaded two-core machine.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from pathlib import Path
from typing import Any

import pika
import psycopg
import pytest

from reliable_amqp import Consumer
from reliable_amqp.outbox import Outbox, status
from support.broker import unique
from support.consumer import QUICK, QUICK_CONFIG, delete_queues, ready_count
from support.outbox import RelayThread, pg_database
from support.partitions import (
    ConsumerCounts,
    ConsumerList,
    Members,
    broker_shares,
    check_effects,
    local_erl,
    prepare_database,
    second_subscription,
)
from support.run_summary import add_summary

pytestmark = [pytest.mark.broker, pytest.mark.faults, pytest.mark.slow]

PARTITIONS = 8
KEYS = 500
PER_KEY = 40
TOTAL = KEYS * PER_KEY
#: events per writer transaction (keys drawn at random: a key's events interleave with others')
BATCH = 25
WRITERS = 2
PREFETCH = 50
#: fractions of the effects at which the member is killed, then the fourth one started
KILL_AT, JOIN_AT = 0.3, 0.6
#: the longest take-over the test accepts (the members look every second)
TAKEOVER_LIMIT = 10.0


def _writer(dsn: str, exchange: str, plan: list[str], failures: list[BaseException]) -> None:
    """Commit ``plan`` (one key per event) in transactions of ``BATCH`` events, each locking its
    keys' aggregate rows in key order and numbering the events: a key's seq is commit order."""
    outbox = Outbox()
    try:
        with psycopg.connect(dsn) as conn:
            conn.execute("SET synchronous_commit = off")
            conn.commit()
            for start in range(0, len(plan), BATCH):
                keys = plan[start : start + BATCH]
                rows = conn.execute(
                    "SELECT key, seq FROM aggregates WHERE key = ANY(%s) ORDER BY key FOR UPDATE",
                    (sorted(set(keys)),),
                ).fetchall()
                current: dict[str, int] = {str(key): int(seq) for key, seq in rows}
                messages: list[dict[str, Any]] = []
                for key in keys:
                    current[key] += 1
                    body = f"{key}:{current[key]}".encode()
                    messages.append(
                        {"exchange": exchange, "routing_key": key, "body": body, "key": key}
                    )
                conn.execute(
                    "UPDATE aggregates SET seq = v.seq FROM unnest(%s::text[], %s::int[])"
                    " AS v(key, seq) WHERE aggregates.key = v.key",
                    (list(current), list(current.values())),
                )
                outbox.add_many(conn, messages)
                conn.commit()
    except BaseException as exc:  # reported by the test
        failures.append(exc)


def _effects(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM effects").fetchone()
    return int(row[0]) if row else 0


def _delete_group(url: str, name: str, own: tuple[str, ...]) -> None:
    """The group's queues (partitions, delay queues, dead letters, and its auto-delete queues:
    one never consumed stays) and its exchange."""
    with contextlib.suppress(pika.exceptions.AMQPError):
        extra = [f"{name}.partitions"]
        delete_queues(url, [*(f"{name}.{i}" for i in range(PARTITIONS)), *own, *extra])
        connection = pika.BlockingConnection(pika.URLParameters(url))
        connection.channel().exchange_delete(name)
        connection.close()


def test_three_members_a_kill_and_a_join_keep_each_keys_effects_once_and_in_order(
    amqp_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    began = time.monotonic()
    name = unique("part-chain")
    keys = [f"key-{n:03d}" for n in range(KEYS)]
    plan = [key for key in keys for _ in range(PER_KEY)]
    random.Random(46).shuffle(plan)
    own = Consumer(amqp_url, name, partitions=PARTITIONS, redelivery=QUICK).own_queues
    request.addfinalizer(lambda: _delete_group(amqp_url, name, own))
    with pg_database() as dsn:
        prepare_database(dsn)
        with psycopg.connect(dsn) as conn:
            Outbox().install(conn)
            conn.execute("CREATE TABLE aggregates (key text PRIMARY KEY, seq integer NOT NULL)")
            conn.execute("INSERT INTO aggregates SELECT unnest(%s::text[]), 0", (keys,))
        members = Members(
            tmp_path / "members",
            url=amqp_url,
            name=name,
            partitions=PARTITIONS,
            dsn=dsn,
            prefetch=PREFETCH,
            redelivery=QUICK_CONFIG,
        )
        counts = ConsumerCounts([amqp_url], name, PARTITIONS)
        listing = ConsumerList(local_erl, name, PARTITIONS)
        members.watchdog = listing.violation
        relay: RelayThread | None = None
        failures: list[BaseException] = []
        writers = [
            threading.Thread(target=_writer, args=(dsn, name, plan[i::WRITERS], failures))
            for i in range(WRITERS)
        ]
        try:
            for label in "abc":
                members.start(label)
            members.wait_joined(60)  # the partition queues exist: the broker's view begins
            counts.start()
            listing.start()
            joined = members.wait_settled(90, "three members sharing the 8 partitions")
            # The exchange and its queues exist (the members declared them): relay and write.
            relay = RelayThread(dsn, amqp_url, poll_interval=0.2).start()
            for writer in writers:
                writer.start()

            def effects_reach(n: int) -> bool:
                return _effects(dsn) >= n or bool(failures)

            members.wait(lambda: effects_reach(int(TOTAL * KILL_AT)), 120, "30% of the effects")
            before_kill = _effects(dsn)
            victim = members.procs["a"].pid
            killed_at = members.kill9("a")
            # By the broker: a partition without a consumer (the victim's), then all held again.
            gap_at = counts.wait(
                lambda m, c: 0 in c, killed_at, 15, "the victim's partitions freed"
            )
            held_at = counts.wait(lambda m, c: m == 2 and min(c) >= 1, gap_at, 30, "all held again")
            takeover = held_at - killed_at
            members.wait_settled(30, "two members holding 4 partitions each")
            survivors = [p.pid for label, p in members.procs.items() if label in "bc"]
            reported = members.record().all_held_at(survivors, killed_at, PARTITIONS)
            restarted_at = time.monotonic()
            members.start("a2")
            members.wait_settled(60, "the restarted member taking its share")
            members.wait(lambda: effects_reach(int(TOTAL * JOIN_AT)), 120, "60% of the effects")
            at_join = _effects(dsn)
            joined_at = time.monotonic()
            members.start("d")
            members.wait_settled(60, "the fourth member taking its share")
            for writer in writers:
                writer.join(120)
            assert not failures, failures
            members.wait(lambda: _effects(dsn) >= TOTAL, 180, f"{TOTAL} effects")
            relay.stop()
            relay = None
            final = broker_shares(local_erl, name, PARTITIONS)
            held_by_children = members.holding()
            # What ownership rests on: the broker refuses a second exclusive subscription.
            intruder = second_subscription(amqp_url, f"{name}.0", local_erl)
            listing.stop()
            counts.stop()
            codes = members.terminate_all()
        finally:
            members.close()
            counts.stop()
            listing.stop()
            if relay is not None:
                with contextlib.suppress(Exception):
                    relay.stop()
            for writer in writers:
                writer.join(60)

        # Nothing left anywhere: the outbox, the partition queues, the dead letters.
        left = status(dsn)
        remaining = {q: ready_count(amqp_url, q) for q in [f"{name}.{i}" for i in range(8)]}
        dead = ready_count(amqp_url, f"{name}.dead")
        effects = check_effects(dsn, dict.fromkeys(keys, PER_KEY))

    assert codes == dict.fromkeys(codes, 0), (codes, members.errors())
    assert intruder is None, intruder
    assert left.pending == 0 and left.failed == 0, left
    assert set(remaining.values()) == {0} and dead == 0, (remaining, dead)
    # One active consumer per partition queue at most, whenever the broker was asked.
    assert max(listing.most) == 1, (listing.most, listing.doubles[:5])
    assert listing.listings >= 5, (listing.listings, listing.failures[:3])
    # The end: four members, two partitions each, by the broker and by the members.
    assert sorted(final) == ["member-a2", "member-b", "member-c", "member-d"], final
    assert all(len(parts) == 2 for parts in final.values()), final
    assert sorted(p for parts in final.values() for p in parts) == list(range(PARTITIONS))
    assert sorted(map(len, held_by_children.values())) == [2, 2, 2, 2], held_by_children
    assert reported is not None
    turns = sum(len(t) for t in effects.turns.values())
    # Each hand-over of a partition (one member's last effect, the next one's first): its
    # gap, and when it began after the kill, the restart or the join.
    events = {"start": began, "kill": killed_at, "restart": restarted_at, "join": joined_at}

    def when(at: float) -> str:
        name, t = max(((n, t) for n, t in events.items() if t <= at), key=lambda e: e[1])
        return f"{name}+{at - t:.1f}s"

    # (only those whose queue had messages waiting throughout: otherwise the gap is an empty
    # queue's, not the group's)
    stalls = sorted(
        (b - a, p, when(a))
        for p, hs in effects.handovers.items()
        for a, b in hs
        if counts.backlogged(p, a, b)
    )
    handover = ", ".join(f"p{p} {gap:.2f} s at {at}" for gap, p, at in stalls[::-1][:3])
    exits = members.record().exits
    duplicates = sum(e["duplicates"] for e in exits)
    by_members = reported - killed_at
    freed = gap_at - killed_at
    add_summary(
        request,
        "partitions",
        f"chain, 3 members on partitions=8, kill -9 + restart + a 4th: {TOTAL} events over "
        f"{KEYS} keys through the outbox, {effects.total} effects (each once, per-key commit "
        f"order); take-over after kill -9 {takeover:.2f} s by the broker "
        f"({by_members:.2f} s by the members' reports; freed {freed:.2f} s after the kill); "
        f"killed at {before_kill} effects (pid {victim}), 4th joined at {at_join}; "
        f"{effects.redelivered} effects from redeliveries, {duplicates} duplicates skipped by "
        f"the inbox; {turns} partition turns; slowest hand-overs with messages waiting: "
        f"{handover or 'none'}; "
        f"{len(counts.samples)} consumer-count samples, {listing.listings} list_consumers "
        f"listings, most active consumers on one partition {max(listing.most)} (most listed "
        f"{listing.most_listed}, most by passive declare {max(counts.most)}); "
        f"final shares {final}; "
        f"first settle {joined:.1f} s; test {time.monotonic() - began:.1f} s",
    )
    assert takeover < TAKEOVER_LIMIT, f"take-over took {takeover:.1f} s"


def test_the_consumer_list_sees_two_active_channels_on_one_queue(amqp_url: str) -> None:
    """The list the test above trusts can fail: two channels consuming one plain queue are
    both active, and ConsumerList reports the double; the owner is each channel's connection."""
    name = unique("c-list")
    params = pika.URLParameters(amqp_url)
    params.client_properties = {"connection_name": f"{name} owner"}
    connection = pika.BlockingConnection(params)
    listing = ConsumerList(local_erl, name, 2, every=0.01)
    try:
        first, second = connection.channel(), connection.channel()
        first.queue_declare(f"{name}.0", auto_delete=True)
        first.queue_declare(f"{name}.1", auto_delete=True)
        first.basic_consume(f"{name}.0", lambda *_: None)
        second.basic_consume(f"{name}.0", lambda *_: None)
        first.basic_consume(f"{name}.1", lambda *_: None)
        listing.start()
        deadline = time.monotonic() + 30
        while listing.listings < 3 and time.monotonic() < deadline:
            connection.process_data_events(0.05)
        listing.stop()
        assert listing.listings >= 3, listing.failures[:3]
        assert listing.most == [2, 1] and listing.most_listed == 2
        found = listing.violation()
        assert found is not None and f"'{name}.0'" in found, found
        assert broker_shares(local_erl, name, 2) == {f"{name} owner": [0, 0, 1]}
    finally:
        listing.stop()
        connection.close()
