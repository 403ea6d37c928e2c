"""Confirms, nacks and returns, through the real adapters, against the fake peer."""

from __future__ import annotations

from collections import Counter

import pytest

from adapters.conftest import Peers, PublisherFactory
from adapters.drivers import outcomes, wait_until
from fake import ACK, HOLD, NACK, RETURN, FakeBroker, Message
from reliable_amqp import Confirmation, MessageNacked, MessageReturned, RetryPolicy

pytestmark = pytest.mark.timeout(60)


def test_a_stream_is_confirmed_by_single_acks(
    peer: FakeBroker, make_publisher: PublisherFactory
) -> None:
    n = 300
    with make_publisher(peer.url()) as publisher:
        futures = [publisher.publish("", "q", b"m%03d" % i) for i in range(n)]
        assert publisher.flush(timeout=10) == 0
        stats = publisher.stats()
    results = [f.result(0) for f in futures]
    assert [r.attempts for r in results] == [1] * n
    received = peer.received()
    assert [m.body for m in received] == [b"m%03d" % i for i in range(n)]
    assert [m.message_id for m in received] == [r.message_id for r in results]
    assert len({r.message_id for r in results}) == n
    assert [m.tag for m in received] == list(range(1, n + 1))  # one channel, tags from 1
    assert {(m.connection, m.channel) for m in received} == {(1, received[0].channel)}
    assert {m.properties.delivery_mode for m in received} == {2}  # persistent by default
    assert len(peer.confirms) == n and not any(c.multiple for c in peer.confirms)
    assert (stats.published, stats.confirmed, stats.republished) == (n, n, 0)


def test_coalesced_multiple_acks_confirm_every_message_once(
    make_peer: Peers, make_publisher: PublisherFactory
) -> None:
    peer = make_peer(coalesce=True)  # LavinMQ: one ack with multiple=True per batch read
    n = 2000
    with make_publisher(peer.url()) as publisher:
        futures = [publisher.publish("", "q", b"%d" % i) for i in range(n)]
        assert publisher.flush(timeout=10) == 0
        stats = publisher.stats()
    assert outcomes(futures) == ["Confirmation"] * n
    assert all(c.multiple for c in peer.confirms)
    assert peer.confirms[-1].tag == n
    assert (stats.confirmed, stats.in_flight) == (n, 0)


def test_single_and_multiple_acks_settle_exactly_what_they_cover(
    make_peer: Peers, make_publisher: PublisherFactory
) -> None:
    peer = make_peer(auto_ack=False)
    with make_publisher(peer.url()) as publisher:
        futures = [publisher.publish("", "q", b"%d" % i) for i in range(10)]
        peer.wait_for_messages(10)

        def done() -> set[int]:
            return {i for i, f in enumerate(futures) if f.done()}

        assert done() == set()
        peer.ack(3, multiple=True)
        wait_until(futures[2].done, what="tags 1-3 settled")
        assert done() == {0, 1, 2}
        peer.ack(5)
        wait_until(futures[4].done, what="tag 5 settled")
        assert done() == {0, 1, 2, 4}  # a single ack covers its own tag only
        assert publisher.in_flight == 6
        peer.ack(10, multiple=True)
        assert publisher.flush(timeout=5) == 0
    assert [f.result(0).attempts for f in futures] == [1] * 10
    assert len(peer.received()) == 10  # nothing was sent twice


def test_an_ack_multiple_over_a_nacked_tag_settles_it_once(
    make_peer: Peers, make_publisher: PublisherFactory
) -> None:
    # LavinMQ coalesces acks but nacks singly: its ack-multiple may cover a tag nacked already.
    peer = make_peer(auto_ack=False)
    once = RetryPolicy(max_attempts=1)
    with make_publisher(peer.url(), nack_policy=once) as publisher:
        futures = [publisher.publish("", "q", b"%d" % i) for i in range(5)]
        peer.wait_for_messages(5)
        peer.nack(2)
        peer.ack(5, multiple=True)
        assert publisher.flush(timeout=5) == 0
        stats = publisher.stats()
    assert outcomes(futures) == ["Confirmation", "MessageNacked"] + ["Confirmation"] * 3
    error = futures[1].exception()
    assert isinstance(error, MessageNacked) and error.attempts == 1 and error.message.body == b"1"
    assert (stats.confirmed, stats.nacked, stats.failed_nacked) == (4, 1, 1)
    assert len(peer.received()) == 5


def test_a_nack_is_retried_then_confirmed(
    make_peer: Peers, make_publisher: PublisherFactory
) -> None:
    seen: Counter[str | None] = Counter()

    def nack_first_copy(message: Message) -> str | None:
        seen[message.message_id] += 1
        return NACK if seen[message.message_id] == 1 else ACK

    peer = make_peer(policy=nack_first_copy)
    n = 20
    with make_publisher(peer.url()) as publisher:
        futures = [publisher.publish("", "q", b"%d" % i, message_id=f"id-{i}") for i in range(n)]
        assert publisher.flush(timeout=10) == 0
        stats = publisher.stats()
    assert [f.result(0) for f in futures] == [Confirmation(f"id-{i}", 2) for i in range(n)]
    ids = [m.message_id for m in peer.received()]
    assert Counter(ids) == {f"id-{i}": 2 for i in range(n)}
    # Each retry carries the original's message_id, and the first copies went out in order.
    assert list(dict.fromkeys(ids)) == [f"id-{i}" for i in range(n)]
    assert (stats.nacked, stats.confirmed, stats.failed_nacked) == (n, n, 0)


def test_nacks_until_the_policy_is_spent_fail_with_message_nacked(
    make_peer: Peers, make_publisher: PublisherFactory
) -> None:
    peer = make_peer(policy=lambda m: NACK)
    policy = RetryPolicy(max_attempts=3, initial_delay=0.01, max_delay=0.02, jitter=0.0)
    with make_publisher(peer.url(), nack_policy=policy) as publisher:
        futures = [publisher.publish("", "q", b"b%d" % i, message_id=f"n{i}") for i in range(4)]
        assert publisher.flush(timeout=10) == 0
        stats = publisher.stats()
    errors = [f.exception(0) for f in futures]
    assert all(isinstance(e, MessageNacked) for e in errors)
    assert [(e.attempts, e.message.body, e.message.properties.message_id) for e in errors] == [
        (3, b"b%d" % i, f"n{i}") for i in range(4)
    ]
    assert Counter(m.message_id for m in peer.received()) == {f"n{i}": 3 for i in range(4)}
    assert (stats.nacked, stats.failed_nacked, stats.confirmed) == (12, 4, 0)


def test_unroutable_mandatory_messages_fail_with_message_returned(
    make_peer: Peers, make_publisher: PublisherFactory
) -> None:
    peer = make_peer(policy=lambda m: RETURN if m.routing_key == "nowhere" else ACK)
    with make_publisher(peer.url()) as publisher:
        # The same message_id everywhere: returns are matched per attempt, not by the user's id.
        routed = publisher.publish("", "q", b"r0", mandatory=True, message_id="same")
        lost = [
            publisher.publish("", "nowhere", b"l%d" % i, mandatory=True, message_id="same")
            for i in range(3)
        ]
        routed_too = publisher.publish("", "q", b"r1", mandatory=True, message_id="same")
        assert publisher.flush(timeout=10) == 0
        stats = publisher.stats()
    assert outcomes([routed, *lost, routed_too]) == (
        ["Confirmation"] + ["MessageReturned"] * 3 + ["Confirmation"]
    )
    errors = [f.exception(0) for f in lost]
    assert [(e.reply_code, e.reply_text, e.message.body) for e in errors] == [
        (312, "NO_ROUTE", b"l%d" % i) for i in range(3)
    ]
    assert all(e.message.routing_key == "nowhere" and e.attempts == 1 for e in errors)
    assert [m.outcome for m in peer.received()] == [ACK, RETURN, RETURN, RETURN, ACK]
    assert all(m.mandatory for m in peer.received())
    assert (stats.returned, stats.confirmed) == (3, 2)


def test_held_messages_wait_for_the_script(
    make_peer: Peers, make_publisher: PublisherFactory
) -> None:
    peer = make_peer(policy=lambda m: HOLD)
    with make_publisher(peer.url()) as publisher:
        futures = [publisher.publish("", "q", b"%d" % i, mandatory=True) for i in range(3)]
        peer.wait_for_messages(3)
        assert publisher.flush(timeout=0.2) == 3
        assert publisher.in_flight == 3
        assert peer.pending() == [1, 2, 3]
        peer.return_(2)
        peer.ack(3, multiple=True)
        assert publisher.flush(timeout=5) == 0
    assert outcomes(futures) == ["Confirmation", "MessageReturned", "Confirmation"]
    error = futures[1].exception(0)
    assert isinstance(error, MessageReturned) and error.message.body == b"1"
