"""pika specifics of the sync publisher: the connection class, properties, error translation."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pika
import pika.exceptions
from pika.adapters.select_connection import SelectConnection

from reliable_amqp._core.errors import (
    AmqpConnectionError,
    AuthenticationFailed,
    ConfigurationError,
    ReliableAmqpError,
    broker_error,
)
from reliable_amqp._core.options import PublisherOptions, redact_url

log = logging.getLogger("reliable_amqp")


class CoalescingConnection(SelectConnection):  # type: ignore[misc]
    """A SelectConnection that can gather the frames of many publishes into one write.

    pika hands every frame to the socket separately (three ``send()`` calls per message); between
    :meth:`begin_gather` and :meth:`emit_gathered`, frames collect here and go out as one buffer.
    ``_adapter_emit_data`` is pika's designated override point for where frames go.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._gather = False
        self._gathered: list[bytes | memoryview] = []
        super().__init__(*args, **kwargs)

    def _adapter_emit_data(self, data: bytes) -> None:
        if self._gather:
            self._gathered.append(data)
        else:
            super()._adapter_emit_data(data)

    def begin_gather(self) -> list[bytes | memoryview]:
        """Start gathering; frames appended to the returned list go out on emit_gathered()."""
        self._gather = True
        return self._gathered

    def emit_gathered(self) -> None:
        """Write what was gathered as one buffer and stop gathering."""
        self._gather = False
        if self._gathered:
            data = b"".join(self._gathered)
            self._gathered.clear()
            # As a memoryview: when the socket takes part of a buffer, pika requeues the rest as
            # ``chunk[sent:]``, which copies a bytes object (a batch of 1 KiB messages is ~2 MiB,
            # sent in several parts: quadratic copying) but only slices a view.
            super()._adapter_emit_data(memoryview(data))


def connection_parameters(url: str, options: PublisherOptions) -> pika.URLParameters:
    """pika parameters for one URL: one attempt each (our policy retries), our timeouts."""
    try:
        params = pika.URLParameters(url)
    except Exception as exc:  # pika raises ValueError, TypeError, KeyError on bad URLs
        raise ConfigurationError(
            f"malformed broker URL {redact_url(url)}: {type(exc).__name__}"
        ) from None
    if "heartbeat" not in url:
        params.heartbeat = options.heartbeat
    params.connection_attempts = 1
    params.retry_delay = 0
    params.socket_timeout = options.connect_timeout
    params.stack_timeout = options.connect_timeout
    params.blocked_connection_timeout = options.blocked_timeout
    params.client_properties = {
        "connection_name": options.connection_name or "reliable-amqp",
        "product": "reliable-amqp",
    }
    return params


def translate_connection_error(error: Any) -> ReliableAmqpError:
    """A pika connection failure as one of ours (credentials and vhosts are not retriable)."""
    if isinstance(error, ReliableAmqpError):
        return error
    if isinstance(
        error,
        (pika.exceptions.ProbableAuthenticationError, pika.exceptions.AuthenticationError),
    ):
        result: ReliableAmqpError = AuthenticationFailed(
            "the broker refused the credentials (wrong user or password)"
        )
    elif isinstance(error, pika.exceptions.ProbableAccessDeniedError):
        result = AuthenticationFailed(
            "the broker refused access to the virtual host (missing vhost or no permission)"
        )
    elif isinstance(error, pika.exceptions.ConnectionClosed) and error.reply_code in (403, 530):
        broker = broker_error(error.reply_code, error.reply_text)
        result = AuthenticationFailed(f"the broker refused the connection: {broker}")
    else:
        result = AmqpConnectionError(f"{type(error).__name__}: {error!r}")
    if isinstance(error, BaseException):
        result.__cause__ = error
    return result


def call_threadsafe(loop: Any, callback: Callable[[], None]) -> None:
    try:
        loop.add_callback_threadsafe(callback)
    except Exception:  # the loop closed under us; the next connection drains the outbox
        log.debug("reliable-amqp: wake-up lost with a closed I/O loop", exc_info=True)
