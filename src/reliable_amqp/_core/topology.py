"""Topology a publisher was asked to declare, recorded so it can be replayed after a reconnect.

A non-durable queue, an auto-delete exchange or a binding to either is gone after a broker
restart; the publisher declares again, in the original order, everything in its
:class:`Topology` before it writes messages on a new connection.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from reliable_amqp._core.builder import shortstr_problem
from reliable_amqp._core.errors import ConfigurationError

#: The AMQP method (as named by pika and aiormq) each operation kind maps to.
METHODS = {"exchange": "exchange_declare", "queue": "queue_declare", "bind": "queue_bind"}


@dataclass(frozen=True, slots=True)
class TopologyOp:
    """One declaration: ``kind`` is exchange, queue or bind; ``args`` its keyword arguments."""

    kind: str
    args: Mapping[str, Any] = field(default_factory=dict)

    @property
    def method(self) -> str:
        """The AMQP method name (``queue_declare``, ...)."""
        return METHODS[self.kind]

    def describe(self) -> str:
        """A short human description for logs and errors."""
        if self.kind == "bind":
            return (
                f"binding of queue {self.args['queue']!r} to exchange {self.args['exchange']!r}"
                f" with routing key {self.args['routing_key']!r}"
            )
        name = self.args["queue" if self.kind == "queue" else "exchange"]
        return f"{self.kind} {name!r}"


def exchange_op(
    exchange: str,
    exchange_type: str = "direct",
    *,
    durable: bool = True,
    auto_delete: bool = False,
    internal: bool = False,
    arguments: Mapping[str, Any] | None = None,
) -> TopologyOp:
    """A validated exchange declaration."""
    _name("exchange", exchange, allow_empty=False)
    _name("exchange_type", exchange_type, allow_empty=False)
    return TopologyOp(
        "exchange",
        {
            "exchange": exchange,
            "exchange_type": exchange_type,
            "durable": durable,
            "auto_delete": auto_delete,
            "internal": internal,
            "arguments": dict(arguments) if arguments else None,
        },
    )


def queue_op(
    queue: str,
    *,
    durable: bool = True,
    exclusive: bool = False,
    auto_delete: bool = False,
    arguments: Mapping[str, Any] | None = None,
) -> TopologyOp:
    """A validated queue declaration (a name is required: a server-named queue cannot be
    declared again under the same name after a reconnect)."""
    _name("queue", queue, allow_empty=False)
    return TopologyOp(
        "queue",
        {
            "queue": queue,
            "durable": durable,
            "exclusive": exclusive,
            "auto_delete": auto_delete,
            "arguments": dict(arguments) if arguments else None,
        },
    )


def bind_op(
    queue: str,
    exchange: str,
    routing_key: str = "",
    *,
    arguments: Mapping[str, Any] | None = None,
) -> TopologyOp:
    """A validated queue binding."""
    _name("queue", queue, allow_empty=False)
    _name("exchange", exchange, allow_empty=False)
    _name("routing_key", routing_key, allow_empty=True)
    return TopologyOp(
        "bind",
        {
            "queue": queue,
            "exchange": exchange,
            "routing_key": routing_key,
            "arguments": dict(arguments) if arguments else None,
        },
    )


class Topology:
    """Declarations that succeeded, in order, each recorded once."""

    def __init__(self) -> None:
        self._ops: list[TopologyOp] = []

    def record(self, op: TopologyOp) -> None:
        """Remember a declaration the broker accepted (an identical repeat is kept once)."""
        if op not in self._ops:
            self._ops.append(op)

    def __iter__(self) -> Iterator[TopologyOp]:
        return iter(list(self._ops))

    def __len__(self) -> int:
        return len(self._ops)


def _name(what: str, value: object, *, allow_empty: bool) -> None:
    if not isinstance(value, str):
        raise ConfigurationError(f"{what} must be a str, not {type(value).__name__}")
    if not value and not allow_empty:
        raise ConfigurationError(f"{what} must not be empty")
    problem = shortstr_problem(value)
    if problem is not None:
        raise ConfigurationError(f"{what} {problem}")
