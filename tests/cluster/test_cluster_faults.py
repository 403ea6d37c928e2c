"""A three-node RabbitMQ 4 cluster with quorum queues: what users run in production.

Each test runs both publishers at once (a sync ``Publisher`` and an ``AsyncPublisher``, each with
its own quorum queue), given every node's URL, publishing steadily while one fault happens:

- kill -9 of the node both publishers are connected to;
- kill -9 of the node holding the queues' leaders, the publishers on another node;
- a rolling restart of all three nodes, one after another;
- two of three nodes down (no majority): every message published meanwhile fails explicitly
  with ``DeliveryTimeout`` within ``delivery_timeout``, nothing hangs, and once the nodes are back
  the publishers go on;
- the connected node frozen with SIGSTOP (sockets open, nothing answers): with default options
  the longest gap between confirms stays under 20 s.

One more test reads a stream through a node that holds no member of it (RabbitMQ's 406 "does
not have a replica on the local node", also seen on one node just after a stream is declared):
the reader waits for a member, then fails with ``StreamUnavailable``; one added meanwhile is
read from.

Afterwards every message is held against the queue by id: confirmed but missing must be 0; the
counts (confirmed, failed, duplicates, failed but stored anyway) are printed per publisher and in
the run's summary. The cluster starts once for the module (about 10 s); the whole module takes
about two and a half minutes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pika
import pytest

from harness.rabbitmq4 import Rabbitmq4Cluster, Rabbitmq4Node
from harness.rabbitmq4_load import PublishLoad, Tally, drain_ids
from reliable_amqp._core.options import PublisherOptions
from reliable_amqp.spark import StreamUnavailable, _stream
from support.broker import unique
from support.run_summary import add_summary
from support.stream import declare_stream, publish

pytestmark = [pytest.mark.broker, pytest.mark.faults, pytest.mark.slow]

KINDS = ("sync", "async")
#: messages a second per publisher: thousands per test, not tens of thousands
RATE = 250.0


class Case:
    """Both publishers on their own quorum queues, and the check afterwards."""

    def __init__(self, cluster: Rabbitmq4Cluster, leader: int, **options: Any) -> None:
        self.cluster = cluster
        # client-local: the leader goes to the node the declaring connection is on. Deleted
        # by check(), from a node that is up then.
        connection = pika.BlockingConnection(pika.URLParameters(cluster.nodes[leader].url))
        try:
            channel = connection.channel()
            self.queues = {kind: unique(f"cluster-{kind}") for kind in KINDS}
            for queue in self.queues.values():
                channel.queue_declare(
                    queue,
                    durable=True,
                    arguments={"x-queue-type": "quorum", "x-queue-leader-locator": "client-local"},
                )
        finally:
            connection.close()
        for queue in self.queues.values():
            assert cluster.leader(queue) is cluster.nodes[leader]
        self.loads = {
            kind: PublishLoad(kind, cluster.urls, self.queues[kind], rate=RATE, **options)
            for kind in KINDS
        }

    def start(self) -> None:
        for load in self.loads.values():
            load.start()

    def stop(self) -> None:
        errors = []
        for load in self.loads.values():
            try:
                load.stop()
            except BaseException as exc:  # stop both before reporting
                errors.append(exc)
        if errors:
            raise errors[0]

    def check(self, request: pytest.FixtureRequest, case: str) -> dict[str, Tally]:
        """Drain each queue (all nodes up) and tally; confirmed-but-missing must be 0."""
        node = next(n for n in self.cluster.nodes if n.is_running() and not n.frozen)
        tallies = {}
        for kind, queue in self.queues.items():
            present = drain_ids(node.url, queue)
            _delete(node.url, queue)
            tallies[kind] = tally = self.loads[kind].tally(present)
            add_summary(request, "rabbitmq 4", tally.line(case))
        for kind, tally in tallies.items():
            assert tally.published > 0, kind
            assert tally.unresolved == 0 and self.loads[kind].unresolved == 0, tally.line(case)
            assert not tally.missing, f"confirmed but missing: {tally.missing[:10]}"
            assert tally.strangers == 0, tally.line(case)
        return tallies


def _delete(url: str, queue: str) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        connection.channel().queue_delete(queue)
    finally:
        connection.close()


def _during(case: Case, before: float, fault: Callable[[], None], after: float) -> float:
    """Publish ``before`` s, run ``fault`` (publishing goes on), publish ``after`` s more.

    Returns when the fault started (time.monotonic()).
    """
    case.start()
    try:
        time.sleep(before)
        began = time.monotonic()
        fault()
        time.sleep(after)
    finally:
        case.stop()
    return began


def test_kill_of_the_connected_node(
    healthy: Rabbitmq4Cluster, request: pytest.FixtureRequest
) -> None:
    nodes = healthy.nodes
    case = Case(healthy, leader=1)  # the publishers are on node 0 (first URL)

    def fault() -> None:
        assert nodes[0].client_connections() == 2  # both publishers
        nodes[0].kill()
        time.sleep(3)
        nodes[0].start()

    began = _during(case, 2, fault, 3)
    tallies = case.check(request, "kill -9 of the connected node")
    for kind, tally in tallies.items():
        assert tally.failed == Counter(), tally.line(kind)
        assert case.loads[kind].confirmed_between(began + 0.5) > 0


def test_kill_of_the_leader_node_while_publishing_through_another(
    healthy: Rabbitmq4Cluster, request: pytest.FixtureRequest
) -> None:
    nodes = healthy.nodes
    case = Case(healthy, leader=1)

    def fault() -> None:
        assert (nodes[0].client_connections(), nodes[1].client_connections()) == (2, 0)
        nodes[1].kill()
        time.sleep(3)

    began = _during(case, 2, fault, 2)
    # A new leader was elected among the two left.
    assert {healthy.leader(q) for q in case.queues.values()} <= {nodes[0], nodes[2]}
    nodes[1].start()
    healthy.await_members()
    tallies = case.check(request, "kill -9 of the leader's node")
    for kind, tally in tallies.items():
        assert tally.failed == Counter(), tally.line(kind)
        assert case.loads[kind].confirmed_between(began + 0.5) > 0


def test_rolling_restart_of_all_three_nodes(
    healthy: Rabbitmq4Cluster, request: pytest.FixtureRequest
) -> None:
    case = Case(healthy, leader=2)

    def fault() -> None:
        for node in healthy.nodes:
            node.restart()
            healthy.await_members()

    began = _during(case, 2, fault, 2)
    tallies = case.check(request, "rolling restart")
    for kind, tally in tallies.items():
        assert tally.failed == Counter(), tally.line(kind)
        assert case.loads[kind].confirmed_between(began + 1) > 0


def test_majority_down_fails_explicitly_and_resumes(
    healthy: Rabbitmq4Cluster, request: pytest.FixtureRequest
) -> None:
    nodes = healthy.nodes
    delivery_timeout = 6.0
    case = Case(healthy, leader=0, delivery_timeout=delivery_timeout)
    marks: dict[str, float] = {}

    def fault() -> None:
        killers = [threading.Thread(target=node.kill) for node in nodes[1:]]
        for thread in killers:
            thread.start()
        for thread in killers:
            thread.join()
        time.sleep(delivery_timeout + 4)  # messages of the outage run out of time
        marks["back"] = time.monotonic()
        for node in nodes[1:]:  # boot both at once
            node.launch()
        for node in nodes[1:]:
            node.wait_started()
        marks["up"] = time.monotonic()

    began = _during(case, 2, fault, 6)
    healthy.await_members()
    tallies = case.check(request, "majority down")
    for kind, tally in tallies.items():
        load = case.loads[kind]
        # Explicit failures, each within its deadline (plus the timer's slack), nothing else.
        assert set(tally.failed) == {"DeliveryTimeout"}, tally.line(kind)
        assert load.slowest_failure() < delivery_timeout + 2, load.slowest_failure()
        # Messages of the outage did not come through while it lasted ...
        assert load.confirmed_between(began + delivery_timeout, marks["back"]) == 0
        # ... and once a majority is back, the publisher goes on.
        assert load.confirmed_between(marks["up"]) > 0, tally.line(kind)


def test_frozen_connected_node_is_left_within_20_s_with_default_options(
    healthy: Rabbitmq4Cluster, request: pytest.FixtureRequest
) -> None:
    nodes = healthy.nodes
    case = Case(healthy, leader=1)  # default options: only the URLs are given
    frozen: list[Rabbitmq4Node] = []

    def fault() -> None:
        assert nodes[0].client_connections() == 2
        nodes[0].freeze()
        frozen.append(nodes[0])
        time.sleep(24)
        nodes[0].thaw()

    try:
        began = _during(case, 2, fault, 2)
    finally:
        for node in frozen:
            node.thaw()
    tallies = case.check(request, "SIGSTOP of the connected node")
    for kind, tally in tallies.items():
        assert tally.failed == Counter(), tally.line(kind)
        assert case.loads[kind].confirmed_between(began + 1, began + 24) > 0, tally.line(kind)
        assert tally.longest_gap < 20, tally.line(kind)


class _Waiting(logging.Handler):
    """Sets ``event`` when the stream reader logs that it waits for a member on its node."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "no running member on this node" in record.getMessage():
            self.event.set()


def test_a_stream_read_through_a_node_without_its_member_waits_for_one(
    healthy: Rabbitmq4Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream with one member, read through another node: RabbitMQ refuses the consumer (406,
    "does not have a running replica on the local node"), as one node does just after a stream
    is declared. The reader tries again on new channels for ``REPLICA_WAIT`` seconds, then
    raises ``StreamUnavailable`` naming the stream; a member added on that node while it waits
    is read from, every message in order."""
    name = unique("ra-cluster-stream")
    declare_stream(healthy.nodes[0].url, name, x_initial_cluster_size=1)
    try:
        publish(healthy.nodes[0].url, name, 0, 10)
        holder = healthy.leader(name)
        reader = next(node for node in healthy.nodes if node is not holder)
        connector = _stream.Connector(PublisherOptions.create(reader.url))

        monkeypatch.setattr(_stream, "REPLICA_WAIT", 2.0)
        with pytest.raises(StreamUnavailable, match=name) as refused:
            connector.probing(lambda connection: _stream.end_offset(connection, name))
        assert "rabbitmq-streams add_replica" in str(refused.value)

        monkeypatch.setattr(_stream, "REPLICA_WAIT", 300.0)  # the member is added meanwhile
        waiting = _Waiting()
        logger = logging.getLogger("reliable_amqp.spark")
        logger.addHandler(waiting)
        level = logger.level
        logger.setLevel(logging.DEBUG)
        read: list[list[int]] = []
        failed: list[BaseException] = []

        def read_all() -> None:
            try:
                chunks = _stream.read_range(connector, name, 0, 10)
                read.append([offset for chunk in chunks for offset in chunk.offsets])
            except BaseException as exc:  # reported by the test's thread below
                failed.append(exc)

        thread = threading.Thread(target=read_all, daemon=True)
        try:
            thread.start()
            assert waiting.event.wait(120), "the reader never met the missing member"
            reader.tool("rabbitmq-streams", "add_replica", name, reader.nodename)
            thread.join(300)
        finally:
            logger.removeHandler(waiting)
            logger.setLevel(level)
        assert not thread.is_alive(), "the read did not end once the member was added"
        assert not failed, failed
        assert read == [list(range(10))]
        assert connector.probing(lambda connection: _stream.end_offset(connection, name)) == 10
    finally:
        _delete(healthy.nodes[0].url, name)
