"""Issue 45, on the three-node RabbitMQ 4 cluster: a consumer with the inbox through node kills.

A :class:`reliable_amqp.Consumer` given every node's URL, whose handler is ``Inbox.handler``
on PostgreSQL (the effect, one row in ``effects``, committed in the claim's transaction; the ack
after the commit), runs in a child process (``tests/inbox_consumer/inbox_child.py``) and reads a
quorum queue of 10,000 messages (leader on node 1; the consumer connects to node 0, the first
URL). Mid-run one node is killed -9:

- the node holding the queue's leader (the consumer's connection is untouched: the two members
  left elect a leader);
- the node the consumer's connections are on (it fails over to the next URL; the broker gives
  back what it had not acked, effects committed or not).

The killed node is started again while the consumer goes on. Then: exactly 10,000 effects, one
per message id; 0 messages in the queue once the consumer has stopped (a passive declare: exact
on quorum queues; with no consumer, ready is everything); and consuming resumed within 20 s: the
longest gap between consecutive effects' commit times (``clock_timestamp()`` of each insert,
the commit follows it in the same handler call) is printed and held under 20 s. About 30-45 s a
test, plus the cluster's start.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import psycopg
import pytest

from harness.rabbitmq4 import Rabbitmq4Cluster, Rabbitmq4Node
from reliable_amqp.inbox import Inbox
from support.broker import unique
from support.consumer import QUICK, delete_queues, fill, ready_count, side_queues
from support.inbox import Database, run
from support.inbox_consumer import Children
from support.outbox import pg_database
from support.run_summary import add_summary

pytestmark = [pytest.mark.broker, pytest.mark.faults, pytest.mark.slow]

TOTAL = 10_000
PREFETCH = 100
#: effects committed before the kill (a quarter of the run)
KILL_AT = 2_500
#: the longest pause between two effects a kill may cause
PAUSE_LIMIT = 20.0
LEADER, CONNECTED = 1, 0


@pytest.fixture
def db() -> Iterator[Database]:
    """A PostgreSQL database of the test's own: the inbox's tables, and ``effects`` (no unique
    key: an effect applied twice shows) with each row's commit time."""
    with pg_database() as dsn:
        database = Database("postgresql", dsn)
        conn = database.connect()
        try:
            Inbox("billing").install(conn)
            run(
                conn,
                "CREATE TABLE effects (message_id varchar(255) NOT NULL, note text, committed "
                "double precision NOT NULL DEFAULT extract(epoch FROM clock_timestamp()))",
            )
            conn.commit()
        finally:
            conn.close()
        yield database


def _declare(node: Rabbitmq4Node, queue: str) -> None:
    """A quorum queue (three members) whose leader is on ``node`` (client-local)."""
    connection = pika.BlockingConnection(pika.URLParameters(node.url))
    try:
        connection.channel().queue_declare(
            queue,
            durable=True,
            arguments={"x-queue-type": "quorum", "x-queue-leader-locator": "client-local"},
        )
    finally:
        connection.close()


def _clients(nodes: list[Rabbitmq4Node]) -> list[int]:
    """Client connections on each node's AMQP port (listed by the node itself)."""
    return [node.client_connections() for node in nodes]


class Effects:
    """The effects table, watched on a connection of its own (autocommit: each read is new)."""

    def __init__(self, db: Database, group: Children) -> None:
        self.conn = psycopg.connect(db.dsn, autocommit=True)
        self.group = group

    def one(self, sql: str, params: tuple[Any, ...] = ()) -> Any:
        row = self.conn.execute(sql, params).fetchone()
        assert row is not None
        return row[0]

    def count(self) -> int:
        return int(self.one("SELECT count(*) FROM effects"))

    def wait(self, at_least: int, timeout: float, what: str) -> int:
        """Poll the count until it reaches ``at_least``; fail at once if the consumer died."""
        deadline = time.monotonic() + timeout
        while True:
            count = self.count()
            if count >= at_least:
                return count
            proc = self.group.proc
            if proc.poll() is not None:
                raise AssertionError(
                    f"the consumer exited ({proc.returncode}) at {count} effects, before "
                    f"{what}:\n{self.group.errors()}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{count} effects after {timeout} s waiting for {what}\n{self.group.errors()}"
                )
            time.sleep(0.05)

    def longest_gap(self) -> tuple[float, float]:
        """(the longest gap between consecutive commits, when it began: epoch seconds)."""
        row = self.conn.execute(
            "SELECT gap, began FROM (SELECT committed - lag(committed) OVER w AS gap,"
            " lag(committed) OVER w AS began FROM effects WINDOW w AS (ORDER BY committed)) g"
            " WHERE gap IS NOT NULL ORDER BY gap DESC LIMIT 1"
        ).fetchone()
        assert row is not None
        return float(row[0]), float(row[1])

    def close(self) -> None:
        self.conn.close()


def _run_with_kill(
    cluster: Rabbitmq4Cluster,
    db: Database,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    *,
    victim: int,
    case: str,
) -> None:
    """Consume ``TOTAL`` messages from a quorum queue led by node ``LEADER`` through node
    ``CONNECTED`` (every node's URL given), kill -9 node ``victim`` mid-run and start it again,
    then count every effect and the queue."""
    began = time.monotonic()
    nodes = cluster.nodes
    queue = unique("cluster-inbox")
    _declare(nodes[LEADER], queue)
    group: Children | None = None
    effects: Effects | None = None
    try:
        assert cluster.leader(queue) is nodes[LEADER]
        ids = [f"c{i:05d}" for i in range(TOTAL)]
        fill(nodes[CONNECTED].url, queue, ids)
        assert ready_count(nodes[CONNECTED].url, queue) == TOTAL
        group = Children(
            tmp_path / "consumer",
            url=cluster.urls,  # node 0 first: the consumer and its redelivery publisher go there
            queue=queue,
            dialect=db.dialect,
            dsn=db.dsn,
            prefetch=PREFETCH,
        )
        effects = Effects(db, group)
        # The first handler waits on this lock (its insert into effects) while the test checks
        # where the consumer is connected: the listing takes seconds, the whole run about three.
        gate = psycopg.connect(db.dsn)
        gate.execute("LOCK TABLE effects IN SHARE MODE")
        try:
            group.start()
            group.wait(lambda record: len(record.started) > 0, 60, "the first delivery")
            clients = _clients(nodes)
        finally:
            gate.rollback()
            gate.close()
        # the consumer (and its redelivery publisher), all on node CONNECTED
        assert clients[CONNECTED] >= 1 and sum(clients) == clients[CONNECTED], clients
        before = effects.wait(KILL_AT, 60, f"{KILL_AT} effects before the kill")
        killed_at = time.time()
        nodes[victim].kill()
        assert before < TOTAL - 2 * PREFETCH, f"the kill came too late ({before} effects)"
        # Consuming resumes: more effects than the consumer could have held when the node died.
        effects.wait(before + 2 * PREFETCH + 100, 60, "consuming to resume after the kill")
        nodes[victim].launch()  # boots while the consumer goes on
        if victim == LEADER:
            assert cluster.leader(queue) is not nodes[victim], "no new leader was elected"
        effects.wait(TOTAL, 120, f"{TOTAL} effects")
        nodes[victim].wait_started()
        cluster.await_members()
        moved = _clients(nodes)
        if victim == CONNECTED:  # every connection failed over to the nodes left
            assert moved[victim] == 0 and sum(moved) == sum(clients), (clients, moved)
        else:  # nothing happened to the connections
            assert moved == clients, (clients, moved)
        # A graceful stop: what was handled is acked, the rest (nothing) goes back.
        assert group.terminate() == 0, group.errors()
        exit_ = group.record().exits[-1]

        # Every message's effect exactly once.
        assert effects.count() == TOTAL
        assert effects.one("SELECT count(DISTINCT message_id) FROM effects") == TOTAL
        stored = {r[0] for r in effects.conn.execute("SELECT message_id FROM effects")}
        assert stored == set(ids)
        # Nothing left: with no consumer, ready is everything (acked or given back).
        assert ready_count(nodes[CONNECTED].url, queue) == 0
        assert ready_count(nodes[CONNECTED].url, f"{queue}.dead") == 0
        # Consuming resumed within the limit.
        gap, gap_began = effects.longest_gap()
        record = group.record()
        redelivered = sum(1 for _, _, _, again in record.handled if again)
        warnings = group.errors().count("WARNING")
        add_summary(
            request,
            "rabbitmq 4",
            f"{case}: {TOTAL} messages, {TOTAL} effects, 0 left; killed at {before} effects; "
            f"longest pause between effects {gap:.2f} s (from {gap_began - killed_at:+.2f} s "
            f"after the kill); {redelivered} redelivered, {exit_['duplicates']} duplicates "
            f"skipped by the inbox; {warnings} warnings; test {time.monotonic() - began:.1f} s",
        )
        assert gap < PAUSE_LIMIT, f"consuming paused {gap:.1f} s"
    finally:
        if group is not None:
            group.close()
        if effects is not None:
            effects.close()
        # Best effort after a failure (a side queue's node may be down): the cluster is the
        # module's own, and its leftovers go with it.
        with contextlib.suppress(pika.exceptions.AMQPError):
            up = next(n for n in nodes if n.is_running())
            delete_queues(up.url, [queue, *side_queues(queue, QUICK)])


def test_inbox_consumer_through_a_kill_of_the_leader_node(
    healthy: Rabbitmq4Cluster, db: Database, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """kill -9 of the node holding the quorum queue's leader, the consumer on another node."""
    _run_with_kill(
        healthy, db, tmp_path, request, victim=LEADER, case="inbox consumer, kill -9 of the leader"
    )


def test_inbox_consumer_through_a_kill_of_its_own_node(
    healthy: Rabbitmq4Cluster, db: Database, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """kill -9 of the node the consumer (and its redelivery publisher) is connected to."""
    _run_with_kill(
        healthy,
        db,
        tmp_path,
        request,
        victim=CONNECTED,
        case="inbox consumer, kill -9 of its own node",
    )
