"""Flow control, deadlines, liveness, flush and close, through the real adapters."""

from __future__ import annotations

import time

import pytest

from adapters.conftest import Peers, PublisherFactory, kinds
from adapters.drivers import outcomes, wait_until
from fake import ACK, HOLD, FakeBroker
from reliable_amqp import (
    Confirmation,
    DeliveryTimeout,
    EventKind,
    PublisherClosed,
    PublisherEvent,
    State,
)

pytestmark = pytest.mark.timeout(60)


def aiormq_reports_block_reasons() -> bool:
    """aiormq 7 and later let the publisher see connection.blocked's reason."""
    from importlib.metadata import version

    return int(version("aiormq").split(".")[0]) >= 7


@pytest.mark.parametrize("kind", ["sync", "async"], indirect=True)
def test_nothing_is_written_while_blocked_and_deadlines_still_fire(
    peer: FakeBroker,
    make_publisher: PublisherFactory,
    events: list[PublisherEvent],
    kind: str,
) -> None:
    with make_publisher(peer.url(), delivery_timeout=0.5) as publisher:
        assert publisher.publish_and_wait("", "q", b"before").attempts == 1
        peer.block("low on memory")
        wait_until(lambda: publisher.state is State.BLOCKED, 2, "the BLOCKED state")
        started = time.monotonic()
        stuck = [publisher.publish("", "q", b"stuck%d" % i) for i in range(5)]
        assert publisher.flush(timeout=5) == 0  # the deadline fires while blocked
        elapsed = time.monotonic() - started
        assert outcomes(stuck) == ["DeliveryTimeout"] * 5
        assert peer.received(while_blocked=True) == []  # not one written while blocked
        peer.unblock()
        wait_until(lambda: publisher.state is State.OPEN, what="the OPEN state")
        assert publisher.publish_and_wait("", "q", b"after").attempts == 1
    assert 0.4 <= elapsed < 3
    assert [m.body for m in peer.received()] == [b"before", b"after"]  # the expired never went
    assert kinds(events) == [
        EventKind.CONNECTED,
        EventKind.BLOCKED,
        EventKind.UNBLOCKED,
        EventKind.CLOSED,
    ]
    blocked = next(e for e in events if e.kind is EventKind.BLOCKED)
    if kind == "sync" or aiormq_reports_block_reasons():
        assert "low on memory" in blocked.detail
    else:  # aiormq 6 binds its frame handlers before the publisher sees the connection
        assert blocked.detail == "connection.blocked (a resource alarm)"


@pytest.mark.parametrize("kind", ["sync", "async"], indirect=True)
def test_messages_published_while_blocked_go_out_on_unblock(
    peer: FakeBroker, make_publisher: PublisherFactory
) -> None:
    with make_publisher(peer.url()) as publisher:
        publisher.publish_and_wait("", "q", b"first")
        peer.block("disk alarm")
        wait_until(lambda: publisher.state is State.BLOCKED, 2, "the BLOCKED state")
        futures = [publisher.publish("", "q", b"%d" % i) for i in range(5)]
        assert publisher.flush(timeout=0.3) == 5  # held back, not failed
        peer.unblock()
        assert publisher.flush(timeout=5) == 0
    assert outcomes(futures) == ["Confirmation"] * 5
    assert peer.received(while_blocked=True) == []
    assert [m.body for m in peer.received()] == [b"first", b"0", b"1", b"2", b"3", b"4"]


def test_messages_never_acked_fail_with_delivery_timeout(
    make_peer: Peers, make_publisher: PublisherFactory
) -> None:
    peer = make_peer(auto_ack=False)
    with make_publisher(peer.url(), delivery_timeout=0.5) as publisher:
        started = time.monotonic()
        futures = [publisher.publish("", "q", b"%d" % i, message_id=f"t{i}") for i in range(5)]
        assert publisher.flush(timeout=5) == 0
        elapsed = time.monotonic() - started
        stats = publisher.stats()
    assert 0.4 <= elapsed < 3
    errors = [f.exception(0) for f in futures]
    assert all(isinstance(e, DeliveryTimeout) and e.timeout == 0.5 for e in errors)
    assert [e.message.properties.message_id for e in errors] == [f"t{i}" for i in range(5)]
    assert [m.message_id for m in peer.received()] == [f"t{i}" for i in range(5)]  # sent once
    assert (stats.timed_out, stats.confirmed, stats.in_flight) == (5, 0, 0)


@pytest.mark.parametrize("kind", ["sync", "async"], indirect=True)
def test_a_stalled_link_is_noticed_by_the_heartbeat_and_recovered(
    make_peer: Peers, make_publisher: PublisherFactory, events: list[PublisherEvent]
) -> None:
    peer = make_peer(heartbeat=1)
    with make_publisher(peer.url(), heartbeat=1) as publisher:
        assert publisher.publish_and_wait("", "q", b"ok").attempts == 1
        assert peer.connections[0].heartbeat == 1
        peer.stall()
        started = time.monotonic()
        futures = [publisher.publish("", "q", b"s%d" % i, message_id=f"s{i}") for i in range(3)]
        assert publisher.flush(timeout=10) == 0
        noticed = time.monotonic() - started
    assert [f.result(0) for f in futures] == [Confirmation(f"s{i}", 2) for i in range(3)]
    assert 1.5 <= noticed < 6  # about 2 heartbeats of silence, then a reconnect
    assert [m.message_id for m in peer.received(connection=2)] == ["s0", "s1", "s2"]
    assert kinds(events)[:4] == [
        EventKind.CONNECTED,
        EventKind.CONNECTION_LOST,
        EventKind.RETRYING,
        EventKind.RECOVERED,
    ]


@pytest.mark.parametrize("kind", ["sync", "async"], indirect=True)
def test_a_quiet_link_kept_alive_by_heartbeats_is_not_dropped(
    make_peer: Peers, make_publisher: PublisherFactory, events: list[PublisherEvent]
) -> None:
    peer = make_peer(heartbeat=1)
    with make_publisher(peer.url(), heartbeat=1) as publisher:
        publisher.publish_and_wait("", "q", b"one")
        conn = peer.connections[0]
        # pika beats every 0.5 s: five beats are 2.5 s of nothing but heartbeats both ways,
        # more than the 2 heartbeats of silence after which a link counts as stalled.
        peer.wait_until(lambda: conn.heartbeats_received >= 5, 10, "five client heartbeats")
        publisher.publish_and_wait("", "q", b"two")
    assert len(peer.connections) == 1
    assert kinds(events) == [EventKind.CONNECTED, EventKind.CLOSED]


def test_flush_returns_how_many_are_still_unresolved(
    make_peer: Peers, make_publisher: PublisherFactory
) -> None:
    peer = make_peer(auto_ack=False)
    with make_publisher(peer.url()) as publisher:
        assert publisher.flush(timeout=0.1) == 0
        futures = [publisher.publish("", "q", b"%d" % i) for i in range(5)]
        peer.wait_for_messages(5)
        assert publisher.flush(timeout=0.1) == 5
        peer.ack(2, multiple=True)
        # A future is resolved a moment before its room in the window is freed (the same I/O
        # step): wait for both, then flush must count exactly the three left.
        wait_until(lambda: futures[1].done() and publisher.in_flight == 3, what="two confirms")
        assert publisher.flush(timeout=0.1) == 3
        assert publisher.in_flight == 3
        peer.ack(5, multiple=True)
        assert publisher.flush(timeout=5) == 0
        assert publisher.in_flight == 0
    assert outcomes(futures) == ["Confirmation"] * 5


def test_close_fails_what_is_unconfirmed_with_publisher_closed(
    make_peer: Peers, make_publisher: PublisherFactory, events: list[PublisherEvent]
) -> None:
    peer = make_peer(policy=lambda m: ACK if m.body == b"0" else HOLD)
    publisher = make_publisher(peer.url()).connect()
    futures = [publisher.publish("", "q", b"%d" % i) for i in range(4)]
    peer.wait_for_messages(4)
    wait_until(futures[0].done, what="the first confirm")
    started = time.monotonic()
    assert publisher.close(timeout=0.3) == 3
    assert time.monotonic() - started < 3
    assert outcomes(futures, timeout=0) == ["Confirmation"] + ["PublisherClosed"] * 3
    errors = [f.exception(0) for f in futures[1:]]
    assert [e.message.body for e in errors] == [b"1", b"2", b"3"]
    with pytest.raises(PublisherClosed):
        publisher.publish("", "q", b"late")
    assert publisher.state is State.CLOSED
    assert kinds(events) == [EventKind.CONNECTED, EventKind.CLOSED]
    peer.wait_until(lambda: peer.live_connections() == [], what="the client to hang up")
    assert peer.connections[0].ended == "closed by the client"  # a clean connection.close


def test_events_follow_the_connection_through_channel_and_connection_loss(
    make_peer: Peers, make_publisher: PublisherFactory, events: list[PublisherEvent]
) -> None:
    peer = make_peer()
    with make_publisher(peer.url()) as publisher:
        publisher.publish_and_wait("", "q", b"1")
        peer.close_channel(506, "RESOURCE_ERROR - queue full")
        wait_until(lambda: EventKind.RECOVERED in kinds(events), what="the channel again")
        publisher.publish_and_wait("", "q", b"2")
        peer.drop()
        wait_until(lambda: kinds(events).count(EventKind.RECOVERED) == 2, what="a reconnect")
        publisher.publish_and_wait("", "q", b"3")
        stats = publisher.stats()
    assert kinds(events) == [
        EventKind.CONNECTED,
        EventKind.CHANNEL_LOST,
        EventKind.RECOVERED,
        EventKind.CONNECTION_LOST,
        EventKind.RETRYING,
        EventKind.RECOVERED,
        EventKind.CLOSED,
    ]
    assert "506" in events[1].detail
    assert all(e.downtime is not None for e in events if e.kind is EventKind.RECOVERED)
    assert [e.at for e in events] == sorted(e.at for e in events)
    assert [(m.connection, m.channel_serial, m.body) for m in peer.received()] == [
        (1, 1, b"1"),
        (1, 2, b"2"),
        (2, 3, b"3"),
    ]
    assert stats.recoveries == 1  # a channel recovery is not a connection recovery


@pytest.mark.parametrize("kind", ["sync", "async"], indirect=True)
def test_heartbeat_zero_in_the_url_means_no_liveness_watchdog(
    make_peer: Peers, make_publisher: PublisherFactory, events: list[PublisherEvent]
) -> None:
    # The broker offers heartbeats of 1 s; the URL turns them off. The watchdog must follow what
    # was negotiated (none): a quiet link is not "dead" after 2 silent heartbeats.
    peer = make_peer(heartbeat=1)
    with make_publisher(peer.url(heartbeat=0)) as publisher:
        assert publisher.publish_and_wait("", "q", b"before").attempts == 1
        time.sleep(3)  # three offered heartbeat intervals without a byte either way
        assert publisher.publish_and_wait("", "q", b"after").attempts == 1
    assert EventKind.CONNECTION_LOST not in kinds(events)
    assert len(peer.connections) == 1
