"""AMQP 0-9-1 frames for ``basic.publish``, marshalled straight to bytes.

pamqp (under aiormq and aio-pika) builds a ``Basic.Publish``, a ``ContentHeader`` with a
``Basic.Properties`` and a ``ContentBody`` object per message and walks each one's attributes to
encode it: the largest single cost on the publish path, four times what one function packing
the three frames with ``struct`` costs here (docs/benchmarks.md).

Both publishers write with it (the sync one hands the bytes to pika's connection, the async one
to aiormq's). Field tables (``headers``) are encoded the way pika encodes them, byte for byte
(``tests/async/test_async_frames.py`` checks that against pika); two types pika cannot encode but
the message checks admit are added: a float is a double (``d``) and a tuple an array. pamqp is
not used for tables because it writes floats as 32-bit and cannot encode bytes.
"""

from __future__ import annotations

import calendar
import datetime as _dt
import decimal
import math
import struct
from collections.abc import Mapping
from typing import Any

from reliable_amqp._core.brokers import ANY_BROKER, BrokerLimits
from reliable_amqp._core.errors import InvalidMessage, a_type
from reliable_amqp._core.message import MessageParts, MessageProperties

FRAME_METHOD = 1
FRAME_HEADER = 2
FRAME_BODY = 3
FRAME_END = b"\xce"
#: frame type, channel, payload size; plus the end octet: the bytes a frame adds to its payload
FRAME_OVERHEAD = 8

_BASIC_CLASS = 60
_PUBLISH_METHOD = 40

_frame_head = struct.Struct(">BHI").pack
_publish_head = struct.Struct(">HHH").pack(_BASIC_CLASS, _PUBLISH_METHOD, 0)  # 0: reserved ticket
_content_head = struct.Struct(">HHQH").pack  # class, weight, body size, property flags
_content_head_size = struct.calcsize(">HHQH")
_u64 = struct.Struct(">Q").pack
_u32 = struct.Struct(">I").pack
_long_str = struct.Struct(">cI").pack
_int32 = struct.Struct(">ci").pack
_int64 = struct.Struct(">cq").pack
_decimal = struct.Struct(">cBi").pack
_double = struct.Struct(">cd").pack
_stamp = struct.Struct(">cQ").pack

# Property flag bits, in the order the properties are encoded (AMQP 0-9-1, basic class).
_CONTENT_TYPE = 1 << 15
_CONTENT_ENCODING = 1 << 14
_HEADERS = 1 << 13
_DELIVERY_MODE = 1 << 12
_PRIORITY = 1 << 11
_CORRELATION_ID = 1 << 10
_REPLY_TO = 1 << 9
_EXPIRATION = 1 << 8
_MESSAGE_ID = 1 << 7
_TIMESTAMP = 1 << 6
_TYPE = 1 << 5
_USER_ID = 1 << 4
_APP_ID = 1 << 3


def _shortstr(value: str) -> bytes:
    data = value.encode("utf-8")
    return bytes((len(data),)) + data


def encode_table(table: Mapping[str, Any], path: str = "headers") -> bytes:
    """An AMQP field table, encoded as pika encodes it (plus ``float`` and ``tuple``).

    Raises :class:`InvalidMessage` for a value with no AMQP encoding (a ``Decimal`` with more
    than 32 bits of digits, say); publishers call it before accepting a message with headers.
    """
    parts: list[bytes] = []
    for key, value in table.items():
        parts.append(_shortstr(key))
        _encode_value(parts, value, f"{path}[{key!r}]")
    data = b"".join(parts)
    return _u32(len(data)) + data


def _encode_value(parts: list[bytes], value: Any, path: str) -> None:
    # The order of the checks matters: bool is an int, and str/bytes before the generic cases.
    if isinstance(value, str):
        data = value.encode("utf-8")
        parts.append(_long_str(b"S", len(data)))
        parts.append(data)
    elif isinstance(value, bytes):
        parts.append(_long_str(b"x", len(value)))
        parts.append(value)
    elif isinstance(value, bool):
        parts.append(b"t\x01" if value else b"t\x00")
    elif isinstance(value, int):
        parts.append(_int32(b"I", value) if -(2**31) <= value < 2**31 else _int64(b"l", value))
    elif isinstance(value, float):
        parts.append(_double(b"d", value))
    elif isinstance(value, decimal.Decimal):
        parts.append(_encode_decimal(value, path))
    elif isinstance(value, _dt.datetime):
        parts.append(_stamp(b"T", calendar.timegm(value.utctimetuple())))
    elif isinstance(value, Mapping):
        parts.append(b"F")
        parts.append(encode_table(value, path))
    elif isinstance(value, (list, tuple)):
        items: list[bytes] = []
        for i, item in enumerate(value):
            _encode_value(items, item, f"{path}[{i}]")
        data = b"".join(items)
        parts.append(_long_str(b"A", len(data)))
        parts.append(data)
    elif value is None:
        parts.append(b"V")
    else:
        raise InvalidMessage(path, f"{a_type(value)} has no AMQP field type")


def headers_match(sent: object, got: object) -> bool:
    """Whether ``got``, a field table as a decoder (pika's, pamqp's) hands it back, is what
    ``sent`` (headers this library encoded) decodes to, allowing for what decoders do to values:
    ``str`` and ``bytes`` alike (undecodable strings come back as bytes, byte arrays as
    ``bytearray``), a list for a tuple, a dict for any mapping (order does not count), ``None``
    or an empty table as ``{}``, a datetime to the whole UTC second (pamqp reads a stamp after
    2106 as milliseconds), a double as its float or its truncation to an int (pika's).
    """
    return _same({} if sent is None else sent, {} if got is None else got)


_STAMP_MS = 0xFFFFFFFF  # pamqp reads a larger stamp as milliseconds


def _same(sent: object, got: object) -> bool:
    if isinstance(sent, (str, bytes, bytearray, memoryview)):
        return isinstance(got, (str, bytes, bytearray, memoryview)) and _raw(sent) == _raw(got)
    if isinstance(sent, bool) or isinstance(got, bool):
        return type(sent) is type(got) and sent == got  # a bool is not the int 0 or 1
    if isinstance(sent, float):
        return got == sent or (isinstance(got, int) and math.isfinite(sent) and got == int(sent))
    if isinstance(sent, _dt.datetime):
        if not isinstance(got, _dt.datetime):
            return False
        stamp, back = calendar.timegm(sent.utctimetuple()), calendar.timegm(got.utctimetuple())
        return back == stamp or (stamp > _STAMP_MS and back == stamp // 1000)
    if isinstance(sent, Mapping):
        return (
            isinstance(got, Mapping)
            and len(got) == len(sent)
            and all(key in got and _same(value, got[key]) for key, value in sent.items())
        )
    if isinstance(sent, (list, tuple)):
        return (
            isinstance(got, (list, tuple))
            and len(got) == len(sent)
            and all(_same(a, b) for a, b in zip(sent, got, strict=True))
        )
    return type(got) is not str and sent == got


def _raw(value: str | bytes | bytearray | memoryview) -> bytes:
    return value.encode("utf-8", "surrogatepass") if isinstance(value, str) else bytes(value)


def _encode_decimal(value: decimal.Decimal, path: str) -> bytes:
    scale, raw = decimal_parts(path, value)
    return _decimal(b"D", scale, raw)


def _properties(
    props: MessageProperties, headers: Mapping[str, Any] | None
) -> tuple[int, bytes, bytes]:
    """Property flags and the encoded property list around ``message_id``: (flags, the
    properties before it, the properties after it). ``props.message_id`` is not encoded (the
    message's own id goes between the two parts) and its flag is not set."""
    flags = 0
    parts: list[bytes] = []
    if props.content_type is not None:
        flags |= _CONTENT_TYPE
        parts.append(_shortstr(props.content_type))
    if props.content_encoding is not None:
        flags |= _CONTENT_ENCODING
        parts.append(_shortstr(props.content_encoding))
    if headers is not None:
        flags |= _HEADERS
        parts.append(encode_table(headers))
    # delivery_mode is always set: OutgoingMessage defaults it to persistent
    flags |= _DELIVERY_MODE
    parts.append(bytes((props.delivery_mode,)))
    if props.priority is not None:
        flags |= _PRIORITY
        parts.append(bytes((props.priority,)))
    if props.correlation_id is not None:
        flags |= _CORRELATION_ID
        parts.append(_shortstr(props.correlation_id))
    if props.reply_to is not None:
        flags |= _REPLY_TO
        parts.append(_shortstr(props.reply_to))
    if props.expiration is not None:
        flags |= _EXPIRATION
        parts.append(_shortstr(props.expiration))
    before = b"".join(parts)
    parts.clear()
    if props.timestamp is not None:
        flags |= _TIMESTAMP
        parts.append(_u64(props.timestamp))
    if props.type is not None:
        flags |= _TYPE
        parts.append(_shortstr(props.type))
    if props.user_id is not None:
        flags |= _USER_ID
        parts.append(_shortstr(props.user_id))
    if props.app_id is not None:
        flags |= _APP_ID
        parts.append(_shortstr(props.app_id))
    return flags, before, b"".join(parts)


# The encoded properties of each shared ``base`` (see OutgoingMessage), by id: the entry holds
# the base itself, so an id is not reused while cached. Bounded; cleared when full.
_encoded_bases: dict[int, tuple[MessageProperties, int, bytes, bytes]] = {}
_BASE_CACHE_MAX = 1024


def _encoded_base(base: MessageProperties) -> tuple[MessageProperties, int, bytes, bytes]:
    flags, before, after = _properties(base, base.headers)
    if len(_encoded_bases) >= _BASE_CACHE_MAX:
        _encoded_bases.clear()
    cached = _encoded_bases[id(base)] = (base, flags, before, after)
    return cached


# Whole basic.publish method frames by (channel, exchange, routing key, mandatory): producers
# publish to a few routes over and over. Bounded; cleared when full (dict ops are thread-safe).
_method_frames: dict[tuple[int, str, str, bool], bytes] = {}
_METHOD_CACHE_MAX = 1024


def _method_frame(route: tuple[int, str, str, bool]) -> bytes:
    channel, exchange, routing_key, mandatory = route
    payload = (
        _publish_head
        + _shortstr(exchange)
        + _shortstr(routing_key)
        + (b"\x01" if mandatory else b"\x00")  # bit 0 mandatory, bit 1 immediate (unset)
    )
    frame = _frame_head(FRAME_METHOD, channel, len(payload)) + payload + FRAME_END
    if len(_method_frames) >= _METHOD_CACHE_MAX:
        _method_frames.clear()
    _method_frames[route] = frame
    return frame


def header_too_large(size: int, frame_max: int) -> str:
    """Why a content header of ``size`` bytes cannot be sent (for :class:`InvalidMessage`)."""
    return (
        f"the properties and headers take {size} bytes in their frame, more than the "
        f"{frame_max}-byte frame_max the broker negotiated (AMQP cannot split a header frame)"
    )


def header_frame_size(base: MessageProperties, message_id: str, extra: int = 0) -> int:
    """Bytes of the content-header frame of a message with properties ``base`` and id
    ``message_id``, plus ``extra`` for headers added later."""
    _, before, after = _properties(base, base.headers)
    mid = len(message_id.encode("utf-8")) + 1 if message_id else 0
    return _content_head_size + len(before) + mid + len(after) + FRAME_OVERHEAD + extra


_header_head = struct.Struct(
    ">BHIHHQH"
).pack  # frame type, channel, size; class, weight, body size, flags
_body_head = struct.Struct(">cBHI").pack  # the header frame's end octet, then the body frame's head
_HEADER_FIXED = _content_head_size + FRAME_OVERHEAD


def publish_frames(
    channel: int,
    message: MessageParts,
    headers: Mapping[str, Any] | None,
    frame_max: int,
    out: list[bytes | memoryview],
    *,
    broker: BrokerLimits | None = None,
) -> None:
    """Append the frames of one ``basic.publish`` of ``message`` on ``channel`` to ``out``.

    ``headers`` replaces the message's own headers when not None (the engine adds its attempt
    and dedup headers there). Bodies are split into frames of at most ``frame_max`` bytes, the
    size negotiated in ``connection.tune``. ``broker``: the connected broker's own limits, when
    the message was not checked against them (taken before the broker was known). Appends
    nothing when it raises (a value that cannot be encoded, or one the broker refuses), so the
    caller can take the publish back.

    :class:`PublishEncoder` is its fast-path twin (a run of messages sharing route and
    properties): change both together (see there for the tests that keep them in step).
    """
    base = message.base
    if broker is not None and base.expiration is not None:
        broker.check_expiration(base.expiration)
    if headers is None:
        cached = _encoded_bases.get(id(base))
        if cached is None or cached[0] is not base:
            cached = _encoded_base(base)
        _, flags, before, after = cached
    else:
        flags, before, after = _properties(base, headers)
    message_id = message.message_id
    if message_id:
        data = message_id.encode("utf-8")
        mid = bytes((len(data),)) + data
        flags |= _MESSAGE_ID
    else:
        mid = b""
    size = _content_head_size + len(before) + len(mid) + len(after)
    if frame_max and size + FRAME_OVERHEAD > frame_max:
        # The broker would close the whole connection (501 FRAME_ERROR), not just the channel.
        raise InvalidMessage("headers", header_too_large(size + FRAME_OVERHEAD, frame_max))
    route = (channel, message.exchange, message.routing_key, message.mandatory)
    method = _method_frames.get(route)
    if method is None:
        method = _method_frame(route)
    body = message.body
    length = len(body)
    head = _header_head(FRAME_HEADER, channel, size, _BASIC_CLASS, 0, length, flags)
    limit = frame_max - FRAME_OVERHEAD if frame_max > FRAME_OVERHEAD else length or 1
    if length <= limit:
        if length:
            out += (
                method,
                head,
                before,
                mid,
                after,
                _body_head(FRAME_END, FRAME_BODY, channel, length),
                body,
                FRAME_END,
            )
        else:
            out += (method, head, before, mid, after, FRAME_END)
        return
    out += (method, head, before, mid, after, FRAME_END)
    view = memoryview(body)
    for start in range(0, length, limit):
        chunk = view[start : start + limit]
        out.append(_frame_head(FRAME_BODY, channel, len(chunk)))
        out.append(chunk)  # b"".join takes views: the body is copied once, not twice
        out.append(FRAME_END)


_size_class_weight = struct.Struct(">IHH").pack
_flags = struct.Struct(">H").pack


class PublishEncoder:
    """:func:`publish_frames` for one channel and ``frame_max``, for messages that go out with
    their own headers, with the parts that depend only on the route and the properties packed
    once.

    ``broker`` is the connected broker's limits: a message it refuses (taken before the broker
    was known) raises :class:`~reliable_amqp._core.brokers.BrokerLimitExceeded`, checked once
    per property set.

    Producers publish runs of messages that share their exchange, routing key and properties
    (the very objects: ``publish_many()`` and a ``publish()`` loop pass the same ones). While
    they do, a message's frames are one ``struct`` pack of those parts, its body size and its
    id, then the body and the end octet; anything else (a new route or property set, an id of
    another length, a body that needs several frames, no id) goes through
    :func:`publish_frames`, which the result equals byte for byte.

    A fast-path twin of :func:`publish_frames`: change both together. Kept in step by
    tests/async/test_async_frames.py: test_the_publish_encoder_writes_what_pika_writes (this
    encoder against pika's own marshalling) and test_publish_frames_match_pika (the twin
    against the same).
    """

    __slots__ = (
        "_after",
        "_base",
        "_before",
        "_exchange",
        "_id_size",
        "_mandatory",
        "_max_body",
        "_pack",
        "_parts",
        "_prefix",
        "_routing_key",
        "broker",
        "channel",
        "frame_max",
    )

    def __init__(self, channel: int, frame_max: int, broker: BrokerLimits = ANY_BROKER) -> None:
        self.channel = channel
        self.frame_max = frame_max
        self.broker = broker
        #: the largest body that fits one frame
        self._max_body = frame_max - FRAME_OVERHEAD if frame_max > FRAME_OVERHEAD else 2**64
        self._exchange: str | None = None
        self._routing_key: str | None = None
        self._mandatory: bool | None = None
        self._base: MessageProperties | None = None
        self._id_size = -1
        self._prefix = b""  # the method frame, then the header frame's type and channel
        self._before = b""  # the property flags and the properties before message_id
        self._after = b""  # the properties after it, the header's end, the body frame's head
        self._pack: Any = None
        self._parts: tuple[bytes, bytes, bytes] = (b"", b"", b"")

    def encode(self, message: MessageParts, out: list[bytes | memoryview]) -> None:
        """Append the frames of one publish of ``message`` (its own headers) to ``out``."""
        if (
            message.base is not self._base
            or message.exchange is not self._exchange
            or message.routing_key is not self._routing_key
            or message.mandatory is not self._mandatory
        ):
            self._switch(message)
        data = message.message_id.encode("utf-8")
        body = message.body
        length = len(body)
        if len(data) != self._id_size and not self._resize(len(data), length):
            publish_frames(self.channel, message, None, self.frame_max, out)
            return
        if not 0 < length <= self._max_body:
            publish_frames(self.channel, message, None, self.frame_max, out)
            return
        head, before, after = self._parts
        out += (self._pack(head, length, before, data, after, length), body, FRAME_END)

    def _switch(self, message: MessageParts) -> None:
        base = message.base
        if base.expiration is not None:  # before anything changes: it raises for each message
            self.broker.check_expiration(base.expiration)
        flags, before, after = _properties(base, base.headers)
        route = (self.channel, message.exchange, message.routing_key, message.mandatory)
        method = _method_frames.get(route)
        if method is None:
            method = _method_frame(route)
        self._prefix = method + bytes((FRAME_HEADER,)) + self.channel.to_bytes(2, "big")
        self._before = _flags(flags | _MESSAGE_ID) + before
        self._after = after + FRAME_END + bytes((FRAME_BODY,)) + self.channel.to_bytes(2, "big")
        self._base = base
        self._exchange = message.exchange
        self._routing_key = message.routing_key
        self._mandatory = message.mandatory
        self._id_size = -1

    def _resize(self, id_size: int, length: int) -> bool:
        """Prepare for ids of ``id_size`` bytes; False when the fast path cannot take such a
        message (no id, or a header frame over frame_max: publish_frames raises for it)."""
        if not 0 < id_size <= 255:
            return False
        # the header payload: class, weight, body size, flags, properties with the id
        before = self._before
        size = _content_head_size + len(before) - 2 + 1 + id_size + len(self._after) - 4
        if self.frame_max and size + FRAME_OVERHEAD > self.frame_max:
            return False
        head = self._prefix + _size_class_weight(size, _BASIC_CLASS, 0)
        before_id = before + bytes((id_size,))
        self._pack = struct.Struct(
            f">{len(head)}sQ{len(before_id)}s{id_size}s{len(self._after)}sI"
        ).pack
        self._parts = (head, before_id, self._after)
        self._id_size = id_size
        return True


#: AMQP's decimal holds a signed 32-bit value: at most 10 digits
_DECIMAL_DIGITS = 10


def decimal_parts(path: str, value: decimal.Decimal) -> tuple[int, int]:
    """AMQP's decimal for ``value``: (scale octet, signed 32-bit value), value / 10**scale.

    Works on the digit tuple alone, so a huge exponent (``Decimal('1E+1000000')``) is refused at
    once instead of being expanded (or overflowing the decimal context). Raises
    :class:`InvalidMessage` naming ``path`` when AMQP cannot hold it.
    """
    if not value.is_finite():
        raise InvalidMessage(path, f"Decimal {value} is not finite")
    sign, digits, exponent = value.as_tuple()
    assert isinstance(exponent, int)
    if not any(digits):
        return 0, 0  # any zero (0.000, -0) is 0 with scale 0, as pika writes it
    end = len(digits)
    while end > 1 and digits[end - 1] == 0 and exponent < 0:  # 1.500 -> 1.5: drop zeros
        end -= 1
        exponent += 1
    while end > 1 and digits[0] == 0:
        digits = digits[1:]
        end -= 1
    width = end + max(exponent, 0)  # digits of the scaled integer
    scale = max(0, -exponent)
    if width > _DECIMAL_DIGITS or scale > 255:
        raise InvalidMessage(
            path, f"Decimal {value} does not fit AMQP's decimal (32-bit digits, scale up to 255)"
        )
    raw = int("".join(map(str, digits[:end]))) * 10 ** max(exponent, 0)
    if sign:
        raw = -raw
    if not -(2**31) <= raw < 2**31:
        raise InvalidMessage(
            path, f"Decimal {value} does not fit AMQP's decimal (32-bit digits, scale up to 255)"
        )
    return scale, raw
