"""The public methods both publishers share word for word, written once.

``Publisher`` and ``AsyncPublisher`` differ in how they wait (threads or asyncio), not in what
they offer: topology declarations, ``stats()``, ``in_flight``, ``state`` and the repr are the same
for both. Each publisher supplies ``_declare`` (which returns the declared name, or an awaitable
of it), a supervisor and a window; this class holds no state of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

from reliable_amqp._core.builder import MessageBuilder
from reliable_amqp._core.message import MessageProperties, OutgoingMessage
from reliable_amqp._core.options import PublisherOptions, redact_url
from reliable_amqp._core.state import State
from reliable_amqp._core.stats import Stats
from reliable_amqp._core.supervisor import Supervisor
from reliable_amqp._core.topology import TopologyOp, bind_op, exchange_op, queue_op
from reliable_amqp._core.window import Window

D = TypeVar("D")  # declare_exchange/bind_queue: None, or an awaitable of None
Q = TypeVar("Q")  # declare_queue: the queue name, or an awaitable of it
M = TypeVar("M")  # a publisher's in-flight type, which its builder makes
F = TypeVar("F")  # publish(), publish_message(): the message's future, or an awaitable of it
L = TypeVar("L")  # publish_many(): the messages' futures, or an awaitable of them


class PublisherSurface(Generic[D, Q, F, L]):
    """Declarations, statistics and state, for both publishers."""

    options: PublisherOptions
    _supervisor: Supervisor[Any]
    _window: Window
    _builder: MessageBuilder[Any]

    def _declare(self, op: TopologyOp, timeout: float | None) -> Any:
        raise NotImplementedError

    def _publish(self, entry: Any) -> F:
        """Send one message its builder made (a coroutine function on the AsyncPublisher)."""
        raise NotImplementedError

    def _publish_many(self, entries: list[Any]) -> L:
        """Send the messages of one ``publish_many()`` call, in order."""
        raise NotImplementedError

    def _init_builder(
        self, new: Callable[[str, str, bytes, MessageProperties, bool, str], M]
    ) -> MessageBuilder[M]:
        """The publisher's message builder (call once, in its ``__init__``): messages made by
        ``new`` from checked parts, the header size checked against the broker's
        ``frame_max`` once connected, ``user_id`` against the user connecting."""
        options = self.options
        return MessageBuilder(
            new,
            mandatory=options.mandatory,
            limits=self._supervisor,
            users={options.login(url)[0] for url in options.urls},
            dedup_header=options.dedup_header,
        )

    def publish(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        *,
        mandatory: bool | None = None,
        **properties: Any,
    ) -> F:
        """Send a message; its future (``await`` the call on the AsyncPublisher, whose futures
        are asyncio ones). This waits only while the in-flight window is full.

        The future's result is a :class:`Confirmation`, or it raises the :class:`PublishError`
        subclass that says what became of the message. Keyword properties are AMQP basic
        properties (``headers``, ``message_id``, ``content_type``, ``correlation_id``,
        ``expiration``, ``priority``, ...); ``delivery_mode`` defaults to 2 (persistent) and a
        ``message_id`` is generated when none is given. Raises :class:`InvalidMessage` naming
        the field for a message AMQP cannot carry (before anything is sent), and
        :class:`PublishTimeout` when no room frees up within ``publish_timeout``. Cancelling the
        future only means the caller stopped caring: the message stays tracked until the broker
        settles it.
        """
        return self._publish(
            self._builder.message(exchange, routing_key, body, mandatory, properties)
        )

    def publish_many(
        self,
        exchange: str,
        routing_key: str,
        bodies: Iterable[bytes],
        *,
        mandatory: bool | None = None,
        message_ids: Iterable[str] | None = None,
        **properties: Any,
    ) -> L:
        """Send many messages to one route with the same properties; one future per body
        (``await`` the call on the AsyncPublisher).

        Each message is as if published alone by :meth:`publish` (its own generated
        ``message_id``, or the one ``message_ids`` gives it, one per body; its own outcome and
        retries), in the order of ``bodies``; the shared arguments are checked once, and the
        whole call takes the window and wakes the writer once. The ``message_id`` keyword
        cannot be given (each message has its own: use ``message_ids``). Raises
        :class:`InvalidMessage` (naming ``bodies[i]`` or ``message_ids[i]`` for a bad one)
        before sending any.

        Waits only as :meth:`publish` does, while the window is full; when the window stays full
        for ``publish_timeout``, :class:`PublishTimeout` is raised if no message of the call was
        taken yet, else the futures of the messages left over fail with it.
        """
        return self._publish_many(
            self._builder.messages(
                exchange, routing_key, bodies, mandatory, properties, message_ids
            )
        )

    def publish_message(self, message: OutgoingMessage) -> F:
        """Send a message made beforehand: an :class:`OutgoingMessage` built by hand, or the
        one a :class:`PublishError` carries (``exc.message``) to try it again; its future
        (``await`` it on the AsyncPublisher).

        As ``publish()`` with the message's fields, its ``message_id`` kept (consumers that
        drop duplicates recognise a second copy); checked as ``publish()`` checks its
        arguments (:class:`InvalidMessage` for what cannot be sent).
        """
        return self._publish(self._builder.from_message(message))

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
        return self._supervisor.stats()

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
