"""Rows of the outbox: what ``add()`` writes for a message, and the message a relay publishes
for a row. No I/O.

A row keeps the message as the durable spool does (the spool's record of everything but the
body, so every header type round-trips exactly), plus readable columns for people and for the
relay's bookkeeping: ``message_id``, ``key`` and its ``part``, the route, the writer's trace
context and when it was written.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from reliable_amqp._core.builder import build_message, message_arguments
from reliable_amqp._core.errors import InvalidMessage
from reliable_amqp._core.frames import header_frame_size, header_too_large
from reliable_amqp._core.message import OutgoingMessage, with_headers
from reliable_amqp._spool._codec import CodecError, decode, encode
from reliable_amqp.outbox._schema import partition_of

#: RabbitMQ's default frame_max: a header block larger than one frame closes the whole
#: connection on the broker, so add() refuses it before it is stored (131072 bytes)
FRAME_MAX = 131_072

#: a row's values, in the order of :data:`~reliable_amqp.outbox._schema.WRITE_COLUMNS`
RowValues = tuple[str, str | None, int, str, str, bytes, bytes, str | None, str | None, float]


def row_values(
    exchange: object,
    routing_key: object,
    body: object,
    *,
    key: object = None,
    message_id: object = None,
    mandatory: object = None,
    properties: Mapping[str, Any],
    trace: tuple[str | None, str | None] = (None, None),
    now: float | None = None,
) -> RowValues:
    """The row for one message, checked as ``publish()`` checks it; raises
    :class:`~reliable_amqp.InvalidMessage` naming the field for what AMQP cannot carry."""
    if key is not None and not isinstance(key, str):
        raise InvalidMessage("key", f"must be a str or None, not {type(key).__name__}")
    if "message_id" in properties:
        raise InvalidMessage("message_id", "pass it as the message_id= keyword")
    props = dict(properties)
    if message_id is not None:
        props["message_id"] = message_id
    message = build_message(
        exchange,
        routing_key,
        body,
        mandatory=True if mandatory is None else mandatory,  # type: ignore[arg-type]
        properties=props,
    )
    # room for the trace headers the relay adds (traceparent 55 bytes, tracestate its own)
    extra = sum(len(t) + 16 for t in trace if t)
    size = header_frame_size(message.base, message.message_id, extra)
    if size > FRAME_MAX:
        raise InvalidMessage("headers", header_too_large(size, FRAME_MAX))
    return (
        message.message_id,
        key,
        partition_of(key, message.message_id),
        message.exchange,
        message.routing_key,
        encode(message),
        message.body,
        trace[0],
        trace[1],
        time.time() if now is None else now,
    )


def many_row_values(
    messages: Iterable[Mapping[str, Any]], trace: tuple[str | None, str | None]
) -> list[RowValues]:
    """Rows for ``add_many()``: each item a mapping with ``exchange``, ``routing_key`` and
    ``body`` and optionally ``key``, ``message_id``, ``mandatory`` and ``properties`` (a dict
    of AMQP properties); raises :class:`~reliable_amqp.InvalidMessage` naming ``messages[i]``
    for a bad one, before any is written."""
    now = time.time()
    rows = []
    for i, item in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(item, Mapping):
            raise InvalidMessage(where, f"must be a mapping, not {type(item).__name__}")
        unknown = set(item) - _ITEM_KEYS
        if unknown:
            raise InvalidMessage(
                where, f"unknown keys {sorted(unknown)} (known: {sorted(_ITEM_KEYS)})"
            )
        missing = {"exchange", "routing_key", "body"} - set(item)
        if missing:
            raise InvalidMessage(where, f"missing {sorted(missing)}")
        try:
            rows.append(
                row_values(
                    item["exchange"],
                    item["routing_key"],
                    item["body"],
                    key=item.get("key"),
                    message_id=item.get("message_id"),
                    mandatory=item.get("mandatory"),
                    properties=item.get("properties") or {},
                    trace=trace,
                    now=now,
                )
            )
        except InvalidMessage as exc:
            raise InvalidMessage(f"{where}.{exc.field}", exc.problem) from None
    return rows


_ITEM_KEYS = frozenset(
    ("exchange", "routing_key", "body", "key", "message_id", "mandatory", "properties")
)


@dataclass(frozen=True, slots=True)
class PendingRow:
    """One row as a relay read it."""

    id: int
    message_id: str
    key: str | None
    part: int
    exchange: str
    routing_key: str
    record: bytes
    body: bytes
    traceparent: str | None
    tracestate: str | None
    created_at: float

    @classmethod
    def of(cls, values: Sequence[Any]) -> PendingRow:
        """From a database row in :data:`~reliable_amqp.outbox._schema.READ_COLUMNS` order."""
        (id_, message_id, key, part, exchange, routing_key, record, body, tp, ts, created) = values
        return cls(
            int(id_), message_id, key, int(part), exchange, routing_key,
            bytes(record), bytes(body), tp, ts, float(created),
        )  # fmt: skip

    def message(self) -> OutgoingMessage:
        """The message to publish: as written, with the writer's trace context in its headers.
        Raises :class:`UnreadableRow` for a record this version cannot read."""
        try:
            message = decode(self.record, self.body)
        except CodecError as exc:
            raise UnreadableRow(f"row {self.id} ({self.message_id}): {exc}") from None
        if not isinstance(message, OutgoingMessage):  # decode builds OutgoingMessage by default
            raise UnreadableRow(f"row {self.id}: not a message")
        if self.traceparent:
            headers = dict(message.base.headers or {})
            headers["traceparent"] = self.traceparent
            if self.tracestate:
                headers["tracestate"] = self.tracestate
            message = OutgoingMessage(
                message.exchange,
                message.routing_key,
                message.body,
                with_headers(message.properties, headers),
                message.mandatory,
            )
        return message


class UnreadableRow(ValueError):
    """A row whose stored record cannot be read back (damaged, or from a newer version)."""


@dataclass(frozen=True, slots=True)
class Run:
    """Consecutive rows sharing route, properties and mandatory flag: one ``publish_many()``."""

    exchange: str
    routing_key: str
    mandatory: bool
    properties: dict[str, Any]
    rows: list[PendingRow]
    messages: list[OutgoingMessage]


def runs(rows: Sequence[PendingRow], messages: Sequence[OutgoingMessage]) -> list[Run]:
    """``rows`` (and their messages) cut into runs that one ``publish_many()`` call each can
    send, in order: a new run wherever the route, the properties or the mandatory flag change.
    Messages decoded from records alike share one properties object, so the comparison is by
    identity first."""
    out: list[Run] = []
    last: Run | None = None
    for row, message in zip(rows, messages, strict=True):
        if (
            last is not None
            and message.base is last.messages[-1].base
            and message.exchange == last.exchange
            and message.routing_key == last.routing_key
            and message.mandatory == last.mandatory
        ):
            last.rows.append(row)
            last.messages.append(message)
            continue
        exchange, routing_key, _body, mandatory, given = message_arguments(message)
        given.pop("message_id", None)
        last = Run(exchange, routing_key, mandatory, given, [row], [message])
        out.append(last)
    return out
