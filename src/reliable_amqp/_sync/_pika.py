"""pika specifics of the sync publisher: connection parameters and error translation.

The hooks into pika internals (the coalescing connection class, ending a dead stream) are in
:mod:`reliable_amqp._compat.pika`; they are re-exported here under their old names.
"""

from __future__ import annotations

import errno
import logging
import re
import socket
import ssl
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pika
import pika.exceptions
from pika.adapters.utils.connection_workflow import (
    AMQPConnectionWorkflowFailed,
    AMQPConnectorPhaseErrorBase,
    AMQPConnectorStackTimeout,
)

from reliable_amqp._compat import scrub_credentials
from reliable_amqp._compat.pika import CoalescingConnection, terminate_stream
from reliable_amqp._core.errors import (
    BrokerError,
    ConfigurationError,
    ReliableAmqpError,
    connection_failure,
    unreachable,
)
from reliable_amqp._core.options import PublisherOptions, redact_url
from reliable_amqp._core.refusals import refusal
from reliable_amqp._logs import OWNED, install
from reliable_amqp._tls import client_context, tls_failure, uses_tls

__all__ = [
    "CoalescingConnection",
    "call_threadsafe",
    "connection_parameters",
    "terminate_stream",
    "translate_connection_error",
]

log = logging.getLogger("reliable_amqp")

install()  # pika's loggers drop records about the library's own connections (_logs)


def connection_parameters(
    url: str, options: PublisherOptions, context: ssl.SSLContext | None = None
) -> pika.URLParameters:
    """pika parameters for one URL: one attempt each (our policy retries), our timeouts.

    The URL was checked by the options (its only query parameter may be ``heartbeat``, which the
    options took over). An ``amqps://`` URL gets ``context`` (default: the one built from the
    options by :func:`reliable_amqp._tls.client_context`) and verifies ``server_hostname``, else
    the URL's host. ``username``/``password`` options replace the URL's.
    """
    credentials = None
    if options.username is not None or options.password is not None:
        credentials = pika.PlainCredentials(*options.login(url))
        # pika cannot parse a user without a password: the credentials go in separately
        parts = urlsplit(url)
        url = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    try:
        params = pika.URLParameters(url)
    except Exception as exc:  # pika raises ValueError, TypeError, KeyError on bad URLs
        raise ConfigurationError(
            f"malformed broker URL {redact_url(url)}: {type(exc).__name__}"
        ) from None
    params.heartbeat = options.heartbeat  # the URL's ?heartbeat=, if any, is this value
    if uses_tls(url):
        context = context or client_context(options)
        assert context is not None  # an amqps:// URL always has one
        params.ssl_options = pika.SSLOptions(context, options.server_hostname or params.host)
    if credentials is not None:
        params.credentials = credentials
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


def translate_connection_error(error: Any, params: Any = None) -> ReliableAmqpError:
    """A pika connection failure as one of ours (see ``connection_failure``: what is retriable).

    This only sorts pika's exceptions into the kinds ``connection_failure`` knows. ``params``
    (the failed connection's ``pika.ConnectionParameters``) lets the error name the host and
    port (``connection refused at 127.0.0.1:5699``), and the user and virtual host of a
    refused login.
    """
    if isinstance(error, ReliableAmqpError):
        return error
    detail = scrub_credentials(_describe(error))
    result: ReliableAmqpError
    tls = tls_failure(error) if isinstance(error, BaseException) else None
    socket_error = _socket_error(error)
    login = _login(params)
    if tls is not None:
        result = connection_failure("tls", f"{_where(params)}{tls}")
    elif _lost_mid_login(error):
        words = _ended_by(str(error), params)
        result = connection_failure(
            "lost",
            f"{words} while logging in"
            if words
            else f"the connection ended while logging in: {detail}",
        )
    elif isinstance(
        error,
        (pika.exceptions.ProbableAuthenticationError, pika.exceptions.AuthenticationError),
    ):
        result = connection_failure("credentials", detail, login=login)
    elif isinstance(error, pika.exceptions.ProbableAccessDeniedError):
        result = connection_failure("vhost", detail, login=login)
    elif isinstance(error, pika.exceptions.ConnectionClosed) and isinstance(error.reply_code, int):
        reply_text = scrub_credentials(str(error.reply_text))
        result = connection_failure("closed", detail, error.reply_code, reply_text, login=login)
    elif socket_error is not None and isinstance(getattr(params, "host", None), str):
        timed_out = isinstance(socket_error, TimeoutError)
        result = unreachable(
            params.host,
            params.port,
            errno.ETIMEDOUT if timed_out else socket_error.errno,
            scrub_credentials(socket_error.strerror or str(socket_error)),
            resolving=isinstance(socket_error, socket.gaierror),
        )
    elif isinstance(error, (TimeoutError, AMQPConnectorStackTimeout)) or isinstance(
        # pika wraps a socket timeout while connecting in AMQPConnectorSocketConnectError
        getattr(error, "exception", None),
        TimeoutError,
    ):
        result = connection_failure("timeout", f"{_where(params)}{detail}")
    elif isinstance(getattr(params, "host", None), str):
        result = connection_failure("lost", _lost_at(error, detail, params))
    else:
        result = connection_failure("lost", detail)
    if isinstance(error, BaseException):
        result.__cause__ = error
    return result


def _describe(error: object) -> str:
    """pika's error in one line, in words where pika has a usual one (``connection lost
    (connection reset by peer)``), else its class named once; pika's wrappers of a failed
    connect left out."""
    error = _innermost(error)
    text = str(error)
    # pika keeps only the repr of the socket error inside these: its last quoted text is what
    # the system said ("Connection reset by peer", "Transport indicated EOF")
    if isinstance(
        error,
        (pika.exceptions.ProbableAuthenticationError, pika.exceptions.ProbableAccessDeniedError),
    ) and (reply := _REPLY.search(text)):
        return f"{reply.group(1)} {reply.group(3)}"  # the broker's close: "403 ACCESS_REFUSED ..."
    quoted = _QUOTED.findall(text)
    said = quoted[-1][1] if quoted else text
    if isinstance(error, pika.exceptions.StreamLostError) and said:
        return f"connection lost ({said})"
    if isinstance(error, pika.exceptions.IncompatibleProtocolError) and said:
        return f"connection closed during the AMQP handshake ({said})"
    name = type(error).__name__
    return f"{name}: {text}" if text and not text.startswith(name) else text or name


def _lost_at(error: object, detail: str, params: Any) -> str:
    """A lost stream said with where: ``connection reset by 127.0.0.1:5672``, ``connection
    closed by 127.0.0.1:5672 during the AMQP handshake``, else ``host:port: detail``."""
    inner = _innermost(error)
    handshake = isinstance(inner, pika.exceptions.IncompatibleProtocolError)
    if handshake or isinstance(inner, pika.exceptions.StreamLostError):
        words = _ended_by(str(inner), params)
        if words:
            return words + (" during the AMQP handshake" if handshake else "")
    return f"{_where(params)}{detail}"


def _ended_by(text: str, params: Any) -> str:
    """``connection reset by host:port`` (or ``closed by``) when pika's text of a lost stream
    says so; "" otherwise."""
    where = _where(params).removesuffix(": ")
    if not where:
        return ""
    if "Connection reset by peer" in text:
        return f"connection reset by {where}"
    if "Transport indicated EOF" in text:
        return f"connection closed by {where}"
    return ""


_QUOTED = re.compile(r"""(['"])([^'"]+)\1""")
#: the broker's connection.close inside pika's "probable" errors: (403) 'ACCESS_REFUSED - ...'
_REPLY = re.compile(r"""\((\d+)\) (['"])(.*)\2""")


def _innermost(error: object) -> object:
    """What pika's wrappers of a failed connect hold (AMQPConnectionError around
    AMQPConnectionWorkflowFailed around AMQPConnectorSocketConnectError around, say,
    ConnectionRefusedError)."""
    for _ in range(8):
        if isinstance(error, AMQPConnectionWorkflowFailed) and error.exceptions:
            error = error.exceptions[-1]
        elif isinstance(error, AMQPConnectorPhaseErrorBase) and error.exception is not None:
            error = error.exception
        elif (
            isinstance(error, pika.exceptions.AMQPConnectionError)
            and type(error) is pika.exceptions.AMQPConnectionError  # not a subclass: a wrapper
            and len(error.args) == 1
            and isinstance(error.args[0], BaseException)
        ):
            error = error.args[0]
        else:
            break
    return error


def _socket_error(error: object) -> OSError | None:
    """The socket error a failed connect comes down to, if that is what it is."""
    inner = _innermost(error)
    if isinstance(inner, ValueError):
        # pika raises ValueError("Expected connected socket, but getpeername() failed:
        # error=OSError(107, '...'); <socket ...>") for a peer that reset the connection as it
        # opened (a proxy that refuses, a broker going down): the OSError only as text
        found = _PEERNAME_FAILED.search(str(inner))
        if found is not None:
            return OSError(errno.ECONNRESET, found.group(1) or "connection reset")
    return inner if isinstance(inner, OSError) else None


_PEERNAME_FAILED = re.compile(r"getpeername\(\) failed: error=\w*Error\(\d+, '([^']*)'\)")


def refusal_at(
    params: Any, reply_code: int, reply_text: str, *, operation: str, name: str, why: str = ""
) -> BrokerError | None:
    """:func:`~reliable_amqp._core.refusals.refusal` on a connection with these pika
    parameters: their virtual host and user name the remedy."""
    return refusal(
        reply_code,
        reply_text,
        operation=operation,
        name=name,
        vhost=str(getattr(params, "virtual_host", "")),
        user=str(getattr(getattr(params, "credentials", None), "username", "")),
        why=why,
    )


def _login(params: Any) -> tuple[str, str] | None:
    """(user name, virtual host) of a connection's parameters, for a refused login."""
    user = getattr(getattr(params, "credentials", None), "username", None)
    vhost = getattr(params, "virtual_host", None)
    if isinstance(user, str) and isinstance(vhost, str):
        return user, vhost
    return None


def _lost_mid_login(error: object) -> bool:
    """True for pika's "probable" authentication or vhost error that was a lost stream.

    pika renames any end of the connection while it authenticates (or opens the vhost) to
    ``ProbableAuthenticationError`` (``ProbableAccessDeniedError``), with the original error's
    repr as its text: the broker's connection.close (wrong credentials: 403 ACCESS_REFUSED, a
    refused vhost: 530), or a ``StreamLostError`` (a reset, a proxy, a broker restarting). Only
    the first is the broker's answer; the second is retried like any lost connection, as
    aiormq, which raises its ``ProbableAuthenticationError`` only for a 403 close, has it.
    """
    if not isinstance(
        error,
        (pika.exceptions.ProbableAuthenticationError, pika.exceptions.ProbableAccessDeniedError),
    ):
        return False
    text = str(error)
    return "StreamLostError" in text and "ConnectionClosedByBroker" not in text


def _where(params: Any) -> str:
    host, port = getattr(params, "host", None), getattr(params, "port", None)
    if not isinstance(host, str):
        return ""
    ssl_options = getattr(params, "ssl_options", None)
    name = getattr(ssl_options, "server_hostname", None)
    checked = f" (certificate name {name!r})" if isinstance(name, str) and name != host else ""
    return f"{host}:{port}{checked}: "


def call_threadsafe(loop: Any, callback: Callable[[], None]) -> None:
    """Run ``callback`` on pika's I/O loop thread; a closed loop drops it (logged at debug)."""
    token = OWNED.set(True)  # pika logs this call (DEBUG), on the caller's thread: ours (_logs)
    try:
        loop.add_callback_threadsafe(callback)
    except Exception:  # the loop closed under us; the next connection drains the outbox
        log.debug("reliable-amqp: wake-up lost with a closed I/O loop", exc_info=True)
    finally:
        OWNED.reset(token)
