"""Unit tests of ``_core/frames.py`` (byte-for-byte agreement with pika is checked in
``tests/async/test_async_frames.py``)."""

from __future__ import annotations

import datetime as dt
import time
from decimal import Decimal
from typing import Any

import pamqp.decode
import pika.data
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reliable_amqp._core.builder import build_message
from reliable_amqp._core.errors import InvalidMessage
from reliable_amqp._core.frames import (
    encode_table,
    header_frame_size,
    headers_match,
    publish_frames,
)


def test_a_header_frame_larger_than_frame_max_is_refused_and_nothing_appended() -> None:
    message = build_message("", "q", b"body", properties={"headers": {"big": "x" * 5000}})
    size = header_frame_size(message.base, message.message_id)
    assert size > 5000
    out: list[bytes | memoryview] = [b"earlier"]
    with pytest.raises(InvalidMessage) as info:
        publish_frames(1, message, None, 4096, out)
    assert info.value.field == "headers"
    assert f"take {size} bytes" in str(info.value) and "4096-byte frame_max" in str(info.value)
    assert out == [b"earlier"]  # nothing of it: the caller can take the publish back


def test_a_header_frame_of_exactly_frame_max_goes_out() -> None:
    probe = build_message("", "q", b"", properties={"headers": {"h": ""}})
    fill = 4096 - header_frame_size(probe.base, probe.message_id)
    message = build_message("", "q", b"", properties={"headers": {"h": "x" * fill}})
    assert header_frame_size(message.base, message.message_id) == 4096
    out: list[bytes | memoryview] = []
    publish_frames(1, message, None, 4096, out)
    assert len(b"".join(out)) > 4096


def test_frame_max_zero_means_no_limit() -> None:
    message = build_message(
        "", "q", b"0123456789" * 1000, properties={"headers": {"h": "x" * 9000}}
    )
    out: list[bytes | memoryview] = []
    publish_frames(1, message, None, 0, out)
    data = b"".join(out)
    assert data.endswith(b"0123456789\xce")
    assert [kind for kind, _ in _frames(data)] == [1, 2, 3]  # method, header, one body frame


def _frames(data: bytes) -> list[tuple[int, bytes]]:
    """(frame type, payload) of each frame in ``data``, checking the frame end octets."""
    frames = []
    at = 0
    while at < len(data):
        kind, size = data[at], int.from_bytes(data[at + 3 : at + 7], "big")
        assert data[at + 7 + size] == 0xCE
        frames.append((kind, data[at + 7 : at + 7 + size]))
        at += 8 + size
    return frames


def test_a_body_larger_than_frame_max_is_split_into_frames_of_frame_max() -> None:
    message = build_message("", "q", b"x" * 10_000)
    out: list[bytes | memoryview] = []
    publish_frames(1, message, None, 4096, out)
    frames = _frames(b"".join(out))
    assert [kind for kind, _ in frames] == [1, 2, 3, 3, 3]
    assert [len(p) for _, p in frames[2:]] == [4088, 4088, 10_000 - 2 * 4088]


def test_an_empty_body_has_no_body_frame() -> None:
    out: list[bytes | memoryview] = []
    publish_frames(1, build_message("", "q", b""), None, 4096, out)
    assert [kind for kind, _ in _frames(b"".join(out))] == [1, 2]


@pytest.mark.parametrize(
    "value, encoded",
    [
        ("1.5", b"D\x01\x00\x00\x00\x0f"),
        ("1.500", b"D\x01\x00\x00\x00\x0f"),
        ("-3.14", b"D\x02\xff\xff\xfe\xc6"),
        ("0.000", b"D\x00\x00\x00\x00\x00"),
        ("100", b"D\x00\x00\x00\x00\x64"),
        ("2147483647", b"D\x00\x7f\xff\xff\xff"),
    ],
)
def test_decimals_encode_as_scale_and_32_bit_value(value: str, encoded: bytes) -> None:
    table = encode_table({"d": Decimal(value)})
    assert table.endswith(encoded)


@pytest.mark.parametrize(
    "value", ["1E+1000000", "1E+200000", "-1E+999999999999999", "2147483648", "1E-256", "NaN"]
)
def test_decimals_amqp_cannot_hold_are_refused_at_once(value: str) -> None:
    started = time.process_time()
    with pytest.raises(InvalidMessage) as info:
        build_message("", "q", b"", properties={"headers": {"d": Decimal(value)}})
    assert info.value.field == "headers['d']"
    assert time.process_time() - started < 0.05  # no expansion of the exponent


# --- matching a returned message's headers ------------------------------------------------------

_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.decimals(-21474836, 21474836, places=2),  # 32 bits of digits
    # after 2106 too, where pamqp reads a stamp as milliseconds
    st.datetimes(
        dt.datetime(1970, 1, 2), dt.datetime(9999, 12, 30), timezones=st.just(dt.timezone.utc)
    ),
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=10,
)


def _decoded(raw: bytes) -> list[Any]:
    """``raw`` (an encoded field table) as pika and pamqp (aiormq's) decode it."""
    return [pika.data.decode_table(raw, 0)[0], pamqp.decode.field_table(raw)[1]]


@settings(max_examples=400, deadline=None)
@given(headers=st.dictionaries(st.text(max_size=5).filter(str.islower), _VALUES, max_size=4))
def test_headers_match_what_pika_and_pamqp_decode_of_them(headers: dict[str, Any]) -> None:
    message = build_message("", "q", b"", properties={"headers": headers})  # checked as publish()
    for got in _decoded(encode_table(headers)):
        assert headers_match(message.properties.headers, got), got


def test_headers_match_tells_apart_what_the_wire_tells_apart() -> None:
    late = dt.datetime(2200, 1, 1, tzinfo=dt.timezone.utc)
    sent = {"CC": ["q"], "f": 5.5, "b": True, "at": late, "n": None}
    [by_pika, by_pamqp] = _decoded(encode_table(sent))
    assert by_pika["f"] == 5 and by_pamqp["at"].year < 2106  # the decoders' own renderings
    assert headers_match(sent, by_pika) and headers_match(sent, by_pamqp)
    assert headers_match(None, {}) and headers_match({}, None)
    for other in (
        {**sent, "CC": ["r"]},
        {**sent, "f": 6},
        {**sent, "b": 1},
        {**sent, "at": dt.datetime(2200, 1, 1, 1, tzinfo=dt.timezone.utc)},  # pamqp: to 1 s in 1000
        {**sent, "n": 0},
        {**sent, "extra": 1},
        {key: value for key, value in sent.items() if key != "n"},
    ):
        assert not headers_match(other, by_pika) and not headers_match(other, by_pamqp), other
    assert not headers_match({"s": "1"}, {"s": 1}) and not headers_match({"i": 1}, {"i": "1"})
