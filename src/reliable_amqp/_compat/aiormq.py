"""Every hook of the async publisher into aiormq and aio-pika internals, probed at import.

The publisher goes beneath aio-pika: it keeps its own bookkeeping (the engine), so it writes
marshalled ``basic.publish`` frames to the aiormq connection's write queue itself and takes
``basic.ack``/``basic.nack``/``basic.return`` off its channel before aiormq's channel reader
sees them. Everything else (opening, confirm.select, the close handshake, frames on other
channels) stays aiormq's.

How confirms are taken: aiormq's connection reader hands each channel its frames with
``channel.frames.put((weight, frame))`` (aiormq 6.8 to 7.x alike). :func:`open_confirm_channel`
taps ``put``/``put_nowait`` of that one queue object, so confirms and returns are handled as
the connection reads them and never reach the channel reader. An earlier version instead
swapped the channel's ``__class__`` to override ``_on_confirm_frame`` and friends; that works
on aiormq 7, whose reader looks the hooks up on every frame, but not on aiormq 6, whose reader
binds them into a dict when it starts, during ``channel.open()``: every ack then went to aiormq's
own hook ("Unexpected confirmation frame") and every publish waited for its deadline.

What this module relies on, and checks when it is imported:

- ``aiormq.abc.AbstractChannel.frames`` (the channel's ``asyncio.Queue``), fed by the
  connection reader through ``put``/``put_nowait`` with ``(weight, frame)`` items;
- ``aiormq.Connection.write_queue`` (an ``asyncio.Queue`` the connection's writer drains),
  ``aiormq.abc.ChannelFrame(payload, should_close, drain_future)`` and
  ``Connection.connection_tune.frame_max``;
- aio-pika's ``Connection.transport.connection`` (the aiormq connection underneath) and its
  ``close_called`` (``_close_called`` before aio-pika 9.5);
- pamqp's ``Basic.Ack``/``Nack``/``Return``, ``Channel.Close``, ``ContentHeader``, ``ContentBody``;
- the liveness check: ``Connection.__last_frame_time`` (name-mangled; aiormq stamps it with the
  loop's time on every frame it reads) and ``Connection._reader_task``, which aiormq's own
  heartbeat watchdog cancels to drop a stuck link (:func:`drop_silent` does the same, sooner).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import aio_pika
import aio_pika.abc
import aiormq
import aiormq.abc
import aiormq.exceptions
from pamqp import commands as spec
from pamqp.body import ContentBody
from pamqp.header import ContentHeader

from reliable_amqp._compat import (
    IncompatibleDependency,
    require_attributes,
    require_coroutine_functions,
    scrub_credentials,
)
from reliable_amqp._compat.waits import wait_for
from reliable_amqp._core.errors import (
    AmqpConnectionError,
    ReliableAmqpError,
    connection_failure,
)

__all__ = [
    "ConfirmChannel",
    "FrameSink",
    "close_called",
    "close_connection",
    "close_reason",
    "drop_silent",
    "frame_max",
    "last_frame_time",
    "negotiated_heartbeat",
    "open_confirm_channel",
    "probe",
    "translate_connection_error",
    "underlying_connection",
    "wait_writable",
    "write_payload",
]

log = logging.getLogger("reliable_amqp")

#: frames the connection reader may queue for the channel before it waits for the channel reader
#: (only rpc replies and channel.close pass the tap, so the queue stays nearly empty)
_FRAME_BUFFER = 256


# aiormq's Connection keeps "not blocked" in a name-mangled asyncio.Event: its reader clears it on
# connection.blocked and sets it on connection.unblocked (and when a connection starts); its
# writer waits on it. There is no callback, so the event is replaced by one that reports changes.
_UNBLOCKED_EVENT = "_Connection__connection_unblocked"
_BLOCKED_HANDLER = "_Connection__handle_connection_blocked"
_UNBLOCKED_HANDLER = "_Connection__handle_connection_unblocked"
# The liveness check: when aiormq last read a frame, and the task whose cancellation drops the link
# (what aiormq's heartbeat watchdog, ``__heartbeat``, does with a stuck one).
_LAST_FRAME_TIME = "_Connection__last_frame_time"
_HEARTBEAT_WATCHDOG = "_Connection__heartbeat"


def probe(aiormq_module: Any = aiormq, aio_pika_module: Any = aio_pika) -> None:
    """Check that aiormq, aio-pika and pamqp have what this module relies on.

    Raises :class:`IncompatibleDependency` naming the package, its installed version and the
    supported range. Run at import; the arguments let tests probe stand-in modules.
    """
    abc = aiormq_module.abc
    require_attributes("aiormq", abc.AbstractChannel, ["frames"], "its AbstractChannel")
    require_attributes(
        "aiormq",
        aiormq_module.Connection,
        ["channel", "write_queue", "connection_tune"],
        "its Connection",
    )
    require_coroutine_functions("aiormq", aiormq_module.Connection, ["channel"], "its Connection")
    # connection.blocked: aiormq pauses its writer on this event and offers no callback.
    require_coroutine_functions(
        "aiormq",
        aiormq_module.Connection,
        [_BLOCKED_HANDLER, _UNBLOCKED_HANDLER],
        "its Connection",
    )
    for method, name in ((aiormq_module.Connection.__init__, _LAST_FRAME_TIME),
                         (getattr(aiormq_module.Connection, _HEARTBEAT_WATCHDOG, None),
                          "_reader_task")):  # fmt: skip
        code = getattr(method, "__code__", None)
        if code is None or name not in code.co_names:
            raise IncompatibleDependency(
                "aiormq", f"its Connection no longer keeps {name} (the liveness check reads it)"
            )
    frame_type = getattr(abc, "ChannelFrame", None)
    fields = (
        {field.name for field in dataclasses.fields(frame_type)}
        if frame_type is not None and dataclasses.is_dataclass(frame_type)
        else set()
    )
    missing = {"payload", "should_close", "drain_future"} - fields
    if missing:
        raise IncompatibleDependency(
            "aiormq", f"its abc.ChannelFrame has no field {', '.join(sorted(missing))}"
        )
    require_attributes("aio-pika", aio_pika_module.Connection, ["transport"], "its Connection")
    require_attributes(
        "aio-pika", aio_pika_module.abc.UnderlayConnection, ["connection"], "its UnderlayConnection"
    )
    for command, names in (
        (spec.Basic.Ack, ["delivery_tag", "multiple"]),
        (spec.Basic.Nack, ["delivery_tag", "multiple"]),
        (spec.Basic.Return, ["reply_code", "reply_text", "exchange", "routing_key"]),
        (spec.Channel.Close, ["reply_code", "reply_text"]),
    ):
        require_attributes("pamqp", command, names, f"its {command.__name__}")
    require_attributes("pamqp", ContentHeader(), ["body_size", "properties"], "its ContentHeader")
    require_attributes(
        "pamqp", spec.Basic.Properties(), ["headers", "message_id"], "its Basic.Properties"
    )
    require_attributes("pamqp", ContentBody(b""), ["value"], "its ContentBody")


probe()


class FrameSink(Protocol):
    """Where a :class:`ConfirmChannel` delivers what the broker says about publishes."""

    def on_confirm(self, generation: int, ack: bool, tag: int, multiple: bool) -> None:
        """``basic.ack`` (``ack=True``) or ``basic.nack`` on the channel of ``generation``."""

    def on_return(
        self,
        headers: Mapping[str, Any] | None,
        reply_code: int,
        text: str,
        returned: tuple[str | None, str, str, bytes],
        generation: int,
    ) -> None:
        """``basic.return`` of a message with these headers and (message_id, exchange,
        routing key, body), on the channel of ``generation``."""


class ConfirmChannel:
    """An aiormq channel in confirm mode whose confirms and returns go to a :class:`FrameSink`.

    Made by :func:`open_confirm_channel`. aiormq's confirmation map stays empty because nothing
    is published through ``basic_publish``; ``channel`` is the aiormq channel itself.
    """

    def __init__(self, channel: aiormq.abc.AbstractChannel, sink: FrameSink, generation: int):
        self.channel = channel
        self.sink = sink
        #: the engine's channel generation this channel was opened for
        self.generation = generation
        #: ``(reply_code, reply_text)`` of the broker's ``channel.close``, if it sent one
        self.close_reply: tuple[int, str] | None = None
        #: a basic.return whose content frames are still arriving: (frame, header or None, left)
        #: the body's frames so far (a return is matched by what it carries, body included)
        self._returning: tuple[spec.Basic.Return, ContentHeader | None, int, list[bytes]] | None = (
            None
        )

    @property
    def connection(self) -> aiormq.abc.AbstractConnection:
        """The aiormq connection the channel is on."""
        return self.channel.connection

    @property
    def number(self) -> int:
        """The channel number frames for this channel carry."""
        return int(self.channel.number)

    @property
    def closing(self) -> asyncio.Future[Any]:
        """aiormq's future that completes when the channel closes."""
        return self.channel.closing

    @property
    def is_closed(self) -> bool:
        """True once aiormq considers the channel closed."""
        return bool(self.channel.is_closed)

    @property
    def writable(self) -> bool:
        """True while frames written to this channel reach an open channel on the broker."""
        return self.close_reply is None and not self.channel.is_closed

    async def close(self) -> None:
        """Close the channel (aiormq's close handshake)."""
        await self.channel.close()

    # --- the tap on the channel's frame queue ------------------------------------------------

    def _consume(self, item: Any) -> bool:
        """Handle one frame the connection hands the channel; True when aiormq must not see it.

        Called twice for a frame that passes (``Queue.put`` ends in ``put_nowait``, both are
        tapped), so everything done for a frame that passes must be idempotent.
        """
        frame = item[1] if type(item) is tuple and len(item) == 2 else item
        try:
            if self._returning is not None and self._return_content(frame):
                return True
            if isinstance(frame, (spec.Basic.Ack, spec.Basic.Nack)):
                self.sink.on_confirm(
                    self.generation,
                    isinstance(frame, spec.Basic.Ack),
                    int(frame.delivery_tag or 0),
                    bool(frame.multiple),
                )
                return True
            if isinstance(frame, spec.Basic.Return):
                self._returning = (frame, None, 0, [])
                return True
            if isinstance(frame, spec.Channel.Close):
                # Recorded as the connection reads it, before aiormq's channel reader queues
                # close-ok: from then on the writer must not touch the channel number, which
                # the broker frees on close-ok.
                self.close_reply = (int(frame.reply_code or 0), frame.reply_text or "")
        except Exception:
            # A bug in the sink must not kill the connection reader (a lent connection carries
            # the caller's channels too): close this channel, whose unconfirmed go out again.
            log.exception("reliable-amqp: handling %r failed; closing the channel", frame)
            self._fail()
            return True
        return False

    def _return_content(self, frame: Any) -> bool:
        """Take the content frames of a basic.return; False for a frame that is not one."""
        assert self._returning is not None
        returned, header, left, chunks = self._returning
        if header is None and isinstance(frame, ContentHeader):
            header, left = frame, int(frame.body_size or 0)
        elif header is not None and isinstance(frame, ContentBody):
            left -= len(frame.value)
            chunks.append(bytes(frame.value))
        else:
            log.error("reliable-amqp: %r arrived inside a returned message; dropped it", frame)
            self._returning = None
            return False
        if left > 0:
            self._returning = (returned, header, left, chunks)
            return True
        self._returning = None
        properties = header.properties
        self.sink.on_return(
            properties.headers if properties is not None else None,
            int(returned.reply_code or 0),
            returned.reply_text or "",
            (
                properties.message_id if properties is not None else None,
                returned.exchange or "",
                returned.routing_key or "",
                b"".join(chunks),
            ),
            self.generation,
        )
        return True

    def _fail(self) -> None:
        if self.close_reply is None:
            self.close_reply = (0, "internal error handling a confirm")
        task = asyncio.ensure_future(self.channel.close())
        _BACKGROUND.add(task)
        task.add_done_callback(_BACKGROUND.discard)

    def _install_tap(self) -> None:
        queue = getattr(self.channel, "frames", None)
        if not isinstance(queue, asyncio.Queue):
            raise IncompatibleDependency("aiormq", "its Channel.frames is not an asyncio.Queue")
        put = queue.put
        put_nowait = queue.put_nowait
        consume = self._consume

        async def tapped_put(item: Any) -> None:
            if not consume(item):
                await put(item)

        def tapped_put_nowait(item: Any) -> None:
            if not consume(item):
                put_nowait(item)

        # Instance attributes shadow Queue's methods for this one queue object. The channel
        # reader is already waiting in get() on it, so replacing the queue would strand it.
        queue.put = tapped_put  # type: ignore[method-assign]
        queue.put_nowait = tapped_put_nowait  # type: ignore[method-assign]


#: closes started from the connection reader, kept referenced until they finish
_BACKGROUND: set[asyncio.Task[Any]] = set()


async def open_confirm_channel(
    connection: aiormq.abc.AbstractConnection,
    sink: FrameSink,
    generation: int,
    timeout: float,
) -> ConfirmChannel:
    """Open a channel in confirm mode on ``connection`` that reports to ``sink``."""
    channel = await connection.channel(
        publisher_confirms=True, frame_buffer_size=_FRAME_BUFFER, timeout=timeout
    )
    confirm = ConfirmChannel(channel, sink, generation)
    try:
        # No await since channel() returned: no frame for this channel was read in between,
        # and nothing was published on it yet, so no confirm can have gone past the tap.
        confirm._install_tap()
    except BaseException:
        await channel.close()
        raise
    return confirm


def close_reason(channel: ConfirmChannel) -> tuple[int | None, str]:
    """Why ``channel`` closed: the broker's reply when it sent one, else (None, the error)."""
    if channel.close_reply is not None:
        return channel.close_reply
    error = _closing_exception(channel)
    if isinstance(error, aiormq.exceptions.ChannelClosed) and len(error.args) == 2:
        code, text = error.args
        if isinstance(code, int):
            return code, str(text)
    return None, repr(error) if error is not None else "channel closed"


def _closing_exception(channel: ConfirmChannel) -> BaseException | None:
    closing = channel.closing
    if not closing.done() or closing.cancelled():
        return None
    return closing.exception()


# --- the write queue --------------------------------------------------------------------------


async def wait_writable(connection: aiormq.abc.AbstractConnection) -> None:
    """Return once ``connection``'s write queue has room for one :func:`write_payload`.

    Call :func:`write_payload` with no ``await`` in between, and the room is still there.
    """
    queue = connection.write_queue
    while queue.full():  # shared with heartbeats and other channels: full only under their load
        # aiormq has no "room in the write queue" signal, and the writer must not hold a
        # marshalled batch while it waits (the channel may close meanwhile). So queue an empty
        # frame with the queue's own waiting put() and wait for its drain: by then the
        # connection's writer has written everything ahead of it. Writing b"" is a no-op.
        marker = asyncio.get_running_loop().create_future()
        await queue.put(
            aiormq.abc.ChannelFrame(payload=b"", should_close=False, drain_future=marker)
        )
        await marker


def write_payload(
    connection: aiormq.abc.AbstractConnection, payload: bytes
) -> asyncio.Future[None]:
    """Put ``payload`` (whole frames) on ``connection``'s write queue; the future is its drain.

    The future completes when the socket has taken the payload (the backpressure); it never
    completes if the connection dies first, so wait on it together with the channel's closing.
    Raises ``asyncio.QueueFull`` unless :func:`wait_writable` just returned.
    """
    drained: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    connection.write_queue.put_nowait(
        aiormq.abc.ChannelFrame(payload=payload, should_close=False, drain_future=drained)
    )
    return drained


class _WatchedEvent(asyncio.Event):
    """An ``asyncio.Event`` that calls each watcher with ``(blocked, reason)`` when cleared or
    set."""

    def __init__(self) -> None:
        super().__init__()
        self.watchers: list[Callable[[bool, str], None]] = []
        #: the reason of the last connection.blocked, where aiormq lets it be seen (7.x)
        self.reason = ""

    def set(self) -> None:
        was = self.is_set()
        super().set()
        if not was:
            self._report(False)

    def clear(self) -> None:
        was = self.is_set()
        super().clear()
        if was:
            self._report(True)

    def _report(self, blocked: bool) -> None:
        for watcher in list(self.watchers):
            try:
                watcher(blocked, self.reason or "connection.blocked (a resource alarm)")
            except Exception:  # aiormq's reader must go on whatever a watcher does
                log.exception("reliable-amqp: connection.blocked watcher failed")


def watch_blocked(
    connection: aiormq.abc.AbstractConnection, on_change: Callable[[bool, str], None]
) -> Callable[[], None] | None:
    """Call ``on_change(True, reason)`` on ``connection.blocked``, ``on_change(False, ...)`` on
    ``connection.unblocked``. Returns the function that stops watching, or None when this
    connection cannot be watched (not an aiormq Connection).

    The broker's reason is seen on aiormq 7, whose reader looks its handler up on the instance;
    aiormq 6 binds its handlers when the connection starts, so there the reason is generic.
    """
    current = getattr(connection, _UNBLOCKED_EVENT, None)
    if not isinstance(current, asyncio.Event):
        return None
    if isinstance(current, _WatchedEvent):
        watched = current
    else:
        watched = _WatchedEvent()
        if current.is_set():
            asyncio.Event.set(watched)  # the same state, without reporting a change
        setattr(connection, _UNBLOCKED_EVENT, watched)
        handler = getattr(connection, _BLOCKED_HANDLER)

        async def blocked_with_reason(frame: Any) -> None:
            watched.reason = str(getattr(frame, "reason", "") or "")
            await handler(frame)

        setattr(connection, _BLOCKED_HANDLER, blocked_with_reason)
        # Someone may wait on the old event already (aiormq's writer, while blocked): release
        # it when the new one is set; it then waits on the watched one.
        if not current.is_set():
            waiter = asyncio.ensure_future(watched.wait())
            waiter.add_done_callback(lambda _: current.set())
    watched.watchers.append(on_change)

    def unwatch() -> None:
        if on_change in watched.watchers:
            watched.watchers.remove(on_change)

    return unwatch


# aiormq raises a class per connection.close code and keeps only the reply text in it.
_CONNECTION_CLOSE_CODES: dict[type[BaseException], int] = {
    aiormq.exceptions.ConnectionFrameError: 501,
    aiormq.exceptions.ConnectionSyntaxError: 502,
    aiormq.exceptions.ConnectionCommandInvalid: 503,
    aiormq.exceptions.ConnectionChannelError: 504,
    aiormq.exceptions.ConnectionUnexpectedFrame: 505,
    aiormq.exceptions.ConnectionResourceError: 506,
    aiormq.exceptions.ConnectionNotAllowed: 530,
    aiormq.exceptions.ConnectionNotImplemented: 540,
    aiormq.exceptions.ConnectionInternalError: 541,
}


def connection_close_reply(connection: aiormq.abc.AbstractConnection) -> tuple[int, str] | None:
    """The broker's ``connection.close`` (code, text) that ended ``connection``, if it sent one."""
    closing = connection.closing
    if not closing.done() or closing.cancelled():
        return None
    error = closing.exception()
    if not isinstance(error, aiormq.exceptions.ConnectionClosed):
        return None
    code = _CONNECTION_CLOSE_CODES.get(type(error))
    if code is not None:
        return code, str(error.args[0]) if error.args else ""
    if len(error.args) == 2 and isinstance(error.args[0], int):
        return error.args[0], str(error.args[1])
    return None


def frame_max(connection: aiormq.abc.AbstractConnection) -> int:
    """The largest frame the broker accepts on ``connection`` (0: no limit was negotiated)."""
    return int(connection.connection_tune.frame_max or 0)


def negotiated_heartbeat(connection: aiormq.abc.AbstractConnection) -> int:
    """The heartbeat interval negotiated on ``connection`` (0: none)."""
    return int(connection.connection_tune.heartbeat or 0)


def last_frame_time(connection: aiormq.abc.AbstractConnection) -> float:
    """When aiormq last read a frame on ``connection`` (its loop's clock): it changes whenever
    the broker sends anything, heartbeats included."""
    return float(getattr(connection, _LAST_FRAME_TIME))


def drop_silent(connection: aiormq.abc.AbstractConnection) -> None:
    """Take down a connection whose broker went silent, as aiormq's own heartbeat watchdog does:
    cancel its reader; the writer then closes the socket without waiting for a close-ok."""
    reader: asyncio.Task[Any] | None = getattr(connection, "_reader_task", None)
    if reader is not None:
        reader.cancel()


# --- aio-pika ---------------------------------------------------------------------------------


def underlying_connection(
    connection: aio_pika.abc.AbstractConnection,
) -> aiormq.abc.AbstractConnection | None:
    """The aiormq connection under an aio-pika one, or None while it has no transport."""
    transport = connection.transport
    return None if transport is None else transport.connection


async def close_connection(connection: aio_pika.abc.AbstractConnection, timeout: float) -> None:
    """Close an aio-pika connection this library opened, within ``timeout`` seconds each step.

    Raises what closing raised, ``asyncio.TimeoutError`` included.
    """
    # aiormq's connection first: its close lets a cancellation through. aio-pika's close (9.x
    # and 10.x), cancelled while it waits for aiormq, then waits in a ``finally`` for its close
    # callback's task; when ``asyncio.run`` cancels that task before it ran (the loop ending
    # under a closing publisher), that wait never ends and neither does the loop. With aiormq
    # closed, aio-pika's close only runs its callback, and a cancellation lands in that wait.
    underlying = underlying_connection(connection)
    if underlying is not None:
        await wait_for(underlying.close(), timeout)
    await wait_for(connection.close(), timeout)


def close_called(connection: aio_pika.abc.AbstractConnection) -> bool:
    """True once ``close()`` was called on the aio-pika connection."""
    # A public property from aio-pika 9.5 on; 9.4 has only the attribute behind it.
    called = getattr(connection, "close_called", None)
    if called is None:
        called = getattr(connection, "_close_called", False)
    return bool(called)


# --- errors -----------------------------------------------------------------------------------


def translate_connection_error(
    error: BaseException, login: tuple[str, str] | None = None
) -> ReliableAmqpError:
    """An aiormq/aio-pika connection failure as one of ours (see ``connection_failure``);
    ``login`` (user name, virtual host) is named when the broker refused it."""
    if isinstance(error, ReliableAmqpError):
        return error
    from reliable_amqp._tls import tls_failure  # a certificate, host name or handshake failure

    result: AmqpConnectionError
    close = next((arg for arg in error.args if isinstance(arg, spec.Connection.Close)), None)
    tls = tls_failure(error)
    if tls is not None:
        result = connection_failure("tls", tls)
    elif close is not None and "Connection.OpenOk" in str(error):
        # The broker answered connection.open (which names the vhost) with connection.close: a
        # missing vhost or no permission on it. aiormq 7 raises that as an InvalidFrameError,
        # aiormq 6 as pamqp's AMQPInternalError; both carry the frame and the expected reply.
        result = connection_failure("vhost", _text(error), login=login)
    elif close is not None:
        reply_text = scrub_credentials(str(close.reply_text or ""))
        code = int(close.reply_code or 0)
        result = connection_failure("closed", _text(error), code, reply_text, login=login)
    elif isinstance(
        error,
        (aiormq.exceptions.ProbableAuthenticationError, aiormq.exceptions.AuthenticationError),
    ):
        result = connection_failure("credentials", _text(error), login=login)
    elif isinstance(error, aiormq.exceptions.ConnectionNotAllowed) or (
        # aiormq reports a connection.close in answer to connection.open (a missing vhost, no
        # permission on it) as an unexpected frame rather than as the close it is.
        isinstance(error, aiormq.exceptions.InvalidFrameError) and "Connection.OpenOk" in str(error)
    ):
        result = connection_failure("vhost", _text(error), login=login)
    elif (
        isinstance(error, aiormq.exceptions.ConnectionClosed)
        and len(error.args) == 2
        and isinstance(error.args[0], int)
    ):
        code, text = error.args
        result = connection_failure(
            "closed", _text(error), code, scrub_credentials(str(text)), login=login
        )
    elif isinstance(error, (asyncio.TimeoutError, TimeoutError)):
        result = connection_failure("timeout", f"{type(error).__name__}: {_text(error)}")
    else:
        result = connection_failure("lost", f"{type(error).__name__}: {_text(error)}")
    result.__cause__ = error
    return result


def _text(error: BaseException) -> str:
    # aiormq and aio-pika put the connection's repr, a URL, in some messages: never its password.
    return scrub_credentials(str(error.args[0]) if len(error.args) == 1 else str(error))
