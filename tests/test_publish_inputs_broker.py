"""One bad message never hurts the others (issue 11), against the real broker, both publishers.

Whatever a caller passes to ``publish()``, the message is either confirmed (or, published with
``mandatory=True`` and routed nowhere, returned), or ``publish()`` raises :class:`InvalidMessage`
at once. Nothing else is allowed: no other exception, no ``MessageRejected``, and above all no
closed channel or connection, which would put every other message in flight at risk.

What the inputs do not include, on purpose:

- an exchange that exists nowhere: the broker closes the channel (404) and the message fails
  alone with ``MessageRejected``. That is a legitimate answer about the world, not a bad input
  ``publish()`` could refuse (the exchange may be declared a moment later). Every well-formed
  exchange name here exists: ``""``, ``"amq.direct"`` and an odd non-ASCII one this test declares;
  the odd names are the ones AMQP cannot carry (over 255 UTF-8 bytes, lone surrogates);
- expirations under an hour: the broker may drop such a message from the queue before the test
  reads it, so the queue's content would not be exact (the broker doing its job);
- the names of ``publish()``'s own parameters as property names (Python's ``TypeError``); any
  other unknown keyword is an ``InvalidMessage`` naming it;
- a well-formed direct reply-to address of a requester that is gone: RabbitMQ 3.10 closes the
  whole connection (541) decoding it, and no check at ``publish()`` can know the requester left.
"""

from __future__ import annotations

import datetime as dt
import math
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, example, given, settings

from reliable_amqp import (
    Confirmation,
    EventKind,
    InvalidMessage,
    MessageRejected,
    MessageReturned,
    Publisher,
    PublisherEvent,
)
from support.broker import BrokerAdmin, unique

pytestmark = [pytest.mark.broker, pytest.mark.timeout(240)]

PublisherClass = Any
LOSSES = (EventKind.CONNECTION_LOST, EventKind.CHANNEL_LOST)
EXAMPLES = 2000
#: valid expirations start here (see the module docstring); RabbitMQ's limit is ten years
#: (on LavinMQ, publish() refuses those over its 2,147,483,647 ms: docs/brokers.md)
LONG_TTL = 3_600_000
TTL_MAX = 315_360_000_000


@pytest.fixture(params=["sync", "async"])
def publisher_class(request: pytest.FixtureRequest) -> PublisherClass:
    """Publisher, and AsyncPublisher through the blocking facade (as in test_publisher.py)."""
    if request.param == "sync":
        return Publisher
    from support.aio_blocking import BlockingAsyncPublisher

    return BlockingAsyncPublisher


def _stats(publisher: Any) -> Any:
    return getattr(publisher, "_publisher", publisher).stats()


# --- strategies -----------------------------------------------------------------------------------


def mostly(valid: st.SearchStrategy[Any], odd: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``valid`` about nine times in ten: every argument odd at once would refuse nearly all."""
    return st.integers(0, 9).flatmap(lambda i: odd if i == 9 else valid)


SURROGATE = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
ANY_TEXT = st.text(st.characters(codec=None), max_size=12)  # incl. lone surrogates
LONG_TEXT = st.integers(86, 300).map(lambda n: "€" * n)  # 258+ UTF-8 bytes
SURROGATE_TEXT = st.tuples(ANY_TEXT, SURROGATE, ANY_TEXT).map("".join)
ODD_TEXT = st.one_of(ANY_TEXT, LONG_TEXT, SURROGATE_TEXT, st.just(""))
NOT_TEXT = st.one_of(st.none(), st.integers(), st.binary(max_size=4), st.floats())

TZ: st.SearchStrategy[Any] = st.one_of(
    st.none(),
    st.just(dt.timezone.utc),
    st.integers(-23 * 60 - 59, 23 * 60 + 59).map(lambda m: dt.timezone(dt.timedelta(minutes=m))),
)
DATETIMES = st.one_of(
    st.datetimes(timezones=TZ),
    st.datetimes(dt.datetime(1969, 12, 31, 23, 59), dt.datetime(1970, 1, 1, 0, 1), timezones=TZ),
    st.datetimes(dt.datetime(9999, 12, 31), timezones=TZ),
)
DECIMALS = st.one_of(
    st.decimals(),
    st.integers(0, 40).flatmap(lambda places: st.decimals(places=places)),
    st.builds(
        lambda sign, digits, exp: Decimal((sign, digits, exp)),
        st.integers(0, 1),
        st.lists(st.integers(0, 9), min_size=1, max_size=40).map(tuple),
        st.integers(-300, 300) | st.integers(-(10**6), 10**6),
    ),
    st.sampled_from(["1E+1000000", "1E+200000", "1E-1000000", "2147483647", "-2147483648"]).map(
        Decimal
    ),
)
SCALARS = mostly(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**63 - 1),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=20),
        st.binary(max_size=20),
        st.decimals(-(2**31) + 1, 2**31 - 1, places=2),
        st.datetimes(dt.datetime(1970, 1, 2), timezones=TZ),
    ),
    st.one_of(
        st.integers(-(2**70), 2**70),
        st.floats(),
        st.text(st.characters(codec=None), max_size=20),
        DECIMALS,
        DATETIMES,
        st.sampled_from([set(), bytearray(b"x"), object(), 1j, math.pi]),
    ),
)
KEYS = mostly(
    st.text(max_size=10),
    st.one_of(
        st.text(st.characters(codec=None), max_size=10),
        LONG_TEXT,
        st.sampled_from(["CC", "BCC", "x-death", "x-match", "x-delay", ""]),
        st.integers(),
        st.binary(max_size=3),
    ),
)


def _nest(value: Any, depth: int) -> Any:
    for i in range(depth):
        value = {"d": value} if i % 2 else [value]
    return value


VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(KEYS, inner, max_size=4),
    ),
    max_leaves=12,
)


def headers(queue: str) -> st.SearchStrategy[Any]:
    routes = st.lists(st.sampled_from([queue, "ra-test-nowhere"]) | st.text(max_size=5), max_size=3)
    routing = st.one_of(routes, routes.map(tuple), VALUES)
    return st.one_of(
        st.none(),
        st.dictionaries(KEYS, VALUES, max_size=5),
        st.dictionaries(KEYS, VALUES, max_size=5),
        st.dictionaries(KEYS, VALUES, max_size=5),
        st.fixed_dictionaries({}, optional={"CC": routing, "BCC": routing, "n": VALUES}),
        st.builds(lambda v, d: {"deep": _nest(v, d)}, SCALARS, st.integers(20, 40)),
        st.sampled_from([[("a", 1)], "a=1", 5]),
    )


def expirations() -> st.SearchStrategy[Any]:
    valid = st.integers(LONG_TTL, TTL_MAX)
    return mostly(
        st.one_of(valid, valid.map(str), valid.map(lambda n: f"000{n}")),
        st.one_of(
            st.integers(TTL_MAX + 1, 10**30) | st.integers(TTL_MAX + 1, 10**30).map(str),
            st.integers(max_value=-1),
            st.sampled_from(["", "+5000000", "1e9", "3600000.0", " 3600000", "١٢٣٤٥٦٧"]),
            st.text(max_size=5),
            st.floats(),
        ),
    )


def reply_keys() -> st.SearchStrategy[str]:
    # Direct reply-to addresses, malformed (refused at publish) or unroutable (not two parts).
    junk = st.text(st.characters(codec="ascii", exclude_characters="."), min_size=1, max_size=8)
    return st.one_of(
        st.tuples(junk, junk).map(lambda p: f"amq.rabbitmq.reply-to.{p[0]}.{p[1]}"),
        st.tuples(junk, junk).map(lambda p: f"amq.rabbitmq.reply-to..{p[0]}..{p[1]}."),
        st.tuples(junk, junk, junk).map(lambda p: "amq.rabbitmq.reply-to." + ".".join(p)),
        st.just("amq.rabbitmq.reply-to"),
        st.just("amq.rabbitmq.reply-to.g1h2AA1yZXBseUA5.abc"),
    )


def _view(data: bytes) -> memoryview:
    return memoryview(data)


@dataclass
class Call:
    exchange: Any
    routing_key: Any
    body: Any
    mandatory: Any = False
    properties: dict[str, Any] = field(default_factory=dict)


@st.composite
def calls(draw: st.DrawFn, queue: str, exchanges: list[str]) -> Call:
    exchange = draw(
        mostly(st.sampled_from(exchanges), st.one_of(LONG_TEXT, SURROGATE_TEXT, NOT_TEXT))
    )
    routing_key = draw(
        mostly(st.just(queue) | st.text(max_size=8), st.one_of(ODD_TEXT, reply_keys(), NOT_TEXT))
    )
    payload = st.binary(max_size=64)
    body = draw(
        mostly(
            st.one_of(payload, payload.map(bytearray), payload.map(_view)),
            st.one_of(st.text(max_size=5), st.none(), st.integers()),
        )
    )
    mandatory = draw(mostly(st.booleans(), st.sampled_from([0, 1, None, "y"])))
    text = mostly(st.text(max_size=10), st.one_of(ODD_TEXT, NOT_TEXT))
    options: dict[str, st.SearchStrategy[Any]] = {
        "content_type": text,
        "content_encoding": text,
        "headers": headers(queue),
        "delivery_mode": mostly(st.sampled_from([1, 2]), st.integers() | NOT_TEXT),
        "priority": mostly(st.integers(0, 255), st.integers() | NOT_TEXT),
        "correlation_id": text,
        "reply_to": mostly(text, st.just("amq.rabbitmq.reply-to")),
        "expiration": expirations(),
        "message_id": text,
        "timestamp": mostly(
            st.integers(0, 2**40) | st.datetimes(dt.datetime(1970, 1, 2), timezones=TZ),
            st.one_of(DATETIMES, st.integers(-(2**65), 2**65), st.floats()),
        ),
        "type": text,
        "user_id": mostly(st.just("guest"), text),
        "app_id": text,
        "priorty": st.integers(),  # unknown property names
        "properties": st.just({"priority": 1}),
        "delivery_tag": st.integers(),
    }
    unknown = {"priorty", "properties", "delivery_tag"}
    known = sorted(set(options) - unknown)
    names = draw(
        st.lists(
            mostly(st.sampled_from(known), st.sampled_from(sorted(options))),
            max_size=4,
            unique=True,
        )
    )
    properties = {name: draw(options[name]) for name in names}
    return Call(exchange, routing_key, body, mandatory, properties)


# --- the property ---------------------------------------------------------------------------------


@dataclass
class Sent:
    future: Future[Confirmation]
    body: bytes
    routed: bool
    returned: bool


def _routed(call: Call, queue: str, exchanges: list[str]) -> bool:
    """Whether the broker routes ``call`` to ``queue`` (every exchange binds it by its name)."""
    if call.exchange not in exchanges:
        return False
    keys = [call.routing_key]
    table = call.properties.get("headers") or {}
    for name in ("CC", "BCC"):
        keys += list(table.get(name) or ())  # validated: a list of str when accepted
    return queue in keys


def test_no_publish_argument_costs_more_than_its_own_message(
    amqp_url: str, broker: BrokerAdmin, publisher_class: PublisherClass
) -> None:
    queue = broker.queue()
    # Odd but printable ASCII, which every broker takes (LavinMQ refuses any other name with
    # 406); a non-ASCII name has a test of its own below, on RabbitMQ.
    odd = broker.exchange(unique("x-odd ~!*|"))
    exchanges = ["", "amq.direct", odd]
    broker.bind(queue, "amq.direct", queue)
    broker.bind(queue, odd, queue)
    events: list[PublisherEvent] = []
    sent: list[Sent] = []
    refused = 0
    started = time.monotonic()
    publisher = publisher_class(amqp_url, on_event=events.append).connect()
    try:

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        )
        @given(call=calls(queue, exchanges))
        # the inputs that passed publish() and then cost a channel or the connection (fixed)
        @example(call=Call("", queue, b"cc", True, {"headers": {"CC": 5}}))
        @example(call=Call("", queue, b"bcc", False, {"headers": {"BCC": None}}))
        @example(call=Call("", queue, b"e", False, {"expiration": 10**20}))
        @example(call=Call("", queue, b"r", False, {"reply_to": "amq.rabbitmq.reply-to"}))
        @example(call=Call("", "amq.rabbitmq.reply-to.g.h", b"k", True))
        @example(
            call=Call(
                "",
                queue,
                b"t",
                False,
                {"headers": {"t": dt.datetime(1969, 12, 31, 23, 59, 59, 500000)}},
            )
        )
        @example(
            call=Call(
                "",
                queue,
                b"y",
                False,
                {
                    "headers": {
                        "t": dt.datetime(
                            9999, 12, 31, 23, tzinfo=dt.timezone(-dt.timedelta(hours=2))
                        )
                    }
                },
            )
        )
        @example(call=Call("", queue, b"cc-ok", False, {"headers": {"CC": ["elsewhere", queue]}}))
        def publish_one(call: Call) -> None:
            nonlocal refused
            try:
                future = publisher.publish(
                    call.exchange,
                    call.routing_key,
                    call.body,
                    mandatory=call.mandatory,
                    **call.properties,
                )
            except InvalidMessage:
                refused += 1
                return
            routed = _routed(call, queue, exchanges)
            # mandatory=None is the publisher's default: mandatory
            mandatory = True if call.mandatory is None else call.mandatory
            sent.append(Sent(future, bytes(call.body), routed, mandatory and not routed))

        publish_one()
        assert publisher.flush(timeout=60) == 0
        stats = _stats(publisher)
    finally:
        publisher.close()
    elapsed = time.monotonic() - started

    wrong = []
    for s in sent:
        error = s.future.exception(0)
        if not (isinstance(error, MessageReturned) if s.returned else error is None):
            wrong.append((s.body, s.returned, error))
    assert not wrong, wrong[:5]
    assert [e for e in events if e.kind in LOSSES] == []
    assert (stats.rejected, stats.timed_out, stats.closed, stats.failed_nacked) == (0, 0, 0, 0)
    assert stats.returned == sum(s.returned for s in sent)
    assert stats.confirmed == len(sent) - stats.returned
    expected_bodies = [s.body for s in sent if s.routed]
    assert broker.count(queue) == len(expected_bodies)
    assert [body for _, body in broker.drain(queue)] == expected_bodies
    assert refused > 0 and len(sent) > 0
    print(f"{publisher_class.__name__}: {len(sent)} sent, {refused} refused in {elapsed:.1f} s")


@pytest.mark.rabbitmq_only(reason="LavinMQ refuses names that are not printable ASCII (406)")
def test_a_non_ascii_exchange_name_routes_and_confirms(
    amqp_url: str, broker: BrokerAdmin, publisher_class: PublisherClass
) -> None:
    queue = broker.queue()
    odd = broker.exchange(unique("x-ödd €"))
    broker.bind(queue, odd, "ключ")
    with publisher_class(amqp_url) as publisher:
        futures = [publisher.publish(odd, "ключ", b"%d" % i) for i in range(10)]
        assert publisher.flush(timeout=30) == 0
    assert [f.result(0).attempts for f in futures] == [1] * 10  # confirmed, none returned
    assert [body for _, body in broker.drain(queue)] == [b"%d" % i for i in range(10)]


# --- the table, row by row ----------------------------------------------------------------

BIG_HEADERS = {"blob": "x" * 200_000}  # 200 KB: over RabbitMQ's 128 KiB frame_max


def test_a_200kb_header_is_refused_at_publish_and_the_others_are_confirmed(
    amqp_url: str, broker: BrokerAdmin, publisher_class: PublisherClass
) -> None:
    queue = broker.queue()
    events: list[PublisherEvent] = []
    with publisher_class(amqp_url, on_event=events.append) as publisher:
        futures = [publisher.publish("", queue, b"m%04d" % i) for i in range(500)]
        with pytest.raises(InvalidMessage) as info:
            publisher.publish("", queue, b"big", headers=BIG_HEADERS)
        assert info.value.field == "headers" and "frame_max" in str(info.value)
        futures += [publisher.publish("", queue, b"m%04d" % i) for i in range(500, 1000)]
        assert publisher.flush(timeout=30) == 0
    assert all(isinstance(f.result(0), Confirmation) for f in futures)
    assert [e for e in events if e.kind in LOSSES] == []
    assert [body for _, body in broker.drain(queue)] == [b"m%04d" % i for i in range(1000)]


def test_a_200kb_header_before_the_connection_is_open_fails_alone(
    amqp_url: str, broker: BrokerAdmin, publisher_class: PublisherClass
) -> None:
    queue = broker.queue()
    events: list[PublisherEvent] = []
    publisher = publisher_class(amqp_url, on_event=events.append)
    try:
        big = publisher.publish("", queue, b"big", headers=BIG_HEADERS)  # frame_max unknown
        futures = [publisher.publish("", queue, b"m%04d" % i) for i in range(1000)]
        assert publisher.flush(timeout=30) == 0
    finally:
        publisher.close()
    error = big.exception(0)
    assert isinstance(error, MessageRejected) and "frame_max" in str(error)
    assert all(isinstance(f.result(0), Confirmation) for f in futures)
    assert [e for e in events if e.kind in LOSSES] == []
    assert [body for _, body in broker.drain(queue)] == [b"m%04d" % i for i in range(1000)]


def test_user_id_must_be_the_connection_user(
    amqp_url: str, broker: BrokerAdmin, publisher_class: PublisherClass
) -> None:
    queue = broker.queue()
    events: list[PublisherEvent] = []
    with publisher_class(amqp_url, on_event=events.append) as publisher:
        with pytest.raises(InvalidMessage) as info:
            publisher.publish("", queue, b"mallory", user_id="mallory")
        assert info.value.field == "user_id"
        assert publisher.publish_and_wait("", queue, b"guest", user_id="guest").attempts == 1
    assert [e for e in events if e.kind in LOSSES] == []
    [(props, body)] = broker.drain(queue)
    assert body == b"guest" and props.user_id == "guest"


@pytest.mark.parametrize("text", ["1E+1000000", "1E+200000"])
def test_a_decimal_with_a_huge_exponent_is_refused_at_once(
    amqp_url: str, broker: BrokerAdmin, publisher_class: PublisherClass, text: str
) -> None:
    queue = broker.queue()
    with publisher_class(amqp_url) as publisher:
        value = Decimal(text)
        cpu = time.process_time()
        with pytest.raises(InvalidMessage) as info:
            publisher.publish("", queue, b"d", headers={"amount": value})
        cpu = time.process_time() - cpu
        assert info.value.field == "headers['amount']"
        assert cpu < 0.05, f"{cpu * 1000:.1f} ms of CPU to refuse Decimal({text!r})"
        assert publisher.publish_and_wait("", queue, b"after").attempts == 1
    assert [body for _, body in broker.drain(queue)] == [b"after"]
