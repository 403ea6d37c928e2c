"""Connection failures in words (issue 20): the cause and where, in one line; a refused login
names the user and vhost, never a password."""

from __future__ import annotations

import errno

import pytest

from reliable_amqp import AmqpConnectionError, AuthenticationFailed
from reliable_amqp._core.errors import connection_failure, unreachable
from support.broker import AMQP_DEFAULT_PORT as PORT


@pytest.mark.parametrize(
    ("args", "kwargs", "text"),
    [
        (("127.0.0.1", 5699, errno.ECONNREFUSED), {}, "connection refused at 127.0.0.1:5699"),
        (("::1", PORT, errno.ECONNREFUSED), {}, f"connection refused at [::1]:{PORT}"),
        (("h", PORT, errno.ETIMEDOUT), {}, f"timed out connecting to h:{PORT}"),
        (("h", PORT, errno.EHOSTUNREACH), {}, f"no route to h:{PORT} (host unreachable)"),
        (
            ("nope.invalid", PORT, -2, "Name or service not known"),
            {"resolving": True},
            "cannot resolve the host name 'nope.invalid' (Name or service not known)",
        ),
        (("h", PORT, None, "odd"), {}, f"cannot connect to h:{PORT}: odd"),
        (("h", PORT, 9999, "odd"), {}, f"cannot connect to h:{PORT}: odd"),
    ],
)
def test_unreachable_says_the_cause_and_where(
    args: tuple[object, ...], kwargs: dict[str, bool], text: str
) -> None:
    error = unreachable(*args, **kwargs)  # type: ignore[arg-type]
    assert type(error) is AmqpConnectionError and error.retriable and str(error) == text


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (
            ("credentials", "ACCESS_REFUSED - Login was refused"),
            "the broker refused the credentials of user 'orders' on virtual host 'prod' (wrong "
            "user or password): 403 ACCESS_REFUSED - Login was refused",
        ),
        (
            ("vhost", "NOT_ALLOWED"),
            "the broker refused user 'orders' access to the virtual host 'prod' (missing vhost "
            "or no permission)",
        ),
        (
            ("closed", "closed", 403, "ACCESS_REFUSED - no access"),
            "the broker refused the connection of user 'orders' to virtual host 'prod': 403 "
            "ACCESS_REFUSED - no access",
        ),
    ],
)
def test_a_refused_login_names_the_user_and_vhost(args: tuple[object, ...], text: str) -> None:
    error = connection_failure(*args, login=("orders", "prod"))  # type: ignore[arg-type]
    assert type(error) is AuthenticationFailed and not error.retriable and str(error) == text
