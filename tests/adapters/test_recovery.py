"""Channel and connection loss, failover and refused connections, through the real adapters."""

from __future__ import annotations

import time

import pytest

from adapters.conftest import Peers, PublisherFactory, kinds
from adapters.drivers import outcomes, wait_until
from fake import ACK, HOLD, FakeBroker, Message
from reliable_amqp import (
    AuthenticationFailed,
    Confirmation,
    EventKind,
    MessageRejected,
    PreconditionFailed,
    PublisherClosed,
    PublisherEvent,
    RecoveryFailed,
    RetryPolicy,
)

pytestmark = pytest.mark.timeout(60)


def from_connection(n: int):  # type: ignore[no-untyped-def]
    """A policy: hold what arrives on connections before ``n``, ack from connection ``n`` on."""

    def policy(message: Message) -> str | None:
        return ACK if message.connection >= n else HOLD

    return policy


def test_a_404_channel_close_rejects_that_message_and_republishes_the_others(
    make_peer: Peers, make_publisher: PublisherFactory, events: list[PublisherEvent]
) -> None:
    peer = make_peer(auto_ack=False)
    with make_publisher(peer.url()) as publisher:
        before = [publisher.publish("", "q", b"b%d" % i) for i in range(3)]
        peer.wait_for_messages(3)
        bad = publisher.publish("nope", "rk", b"nowhere")
        after = [publisher.publish("", "q", b"a%d" % i) for i in range(3)]
        peer.wait_until(lambda: peer.received(outcome="rejected") != [], what="the 404")
        peer.set_auto(True)  # acks what the new channel got so far, and all that follows
        assert publisher.flush(timeout=10) == 0
        later = publisher.publish_and_wait("", "q", b"later")
        stats = publisher.stats()
    error = bad.exception(0)
    assert isinstance(error, MessageRejected)
    assert error.reply_code == 404 and "nope" in error.reply_text
    assert error.message.exchange == "nope" and error.message.body == b"nowhere"
    assert outcomes(before + after) == ["Confirmation"] * 6
    good_ids = [f.result(0).message_id for f in before + after]
    first = peer.received()[0].channel_serial
    on_first = [m.body for m in peer.received(channel_serial=first)]
    assert on_first == [b"b0", b"b1", b"b2", b"nowhere"]  # the rest was discarded (closing)
    second = [m for m in peer.received() if m.channel_serial != first]
    assert {m.channel_serial for m in second} == {first + 1}
    assert [m.connection for m in second] == [1] * 7  # a new channel, the same connection
    assert [m.message_id for m in second] == [*good_ids, later.message_id]
    assert [m.tag for m in second] == list(range(1, 8))  # tags restart on the new channel
    assert [f.result(0).attempts for f in before] == [2, 2, 2]
    # Republished: what was on the wire of the closed channel, unconfirmed. That is the three
    # before it, and those of the three after it written before the client saw the close (the
    # peer discarded them, as the spec says; how many depends on timing).
    discarded = peer.discarded.count((1, first))
    assert 0 <= discarded <= 3
    assert (stats.rejected, stats.republished, stats.confirmed) == (1, 3 + discarded, 7)
    assert kinds(events)[:3] == [EventKind.CONNECTED, EventKind.CHANNEL_LOST, EventKind.RECOVERED]


def test_a_resource_channel_close_is_retried_on_a_new_channel(
    make_peer: Peers, make_publisher: PublisherFactory, events: list[PublisherEvent]
) -> None:
    peer = make_peer(auto_ack=False)
    with make_publisher(peer.url()) as publisher:
        futures = [publisher.publish("", "q", b"%d" % i) for i in range(4)]
        peer.wait_for_messages(4)
        peer.set_policy(lambda m: ACK if m.channel_serial > 1 else HOLD)
        peer.close_channel(406, "PRECONDITION_FAILED - low disk space")  # LavinMQ: retriable
        assert publisher.flush(timeout=10) == 0
    assert outcomes(futures) == ["Confirmation"] * 4
    assert [m.body for m in peer.received(channel_serial=2)] == [b"0", b"1", b"2", b"3"]
    assert kinds(events)[:3] == [EventKind.CONNECTED, EventKind.CHANNEL_LOST, EventKind.RECOVERED]


@pytest.mark.parametrize("how", ["drop", "connection.close 320"])
def test_a_lost_connection_is_recovered_and_the_unconfirmed_republished_in_order(
    make_peer: Peers, make_publisher: PublisherFactory, events: list[PublisherEvent], how: str
) -> None:
    peer = make_peer(policy=from_connection(2))
    n = 10
    with make_publisher(peer.url()) as publisher:
        futures = [publisher.publish("", "q", b"m%d" % i, message_id=f"id{i}") for i in range(n)]
        peer.wait_for_messages(n)
        peer.ack(4, multiple=True)
        wait_until(futures[3].done, what="the first four confirms")
        if how == "drop":
            peer.drop()
        else:
            peer.close_connection(320, "CONNECTION_FORCED - broker forced connection closure")
        assert publisher.flush(timeout=10) == 0
        stats = publisher.stats()
    assert [f.result(0) for f in futures] == [
        Confirmation(f"id{i}", 1 if i < 4 else 2) for i in range(n)
    ]
    assert [m.message_id for m in peer.received(connection=1)] == [f"id{i}" for i in range(n)]
    again = peer.received(connection=2)
    assert [m.message_id for m in again] == [f"id{i}" for i in range(4, n)]  # same ids, in order
    assert [m.body for m in again] == [b"m%d" % i for i in range(4, n)]
    assert [m.tag for m in again] == list(range(1, 7))
    assert len(peer.connections) == 2
    assert (stats.confirmed, stats.republished, stats.recoveries) == (n, 6, 1)
    assert kinds(events) == [
        EventKind.CONNECTED,
        EventKind.CONNECTION_LOST,
        EventKind.RETRYING,
        EventKind.RECOVERED,
        EventKind.CLOSED,
    ]
    recovered = next(e for e in events if e.kind is EventKind.RECOVERED)
    assert recovered.downtime is not None and 0 <= recovered.downtime < 5


def test_failover_to_the_second_url_when_the_first_refuses(
    make_peer: Peers, make_publisher: PublisherFactory
) -> None:
    first, second = make_peer(), make_peer()
    first.refuse_next(1000)
    with make_publisher([first.url(), second.url()]) as publisher:
        futures = [publisher.publish("", "q", b"%d" % i) for i in range(20)]
        assert publisher.flush(timeout=10) == 0
    assert outcomes(futures) == ["Confirmation"] * 20
    assert first.attempts == first.refused == 1 and first.connections == []
    assert [m.body for m in second.received()] == [b"%d" % i for i in range(20)]
    assert len(second.connections) == 1


def test_wrong_credentials_fail_at_once_without_retries(
    peer: FakeBroker, make_publisher: PublisherFactory, events: list[PublisherEvent]
) -> None:
    publisher = make_publisher(peer.url(password="n0t-the-passw0rd"))
    started = time.monotonic()
    with pytest.raises(AuthenticationFailed) as info:
        publisher.connect()
    assert time.monotonic() - started < 2
    assert not info.value.retriable
    assert "n0t-the-passw0rd" not in str(info.value)
    with pytest.raises(PublisherClosed):
        publisher.publish("", "q", b"x")
    publisher.close(timeout=1)
    assert (peer.attempts, peer.auth_refusals) == (1, 1)  # never tried again
    assert peer.received() == []
    assert kinds(events) == [EventKind.RECOVERY_FAILED, EventKind.CLOSED]


def test_a_connection_lost_while_logging_in_is_retried_not_taken_for_wrong_credentials(
    peer: FakeBroker, make_publisher: PublisherFactory
) -> None:
    """pika calls any close while authenticating a "probable authentication error"; only the
    broker's own refusal (connection.close 403, the test above) is final. A reset mid-login (a
    proxy, a broker restarting, a network blip) is retried like any lost connection."""
    peer.drop_next_logins(2)
    with make_publisher(peer.url()) as publisher:
        futures = [publisher.publish("", "q", b"%d" % i) for i in range(5)]
        assert publisher.flush(timeout=10) == 0
    assert outcomes(futures) == ["Confirmation"] * 5
    assert (peer.dropped_logins, peer.auth_refusals, peer.attempts) == (2, 0, 3)
    assert [m.body for m in peer.received()] == [b"%d" % i for i in range(5)]


def test_a_missing_vhost_fails_at_once_without_retries(
    peer: FakeBroker, make_publisher: PublisherFactory
) -> None:
    publisher = make_publisher(peer.url(vhost="no-such-vhost"))
    with pytest.raises(AuthenticationFailed) as info:
        publisher.connect()
    assert not info.value.retriable
    publisher.close(timeout=1)
    assert peer.attempts == 1
    assert peer.connections[0].vhost == "no-such-vhost"


def test_a_spent_connect_policy_raises_recovery_failed(
    peer: FakeBroker, make_publisher: PublisherFactory, events: list[PublisherEvent]
) -> None:
    peer.refuse_next(1000)
    policy = RetryPolicy(max_attempts=3, initial_delay=0.01, max_delay=0.01, jitter=0.0)
    publisher = make_publisher(peer.url(), connect_policy=policy)
    with pytest.raises(RecoveryFailed):
        publisher.connect()
    publisher.close(timeout=1)
    assert peer.attempts == peer.refused == 3
    assert kinds(events) == [
        EventKind.RETRYING,  # attempt 2
        EventKind.RETRYING,  # attempt 3
        EventKind.RECOVERY_FAILED,
        EventKind.CLOSED,
    ]
    assert [e.attempt for e in events[:2]] == [2, 3]


def test_pending_messages_fail_with_publisher_closed_when_recovery_gives_up(
    make_peer: Peers, make_publisher: PublisherFactory, events: list[PublisherEvent]
) -> None:
    peer = make_peer(auto_ack=False)
    policy = RetryPolicy(max_attempts=2, initial_delay=0.01, max_delay=0.01, jitter=0.0)
    publisher = make_publisher(peer.url(), connect_policy=policy)
    with publisher:
        futures = [publisher.publish("", "q", b"%d" % i) for i in range(3)]
        peer.wait_for_messages(3)
        peer.refuse_next(1000)
        peer.drop()
        errors = [f.exception(10) for f in futures]
        with pytest.raises(PublisherClosed):
            publisher.publish("", "q", b"late")
    assert all(isinstance(e, PublisherClosed) for e in errors)
    assert all(isinstance(e.__cause__, RecoveryFailed) for e in errors)
    assert [e.message.body for e in errors] == [b"0", b"1", b"2"]
    assert peer.refused == 1  # the loss was failure 1 of 2: one more attempt, refused
    assert kinds(events) == [
        EventKind.CONNECTED,
        EventKind.CONNECTION_LOST,
        EventKind.RETRYING,
        EventKind.RECOVERY_FAILED,
        EventKind.CLOSED,
    ]


def test_declarations_are_replayed_after_a_reconnect(
    peer: FakeBroker, make_publisher: PublisherFactory
) -> None:
    with make_publisher(peer.url()) as publisher:
        publisher.declare_exchange("orders", "topic", durable=False)
        assert publisher.declare_queue("orders.eu", arguments={"x-max-length": 10}) == "orders.eu"
        publisher.bind_queue("orders.eu", "orders", "eu.#")
        assert publisher.publish_and_wait("orders", "eu.1", b"one", mandatory=True).attempts == 1
        peer.drop()
        peer.wait_until(lambda: len(peer.connections) == 2, what="a reconnect")
        assert publisher.publish_and_wait("orders", "eu.2", b"two", mandatory=True).attempts == 1
    first = [(d.method, d.name, d.arguments) for d in peer.declarations if d.connection == 1]
    again = [(d.method, d.name, d.arguments) for d in peer.declarations if d.connection == 2]
    assert [(m, n) for m, n, _ in first] == [
        ("Exchange.Declare", "orders"),
        ("Queue.Declare", "orders.eu"),
        ("Queue.Bind", "orders.eu"),
    ]
    assert again == first  # same order, same arguments
    assert first[0][2]["exchange_type"] == "topic" and first[0][2]["durable"] is False
    assert first[1][2]["arguments"] == {"x-max-length": 10}
    assert first[2][2]["routing_key"] == "eu.#"
    assert [(m.connection, m.body) for m in peer.received()] == [(1, b"one"), (2, b"two")]


def test_a_failed_declaration_raises_and_publishing_goes_on(
    peer: FakeBroker, make_publisher: PublisherFactory, events: list[PublisherEvent]
) -> None:
    peer.declare_errors["taken"] = (
        406,
        "PRECONDITION_FAILED - inequivalent arg 'durable' for queue 'taken' in vhost '/'",
    )
    with make_publisher(peer.url()) as publisher:
        futures = [publisher.publish("", "q", b"%d" % i) for i in range(50)]
        with pytest.raises(PreconditionFailed) as info:
            publisher.declare_queue("taken", durable=False)
        assert "inequivalent" in str(info.value)
        assert publisher.flush(timeout=10) == 0
        assert publisher.publish_and_wait("", "q", b"after").attempts == 1
    assert outcomes(futures) == ["Confirmation"] * 50
    publishing = {m.channel_serial for m in peer.received()}
    assert len(publishing) == 1  # the publishing channel was never disturbed
    assert EventKind.CHANNEL_LOST not in kinds(events)
