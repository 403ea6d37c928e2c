"""A confirm-mode aiormq channel whose confirms, returns and close go straight to the publisher.

aiormq's ``Channel.basic_publish`` takes a lock, creates a future and an entry in its own
confirmation map per message, and aio-pika adds a ``Message`` object and an awaited socket drain
per message on top. The publisher keeps its own bookkeeping (the engine), so it needs none of
that: it writes marshalled ``basic.publish`` frames to the connection's write queue itself and
takes ``basic.ack``/``basic.nack``/``basic.return``/``channel.close`` from this channel's reader
through the :class:`FrameSink` it names. Everything else (opening, confirm.select, the close
handshake, frames on other channels) stays aiormq's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, Protocol, cast

import aiormq
import aiormq.abc
import aiormq.exceptions
from pamqp import commands as spec
from pamqp.header import ContentHeader

from reliable_amqp._core.errors import (
    AmqpConnectionError,
    AuthenticationFailed,
    ReliableAmqpError,
    broker_error,
)

#: frames the connection reader may queue for the channel before it waits for the channel reader
_FRAME_BUFFER = 256


class FrameSink(Protocol):
    """Where a :class:`ConfirmChannel` delivers what the broker says about publishes."""

    def on_confirm(self, generation: int, ack: bool, tag: int, multiple: bool) -> None:
        """``basic.ack`` (``ack=True``) or ``basic.nack`` on the channel of ``generation``."""

    def on_return(self, headers: Mapping[str, Any] | None, reply_code: int, text: str) -> None:
        """``basic.return`` of a message with these headers."""


class ConfirmChannel(aiormq.Channel):
    """An aiormq channel in confirm mode that reports to a :class:`FrameSink`.

    Only the three frame hooks of aiormq's channel reader are overridden; aiormq's own
    confirmation map stays empty because nothing is published through ``basic_publish``.
    """

    sink: FrameSink
    #: the engine's channel generation this channel was opened for
    generation: int
    #: ``(reply_code, reply_text)`` of the broker's ``channel.close``, if it sent one
    close_reply: tuple[int, str] | None

    async def _on_confirm_frame(self, frame: aiormq.abc.ConfirmationFrameType) -> None:
        if not isinstance(frame, (spec.Basic.Ack, spec.Basic.Nack)):
            return  # basic.reject never answers a publish
        self.sink.on_confirm(
            self.generation,
            isinstance(frame, spec.Basic.Ack),
            int(frame.delivery_tag or 0),
            bool(frame.multiple),
        )

    async def _on_return_frame(self, frame: spec.Basic.Return) -> None:
        header = await self._get_frame()
        if not isinstance(header, ContentHeader):
            raise ValueError(f"expected a content header after basic.return, got {header!r}")
        # The body frames must be taken off the queue even though only the headers matter.
        await self._read_content(frame, header)
        headers = header.properties.headers
        self.sink.on_return(headers, int(frame.reply_code or 0), frame.reply_text or "")

    async def _on_close_frame(self, frame: spec.Channel.Close) -> None:
        # Recorded before aiormq queues close-ok: from then on the writer must not touch the
        # channel number, which the broker frees on close-ok.
        self.close_reply = (int(frame.reply_code or 0), frame.reply_text or "")
        await super()._on_close_frame(frame)

    @property
    def writable(self) -> bool:
        """True while frames written to this channel reach an open channel on the broker."""
        return self.close_reply is None and not self.is_closed


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
    if type(channel) is not aiormq.Channel:
        await channel.close()
        raise TypeError(f"expected an aiormq.Channel, got {type(channel).__name__}")
    # aiormq's connection constructs its channels itself and offers no factory hook, so the
    # channel becomes a ConfirmChannel after the fact. That is safe here: the overridden hooks
    # only handle frames that answer publishes, and nothing has been published on it yet.
    adopted = cast(ConfirmChannel, channel)
    adopted.sink = sink
    adopted.generation = generation
    adopted.close_reply = None
    channel.__class__ = ConfirmChannel
    return adopted


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


def translate_connection_error(error: BaseException) -> ReliableAmqpError:
    """An aiormq/aio-pika connection failure as one of ours; credentials are not retriable."""
    if isinstance(error, ReliableAmqpError):
        return error
    result: ReliableAmqpError
    if isinstance(
        error,
        (aiormq.exceptions.ProbableAuthenticationError, aiormq.exceptions.AuthenticationError),
    ):
        result = AuthenticationFailed(f"the broker refused the credentials: {_text(error)}")
    elif isinstance(error, aiormq.exceptions.ConnectionNotAllowed) or (
        # aiormq reports a connection.close in answer to connection.open (a missing vhost, no
        # permission on it) as an unexpected frame rather than as the close it is.
        isinstance(error, aiormq.exceptions.InvalidFrameError) and "Connection.OpenOk" in str(error)
    ):
        result = AuthenticationFailed(
            "the broker refused access to the virtual host (missing vhost or no permission)"
        )
    elif (
        isinstance(error, aiormq.exceptions.ConnectionClosed)
        and len(error.args) == 2
        and (error.args[0] in (403, 530))
    ):
        broker = broker_error(int(error.args[0]), str(error.args[1]))
        result = AuthenticationFailed(f"the broker refused the connection: {broker}")
    elif isinstance(error, (asyncio.TimeoutError, TimeoutError)):
        result = AmqpConnectionError("timed out connecting to the broker")
    else:
        result = AmqpConnectionError(f"{type(error).__name__}: {_text(error)}")
    result.__cause__ = error
    return result


def _text(error: BaseException) -> str:
    return str(error.args[0]) if len(error.args) == 1 else str(error)
