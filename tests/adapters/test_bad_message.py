"""One bad message never hurts the others: frame errors, oversize header blocks, user_id."""

from __future__ import annotations

import threading
import time

import pytest

from adapters.conftest import Peers, PublisherFactory, kinds
from adapters.drivers import outcomes
from fake import ACK, HOLD, FakeBroker, Message
from fake.records import Action
from reliable_amqp import EventKind, InvalidMessage, PublisherEvent

pytestmark = pytest.mark.timeout(60)


def test_a_connection_closed_for_a_frame_error_fails_only_its_culprit(
    peer: FakeBroker, make_publisher: PublisherFactory, events: list[PublisherEvent]
) -> None:
    # Like a broker that cannot decode one publish: it closes the whole connection with 501
    # and reads nothing after that frame.
    poisoned: set[int] = set()

    def policy(message: Message) -> Action:
        if message.connection in poisoned:
            return HOLD
        if message.headers.get("poison"):
            poisoned.add(message.connection)
            threading.Thread(
                target=peer.close_connection,
                args=(501, "FRAME_ERROR - cannot decode"),
                kwargs={"connection": message.connection},
            ).start()
            return HOLD
        return ACK

    peer.set_policy(policy)
    with make_publisher(peer.url()) as publisher:
        publisher.publish_and_wait("", "q", b"warm-up")
        begun = time.monotonic()
        futures = [
            publisher.publish("", "q", b"m%03d" % i, headers={"poison": i == 50})
            for i in range(100)
        ]
        assert publisher.flush(timeout=20) == 0
        # Not held until a deadline: the suspects go one by one, then the rest at once.
        assert time.monotonic() - begun < 5
        # Publishing goes on at full speed once the suspects are settled.
        started = time.monotonic()
        later = [publisher.publish("", "q", b"later%d" % i) for i in range(100)]
        assert publisher.flush(timeout=5) == 0
        assert time.monotonic() - started < 3
        assert outcomes(later) == ["Confirmation"] * 100
    results = outcomes(futures)
    assert results[50] == "MessageRejected"
    assert results[:50] + results[51:] == ["Confirmation"] * 99
    error = futures[50].exception(0)
    assert error is not None and "501" in str(error) and "FRAME_ERROR" in str(error)
    lost = kinds(events).count(EventKind.CONNECTION_LOST)
    assert 1 <= lost <= 2, f"{lost} connection losses: a reconnect loop"
    confirmed = {m.body for m in peer.received() if m.outcome == "ack"}
    assert confirmed == {b"warm-up"} | {b"m%03d" % i for i in range(100) if i != 50} | {
        b"later%d" % i for i in range(100)
    }


def test_a_header_block_larger_than_frame_max_fails_alone(
    make_peer: Peers, make_publisher: PublisherFactory, events: list[PublisherEvent]
) -> None:
    peer = make_peer(frame_max=4096)
    big = {"blob": "x" * 5000}
    publisher = make_publisher(peer.url())  # not connected yet (the factory closes it)
    # Before the connection is open frame_max is unknown: the message fails alone, unwritten.
    early = publisher.publish("", "q", b"early", headers=big)
    others = [publisher.publish("", "q", b"m%d" % i) for i in range(20)]
    assert publisher.flush(timeout=10) == 0
    assert outcomes([early]) == ["MessageRejected"]
    assert "frame_max" in str(early.exception(0))
    assert outcomes(others) == ["Confirmation"] * 20
    # Once it is known, publish() refuses it at once.
    with pytest.raises(InvalidMessage) as info:
        publisher.publish("", "q", b"late", headers=big)
    assert info.value.field == "headers" and "4096-byte frame_max" in str(info.value)
    assert publisher.publish_and_wait("", "q", b"after").attempts == 1
    assert [m.body for m in peer.received()] == [b"m%d" % i for i in range(20)] + [b"after"]
    assert EventKind.CONNECTION_LOST not in kinds(events)


def test_user_id_other_than_the_connection_user_is_refused_at_publish(
    peer: FakeBroker, make_publisher: PublisherFactory
) -> None:
    with make_publisher(peer.url()) as publisher:
        with pytest.raises(InvalidMessage) as info:
            publisher.publish("", "q", b"x", user_id="mallory")
        assert info.value.field == "user_id" and "'guest'" in str(info.value)
        assert publisher.publish_and_wait("", "q", b"y", user_id="guest").attempts == 1
    [message] = peer.received()
    assert message.body == b"y" and message.properties.user_id == "guest"


#: what LavinMQ says of itself in connection.start (its limits differ from RabbitMQ's)
LAVINMQ_PROPERTIES = {
    "product": "LavinMQ",
    "version": "2.9.1",
    "platform": "Crystal",
    "capabilities": {"publisher_confirms": True, "basic.nack": True},
}


def test_an_expiration_lavinmq_cannot_take_fails_alone_and_is_refused_once_known(
    make_peer: Peers, make_publisher: PublisherFactory, events: list[PublisherEvent]
) -> None:
    peer = make_peer(server_properties=LAVINMQ_PROPERTIES)
    over = "2147483648"  # LavinMQ's limit + 1 (RabbitMQ takes up to ten years)
    publisher = make_publisher(peer.url())  # not connected yet (the factory closes it)
    # Taken before the broker is known: it fails alone, unwritten, typed; the others go.
    early = publisher.publish("", "q", b"early", expiration=over)
    others = [publisher.publish("", "q", b"m%d" % i, expiration="60000") for i in range(20)]
    assert publisher.flush(timeout=10) == 0
    assert outcomes([early]) == ["MessageRejected"]
    error = early.exception(0)
    assert error is not None and error.reply_code == 0
    assert "LavinMQ's limit of 2147483647 ms" in str(error)
    assert outcomes(others) == ["Confirmation"] * 20
    # Once the broker is known, publish() refuses it at once, naming the limit.
    with pytest.raises(InvalidMessage) as info:
        publisher.publish("", "q", b"late", expiration=int(over))
    assert info.value.field == "expiration" and "LavinMQ's limit" in str(info.value)
    with pytest.raises(InvalidMessage):
        publisher.publish_many("", "q", [b"a", b"b"], expiration=over)
    # The limit itself goes.
    assert publisher.publish_and_wait("", "q", b"at", expiration="2147483647").attempts == 1
    received = peer.received()
    assert [m.body for m in received] == [b"m%d" % i for i in range(20)] + [b"at"]
    assert received[-1].properties.expiration == "2147483647"
    assert EventKind.CHANNEL_LOST not in kinds(events)
    assert EventKind.CONNECTION_LOST not in kinds(events)


def test_a_broker_other_than_lavinmq_takes_an_expiration_over_lavinmqs_limit(
    peer: FakeBroker, make_publisher: PublisherFactory
) -> None:
    # the fake presents itself as another broker than LavinMQ: no LavinMQ limit applies
    with make_publisher(peer.url()) as publisher:
        assert publisher.publish_and_wait("", "q", b"x", expiration="2147483648").attempts == 1
    [message] = peer.received()
    assert message.properties.expiration == "2147483648"
