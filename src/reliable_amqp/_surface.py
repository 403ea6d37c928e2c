"""The public methods both publishers share word for word, written once.

``Publisher`` and ``AsyncPublisher`` differ in how they wait (threads or asyncio), not in what
they offer: topology declarations, ``stats()``, ``in_flight``, ``state`` and the repr are the same
for both. Each publisher supplies ``_declare`` (which returns the declared name, or an awaitable
of it), a supervisor and a window; this class holds no state of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

from reliable_amqp._core.errors import InvalidMessage
from reliable_amqp._core.frames import encode_table, header_frame_size, header_too_large
from reliable_amqp._core.message import (
    DEFAULT_BASE,
    MessageProperties,
    OutgoingMessage,
    build_base,
    check_body,
    check_mandatory,
    check_message_id,
    check_route,
    new_message_id,
    new_message_ids,
)
from reliable_amqp._core.options import PublisherOptions, redact_url
from reliable_amqp._core.state import State
from reliable_amqp._core.stats import Stats
from reliable_amqp._core.supervisor import Supervisor
from reliable_amqp._core.topology import TopologyOp, bind_op, exchange_op, queue_op
from reliable_amqp._core.tracker import new_entry
from reliable_amqp._core.window import Window

#: what the properties other than headers can take in a content-header frame, at most (12
#: shortstrs, a timestamp, two octets, flags, the frame's own bytes): below that, no check
_OTHER_PROPERTIES_MAX = 4096
#: the attempt header the engine adds to a mandatory message, at most
_ENGINE_HEADERS_MAX = 96
#: routes and property sets remembered as checked, per publisher (then forgotten at once)
_CACHE_MAX = 1024


def _ids(given: Iterable[str], count: int) -> list[str]:
    """The caller's ``message_ids`` for ``count`` bodies, every one checked."""
    if isinstance(given, (str, bytes)):
        raise InvalidMessage(
            "message_ids", f"must be an iterable of ids, not one {type(given).__name__}"
        )
    try:
        ids = list(given)
    except TypeError:
        raise InvalidMessage(
            "message_ids", f"must be an iterable of ids, not {type(given).__name__}"
        ) from None
    if len(ids) != count:
        raise InvalidMessage("message_ids", f"has {len(ids)} ids for {count} bodies: give one each")
    for i, message_id in enumerate(ids):
        if message_id is None:
            raise InvalidMessage(f"message_ids[{i}]", "is None: give every message its id")
        try:
            check_message_id(message_id)
        except InvalidMessage as exc:
            raise InvalidMessage(f"message_ids[{i}]", exc.problem) from None
    return ids


def _id_length(message: OutgoingMessage) -> int:
    return len(message.message_id.encode("utf-8"))


D = TypeVar("D")  # declare_exchange/bind_queue: None, or an awaitable of None
Q = TypeVar("Q")  # declare_queue: the queue name, or an awaitable of it


class PublisherSurface(Generic[D, Q]):
    """Declarations, statistics and state, for both publishers."""

    options: PublisherOptions
    _supervisor: Supervisor[Any]
    _window: Window

    def _declare(self, op: TopologyOp, timeout: float | None) -> Any:
        raise NotImplementedError

    def _init_checks(self) -> None:
        """The caches of :meth:`_message` (call once, in the publisher's ``__init__``)."""
        #: routes (exchange, routing key) already checked
        self._routes: set[tuple[str, str]] = set()
        #: checked properties (their message_id aside) by the keywords that gave them
        self._bases: dict[tuple[tuple[str, Any], ...], MessageProperties] = {}
        #: what ``mandatory=None`` (the default) means: the publisher's ``mandatory`` option
        self._mandatory: bool = self.options.mandatory
        #: builds the message of a publish from checked parts: an engine entry (the sync
        #: publisher's builds its future, which is also the entry)
        self._new_entry: Callable[
            [str, str, bytes, MessageProperties, bool, str], OutgoingMessage
        ] = new_entry

    def _message(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        mandatory: bool | None,
        properties: dict[str, Any],
    ) -> OutgoingMessage:
        """The validated message of a ``publish()`` call (raises :class:`InvalidMessage`).

        Beyond what each field admits: the headers must encode (checked here, not on the I/O
        side mid-batch), the content header must fit the broker's ``frame_max`` once it is known
        (a larger one makes the broker close the whole connection), and ``user_id`` must be the
        user the publisher connects as (the broker closes the channel otherwise).

        ``properties`` is the caller's keywords dict (this call's own: it is consumed).
        """
        if (exchange, routing_key) not in self._routes:
            self._check_route(exchange, routing_key)
        if type(body) is not bytes:
            body = check_body(body)
        if mandatory is None:
            mandatory = self._mandatory
        elif mandatory is not False and mandatory is not True:
            check_mandatory(mandatory)
        if not properties:
            return self._new_entry(
                exchange, routing_key, body, DEFAULT_BASE, mandatory, new_message_id()
            )
        message_id = check_message_id(properties.pop("message_id", None)) or new_message_id()
        base = self._base(properties) if properties else DEFAULT_BASE
        message = self._new_entry(exchange, routing_key, body, base, mandatory, message_id)
        if base.headers and self._supervisor.frame_max:
            self._check_header_size(message)
        return message

    def _messages(  # noqa: PLR0917
        self,
        exchange: str,
        routing_key: str,
        bodies: Iterable[bytes],
        mandatory: bool | None,
        properties: dict[str, Any],
        message_ids: Iterable[str] | None,
    ) -> list[OutgoingMessage]:
        """The validated messages of a ``publish_many()`` call: the shared arguments checked
        once, every body (and every given id) checked before any message is built."""
        if (exchange, routing_key) not in self._routes:
            self._check_route(exchange, routing_key)
        if mandatory is None:
            mandatory = self._mandatory
        elif mandatory is not False and mandatory is not True:
            check_mandatory(mandatory)
        if "message_id" in properties:
            raise InvalidMessage(
                "message_id",
                "publish_many() gives every message its own id: pass message_ids=[...], one "
                "per body, for ids of your own",
            )
        if isinstance(bodies, (bytes, bytearray, memoryview, str)):
            raise InvalidMessage(
                "bodies", f"must be an iterable of bodies, not one {type(bodies).__name__}"
            )
        try:
            data = list(bodies)
        except TypeError:
            raise InvalidMessage(
                "bodies", f"must be an iterable of bodies, not {type(bodies).__name__}"
            ) from None
        for i, body in enumerate(data):
            if type(body) is not bytes:
                try:
                    data[i] = check_body(body)
                except InvalidMessage as exc:
                    raise InvalidMessage(f"bodies[{i}]", exc.problem) from None
        ids = new_message_ids(len(data)) if message_ids is None else _ids(message_ids, len(data))
        base = self._base(properties) if properties else DEFAULT_BASE
        new = self._new_entry
        messages: list[OutgoingMessage] = [
            new(exchange, routing_key, body, base, mandatory, message_id)
            for body, message_id in zip(data, ids, strict=True)
        ]
        if base.headers and self._supervisor.frame_max and messages:
            # the longest id makes the largest header (a generated one: the last)
            longest = messages[-1] if message_ids is None else max(messages, key=_id_length)
            self._check_header_size(longest)
        return messages

    def _check_route(self, exchange: str, routing_key: str) -> None:
        check_route(exchange, routing_key)
        routes = self._routes
        if len(routes) >= _CACHE_MAX:
            routes.clear()
        routes.add((exchange, routing_key))

    def _base(self, given: dict[str, Any]) -> MessageProperties:
        """Checked properties for the keywords ``given`` (no message_id), cached when every
        value is a str or an int (not a bool: it would equal 1 in the key)."""
        key: tuple[tuple[str, Any], ...] | None = None
        for value in given.values():
            kind = type(value)
            if kind is not str and kind is not int and value is not None:
                break
        else:
            key = tuple(given.items())
            base = self._bases.get(key)
            if base is not None:
                return base
        base = build_base(given)
        if base.headers:
            encode_table(base.headers)  # raises InvalidMessage here, not on the I/O side
        if base.user_id is not None:
            self._check_user(base.user_id)
        if key is not None:
            bases = self._bases
            if len(bases) >= _CACHE_MAX:
                bases.clear()
            bases[key] = base
        return base

    def _check_header_size(self, message: OutgoingMessage) -> None:
        frame_max = self._supervisor.frame_max
        table = encode_table(message.base.headers or {})
        if len(table) + _OTHER_PROPERTIES_MAX > frame_max:
            extra = _ENGINE_HEADERS_MAX
            if self.options.dedup_header is not None:
                extra += len(self.options.dedup_header) + len(message.message_id) + 8
            size = header_frame_size(message, extra)
            if size > frame_max:
                raise InvalidMessage("headers", header_too_large(size, frame_max))

    def _check_user(self, user_id: str) -> None:
        users = {self.options.login(url)[0] for url in self.options.urls}
        if user_id not in users:
            raise InvalidMessage(
                "user_id",
                f"{user_id!r} is not the user this publisher connects as "
                f"({', '.join(sorted(map(repr, users)))}); the broker would close the channel",
            )

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
