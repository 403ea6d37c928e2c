"""Deliveries decoded straight from AMQP 0-9-1 frames, with no I/O.

A consumer channel receives, per message, a ``basic.deliver`` method frame, a content header
frame and zero or more body frames. :class:`DeliveryScanner` walks a buffer of raw frames, takes
those three kinds for the consumer's channel and hands back finished :class:`Delivery` objects;
every other frame (heartbeats, ``basic.cancel``, ``channel.close``, other channels) is left for
the connection library to handle, in order. pika builds a method object, a properties object and
a frame object per frame and walks them through its callback tables: the largest cost of
consuming with it. Here a delivery is one object, its properties one tuple, decoded with
``struct``.

Field tables (``headers``) decode the same on every Python and dependency version (pamqp 3.3,
what Python 3.10 resolves, reads a negative decimal as a huge positive one): the decoder is this
module's, not pamqp's nor pika's. It reads what :mod:`reliable_amqp._core.frames` writes, and
RabbitMQ's field types (the 0-9-1 errata: ``s`` is a signed 16-bit integer, ``l`` signed 64).
"""

from __future__ import annotations

import datetime as _dt
import decimal
import struct
from collections.abc import Callable
from typing import Any

from reliable_amqp._core.errors import ReliableAmqpError
from reliable_amqp._core.frames import FRAME_BODY, FRAME_END, FRAME_HEADER, FRAME_METHOD
from reliable_amqp._core.message import MessageProperties
from reliable_amqp._core.redelivery import (
    ATTEMPT_HEADER,
    NO_ID_HEADER,
    ORIGIN_EXCHANGE_HEADER,
    ORIGIN_ROUTING_KEY_HEADER,
    attempt_of,
)

__all__ = [
    "Delivery",
    "DeliveryScanner",
    "HeaderDecodeError",
    "decode_table",
]

_FRAME_END = FRAME_END[0]

_frame_head = struct.Struct(">BHI").unpack_from
_deliver_id = struct.Struct(">HH").unpack_from
_u16 = struct.Struct(">H").unpack_from
_u32 = struct.Struct(">I").unpack_from
_u64 = struct.Struct(">Q").unpack_from
_header_head = struct.Struct(">HHQH").unpack_from  # class, weight, body size, first flags
#: a content header frame's head and the start of its payload: kind, channel, size, then
#: class, weight, body size and the first property flags
_header_frame = struct.Struct(">BHIHHQH").unpack_from

_BASIC = 60
_DELIVER = 60

_UTC = _dt.timezone.utc
_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_UTC)


class HeaderDecodeError(ReliableAmqpError):
    """A delivery's properties or header table could not be decoded.

    The consumer dead-letters such a message with this error's text as the reason; it never
    reaches the handler.
    """

    permanent = True


# --- field tables ---------------------------------------------------------------------------


_FIXED: dict[int, tuple[Any, int]] = {
    ord("b"): (struct.Struct(">b").unpack_from, 1),
    ord("B"): (struct.Struct(">B").unpack_from, 1),
    ord("s"): (struct.Struct(">h").unpack_from, 2),
    ord("U"): (struct.Struct(">h").unpack_from, 2),
    ord("u"): (struct.Struct(">H").unpack_from, 2),
    ord("I"): (struct.Struct(">i").unpack_from, 4),
    ord("i"): (struct.Struct(">I").unpack_from, 4),
    ord("l"): (struct.Struct(">q").unpack_from, 8),
    ord("L"): (struct.Struct(">q").unpack_from, 8),
    ord("f"): (struct.Struct(">f").unpack_from, 4),
    ord("d"): (struct.Struct(">d").unpack_from, 8),
}
_int32 = struct.Struct(">i").unpack_from


def _value(data: bytes, pos: int) -> tuple[Any, int]:
    """One typed field value at ``pos``: (value, position after it)."""
    kind = data[pos]
    pos += 1
    fixed = _FIXED.get(kind)
    if fixed is not None:
        unpack, size = fixed
        return unpack(data, pos)[0], pos + size
    if kind == 0x53:  # 'S' long string: text when it is UTF-8, else the bytes
        (size,) = _u32(data, pos)
        end = pos + 4 + size
        if end > len(data):
            raise HeaderDecodeError("a long string runs past the end of its table")
        raw = data[pos + 4 : end]
        try:
            return raw.decode(), end
        except UnicodeDecodeError:
            return raw, end
    if kind == 0x74:  # 't' boolean
        return data[pos] != 0, pos + 1
    if kind == 0x46:  # 'F' nested table
        (size,) = _u32(data, pos)
        end = pos + 4 + size
        return _table(data, pos + 4, end), end
    if kind == 0x41:  # 'A' array
        (size,) = _u32(data, pos)
        end = pos + 4 + size
        if end > len(data):
            raise HeaderDecodeError("an array runs past the end of its table")
        items = []
        pos += 4
        while pos < end:
            item, pos = _value(data, pos)
            items.append(item)
        if pos != end:
            raise HeaderDecodeError("an array's last value runs past its length")
        return items, end
    if kind == 0x54:  # 'T' timestamp: seconds since the epoch, UTC
        (seconds,) = _u64(data, pos)
        try:
            return _EPOCH + _dt.timedelta(seconds=seconds), pos + 8
        except OverflowError:
            raise HeaderDecodeError(f"timestamp {seconds} is out of range") from None
    if kind == 0x44:  # 'D' decimal: scale (octet), then a *signed* 32-bit value
        scale = data[pos]
        (raw_value,) = _int32(data, pos + 1)
        return decimal.Decimal(raw_value).scaleb(-scale), pos + 5
    if kind == 0x78:  # 'x' byte array
        (size,) = _u32(data, pos)
        end = pos + 4 + size
        if end > len(data):
            raise HeaderDecodeError("a byte array runs past the end of its table")
        return data[pos + 4 : end], end
    if kind == 0x56:  # 'V' void
        return None, pos
    raise HeaderDecodeError(f"unknown field type {chr(kind)!r} (0x{kind:02x}) in a table")


def _table(data: bytes, pos: int, end: int) -> dict[str, Any]:
    if end > len(data):
        raise HeaderDecodeError("a table runs past the end of its frame")
    table: dict[str, Any] = {}
    while pos < end:
        size = data[pos]
        key_end = pos + 1 + size
        raw_key = data[pos + 1 : key_end]
        try:
            key = raw_key.decode()
        except UnicodeDecodeError:
            raise HeaderDecodeError(f"a table key is not UTF-8: {raw_key!r}") from None
        table[key], pos = _value(data, key_end)
    if pos != end:
        raise HeaderDecodeError("a table's last value runs past its length")
    return table


def decode_table(data: bytes) -> dict[str, Any]:
    """A field table's content (without its 4-byte length) as a dict.

    Raises :class:`HeaderDecodeError` for anything malformed (an unknown type, a length running
    past the end, a key that is not UTF-8).
    """
    try:
        return _table(data, 0, len(data))
    except HeaderDecodeError:
        raise
    except (IndexError, struct.error, ValueError) as exc:
        raise HeaderDecodeError(f"malformed field table: {exc}") from None


# --- deliveries -----------------------------------------------------------------------------

_EMPTY: dict[str, Any] = {}


class Delivery:
    """One message delivered to a consumer (read-only).

    ``body`` is the payload; ``message_id``, ``headers`` (a dict, empty when the message had
    none), ``properties`` (a :class:`~reliable_amqp.MessageProperties`), ``routing_key`` and
    ``exchange`` are what the publisher sent. ``redelivered`` is the broker's flag; ``attempt``
    counts this message's tries, 1 the first time (see docs/consumer.md for how it is counted on
    each queue type). ``queue`` names the queue it came from, ``delivery_tag`` its tag on the
    channel that delivered it.
    """

    __slots__ = (
        "_fields",
        "_properties",
        "attempt",
        "body",
        "consumer_tag",
        "delivery_tag",
        "exchange",
        "generation",
        "header_error",
        "headers",
        "message_id",
        "queue",
        "redelivered",
        "routing_key",
    )

    body: bytes
    message_id: str | None
    headers: dict[str, Any]
    routing_key: str
    exchange: str
    redelivered: bool
    attempt: int
    delivery_tag: int
    queue: str
    consumer_tag: str
    #: the consumer's channel generation that delivered it (tags are per channel)
    generation: int
    #: why the properties could not be decoded (the consumer dead-letters it), else None
    header_error: str | None
    _fields: tuple[Any, ...]
    _properties: MessageProperties | None

    @property
    def properties(self) -> MessageProperties:
        """The AMQP basic properties as sent (``headers`` included)."""
        props = self._properties
        if props is None:
            f = self._fields
            props = self._properties = MessageProperties(
                content_type=f[0],
                content_encoding=f[1],
                headers=self.headers,
                delivery_mode=f[3] or 1,
                priority=f[4],
                correlation_id=f[5],
                reply_to=f[6],
                expiration=f[7],
                message_id=f[8],
                timestamp=f[9],
                type=f[10],
                user_id=f[11],
                app_id=f[12],
            )
        return props

    @property
    def content_type(self) -> str | None:
        """The ``content_type`` property."""
        value: str | None = self._fields[0]
        return value

    @property
    def correlation_id(self) -> str | None:
        """The ``correlation_id`` property."""
        value: str | None = self._fields[5]
        return value

    @property
    def timestamp(self) -> int | None:
        """The ``timestamp`` property (seconds since the epoch)."""
        value: int | None = self._fields[9]
        return value

    @property
    def type(self) -> str | None:
        """The ``type`` property."""
        value: str | None = self._fields[10]
        return value

    def __repr__(self) -> str:
        return (
            f"Delivery(queue={self.queue!r}, message_id={self.message_id!r}, "
            f"attempt={self.attempt}, redelivered={self.redelivered}, "
            f"routing_key={self.routing_key!r}, body=<{len(self.body)} bytes>)"
        )


_SHORTSTR, _OCTET, _TIMESTAMP, _TABLE = 0, 1, 2, 3
#: each of the 14 properties' kind, in flag order (0x8000 first)
_KINDS: tuple[int, ...] = (_SHORTSTR, _SHORTSTR, _TABLE, _OCTET, _OCTET) + (_SHORTSTR,) * 4
_KINDS += (_TIMESTAMP,) + (_SHORTSTR,) * 4
#: a decoder made for one set of properties: (data, pos) -> (the 14 values, pos after, error)
_Decoder = Callable[[bytes, int], tuple[tuple[Any, ...], int, "str | None"]]
#: property flags -> its decoder (a message stream has a handful of flag sets: each decoder is
#: made once per set, not once per message)
_DECODERS: dict[int, _Decoder] = {}
#: the values when no property is present
_NO_PROPERTIES: tuple[Any, ...] = (None, None, _EMPTY) + (None,) * 11


def _decoder(key: int) -> _Decoder:
    decoder = _DECODERS.get(key)
    if decoder is None:
        decoder = _make_decoder(key)
        if len(_DECODERS) < 1024:
            _DECODERS[key] = decoder
    return decoder


def _make_decoder(key: int) -> _Decoder:
    """Straight-line code reading exactly the properties ``key`` says are present, in flag
    order. A walk over the 14 flags with a test of each one's kind, once per message, took
    two and a half times as long; the consumer's I/O thread spends most of its time decoding
    (docs/benchmarks.md). The source is made of this module's constants only."""
    lines = ["def decode(data, pos):", "    error = None"]
    values = ["None"] * 14
    values[2] = "_EMPTY"
    for index in range(14):
        if not key & (0x8000 >> index):
            continue
        name = values[index] = f"v{index}"
        kind = _KINDS[index]
        if kind == _SHORTSTR:
            lines += [
                "    size = data[pos]",
                "    raw = data[pos + 1 : pos + 1 + size]",
                "    try:",
                f"        {name} = raw.decode()",
                "    except UnicodeDecodeError:",
                f"        {name} = raw.decode('utf-8', 'surrogateescape')",
                "    pos += 1 + size",
            ]
        elif kind == _OCTET:  # delivery_mode, priority
            lines += [f"    {name} = data[pos]", "    pos += 1"]
        elif kind == _TIMESTAMP:
            lines += [f"    ({name},) = _u64(data, pos)", "    pos += 8"]
        else:  # headers
            lines += [
                "    (size,) = _u32(data, pos)",
                "    table_end = pos + 4 + size",
                "    try:",
                f"        {name} = decode_table(data[pos + 4 : table_end])",
                "    except HeaderDecodeError as exc:",
                f"        {name} = {{}}",
                "        error = f'undecodable headers: {exc}'",
                "    pos = table_end",
            ]
    lines.append(f"    return ({', '.join(values)}), pos, error")
    namespace: dict[str, Any] = {
        "_u32": _u32,
        "_u64": _u64,
        "_EMPTY": _EMPTY,
        "decode_table": decode_table,
        "HeaderDecodeError": HeaderDecodeError,
    }
    exec("\n".join(lines), namespace)
    decoder: _Decoder = namespace["decode"]
    return decoder


def _properties_after(
    word: int, data: bytes, pos: int, end: int
) -> tuple[tuple[Any, ...], str | None]:
    """The 14 basic properties of a content header payload, its first flag word (``word``)
    read and ``pos`` just after it.

    Returns the values in :data:`~reliable_amqp._core.message.PROPERTY_ORDER` order, then
    ``cluster_id`` (headers decoded), and an error text when the header table could not be
    decoded (the table is then ``{}``).
    """
    flags = word & 0xFFFE
    if word & 1:  # more flag words: no basic property is there, but they are read past
        shift = 16
        while True:
            (word,) = _u16(data, pos)
            pos += 2
            flags |= (word & 0xFFFE) << shift
            if not word & 1:
                break
            shift += 16
    if not flags:
        return _NO_PROPERTIES, None
    key = flags & 0xFFFC
    decoder = _DECODERS.get(key) or _decoder(key)
    values, pos, error = decoder(data, pos)
    if pos > end:
        raise HeaderDecodeError("the content header's properties run past its frame")
    return values, error


def _unended(channel: int) -> HeaderDecodeError:
    """The error for a frame whose end octet is missing: the connection cannot go on."""
    return HeaderDecodeError(f"frame on channel {channel} lacks its end octet")


class DeliveryScanner:
    """Sans-I/O assembly of deliveries for one consumer channel.

    :meth:`scan` walks whole frames in a buffer from a position; frames of the deliveries on
    ``channel`` (``basic.deliver``, their content header and body frames) are taken and turned
    into :class:`Delivery` objects, appended to :attr:`ready`. It stops before the first other
    frame and returns its bounds, so the caller hands that frame to its connection library and
    calls :meth:`scan` again after it.
    """

    __slots__ = ("_body", "_current", "_remaining", "channel", "generation", "queue", "ready")

    def __init__(self, channel: int, generation: int, queue: str) -> None:
        self.channel = channel
        self.generation = generation
        self.queue = queue
        #: finished deliveries, in order; the caller takes them
        self.ready: list[Delivery] = []
        self._current: Delivery | None = None
        self._body: list[bytes] = []
        self._remaining = 0

    def scan(self, data: bytes, pos: int) -> tuple[int, int]:
        """Take this channel's delivery frames from ``data[pos:]``.

        Returns ``(pos, end)``: with ``end > pos``, ``data[pos:end]`` is one whole frame that is
        not this scanner's; with ``end == pos``, ``data[pos:]`` holds no whole frame (wait for
        more bytes). Raises :class:`HeaderDecodeError` on a frame that breaks the protocol (its
        end octet is missing): the connection cannot go on.
        """
        size_all = len(data)
        channel = self.channel
        while size_all - pos >= 8:
            kind, chan, size = _frame_head(data, pos)
            end = pos + 8 + size
            if end > size_all:
                return pos, pos
            if chan != channel:
                return pos, end
            start = pos + 7
            if data[end - 1] != _FRAME_END:
                raise _unended(chan)
            if kind == FRAME_BODY:
                current = self._current
                if current is None:
                    return pos, end  # not ours: let the library complain
                self._body.append(data[start : end - 1])
                self._remaining -= size
                if self._remaining <= 0:
                    self._finish(current)
                pos = end
                continue
            if kind == FRAME_METHOD:
                if size < 4 or _deliver_id(data, start) != (_BASIC, _DELIVER):
                    return pos, end
                if self._current is not None:
                    return pos, end  # a new method mid-content: the library reports it
                d = self._deliver(data, start + 4)
                pos = end
                # The usual delivery: its content header and its whole body in one frame
                # follow in this read. Taken in one pass, not in two more turns of the loop
                # (a tenth of a consumed message's instructions, docs/benchmarks.md);
                # anything else is left to the loop, from the state it expects.
                if size_all - pos >= 21:  # a content header frame is 22 bytes or more
                    # its head, class, weight, body size and first flags in one unpack
                    kind, chan, size, _cls, _weight, body_size, word = _header_frame(data, pos)
                    end = pos + 8 + size
                    if kind == FRAME_HEADER and chan == channel and size >= 14 and end <= size_all:
                        if data[end - 1] != _FRAME_END:
                            raise _unended(chan)
                        self._properties(d, word, data, pos + 21, end - 1)
                        pos = end
                        d.body = b""  # marks "header seen"; replaced by the body
                        if body_size and size_all - pos >= 8:
                            kind, chan, size = _frame_head(data, pos)
                            end = pos + 8 + size
                            if (
                                kind == FRAME_BODY
                                and chan == channel
                                and size == body_size
                                and end <= size_all
                            ):
                                if data[end - 1] != _FRAME_END:
                                    raise _unended(chan)
                                d.body = data[pos + 7 : end - 1]
                                pos = end
                                body_size = 0
                        if not body_size:
                            if d.headers or d.redelivered:
                                self._complete(d)
                            else:
                                self.ready.append(d)
                            continue
                        self._remaining = body_size
                        self._body = []
                self._current = d
                continue
            if kind == FRAME_HEADER:
                current = self._current
                if current is None or current.body is not None:
                    return pos, end
                body_size = self._header(current, data, start, end - 1)
                if body_size == 0:
                    current.body = b""
                    self._finish(current)
                else:
                    self._remaining = body_size
                    current.body = b""  # marks "header seen"; replaced by the joined body
                    self._body = []
                pos = end
                continue
            return pos, end
        return pos, pos

    def _deliver(self, data: bytes, pos: int) -> Delivery:
        d = Delivery.__new__(Delivery)
        # the consumer tag, exchange and routing key: short strings (a length octet, then
        # UTF-8), read inline (three calls a delivery were a tenth of the scan)
        end = pos + 1 + data[pos]
        tag = data[pos + 1 : end]
        (d.delivery_tag,) = _u64(data, end)
        d.redelivered = data[end + 8] & 1 == 1
        pos = end + 9
        end = pos + 1 + data[pos]
        exchange = data[pos + 1 : end]
        pos = end + 1 + data[end]
        routing_key = data[end + 1 : pos]
        try:  # bare decode(): the codec's fast path, without looking up a name and a handler
            d.consumer_tag = tag.decode()
            d.exchange = exchange.decode()
            d.routing_key = routing_key.decode()
        except UnicodeDecodeError:  # not UTF-8: kept byte for byte, as everywhere else
            d.consumer_tag = tag.decode("utf-8", "surrogateescape")
            d.exchange = exchange.decode("utf-8", "surrogateescape")
            d.routing_key = routing_key.decode("utf-8", "surrogateescape")
        d.queue = self.queue
        d.generation = self.generation
        d.body = None  # type: ignore[assignment]  # until the content header
        d._properties = None
        d.attempt = 1
        return d

    def _header(self, d: Delivery, data: bytes, start: int, end: int) -> int:
        _cls, _weight, body_size, word = _header_head(data, start)
        self._properties(d, word, data, start + 14, end)
        return int(body_size)

    @staticmethod
    def _properties(d: Delivery, word: int, data: bytes, pos: int, end: int) -> None:
        """``d``'s properties, from just after the first flag word (``word``) to ``end``."""
        try:
            fields, error = _properties_after(word, data, pos, end)
        except (IndexError, struct.error, HeaderDecodeError) as exc:
            fields = _NO_PROPERTIES
            error = f"undecodable properties: {exc}"
        d._fields = fields
        d.headers = fields[2]
        d.message_id = fields[8]
        d.header_error = error

    def _finish(self, d: Delivery) -> None:
        body = self._body
        if body:
            d.body = body[0] if len(body) == 1 else b"".join(body)
            self._body = []
        self._current = None
        self._remaining = 0
        self._complete(d)

    def _complete(self, d: Delivery) -> None:
        """``d`` is whole: its attempt (and a retried copy's origin) read, then it is ready."""
        headers = d.headers
        if headers:
            d.attempt = attempt_of(headers, d.redelivered)
            if NO_ID_HEADER in headers:  # a retried copy of a message that had no id
                d.message_id = None
                d._fields = (*d._fields[:8], None, *d._fields[9:])
            if ATTEMPT_HEADER in headers:
                # a retried copy came back through its delay queue: report where it was first
                # published, not the delay queue's dead-letter route
                exchange = headers.get(ORIGIN_EXCHANGE_HEADER)
                routing_key = headers.get(ORIGIN_ROUTING_KEY_HEADER)
                if isinstance(exchange, str) and isinstance(routing_key, str):
                    d.exchange = exchange
                    d.routing_key = routing_key
        elif d.redelivered:
            d.attempt = 2
        self.ready.append(d)
