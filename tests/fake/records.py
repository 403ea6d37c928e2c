"""What the fake peer records, and what its policy may decide for a publish."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pamqp import commands as spec

#: what the policy may decide for a publish
ACK = "ack"
NACK = "nack"
RETURN = "return"
HOLD = None

Action = str | None
Policy = Callable[["Message"], Action]


@dataclass
class Message:
    """One ``basic.publish`` as the peer received it (method, header and body reassembled)."""

    #: 1-based index of the connection it came on (see :attr:`FakeBroker.connections`)
    connection: int
    #: channel number
    channel: int
    #: which channel opening on this peer it came on (1-based over all connections; a reused
    #: channel number gets a new serial)
    channel_serial: int
    #: delivery tag in confirm mode (per channel, from 1), None outside confirm mode
    tag: int | None
    exchange: str
    routing_key: str
    mandatory: bool
    properties: spec.Basic.Properties
    body: bytes
    #: True when the connection was blocked (``connection.blocked`` sent) as it arrived
    while_blocked: bool = False
    #: what was done with it: "ack", "nack", "return", "rejected" (closed the channel), or None
    outcome: str | None = None

    @property
    def headers(self) -> dict[str, Any]:
        """The message's header table ({} when it has none)."""
        return dict(self.properties.headers or {})

    @property
    def message_id(self) -> str | None:
        """The ``message_id`` property."""
        return self.properties.message_id


@dataclass
class Declaration:
    """A topology method the peer received (``exchange.declare``, ``queue.bind``, ...)."""

    connection: int
    method: str
    #: exchange or queue name (for a bind: the queue)
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass
class SentConfirm:
    """A ``basic.ack`` or ``basic.nack`` the peer sent."""

    connection: int
    channel: int
    ack: bool
    tag: int
    multiple: bool
