"""Unit tests of ``_core/errors.py``: reply codes by table, retriable flags, publish errors."""

from __future__ import annotations

from typing import Any

import pytest

from reliable_amqp._core.builder import build_message
from reliable_amqp._core.errors import (
    CONNECTION_FAILURES,
    REPLY_CODE_ERRORS,
    AccessRefused,
    AmqpConnectionError,
    AmqpNotImplemented,
    AmqpSyntaxError,
    AuthenticationFailed,
    BrokerError,
    ChannelError,
    CommandInvalid,
    ConfigurationError,
    ConnectionForced,
    ContentTooLarge,
    DeliveryTimeout,
    FrameError,
    InternalError,
    InvalidMessage,
    MessageNacked,
    MessageRejected,
    MessageReturned,
    NoConsumers,
    NoRoute,
    NotAllowed,
    NotFound,
    OperationTimeout,
    PreconditionFailed,
    PublisherClosed,
    PublishError,
    PublishTimeout,
    RecoveryFailed,
    ReliableAmqpError,
    ResourceError,
    ResourceLocked,
    TlsError,
    UnexpectedFrame,
    broker_error,
    connection_failure,
)

# --- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "code, cls, retriable",
    [
        (311, ContentTooLarge, False),
        (312, NoRoute, False),
        (313, NoConsumers, False),
        (320, ConnectionForced, True),
        (403, AccessRefused, False),
        (404, NotFound, False),
        (405, ResourceLocked, True),
        (406, PreconditionFailed, False),
        (501, FrameError, False),
        (502, AmqpSyntaxError, False),
        (503, CommandInvalid, False),
        (504, ChannelError, False),
        (505, UnexpectedFrame, False),
        (506, ResourceError, True),
        (530, NotAllowed, False),
        (540, AmqpNotImplemented, False),
        (541, InternalError, True),
    ],
)
def test_reply_codes_map_to_exception_classes(code: int, cls: type, retriable: bool) -> None:
    error = broker_error(code, "TEXT - why")
    assert type(error) is cls and cls.reply_code == code
    assert REPLY_CODE_ERRORS[code] is cls
    assert (error.code, error.text) == (code, "TEXT - why")
    assert str(error) == f"{code} TEXT - why"
    assert error.retriable is retriable
    assert isinstance(error, BrokerError) and isinstance(error, ReliableAmqpError)


@pytest.mark.parametrize("code", [0, 200, 999, 407])
def test_unknown_reply_codes_give_a_plain_broker_error(code: int) -> None:
    error = broker_error(code, "odd")
    assert type(error) is BrokerError
    assert (error.code, error.retriable) == (code, False)


def test_reply_code_table_is_complete_and_consistent() -> None:
    assert len(REPLY_CODE_ERRORS) == 17
    assert all(code == cls.reply_code for code, cls in REPLY_CODE_ERRORS.items())


def test_publish_errors_carry_the_message() -> None:
    message = build_message("ex", "rk", b"", properties={"message_id": "m-1"})
    rejected = MessageRejected(message, 2, 404, "NOT_FOUND")
    assert rejected.message is message and rejected.attempts == 2
    assert isinstance(rejected.cause, NotFound) and "m-1" in str(rejected)
    returned = MessageReturned(message, 1, 312, "NO_ROUTE")
    assert "'ex'" in str(returned) and "'rk'" in str(returned)
    assert isinstance(DeliveryTimeout(message, 1, 5.0), TimeoutError)
    assert MessageNacked(message, 3).retriable and PublisherClosed(message, 0).retriable
    assert not rejected.retriable and not returned.retriable
    assert isinstance(InvalidMessage("body", "x"), ValueError)
    assert isinstance(ConfigurationError("x"), ValueError)


# --- connection_failure: one classifier for both adapters -----------------------------------------


@pytest.mark.parametrize(
    ("args", "cls", "text"),
    [
        (
            ("credentials", "ACCESS_REFUSED - Login was refused"),
            AuthenticationFailed,
            "the broker refused the credentials (wrong user or password): "
            "403 ACCESS_REFUSED - Login was refused",  # the code aiormq drops, said as pika does
        ),
        (
            ("vhost", "NOT_ALLOWED - vhost nope not found"),
            AuthenticationFailed,
            "the broker refused access to the virtual host (missing vhost or no permission)",
        ),
        (
            ("closed", "closed by broker", 403, "ACCESS_REFUSED - no access to vhost"),
            AuthenticationFailed,
            "the broker refused the connection: 403 ACCESS_REFUSED - no access to vhost",
        ),
        (
            ("closed", "closed by broker", 530, "NOT_ALLOWED - vhost gone"),
            AuthenticationFailed,
            "the broker refused the connection: 530 NOT_ALLOWED - vhost gone",
        ),
        (
            ("closed", "closed by broker", 320, "CONNECTION_FORCED - shutdown"),
            AmqpConnectionError,
            "the broker closed the connection: 320 CONNECTION_FORCED - shutdown",
        ),
        (
            ("closed", "closed by broker", 541, "INTERNAL_ERROR"),
            AmqpConnectionError,
            "the broker closed the connection: 541 INTERNAL_ERROR",
        ),
        (("closed", "closed without a code"), AmqpConnectionError, "closed without a code"),
        (
            ("timeout", "no answer in 10 s"),
            AmqpConnectionError,
            "timed out connecting to the broker: no answer in 10 s",
        ),
        (
            ("tls", "broker.example:5671: certificate verify failed: unable to get local issuer"),
            TlsError,
            "TLS failed: broker.example:5671: certificate verify failed: unable to get local "
            "issuer",
        ),
        (
            ("lost", "[Errno 104] Connection reset"),
            AmqpConnectionError,
            "[Errno 104] Connection reset",
        ),
        # a reply code only matters for "closed"
        (("lost", "reset", 403, "ACCESS_REFUSED"), AmqpConnectionError, "reset"),
        (
            ("timeout", "slow", 530, "NOT_ALLOWED"),
            AmqpConnectionError,
            "timed out connecting to the broker: slow",
        ),
    ],
)
def test_connection_failure_sorts_failures_into_errors(
    args: tuple[Any, ...], cls: type, text: str
) -> None:
    error = connection_failure(*args)
    assert type(error) is cls and str(error) == text
    assert error.retriable is (cls is AmqpConnectionError)
    assert isinstance(error, AmqpConnectionError)


def test_connection_failure_knows_every_documented_kind_and_no_other() -> None:
    assert CONNECTION_FAILURES == ("credentials", "vhost", "closed", "timeout", "tls", "lost")
    for kind in CONNECTION_FAILURES:
        assert isinstance(connection_failure(kind, "detail"), AmqpConnectionError)
    for kind in ("refused", "", "Lost", "closed "):
        with pytest.raises(ValueError, match=f"unknown connection failure kind {kind!r}"):
            connection_failure(kind, "detail", 403, "ACCESS_REFUSED")


def test_not_retriable_connection_errors_never_retry_under_a_policy() -> None:
    assert not AuthenticationFailed("x").retriable and not RecoveryFailed("x").retriable
    assert issubclass(RecoveryFailed, AmqpConnectionError)
    assert issubclass(AuthenticationFailed, AmqpConnectionError)
    assert TlsError.retriable is False and issubclass(TlsError, AmqpConnectionError)
    assert AmqpConnectionError.retriable is True and ReliableAmqpError.retriable is False


# --- the other classes: flags, bases, messages ----------------------------------------------------


def test_timeouts_are_retriable_timeout_errors() -> None:
    for cls in (PublishTimeout, OperationTimeout):
        error = cls("waited")
        assert error.retriable is True
        assert isinstance(error, TimeoutError) and isinstance(error, ReliableAmqpError)


def test_invalid_message_names_field_and_problem() -> None:
    error = InvalidMessage("headers['x']", "a set has no AMQP field type")
    assert str(error) == "invalid headers['x']: a set has no AMQP field type"
    assert (error.field, error.problem) == ("headers['x']", "a set has no AMQP field type")
    assert error.retriable is False


def test_plain_broker_error_has_no_reply_code_of_its_own() -> None:
    assert BrokerError.reply_code == 0 and BrokerError.retriable is False
    error = BrokerError(200, "OK")
    assert (error.code, error.text, str(error)) == (200, "OK", "200 OK")


def test_publish_error_messages_are_exact() -> None:
    message = build_message("ex", "rk", b"", properties={"message_id": "m-1"})
    nacked = MessageNacked(message, 3)
    assert str(nacked) == "message 'm-1' was nacked by the broker (3 attempts)"
    returned = MessageReturned(message, 1, 312, "NO_ROUTE")
    assert str(returned) == (
        "message 'm-1' was returned as unroutable (312 NO_ROUTE) "
        "by exchange 'ex' with routing key 'rk'"
    )
    assert (returned.reply_code, returned.reply_text) == (312, "NO_ROUTE")
    timeout = DeliveryTimeout(message, 2, 120.0)
    assert str(timeout) == "message 'm-1' was not confirmed within its 120 s delivery timeout"
    assert timeout.timeout == 120.0
    assert "within its 0.25 s" in str(DeliveryTimeout(message, 2, 0.25))
    rejected = MessageRejected(message, 1, 406, "PRECONDITION_FAILED - too big")
    assert str(rejected) == (
        "message 'm-1' was rejected: the broker closed the channel with "
        "406 PRECONDITION_FAILED - too big"
    )
    assert isinstance(rejected.cause, PreconditionFailed)
    assert (rejected.reply_code, rejected.reply_text) == (406, "PRECONDITION_FAILED - too big")


def test_message_rejected_before_sending_has_no_cause() -> None:
    message = build_message("ex", "rk", b"", properties={"message_id": "m-2"})
    rejected = MessageRejected(message, 0, 0, "a set has no AMQP field type")
    assert rejected.cause is None and rejected.reply_code == 0
    assert (
        str(rejected)
        == "message 'm-2' was rejected before it was sent: a set has no AMQP field type"
    )


def test_publisher_closed_shows_its_reason_when_it_has_one() -> None:
    message = build_message("ex", "rk", b"", properties={"message_id": "m-3"})
    plain = PublisherClosed(message, 1)
    assert str(plain) == "message 'm-3' was not confirmed before the publisher closed"
    assert plain.reason == ""
    why = PublisherClosed(message, 1, "recovery failed")
    assert (
        str(why) == "message 'm-3' was not confirmed before the publisher closed: recovery failed"
    )
    assert why.reason == "recovery failed" and why.attempts == 1 and why.message is message
    assert isinstance(why, PublishError)
