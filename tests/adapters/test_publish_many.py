"""publish_many(): one future per body, each message as if published alone (both adapters)."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from adapters.conftest import Peers, PublisherFactory
from adapters.drivers import outcomes
from fake import ACK, HOLD, NACK, FakeBroker, Message
from reliable_amqp import Confirmation, InvalidMessage, PublisherClosed, PublishTimeout

pytestmark = pytest.mark.timeout(60)


def test_every_body_is_its_own_message_in_order_with_its_own_id(
    peer: FakeBroker, make_publisher: PublisherFactory
) -> None:
    bodies = [b"m%d" % i for i in range(500)]
    with make_publisher(peer.url()) as publisher:
        futures = publisher.publish_many("", "q", bodies, content_type="text/plain", priority=3)
        assert publisher.flush(timeout=10) == 0
        assert publisher.stats().confirmed == 500
    results = [f.result(0) for f in futures]
    received = peer.received()
    assert [m.body for m in received] == bodies
    ids = [m.message_id for m in received]
    assert len(set(ids)) == 500 and [r.message_id for r in results] == ids
    assert all(isinstance(r, Confirmation) and r.attempts == 1 for r in results)
    assert {m.properties.content_type for m in received} == {"text/plain"}
    assert {m.properties.priority for m in received} == {3}
    assert {m.properties.delivery_mode for m in received} == {2}


def test_each_message_has_its_own_outcome_and_retries(
    make_peer: Peers, make_publisher: PublisherFactory
) -> None:
    seen: Counter[str | None] = Counter()

    def nack_odd_once(message: Message) -> str | None:
        seen[message.message_id] += 1
        odd = int(message.body) % 2 == 1
        return NACK if odd and seen[message.message_id] == 1 else ACK

    peer = make_peer(policy=nack_odd_once)
    with make_publisher(peer.url()) as publisher:
        futures = publisher.publish_many("", "q", [b"%d" % i for i in range(10)])
        assert publisher.flush(timeout=10) == 0
    assert [f.result(0).attempts for f in futures] == [1, 2] * 5
    assert Counter(seen.values()) == {1: 5, 2: 5}  # the retries kept their message_id


@pytest.mark.parametrize(
    "bodies, kwargs, field",
    [
        ([b"a", "text", b"c"], {}, "bodies[1]"),
        ([b"a", None], {}, "bodies[1]"),
        (b"one body", {}, "bodies"),
        (42, {}, "bodies"),
        ([b"a"], {"message_id": "mine"}, "message_id"),
        ([b"a"], {"priority": 300}, "priority"),
        ([b"a"], {"headers": {"k": object()}}, "headers['k']"),
    ],
)
def test_a_bad_argument_raises_before_any_message_is_sent(
    peer: FakeBroker,
    make_publisher: PublisherFactory,
    bodies: object,
    kwargs: dict[str, object],
    field: str,
) -> None:
    with make_publisher(peer.url()) as publisher:
        with pytest.raises(InvalidMessage) as info:
            publisher.publish_many("", "q", bodies, **kwargs)
        assert info.value.field == field
        assert publisher.publish_and_wait("", "q", b"after").attempts == 1
        assert publisher.stats().published == 1
    assert [m.body for m in peer.received()] == [b"after"]


def test_bodies_of_any_iterable_and_bytes_like_type(
    peer: FakeBroker, make_publisher: PublisherFactory
) -> None:
    with make_publisher(peer.url()) as publisher:
        futures = publisher.publish_many(
            "", "q", (b for b in [b"a", bytearray(b"b"), memoryview(b"c")])
        )
        assert publisher.publish_many("", "q", []) == []
        assert publisher.flush(timeout=10) == 0
    assert len(futures) == 3
    assert [m.body for m in peer.received()] == [b"a", b"b", b"c"]


def test_a_batch_larger_than_the_window_goes_out_as_room_frees(
    peer: FakeBroker, make_publisher: PublisherFactory
) -> None:
    with make_publisher(peer.url(), max_in_flight=7) as publisher:
        futures = publisher.publish_many("", "q", [b"%d" % i for i in range(50)])
        assert publisher.flush(timeout=10) == 0
    assert outcomes(futures) == ["Confirmation"] * 50
    assert [m.body for m in peer.received()] == [b"%d" % i for i in range(50)]


def test_a_window_that_stays_full_raises_or_fails_the_rest(
    make_peer: Peers, make_publisher: PublisherFactory
) -> None:
    peer = make_peer(policy=lambda m: HOLD)
    with make_publisher(peer.url(), max_in_flight=3, publish_timeout=0.3) as publisher:
        started = time.monotonic()
        futures = publisher.publish_many("", "q", [b"a", b"b", b"c", b"d", b"e"])
        assert 0.25 < time.monotonic() - started < 5
        assert [f.done() for f in futures] == [False] * 3 + [True] * 2
        assert all(isinstance(f.exception(0), PublishTimeout) for f in futures[3:])
        with pytest.raises(PublishTimeout):  # nothing of this call could be taken: it raises
            publisher.publish_many("", "q", [b"f"])
        assert publisher.close(timeout=0.2) == 3
    assert outcomes(futures[:3]) == ["PublisherClosed"] * 3
    assert [m.body for m in peer.received()] == [b"a", b"b", b"c"]


def test_a_closed_publisher_refuses_a_batch(
    peer: FakeBroker, make_publisher: PublisherFactory
) -> None:
    publisher = make_publisher(peer.url()).connect()
    publisher.close()
    with pytest.raises(PublisherClosed):
        publisher.publish_many("", "q", [b"a", b"b"])
