"""Where the async publisher's AMQP connection comes from: its own, or one the caller lends it.

An owned connection is a plain ``aio_pika.Connection`` (not a ``RobustConnection``): the
publisher reconnects itself, under its ``connect_policy`` and across its failover URLs, because
it must know when a connection is gone to republish what was unconfirmed on it. A borrowed
connection belongs to the caller; with a ``RobustConnection`` aio-pika reconnects it and the
publisher waits for that, with a plain one a loss is final.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
from typing import Any

import aio_pika
import aio_pika.abc
import aiormq.abc
from yarl import URL

from reliable_amqp._compat import installed_version, scrub_credentials
from reliable_amqp._compat.aiormq import (
    close_called,
    close_connection,
    translate_connection_error,
    underlying_connection,
)
from reliable_amqp._core.errors import (
    AmqpConnectionError,
    ConfigurationError,
    RecoveryFailed,
    ReliableAmqpError,
    connection_failure,
    unreachable,
)
from reliable_amqp._core.options import PublisherOptions, redact_url, vhost_of
from reliable_amqp._logs import install, own_context
from reliable_amqp._tls import client_context, tls_failure, uses_tls

log = logging.getLogger("reliable_amqp")

install()  # aiormq's and aio-pika's loggers drop records about our own connections (_logs)

_BORROWED_POLL = 0.05  # how often to look whether a borrowed robust connection is back


def _connection_class(
    server_hostname: str | None, made: list[aio_pika.Connection]
) -> type[aio_pika.Connection]:
    """``aio_pika.Connection`` that lists each instance in ``made``, and when
    ``server_hostname`` is given checks the certificate for that name.

    ``made``: ``aio_pika.connect`` drops the connection it made when connecting fails, open;
    its finalizer then schedules ``close()``, which when the garbage collector runs it off the
    loop's thread is a coroutine never awaited (a RuntimeWarning per failed attempt in the
    user's log). :meth:`ConnectionSource.obtain` closes what an attempt made.

    ``server_hostname``: aio-pika 9.4 and 10 pass a connection's ``kwargs`` on to
    ``aiormq.connect``, whose extra keywords go to ``asyncio.open_connection``: the one way to
    give it a ``server_hostname``.
    """

    class _Connection(aio_pika.Connection):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)
            if server_hostname is None:
                return
            if not isinstance(getattr(self, "kwargs", None), dict):
                raise ConfigurationError(
                    f"server_hostname needs aio-pika's Connection.kwargs; aio-pika "
                    f"{installed_version('aio-pika')} has none"
                )
            self.kwargs["server_hostname"] = server_hostname

    return _Connection


async def _discard(made: list[aio_pika.Connection], timeout: float) -> None:
    """Close the connections a failed attempt made (see :func:`_connection_class`), as every
    connection this library opened is closed (:func:`close_connection`)."""
    for connection in made:
        try:
            await close_connection(connection, timeout)
        except Exception:  # never connected, or half: nothing of it is the user's to know
            log.debug("closing a failed attempt's connection failed", exc_info=True)


def _failure(error: Exception, url: URL, login: tuple[str, str]) -> ReliableAmqpError:
    """What connecting to ``url`` raised, as one of ours: a socket error in one line that names
    where (``connection refused at 127.0.0.1:5699``), a refused login with its user and vhost."""
    translated = translate_connection_error(error, login)
    if not translated.retriable:  # a refused login, a TLS failure: said as well as it can be
        return translated
    # aiormq raises its AMQPConnectionError (an OSError itself) from the socket's OSError
    cause: BaseException | None = error
    socket_error: OSError | None = None
    for _ in range(4):
        if cause is None:
            break
        if isinstance(cause, OSError) and not type(cause).__module__.startswith("aiormq"):
            socket_error = cause
            break
        cause = cause.__cause__
    host, port = url.host or "", url.port
    if isinstance(error, asyncio.TimeoutError) or isinstance(socket_error, TimeoutError):
        return unreachable(host, port, errno.ETIMEDOUT)
    if socket_error is not None:
        return unreachable(
            host,
            port,
            socket_error.errno,
            scrub_credentials(socket_error.strerror or str(socket_error)),
            resolving=isinstance(socket_error, socket.gaierror),
        )
    return translated


class ConnectionSource:
    """Hands the supervisor a live aiormq connection per attempt, and closes what it owns."""

    def __init__(
        self, options: PublisherOptions, borrowed: aio_pika.abc.AbstractConnection | None
    ) -> None:
        self.options = options
        self._borrowed = borrowed
        # built once, now: a missing CA file is a ConfigurationError of the constructor
        self._ssl_context = None if borrowed is not None else client_context(options)
        self._owned: aio_pika.abc.AbstractConnection | None = None
        self._seen_open = False

    @property
    def borrowed(self) -> bool:
        """True when the connection is the caller's."""
        return self._borrowed is not None

    def describe(self, attempt: int) -> str:
        """The URL of ``attempt``, password redacted (for logs)."""
        urls = self.options.urls
        return redact_url(urls[attempt % len(urls)])

    async def obtain(
        self, attempt: int, stop: asyncio.Future[None]
    ) -> aiormq.abc.AbstractConnection:
        """A connected aiormq connection; raises what connecting raised."""
        if self._borrowed is not None:
            return await self._wait_for_borrowed(self._borrowed, stop)
        # aiormq's records about this connection are ours to report (_logs): the mark is on the
        # supervisor task's context, which every task and callback aiormq starts here copies
        own_context()
        await self.release()
        options = self.options
        raw = options.urls[attempt % len(options.urls)]
        # the options checked the URL: its only query parameter may be heartbeat, which they
        # took over, so it is set here whatever the URL says
        url = URL(raw).update_query(heartbeat=str(options.heartbeat))
        if options.username is not None or options.password is not None:
            user, password = options.login(raw)
            url = url.with_user(user).with_password(password)
        tls = uses_tls(raw)
        made: list[aio_pika.Connection] = []
        try:
            connection = await aio_pika.connect(
                url,
                timeout=options.connect_timeout,
                client_properties={
                    "connection_name": options.connection_name or "reliable-amqp",
                    "product": "reliable-amqp",
                },
                # aiormq 6 would wrap even an amqp:// connection in a context it is given
                ssl_context=self._ssl_context if tls else None,
                connection_class=_connection_class(options.server_hostname if tls else None, made),
            )
        except BaseException as exc:
            await _discard(made, options.connect_timeout)
            if isinstance(exc, ReliableAmqpError) or not isinstance(exc, Exception):
                raise
            reason = tls_failure(exc) if tls else None
            if reason is None:
                raise _failure(exc, url, (url.user or "guest", vhost_of(raw))) from exc
            where = f"{url.host}:{url.port}"
            if options.server_hostname and options.server_hostname != url.host:
                where += f" (certificate name {options.server_hostname!r})"
            raise connection_failure("tls", f"{where}: {reason}") from exc
        self._owned = connection
        underlying = underlying_connection(connection)
        if underlying is None:  # connect() returned without a transport: treat as a failure
            raise AmqpConnectionError("aio-pika returned a connection without a transport")
        return underlying

    async def _wait_for_borrowed(
        self, connection: aio_pika.abc.AbstractConnection, stop: asyncio.Future[None]
    ) -> aiormq.abc.AbstractConnection:
        robust = isinstance(connection, aio_pika.abc.AbstractRobustConnection)
        while True:
            underlying = underlying_connection(connection)
            if (
                underlying is not None
                and not underlying.is_closed
                and connection.connected.is_set()
            ):
                self._seen_open = True
                return underlying
            if connection.is_closed or close_called(connection):
                raise RecoveryFailed("the aio-pika connection lent to the publisher was closed")
            if not robust:
                raise RecoveryFailed(
                    "the aio-pika connection lent to the publisher "
                    + ("was lost" if self._seen_open else "is not connected")
                    + "; a plain aio_pika.Connection does not reconnect (use connect_robust)"
                )
            if stop.done():
                raise AmqpConnectionError("publisher closed")
            # RobustConnection has no awaitable "reconnected and usable" signal that also covers
            # the window where its old transport is dead but not yet replaced: poll.
            await asyncio.wait({stop}, timeout=_BORROWED_POLL)

    async def release(self) -> None:
        """Close the connection this source opened, if any (a borrowed one is left alone)."""
        owned, self._owned = self._owned, None
        if owned is not None and loop_is_running():
            with contextlib.suppress(Exception):
                await close_connection(owned, self.options.connect_timeout)


def loop_is_running() -> bool:
    """Whether this coroutine runs in a live event loop, so that a close can be awaited.

    Not when the garbage collector finalizes a publisher's coroutine after its loop was closed
    under it: there ``asyncio.wait_for`` fails before it awaits the close coroutine it was
    handed, which is then reported as never awaited (a RuntimeWarning). Nothing can run a close
    there; the socket goes with the connection object.
    """
    try:
        return not asyncio.get_running_loop().is_closed()
    except RuntimeError:
        return False
