"""The async publisher's own basic.publish marshalling, byte for byte against pika's.

Matching pika means a message leaves AsyncPublisher exactly as it leaves the sync Publisher.
"""

from __future__ import annotations

import datetime as dt
import decimal
from typing import Any

import pika
import pika.frame
import pika.spec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pamqp import decode

from reliable_amqp import InvalidMessage
from reliable_amqp._core import frames
from reliable_amqp._core.builder import build_message
from reliable_amqp._core.frames import PublishEncoder, encode_table, publish_frames
from reliable_amqp._core.message import OutgoingMessage, new_message_id, new_outgoing

shortstr = st.text(max_size=40)
# pika before 1.3.1 wrote a negative long-long as 'L' (RabbitMQ reads 'l': signed 64-bit, which
# is what this library and later pikas write); compare only where the two pikas agree.
_PIKA = tuple(int(part) for part in pika.__version__.split(".")[:3])
_LOWEST_INT = -(2**63) if _PIKA >= (1, 3, 1) else -(2**31)
# What pika can encode (it has no float and no tuple; those are tested on their own below).
header_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(_LOWEST_INT, 2**63 - 1)
    | st.text(max_size=20)
    | st.binary(max_size=20)
    | st.datetimes(min_value=dt.datetime(1970, 1, 1), max_value=dt.datetime(2200, 1, 1)).map(
        lambda d: d.replace(microsecond=0)
    )
    | st.decimals(min_value=-(10**6), max_value=10**6, places=3, allow_nan=False),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
properties = st.fixed_dictionaries(
    {},
    optional={
        "content_type": shortstr,
        "content_encoding": shortstr,
        # (not CC or BCC: RabbitMQ routes on those, and publish() refuses them unless lists of str)
        "headers": st.dictionaries(
            st.text(min_size=1, max_size=12).filter(lambda key: key not in ("CC", "BCC")),
            header_values,
            max_size=4,
        ),
        "delivery_mode": st.sampled_from([1, 2]),
        "priority": st.integers(0, 255),
        "correlation_id": shortstr,
        "reply_to": shortstr,
        "expiration": st.integers(0, 10**9).map(str),
        "message_id": st.text(min_size=1, max_size=40),
        "timestamp": st.integers(0, 2**40),
        "type": shortstr,
        "user_id": shortstr,
        "app_id": shortstr,
    },
)


def reference(
    channel: int, message: OutgoingMessage, headers: dict[str, Any] | None, frame_max: int
) -> bytes:
    """What pika (the sync Publisher) puts on the wire for the same publish."""
    p = message.properties
    props = pika.spec.BasicProperties(
        content_type=p.content_type,
        content_encoding=p.content_encoding,
        headers=p.headers if headers is None else headers,
        delivery_mode=p.delivery_mode,
        priority=p.priority,
        correlation_id=p.correlation_id,
        reply_to=p.reply_to,
        expiration=p.expiration,
        message_id=p.message_id,
        timestamp=p.timestamp,
        type=p.type,
        user_id=p.user_id,
        app_id=p.app_id,
    )
    publish = pika.spec.Basic.Publish(
        exchange=message.exchange, routing_key=message.routing_key, mandatory=message.mandatory
    )
    out: bytes = pika.frame.Method(channel, publish).marshal()
    out += pika.frame.Header(channel, len(message.body), props).marshal()
    step = frame_max - 8 if frame_max else max(len(message.body), 1)  # 0: no limit
    for start in range(0, len(message.body), step):
        out += pika.frame.Body(channel, message.body[start : start + step]).marshal()
    return out


def ours(
    channel: int, message: OutgoingMessage, headers: dict[str, Any] | None, frame_max: int
) -> bytes:
    parts: list[bytes | memoryview] = []
    publish_frames(channel, message, headers, frame_max, parts)
    return b"".join(parts)


@settings(max_examples=300, deadline=None)
@given(
    channel=st.integers(1, 65535),
    exchange=shortstr,
    routing_key=st.text(max_size=60),
    body=st.binary(max_size=300),
    mandatory=st.booleans(),
    props=properties,
    # 4096 is AMQP's frame-min-size (the supervisor refuses a broker that offers less); 0 is
    # "no limit"; small bodies still get split by 4096 + 8 and the large cases below
    frame_max=st.sampled_from([4096, 4096 + 8, 131072, 0]),
    override=st.none() | st.dictionaries(st.text(min_size=1, max_size=8), st.text(max_size=8)),
)
def test_publish_frames_match_pika(  # noqa: PLR0917
    channel: int,
    exchange: str,
    routing_key: str,
    body: bytes,
    mandatory: bool,
    props: dict[str, Any],
    frame_max: int,
    override: dict[str, Any] | None,
) -> None:
    message = build_message(exchange, routing_key, body, mandatory=mandatory, properties=props)
    assert ours(channel, message, override, frame_max) == reference(
        channel, message, override, frame_max
    )


@settings(max_examples=200, deadline=None)
@given(
    channel=st.integers(1, 65535),
    templates=st.lists(
        st.tuples(shortstr, st.text(max_size=60), st.booleans(), properties), min_size=1, max_size=3
    ),
    steps=st.lists(
        st.tuples(
            st.integers(0, 2),
            st.binary(max_size=300) | st.sampled_from([b"", b"x" * 5000]),
            st.sampled_from(["new", "", "short", "long"]) | st.text(max_size=30),
        ),
        min_size=1,
        max_size=12,
    ),
    frame_max=st.sampled_from([4096, 4096 + 8, 131072, 0]),
)
def test_the_publish_encoder_writes_what_pika_writes(
    channel: int,
    templates: list[tuple[str, str, bool, dict[str, Any]]],
    steps: list[tuple[int, bytes, str]],
    frame_max: int,
) -> None:
    """PublishEncoder (the writer's fast path: route and properties packed once while messages
    share them) puts every message on the wire as pika would, through runs of messages sharing
    a route and properties, switches between them, ids of new lengths, no id, empty bodies and
    bodies split over frames."""
    built = [
        build_message(exchange, routing_key, b"", mandatory=mandatory, properties=props)
        for exchange, routing_key, mandatory, props in templates
    ]
    encoder = PublishEncoder(channel, frame_max)
    for which, body, id_kind in steps:
        template = built[which % len(built)]
        message_id = {"new": new_message_id(), "short": "a", "long": "b" * 200}.get(
            id_kind, id_kind
        )
        message = new_outgoing(
            template.exchange,  # the very objects, as publish_many() passes them
            template.routing_key,
            body,
            template.base,
            template.mandatory,
            message_id,
        )
        out: list[bytes | memoryview] = []
        try:
            encoder.encode(message, out)
        except InvalidMessage:  # a header frame over frame_max: publish_frames refuses it too
            assert out == []
            with pytest.raises(InvalidMessage):
                ours(channel, message, None, frame_max)
            continue
        assert b"".join(out) == reference(channel, message, None, frame_max)


def test_the_publish_encoder_refuses_a_header_over_frame_max_and_appends_nothing() -> None:
    message = build_message("", "q", b"body", properties={"headers": {"h": "x" * 5000}})
    out: list[bytes | memoryview] = []
    with pytest.raises(InvalidMessage) as info:
        PublishEncoder(1, 4096).encode(message, out)
    assert info.value.field == "headers" and out == []


def test_a_large_body_is_split_at_frame_max() -> None:
    message = build_message("", "q", bytes(range(256)) * 1000)
    data = ours(7, message, None, 131072)
    assert data == reference(7, message, None, 131072)
    assert data.count(b"\xce") >= 4  # method, header and two body frames at least


def test_floats_and_tuples_pika_cannot_encode_decode_back() -> None:
    # pamqp decodes here: pika's own decoder truncates doubles to ints.
    table = {"f": 1.5, "t": (1, "a", None), "nested": {"g": -2.25}}
    _, decoded = decode.field_table(encode_table(table))
    assert decoded == {"f": 1.5, "t": [1, "a", None], "nested": {"g": -2.25}}


def test_unencodable_decimal_is_invalid_input() -> None:
    with pytest.raises(InvalidMessage) as info:
        encode_table({"d": {"big": decimal.Decimal("1e20")}})
    assert info.value.field == "headers['d']['big']"


def test_cached_method_frames_stay_exact_and_bounded() -> None:
    # Method frames are cached by route; more routes than the cache holds must still encode
    # exactly, and the cache must not grow past its bound.
    limit = frames._METHOD_CACHE_MAX
    for i in range(2 * limit + 5):
        message = build_message("ex", f"rk-{i % (limit + 300)}", b"x", mandatory=bool(i % 3))
        assert ours(1 + i % 3, message, None, 131072) == reference(1 + i % 3, message, None, 131072)
        assert len(frames._method_frames) <= limit
