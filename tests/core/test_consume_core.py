"""The consumer's sans-I/O core: delivery decoding, ack bookkeeping, redelivery decisions."""

from __future__ import annotations

import datetime as dt
import decimal
import struct
from collections import deque
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reliable_amqp import MessageProperties, RetryPolicy
from reliable_amqp._core.acks import ACK, REQUEUE, AckBook
from reliable_amqp._core.delivery import DeliveryScanner, HeaderDecodeError, decode_table
from reliable_amqp._core.frames import encode_table
from reliable_amqp._core.redelivery import (
    ATTEMPT_HEADER,
    DeadLetter,
    Retry,
    attempt_of,
    before_handler,
    delay_levels,
    on_failure,
    retry_headers,
)

# --- frames, built by hand (what a broker sends) ----------------------------------------------


def _frame(kind: int, channel: int, payload: bytes) -> bytes:
    return struct.pack(">BHI", kind, channel, len(payload)) + payload + b"\xce"


def _short(text: str) -> bytes:
    raw = text.encode()
    return bytes([len(raw)]) + raw


def deliver_frames(
    channel: int,
    tag: int,
    body: bytes,
    *,
    headers: bytes | None = None,
    message_id: str | None = None,
    redelivered: bool = False,
    frame_max: int = 131072,
) -> bytes:
    method = (
        struct.pack(">HH", 60, 60)
        + _short("ctag")
        + struct.pack(">QB", tag, 1 if redelivered else 0)
        + _short("ex")
        + _short("rk")
    )
    flags = 0
    props = b""
    if headers is not None:
        flags |= 1 << 13
        props += headers  # a whole table: its length, then its fields
    if message_id is not None:
        flags |= 1 << 7
        props += _short(message_id)
    header = struct.pack(">HHQH", 60, 0, len(body), flags) + props
    out = _frame(1, channel, method) + _frame(2, channel, header)
    step = frame_max - 8
    for i in range(0, len(body), step):
        out += _frame(3, channel, body[i : i + step])
    return out


def test_a_delivery_is_decoded_from_its_three_frames() -> None:
    scanner = DeliveryScanner(1, 7, "q")
    table = encode_table({"a": 1, "s": "text", ATTEMPT_HEADER: 2})
    data = deliver_frames(1, 5, b"hello", headers=table, message_id="m-1", redelivered=True)
    pos, end = scanner.scan(data, 0)
    assert (pos, end) == (len(data), len(data))
    [d] = scanner.ready
    assert (d.body, d.message_id, d.delivery_tag, d.redelivered) == (b"hello", "m-1", 5, True)
    assert (d.exchange, d.routing_key, d.queue, d.generation) == ("ex", "rk", "q", 7)
    assert d.headers == {"a": 1, "s": "text", ATTEMPT_HEADER: 2}
    assert d.attempt == 3  # the copy's attempt 2, redelivered once more
    assert isinstance(d.properties, MessageProperties)
    assert d.properties.message_id == "m-1"


#: the 14 basic properties in flag order (0x8000 first): the kind of each, as the spec says
_PROPERTY_KINDS = ("s", "s", "table", "octet", "octet") + ("s",) * 4 + ("u64",) + ("s",) * 4
_SHORT_BYTES = st.binary(max_size=12) | st.sampled_from([b"\xff\xfe", b"caf\xc3\xa9", b"\xc3"])


@st.composite
def _properties(draw: st.DrawFn) -> tuple[int, bytes, list[Any]]:
    """A random set of properties: (flags, encoded, the values a decoder must give)."""
    flags, encoded = 0, b""
    values: list[Any] = [None] * 14
    values[2] = {}
    for index, kind in enumerate(_PROPERTY_KINDS):
        if not draw(st.booleans()):
            continue
        flags |= 0x8000 >> index
        if kind == "s":
            raw = draw(_SHORT_BYTES)
            encoded += bytes([len(raw)]) + raw
            values[index] = raw.decode("utf-8", "surrogateescape")
        elif kind == "octet":
            values[index] = draw(st.integers(0, 255))
            encoded += bytes([values[index]])
        elif kind == "u64":
            values[index] = draw(st.integers(0, 2**64 - 1))
            encoded += struct.pack(">Q", values[index])
        else:
            table = draw(st.dictionaries(st.text(max_size=5), st.integers(-5, 5), max_size=3))
            encoded += encode_table(table)
            values[index] = table
    return flags, encoded, values


@settings(max_examples=300, deadline=None)
@given(
    props=st.lists(_properties(), min_size=1, max_size=4),
    names=st.tuples(_SHORT_BYTES, _SHORT_BYTES, _SHORT_BYTES),
)
def test_every_set_of_properties_and_any_bytes_decode_as_the_spec_says(
    props: list[tuple[int, bytes, list[Any]]], names: tuple[bytes, bytes, bytes]
) -> None:
    """Each set of properties has a decoder made for it (``_make_decoder``), and names are
    decoded with a fast path that falls back for bytes that are not UTF-8: whatever the
    set and the bytes, the values are the spec's, undecodable bytes kept (surrogateescape)."""
    tag, exchange, routing_key = names
    data = b""
    for n, (flags, encoded, _) in enumerate(props, 1):
        method = (
            struct.pack(">HH", 60, 60)
            + bytes([len(tag)])
            + tag
            + struct.pack(">QB", n, 0)
            + bytes([len(exchange)])
            + exchange
            + bytes([len(routing_key)])
            + routing_key
        )
        header = struct.pack(">HHQH", 60, 0, 1, flags) + encoded
        data += _frame(1, 1, method) + _frame(2, 1, header) + _frame(3, 1, b"b")
    scanner = DeliveryScanner(1, 1, "q")
    assert scanner.scan(data, 0) == (len(data), len(data))
    assert len(scanner.ready) == len(props)
    for d, (_, _, values) in zip(scanner.ready, props, strict=True):
        assert d.consumer_tag == tag.decode("utf-8", "surrogateescape")
        assert d.exchange == exchange.decode("utf-8", "surrogateescape")
        assert d.routing_key == routing_key.decode("utf-8", "surrogateescape")
        assert list(d._fields) == values
        assert d.header_error is None and d.body == b"b"


def test_bodies_split_over_frames_and_bytes_split_over_reads_are_joined() -> None:
    body = bytes(range(256)) * 100
    data = deliver_frames(1, 1, body, frame_max=1000) + deliver_frames(1, 2, b"")
    scanner = DeliveryScanner(1, 1, "q")
    buffer = b""
    pos = 0
    for i in range(0, len(data), 333):  # reads that cut frames anywhere
        buffer = buffer[pos:] + data[i : i + 333]
        pos, end = scanner.scan(buffer, 0)
        assert end == pos
    assert [d.body for d in scanner.ready] == [body, b""]
    assert [d.delivery_tag for d in scanner.ready] == [1, 2]


def test_other_frames_are_left_to_the_library_in_order() -> None:
    scanner = DeliveryScanner(1, 1, "q")
    heartbeat = _frame(8, 0, b"")
    other_channel = deliver_frames(2, 1, b"x")
    data = deliver_frames(1, 1, b"a") + heartbeat + other_channel
    pos, end = scanner.scan(data, 0)
    assert [d.body for d in scanner.ready] == [b"a"]
    assert data[pos:end] == heartbeat
    pos2, end2 = scanner.scan(data, end)
    assert pos2 == end and data[pos2:end2] == other_channel[: end2 - pos2]


_OTHER_FRAMES = (
    _frame(8, 0, b""),  # a heartbeat
    _frame(1, 2, struct.pack(">HH", 60, 80) + struct.pack(">QB", 9, 0)),  # another channel's
    _frame(1, 1, struct.pack(">HH", 60, 80) + struct.pack(">QB", 9, 0)),  # ours, not a delivery
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(
                st.integers(0, 700),  # body size
                st.sampled_from([30, 100, 4096]),  # frame_max: one body frame or several
                st.booleans(),  # headers
                st.booleans(),  # message id
                st.booleans(),  # redelivered
            ),
            st.integers(0, len(_OTHER_FRAMES) - 1),
        ),
        max_size=25,
    ),
    st.lists(st.integers(1, 600), min_size=1, max_size=40),
)
def test_any_stream_cut_anywhere_gives_each_delivery_and_other_frame_once_in_order(
    items: list[tuple[int, int, bool, bool, bool] | int], reads: list[int]
) -> None:
    """Deliveries whose frames arrive whole, split over reads or over body frames, between
    frames that are not the scanner's, read in pieces of any size: each delivery comes out
    once, whole and in order, and every other frame is handed back, in order."""
    data = b""
    expected: list[tuple[int, bytes, str | None, bool, dict[str, Any]]] = []
    others: list[bytes] = []
    for tag, item in enumerate(items, 1):
        if isinstance(item, int):
            data += _OTHER_FRAMES[item]
            others.append(_OTHER_FRAMES[item])
            continue
        size, frame_max, with_headers, with_id, redelivered = item
        body = bytes((tag + i) % 256 for i in range(size))
        headers = {"n": tag} if with_headers else {}
        message_id = f"m-{tag}" if with_id else None
        data += deliver_frames(
            1,
            tag,
            body,
            headers=encode_table(headers) if with_headers else None,
            message_id=message_id,
            redelivered=redelivered,
            frame_max=frame_max,
        )
        expected.append((tag, body, message_id, redelivered, headers))
    scanner = DeliveryScanner(1, 1, "q")
    handed_back: list[bytes] = []
    buffer = b""
    offset = 0
    cuts = iter(reads * (len(data) // sum(reads) + 1))
    while offset < len(data):  # reads as the connection sees them
        step = next(cuts)
        buffer += data[offset : offset + step]
        offset += step
        pos = 0
        while pos < len(buffer):
            pos, end = scanner.scan(buffer, pos)
            if end == pos:
                break
            handed_back.append(buffer[pos:end])
            pos = end
        buffer = buffer[pos:]
    assert buffer == b""
    got = [(d.delivery_tag, d.body, d.message_id, d.redelivered, d.headers) for d in scanner.ready]
    assert got == expected
    assert handed_back == others
    for d in scanner.ready:
        assert d.attempt == (2 if d.redelivered else 1)
        assert (d.exchange, d.routing_key, d.queue, d.consumer_tag) == ("ex", "rk", "q", "ctag")


def test_a_frame_without_its_end_octet_breaks_the_connection() -> None:
    data = bytearray(deliver_frames(1, 1, b"a"))
    data[-1] = 0
    with pytest.raises(HeaderDecodeError):
        DeliveryScanner(1, 1, "q").scan(bytes(data), 0)


def test_undecodable_headers_are_reported_not_raised() -> None:
    bad = b"\x00\x00\x00\x03\x01kZ"  # key "k", unknown type 'Z'
    scanner = DeliveryScanner(1, 1, "q")
    scanner.scan(deliver_frames(1, 1, b"x", headers=bad, message_id="m"), 0)
    [d] = scanner.ready
    assert d.header_error is not None and "unknown field type" in d.header_error
    assert d.headers == {} and d.message_id == "m"
    dead = before_handler(d.attempt, d.header_error, 5)
    assert isinstance(dead, DeadLetter) and dead.exception_type == "HeaderDecodeError"


VALUES: dict[str, Any] = {
    "int": -5,
    "big": 2**40,
    "float": 1.5,
    "text": "h\u00e9",
    "bytes": b"\xff\x00",
    "bool": True,
    "none": None,
    "dec": decimal.Decimal("-0.01"),
    "list": [1, "a", [2]],
    "table": {"x": {"y": 1}},
    "when": dt.datetime(2024, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc),
}


def test_tables_round_trip_through_the_publishers_encoder() -> None:
    decoded = decode_table(encode_table(VALUES)[4:])
    assert decoded == VALUES
    # pamqp 3.3 (Python 3.10's) reads this one as 42949672.95: ours never does
    assert decoded["dec"] == decimal.Decimal("-0.01")


@pytest.mark.parametrize(
    "raw",
    [b"\x01kS\x00\x00\x00\x09ab", b"\x01kA\x00\x00\x00\x09", b"\x02\xff\xfeI\x00\x00\x00\x01"],
)
def test_malformed_tables_raise_a_typed_error(raw: bytes) -> None:
    with pytest.raises(HeaderDecodeError):
        decode_table(raw)


# --- acks -----------------------------------------------------------------------------------


def test_a_multiple_ack_never_covers_an_unfinished_tag() -> None:
    book = AckBook(1, batch=1)
    for tag in range(1, 6):
        book.delivered(tag)
    assert book.settle(1, 2)
    assert book.settle(1, 3)
    assert book.take() == [("ack", 2, False), ("ack", 3, False)]  # 1 still runs
    assert book.settle(1, 1)
    assert book.take() == [("ack", 1, True)]  # 2 and 3 went already
    assert book.settle(1, 5)
    assert book.requeue_rest() == [("ack", 5, False), ("nack", 4, True)]


def test_settlements_of_another_generation_or_twice_are_refused() -> None:
    book = AckBook(2)
    book.delivered(1)
    assert not book.settle(1, 1)  # an old channel's tag
    assert book.settle(2, 1)
    assert not book.settle(2, 1)
    assert not book.settle(2, 9)


def test_acks_wait_for_a_batch_unless_forced() -> None:
    book = AckBook(1, batch=3)
    for tag in range(1, 4):
        book.delivered(tag)
    book.settle(1, 1)
    book.settle(1, 2)
    assert book.take() == []
    assert book.take(force=True) == [("ack", 2, True)]
    book.settle(1, 3, REQUEUE)
    assert book.take(force=True) == [("nack", 3, False)]
    assert len(book) == 0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 3), st.integers(0, 12), st.sampled_from([ACK, REQUEUE])),
        max_size=40,
    )
)
def test_settle_all_is_settle_for_each_in_turn(settlements: list[tuple[int, int, int]]) -> None:
    """The I/O thread's batch call decides each settlement as one settle() call would (another
    generation's, unknown and repeated tags refused), empties the deque, and counts refusals."""
    one, batched = AckBook(2, batch=2), AckBook(2, batch=2)
    for book in (one, batched):
        book.delivered_all([_Tagged(tag) for tag in range(1, 11)])
    refused = sum(not one.settle(*settlement) for settlement in settlements)
    queue = deque(settlements)
    assert batched.settle_all(queue) == refused
    assert not queue
    assert batched.due == one.due
    assert batched.take(force=True) == one.take(force=True)
    assert batched.requeue_rest() == one.requeue_rest()


class _Tagged:
    def __init__(self, tag: int) -> None:
        self.delivery_tag = tag


@settings(max_examples=300, deadline=None)
@given(
    st.integers(min_value=1, max_value=40),
    st.lists(st.tuples(st.integers(0, 60), st.booleans(), st.booleans()), max_size=120),
)
def test_acks_against_a_naive_model(n: int, script: list[tuple[int, bool, bool]]) -> None:
    """Random finish orders, requeues and flushes: every tag is settled on the wire exactly
    once as its handler decided, and no ack (multiple or not) ever covers a running tag."""
    book = AckBook(1, batch=3)
    for tag in range(1, n + 1):
        book.delivered(tag)
    running = set(range(1, n + 1))
    decided: dict[int, str] = {}
    wire: dict[int, str] = {}

    def apply(frames: list[tuple[str, int, bool]]) -> None:
        for method, tag, multiple in frames:
            if multiple:
                assert method == "ack"  # only the stop's requeue_rest nacks many
                for t in range(1, tag + 1):
                    if t in wire:
                        continue  # settled already: a multiple ack passes over it harmlessly
                    assert t not in running, f"ack {tag} multiple covers running {t}"
                    assert decided[t] == "ack", f"ack {tag} multiple covers requeued {t}"
                    wire[t] = "ack"
            else:
                assert tag not in running and tag not in wire
                assert decided[tag] == method
                wire[tag] = method

    for index, requeue, force in script:
        tag = index % n + 1
        if tag in running:
            running.discard(tag)
            decided[tag] = "nack" if requeue else "ack"
            assert book.settle(1, tag, REQUEUE if requeue else ACK)
        apply(book.take(force))
    for tag in sorted(running):
        running.discard(tag)
        decided[tag] = "ack"
        book.settle(1, tag)
    apply(book.take(force=True))
    assert wire == decided
    assert len(book) == 0


# --- redelivery -----------------------------------------------------------------------------


def test_attempts_come_from_our_header_and_the_brokers_count() -> None:
    assert attempt_of({}, False) == 1
    assert attempt_of({}, True) == 2  # classic: a lower bound
    assert attempt_of({"x-delivery-count": 3}, True) == 4  # quorum: exact
    assert attempt_of({ATTEMPT_HEADER: 3}, False) == 3
    assert attempt_of({ATTEMPT_HEADER: 3, "x-delivery-count": 2}, True) == 5
    assert attempt_of({ATTEMPT_HEADER: "x"}, False) == 1  # a forged header is not trusted


def test_a_failure_is_retried_after_at_least_the_policys_delay_then_dead() -> None:
    policy = RetryPolicy(max_attempts=3, initial_delay=1.0, jitter=0.0)
    first = on_failure("q", 1, ValueError("boom"), policy, rejected=False)
    assert isinstance(first, Retry)
    assert first.attempt == 2 and first.delay_ms >= 1000 and first.queue == "q.retry.1000ms"
    second = on_failure("q", 2, ValueError("boom"), policy, rejected=False)
    assert isinstance(second, Retry) and second.delay_ms >= 2000
    last = on_failure("q", 3, ValueError("boom"), policy, rejected=False)
    assert last == DeadLetter("boom", "builtins.ValueError", 3)
    rejected = on_failure("q", 1, ValueError("no"), policy, rejected=True)
    assert isinstance(rejected, DeadLetter) and rejected.attempts == 1


def test_every_delay_the_policy_can_ask_for_has_its_queue() -> None:
    policy = RetryPolicy(max_attempts=6, initial_delay=0.3, multiplier=3, max_delay=60, jitter=0.5)
    levels = set(delay_levels(policy))
    for attempt in range(1, 6):
        for draw in (0.0, 0.37, 0.999):

            def rng(draw: float = draw) -> float:
                return draw

            verdict = on_failure("q", attempt, ValueError(), policy, rejected=False, rng=rng)
            assert isinstance(verdict, Retry)
            assert verdict.delay_ms in levels
            assert verdict.delay_ms >= policy.delay(attempt, rng) * 1000
    assert len(levels) <= 12


def test_a_policy_without_max_attempts_is_refused_for_consuming() -> None:
    with pytest.raises(Exception, match="max_attempts"):
        delay_levels(RetryPolicy(max_attempts=None))


def test_past_max_attempts_a_message_is_dead_before_the_handler() -> None:
    assert before_handler(3, None, 3) is None
    dead = before_handler(4, None, 3)
    assert isinstance(dead, DeadLetter) and "more than max_attempts=3" in dead.reason


def test_retried_copies_drop_the_brokers_headers_and_keep_their_origin() -> None:
    headers = {"a": 1, "x-death": [{"count": 1}], "x-delivery-count": 2}
    out = retry_headers(headers, Retry("q.retry.1000ms", 1000, 2), "q", "ex", "rk")
    assert out == {
        "a": 1,
        ATTEMPT_HEADER: 2,
        "x-original-queue": "q",
        "x-original-exchange": "ex",
        "x-original-routing-key": "rk",
    }


def test_a_copy_of_a_message_without_an_id_reads_as_without_one() -> None:
    table = encode_table({ATTEMPT_HEADER: 2, "x-consume-no-message-id": True})
    scanner = DeliveryScanner(1, 1, "q")
    scanner.scan(deliver_frames(1, 1, b"x", headers=table, message_id="made-up-1"), 0)
    [d] = scanner.ready
    assert d.message_id is None and d.properties.message_id is None
    assert d.attempt == 2
