"""The exception hierarchy: one root, a ``retriable`` flag per class, AMQP reply codes by table.

Per-message failures derive from :class:`PublishError` and carry the message they are about, so a
caller holding only the exception can republish, log or dead-letter it. Everything a broker says
with a reply code is turned into a :class:`BrokerError` subclass through :data:`REPLY_CODE_ERRORS`
(the pamqp way: one table, not a chain of ``if`` statements).
"""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from reliable_amqp._core.message import OutgoingMessage


class ReliableAmqpError(Exception):
    """Root of every exception this library raises."""

    #: True when doing the same thing again later may succeed; retry logic reads this flag.
    retriable: ClassVar[bool] = False
    #: True when a consumer's handler that raised it can never succeed with the same message
    #: (it depends on the message alone): the message is dead-lettered at once, no retries.
    permanent: ClassVar[bool] = False


# --- configuration and input -------------------------------------------------------------------


class ConfigurationError(ReliableAmqpError, ValueError):
    """An option, URL or retry policy is invalid (raised before anything is sent)."""


def a_type(value: object) -> str:
    """``value``'s type named with its article, for messages: "a list", "an object"."""
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


class InvalidMessage(ReliableAmqpError, ValueError):
    """A message given to ``publish()`` cannot be sent as it is; nothing was sent.

    ``field`` names what was wrong (``"body"``, ``"routing_key"``, ``"headers['x']"``, ...).
    """

    permanent = True

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"invalid {field}: {problem}")
        self.field = field
        self.problem = problem


class MissingMessageId(ReliableAmqpError, ValueError):
    """The inbox was asked to claim a delivery that has no ``message_id``, without ``key=``: its
    duplicates cannot be recognised, and treating it as new every time would handle each copy
    again (``reliable_amqp.inbox``)."""

    permanent = True


class PublishTimeout(ReliableAmqpError, TimeoutError):
    """``publish()`` waited longer than ``publish_timeout`` for room in the in-flight window."""

    retriable = True


class OperationTimeout(ReliableAmqpError, TimeoutError):
    """A declaration or other broker round trip did not finish in time."""

    retriable = True


# --- broker replies -------------------------------------------------------------------------------


class BrokerError(ReliableAmqpError):
    """The broker closed a channel or connection with an AMQP reply code."""

    reply_code: ClassVar[int] = 0

    def __init__(self, reply_code: int, reply_text: str) -> None:
        super().__init__(f"{reply_code} {reply_text}")
        self.code = reply_code
        self.text = reply_text


class ConnectionForced(BrokerError):
    """320: the broker closed the connection (shutdown, ``rabbitmqctl close_connection``)."""

    reply_code = 320
    retriable = True


class ContentTooLarge(BrokerError):
    """311: the message body is too large."""

    reply_code = 311


class NoRoute(BrokerError):
    """312: a mandatory message could not be routed to any queue."""

    reply_code = 312


class NoConsumers(BrokerError):
    """313: an immediate message had no consumer."""

    reply_code = 313


class AccessRefused(BrokerError):
    """403: the user may not do this (wrong permissions, reserved ``amq.`` names)."""

    reply_code = 403


class NotFound(BrokerError):
    """404: the exchange or queue does not exist."""

    reply_code = 404


class ResourceLocked(BrokerError):
    """405: an exclusive queue belongs to another connection."""

    reply_code = 405
    retriable = True


class PreconditionFailed(BrokerError):
    """406: a precondition failed (oversize message, mismatched declare, LavinMQ low disk)."""

    reply_code = 406


class FrameError(BrokerError):
    """501: a malformed frame."""

    reply_code = 501


class AmqpSyntaxError(BrokerError):
    """502: a frame with illegal values (AMQP ``syntax-error``; named so as not to shadow the
    built-in ``SyntaxError``)."""

    reply_code = 502


class CommandInvalid(BrokerError):
    """503: a command not allowed in the current state."""

    reply_code = 503


class ChannelError(BrokerError):
    """504: a command on a channel that is not open."""

    reply_code = 504


class UnexpectedFrame(BrokerError):
    """505: a frame the broker did not expect."""

    reply_code = 505


class ResourceError(BrokerError):
    """506: the broker lacks a resource (memory, file handles)."""

    reply_code = 506
    retriable = True


class NotAllowed(BrokerError):
    """530: not allowed (a virtual host that does not exist or was deleted)."""

    reply_code = 530


class AmqpNotImplemented(BrokerError):
    """540: the broker does not implement this (AMQP ``not-implemented``; named so as not to
    shadow the built-in ``NotImplemented``)."""

    reply_code = 540


class InternalError(BrokerError):
    """541: the broker hit an internal error."""

    reply_code = 541
    retriable = True


#: AMQP 0-9-1 reply code -> exception class.
REPLY_CODE_ERRORS: dict[int, type[BrokerError]] = {
    cls.reply_code: cls
    for cls in (
        ContentTooLarge,
        NoRoute,
        NoConsumers,
        ConnectionForced,
        AccessRefused,
        NotFound,
        ResourceLocked,
        PreconditionFailed,
        FrameError,
        AmqpSyntaxError,
        CommandInvalid,
        ChannelError,
        UnexpectedFrame,
        ResourceError,
        NotAllowed,
        AmqpNotImplemented,
        InternalError,
    )
}


def broker_error(reply_code: int, reply_text: str) -> BrokerError:
    """Return the exception for an AMQP reply code (a plain :class:`BrokerError` if unknown)."""
    cls = REPLY_CODE_ERRORS.get(reply_code, BrokerError)
    return cls(reply_code, reply_text)


# --- connections ------------------------------------------------------------------------------


class AmqpConnectionError(ReliableAmqpError):
    """The connection to the broker failed or was lost."""

    retriable = True


class AuthenticationFailed(AmqpConnectionError):
    """The broker refused the credentials (never retried: retrying cannot fix a password)."""

    retriable = False


class TlsError(AmqpConnectionError):
    """TLS failed: an untrusted certificate, a name the certificate does not cover, a failed
    handshake (a client certificate the broker wanted, ``amqps://`` to a plain AMQP port).

    Never retried: the same certificates and the same port fail the same way again. The message
    names the host and the reason; it never holds a URL or a password.
    """

    retriable = False


class RecoveryFailed(AmqpConnectionError):
    """The publisher gave up reconnecting (connect retry policy spent, or a permanent error)."""

    retriable = False


#: What went wrong with a connection, as each client library's exceptions are sorted into it by
#: the compat layer: ``credentials`` (refused login), ``vhost`` (no access to the virtual host),
#: ``closed`` (the broker sent connection.close with a reply code), ``timeout`` (connecting took
#: too long), ``tls`` (certificate, host name or handshake failure: ``detail`` names the host and
#: the reason), ``lost`` (anything else: a reset socket, a refused port, a stalled link).
CONNECTION_FAILURES = ("credentials", "vhost", "closed", "timeout", "tls", "lost")


def connection_failure(
    kind: str,
    detail: str,
    reply_code: int | None = None,
    reply_text: str = "",
    *,
    login: tuple[str, str] | None = None,
) -> AmqpConnectionError:
    """The one translation of a failed or lost connection into this library's errors.

    Wrong credentials, a refused virtual host and a broker close with 403/530 are not retriable
    (:class:`AuthenticationFailed`), nor is a TLS failure (:class:`TlsError`); everything else
    is a retriable :class:`AmqpConnectionError`.
    ``detail`` is the client library's own description (never a URL: it may hold a password).
    ``login`` (user name, virtual host) is named in an :class:`AuthenticationFailed`; the
    password never is.
    """
    if kind == "credentials":
        if detail.startswith("ACCESS_REFUSED"):  # aiormq drops the code pika keeps: say it alike
            detail = f"403 {detail}"
        of = f" of user {login[0]!r} on virtual host {login[1]!r}" if login else ""
        return AuthenticationFailed(
            f"the broker refused the credentials{of} (wrong user or password): {detail}"
        )
    if kind == "vhost":
        who = f" user {login[0]!r}" if login else ""
        which = f" {login[1]!r}" if login else ""
        return AuthenticationFailed(
            f"the broker refused{who} access to the virtual host{which} (missing vhost or no "
            "permission)"
        )
    if kind == "closed" and reply_code in (403, 530):
        broker = broker_error(reply_code, reply_text)
        of = f" of user {login[0]!r} to virtual host {login[1]!r}" if login else ""
        return AuthenticationFailed(f"the broker refused the connection{of}: {broker}")
    if kind == "closed" and reply_code is not None:
        return AmqpConnectionError(f"the broker closed the connection: {reply_code} {reply_text}")
    if kind == "timeout":
        return AmqpConnectionError(f"timed out connecting to the broker: {detail}")
    if kind == "tls":
        return TlsError(f"TLS failed: {detail}")
    if kind not in CONNECTION_FAILURES:
        raise ValueError(f"unknown connection failure kind {kind!r}")
    return AmqpConnectionError(detail)


#: what the errno of a failed TCP connection says, in words ({where} is host:port)
_SOCKET_ERRNOS = {
    errno.ECONNREFUSED: "connection refused at {where}",
    errno.ETIMEDOUT: "timed out connecting to {where}",
    errno.EHOSTUNREACH: "no route to {where} (host unreachable)",
    errno.ENETUNREACH: "no route to {where} (network unreachable)",
    errno.ECONNRESET: "connection reset by {where}",
    errno.ECONNABORTED: "connection aborted at {where}",
    errno.EPIPE: "connection to {where} broken",
    errno.EADDRNOTAVAIL: "cannot connect to {where} (address not available)",
}


def unreachable(
    host: str, port: int | None, code: int | None, text: str = "", *, resolving: bool = False
) -> AmqpConnectionError:
    """A broker that could not be reached, in one line that names the cause and where:
    ``connection refused at 127.0.0.1:5699``.

    ``code`` is the socket error's errno (None when it has none: ``text`` then says what
    happened); ``resolving`` is True when the host name did not resolve. Retriable, as every
    :class:`AmqpConnectionError`: a broker may be starting, a name may come back.
    """
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if resolving:
        return AmqpConnectionError(f"cannot resolve the host name {host!r} ({text})")
    phrase = _SOCKET_ERRNOS.get(code) if code is not None else None
    if phrase is not None:
        return AmqpConnectionError(phrase.format(where=where))
    return AmqpConnectionError(f"cannot connect to {where}: {text}" if text else where)


class WouldDeadlock(ReliableAmqpError, RuntimeError):
    """A blocking call (``result()``, ``flush()``, ``publish_and_wait()``, ``close()``, ...) was
    made on the publisher's own I/O thread, in a done-callback or the ``on_event`` hook, where it
    could never return: only that thread settles messages."""


class PublisherForked(ReliableAmqpError):
    """The publisher was made in another process: a child that ``fork()`` made inherited a copy
    without its I/O thread and connection. Create a new publisher in the child."""


# --- per-message outcomes -------------------------------------------------------------------------


class PublishError(ReliableAmqpError):
    """A message was not confirmed; ``message`` is it, ``attempts`` how often it went out."""

    def __init__(self, message: OutgoingMessage, attempts: int, detail: str) -> None:
        super().__init__(f"message {message.message_id!r} {detail}")
        #: the message
        self.message = message
        self.attempts = attempts


class MessageNacked(PublishError):
    """The broker answered ``basic.nack`` and the nack retry policy is spent."""

    retriable = True

    def __init__(self, message: OutgoingMessage, attempts: int) -> None:
        super().__init__(message, attempts, f"was nacked by the broker ({attempts} attempts)")


class MessageReturned(PublishError):
    """A ``mandatory`` message could not be routed: the broker returned it (``basic.return``)."""

    def __init__(
        self, message: OutgoingMessage, attempts: int, reply_code: int, reply_text: str
    ) -> None:
        super().__init__(
            message,
            attempts,
            f"was returned as unroutable ({reply_code} {reply_text}) "
            f"by exchange {message.exchange!r} with routing key {message.routing_key!r}",
        )
        self.reply_code = reply_code
        self.reply_text = reply_text


class DeliveryTimeout(PublishError, TimeoutError):
    """The message's whole deadline (``delivery_timeout``, reconnects included) passed."""

    retriable = True

    def __init__(self, message: OutgoingMessage, attempts: int, timeout: float) -> None:
        super().__init__(
            message, attempts, f"was not confirmed within its {timeout:g} s delivery timeout"
        )
        self.timeout = timeout


class MessageRejected(PublishError):
    """The channel was closed by this very message (404 missing exchange, 406 oversize, ...).

    ``reply_code`` 0 means the client itself could not put the message on the wire (it could
    not be encoded); ``cause`` is then None.
    """

    def __init__(
        self, message: OutgoingMessage, attempts: int, reply_code: int, reply_text: str
    ) -> None:
        detail = (
            f"was rejected: the broker closed the channel with {reply_code} {reply_text}"
            if reply_code
            else f"was rejected before it was sent: {reply_text}"
        )
        super().__init__(message, attempts, detail)
        self.reply_code = reply_code
        self.reply_text = reply_text
        self.cause: BrokerError | None = (
            broker_error(reply_code, reply_text) if reply_code else None
        )


class PublisherClosed(PublishError):
    """The publisher was closed (or failed for good) before the message could be confirmed;
    also what every call on a closed publisher raises (:meth:`refused`), where ``message`` is
    the message the call was given, or None for a call that publishes nothing (``connect()``,
    ``declare_*``, ``with``)."""

    retriable = True

    def __init__(self, message: OutgoingMessage, attempts: int, reason: str = "") -> None:
        detail = "was not confirmed before the publisher closed"
        super().__init__(message, attempts, f"{detail}: {reason}" if reason else detail)
        self.reason = reason

    def kept_in_spool(self, directory: str) -> PublisherClosed:
        """This error as it reads for a message of a publisher with a spool: the message stays
        in the spool ``directory`` (sending it again would make a duplicate)."""
        error = PublisherClosed(
            self.message,
            self.attempts,
            f"{self.reason or 'publisher closed'}; the message stays in the spool {directory} "
            "and goes out with the next publisher opened on it",
        )
        error.__cause__ = self.__cause__
        return error

    @classmethod
    def refused(
        cls, call: str, message: OutgoingMessage | None = None, reason: str = ""
    ) -> PublisherClosed:
        """The error of ``call`` (``"publish()"``, ``"connect()"``, ...) on a closed publisher:
        nothing was sent; ``reason`` says more (why it closed, when it was not ``close()``)."""
        error = cls.__new__(cls)
        text = f"the publisher is closed: {call} sends nothing"
        ReliableAmqpError.__init__(error, f"{text} ({reason})" if reason else text)
        # None only for a call that was given no message (documented above)
        error.message = message  # type: ignore[assignment]
        error.attempts = 0
        error.reason = reason or "publisher is closed"
        return error


# --- the durable spool ----------------------------------------------------------------------------


class SpoolError(ReliableAmqpError):
    """The durable spool (``spool=DIR``) cannot be used as it is: a corrupt or unreadable file, a
    file that is no spool, a write that failed. The message names the file and what is wrong;
    the spool never drops what it holds to get past such an error."""


class SpoolWriteError(PublishError, SpoolError):
    """``publish()`` could not write the message to the spool (an I/O error): the message was
    not accepted. Everything the spool held before stays in it."""

    def __init__(self, message: OutgoingMessage, path: str, reason: str) -> None:
        super().__init__(message, 0, f"was not accepted: the spool {path} {reason}")
        self.path = path
        self.reason = reason


class SpoolFull(SpoolWriteError):
    """``publish()`` could not write the message to the spool because the disk (file system)
    is full. Retriable: once space is freed (or confirms empty the spool) publishing resumes.
    Reaching ``spool_max_bytes`` is not this error: ``publish()`` then waits for room and raises
    :class:`PublishTimeout` after ``publish_timeout``."""

    retriable = True
