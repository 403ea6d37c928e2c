"""The public methods both publishers share word for word, written once.

``Publisher`` and ``AsyncPublisher`` differ in how they wait (threads or asyncio), not in what
they offer: topology declarations, ``stats()``, ``in_flight``, ``state`` and the repr are the same
for both. Each publisher supplies ``_declare`` (which returns the declared name, or an awaitable
of it), a supervisor and a window; this class holds no state of its own.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from reliable_amqp._core.errors import InvalidMessage
from reliable_amqp._core.frames import encode_table, header_frame_size, header_too_large
from reliable_amqp._core.message import OutgoingMessage, build_message
from reliable_amqp._core.options import PublisherOptions, redact_url
from reliable_amqp._core.state import State
from reliable_amqp._core.stats import Stats
from reliable_amqp._core.supervisor import Supervisor
from reliable_amqp._core.topology import TopologyOp, bind_op, exchange_op, queue_op
from reliable_amqp._core.window import Window

#: what the properties other than headers can take in a content-header frame, at most (12
#: shortstrs, a timestamp, two octets, flags, the frame's own bytes): below that, no check
_OTHER_PROPERTIES_MAX = 4096
#: the attempt header the engine adds to a mandatory message, at most
_ENGINE_HEADERS_MAX = 96

D = TypeVar("D")  # declare_exchange/bind_queue: None, or an awaitable of None
Q = TypeVar("Q")  # declare_queue: the queue name, or an awaitable of it


class PublisherSurface(Generic[D, Q]):
    """Declarations, statistics and state, for both publishers."""

    options: PublisherOptions
    _supervisor: Supervisor[Any]
    _window: Window

    def _declare(self, op: TopologyOp, timeout: float | None) -> Any:
        raise NotImplementedError

    def _message(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        mandatory: bool,
        properties: dict[str, Any],
    ) -> OutgoingMessage:
        """The validated message of a ``publish()`` call (raises :class:`InvalidMessage`).

        Beyond what each field admits: the headers must encode (checked here, not on the I/O
        side mid-batch), the content header must fit the broker's ``frame_max`` once it is known
        (a larger one makes the broker close the whole connection), and ``user_id`` must be the
        user the publisher connects as (the broker closes the channel otherwise).
        """
        message = build_message(
            exchange, routing_key, body, mandatory=mandatory, properties=properties
        )
        props = message.properties
        if props.headers:
            table = encode_table(props.headers)
            frame_max = self._supervisor.frame_max
            if frame_max and len(table) + _OTHER_PROPERTIES_MAX > frame_max:
                extra = _ENGINE_HEADERS_MAX
                if self.options.dedup_header is not None:
                    extra += len(self.options.dedup_header) + len(message.message_id) + 8
                size = header_frame_size(message, extra)
                if size > frame_max:
                    raise InvalidMessage("headers", header_too_large(size, frame_max))
        if props.user_id is not None:
            users = {self.options.login(url)[0] for url in self.options.urls}
            if props.user_id not in users:
                raise InvalidMessage(
                    "user_id",
                    f"{props.user_id!r} is not the user this publisher connects as "
                    f"({', '.join(sorted(map(repr, users)))}); the broker would close the channel",
                )
        return message

    def __repr__(self) -> str:
        urls = ", ".join(redact_url(u) for u in self.options.urls)
        name = type(self).__name__
        return f"<{name} [{urls}] {self.state.value}, {self._window.count} in flight>"

    @property
    def state(self) -> State:
        """The connection state (see :class:`~reliable_amqp.State`)."""
        return self._supervisor.state.state

    def stats(self) -> Stats:
        """Counters (published, confirmed, nacked, returned, rejected, republished, timed out,
        ...), the in-flight gauge and a confirm-latency summary."""
        return self._supervisor.engine.stats()

    @property
    def in_flight(self) -> int:
        """How many published messages are not resolved yet."""
        return self._window.count

    def declare_exchange(
        self,
        exchange: str,
        exchange_type: str = "direct",
        *,
        durable: bool = True,
        auto_delete: bool = False,
        internal: bool = False,
        arguments: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> D:
        """Declare an exchange now, and again after every reconnect (``await`` it on the
        AsyncPublisher).

        Raises the broker's error (e.g. :class:`PreconditionFailed` for an exchange that exists
        with other settings) without disturbing messages in flight.
        """
        op = exchange_op(
            exchange,
            exchange_type,
            durable=durable,
            auto_delete=auto_delete,
            internal=internal,
            arguments=arguments,
        )
        result: D = self._declare(op, timeout)
        return result

    def declare_queue(
        self,
        queue: str,
        *,
        durable: bool = True,
        exclusive: bool = False,
        auto_delete: bool = False,
        arguments: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> Q:
        """Declare a queue now, and again after every reconnect; returns its name (``await``
        it on the AsyncPublisher)."""
        op = queue_op(
            queue,
            durable=durable,
            exclusive=exclusive,
            auto_delete=auto_delete,
            arguments=arguments,
        )
        result: Q = self._declare(op, timeout)
        return result

    def bind_queue(
        self,
        queue: str,
        exchange: str,
        routing_key: str = "",
        *,
        arguments: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> D:
        """Bind a queue to an exchange now, and again after every reconnect (``await`` it on
        the AsyncPublisher)."""
        result: D = self._declare(
            bind_op(queue, exchange, routing_key, arguments=arguments), timeout
        )
        return result
