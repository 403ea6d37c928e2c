"""No fragment of a password in any error, repr or log record, for both publishers: passwords
with '/', '?', '#' and '@', in URLs that parse (percent-encoded) and that do not (raw), and given
as the ``password`` option, which overrides the URL's (as ``username`` does).

Against the shared broker (plain AMQP): the secrets rows of issue 11 are not about TLS, but they
are about the same edge of the library.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import quote

import pytest

from reliable_amqp import (
    AsyncPublisher,
    AuthenticationFailed,
    ConfigurationError,
    Confirmation,
    Publisher,
)
from support.broker import AMQP_HOSTPORT

pytestmark = pytest.mark.broker

HOST = AMQP_HOSTPORT  # the test broker's host:port, for URLs with other credentials
SECRET = "Zq7/Xw9?Yv8#Ut6@Sr5"
FRAGMENTS = ("Zq7", "Xw9", "Yv8", "Ut6", "Sr5")
KINDS = ("sync", "async")


def shown(*texts: str) -> list[str]:
    """The fragments of SECRET that appear in ``texts`` (expected: none)."""
    return [f for f in FRAGMENTS if any(f in text for text in texts)]


def connect(kind: str, url: str, **options: Any) -> tuple[str, BaseException | None]:
    """(repr of the publisher, what connect raised) with one connection attempt."""
    options.setdefault("connect_policy", {"max_attempts": 1})
    options.setdefault("connect_timeout", 5.0)
    if kind == "sync":
        publisher = Publisher(url, **options)
        try:
            publisher.connect()
        except Exception as exc:
            return repr(publisher), exc
        finally:
            publisher.close(timeout=1)
        return repr(publisher), None

    async def run() -> tuple[str, BaseException | None]:
        publisher = AsyncPublisher(url, **options)
        try:
            await publisher.connect()
        except Exception as exc:
            return repr(publisher), exc
        finally:
            await publisher.aclose(timeout=1)
        return repr(publisher), None

    return asyncio.run(asyncio.wait_for(run(), 30))


def everything_logged(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(
        f"{r.getMessage()} {r.exc_text or ''}"
        + (logging.Formatter().formatException(r.exc_info) if r.exc_info else "")
        for r in caplog.records
    )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "url, options",
    [
        (f"amqp://guest:{quote(SECRET, safe='')}@{HOST}/%2F", {}),
        (f"amqp://guest@{HOST}/%2F", {"password": SECRET}),
        (f"amqp://guest:guest@{HOST}/%2F", {"password": SECRET}),
        (f"amqp://{HOST}/%2F", {"username": "guest", "password": SECRET}),
    ],
    ids=["percent-encoded-in-url", "option-url-without", "option-overrides-url", "both-options"],
)
def test_a_refused_password_shows_nowhere(
    kind: str, url: str, options: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    text, error = connect(kind, url, **options)
    assert type(error) is AuthenticationFailed
    assert shown(str(error), repr(error), text, everything_logged(caplog)) == []


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "url",
    [
        f"amqp://guest:{SECRET}@{HOST}/%2F",
        f"amqp://guest:{SECRET}@localhost/",
        f"amqps://guest:{SECRET}@{HOST}/%2F?heartbeat=5",
        f"amqp://guest:Zq7@{HOST}/%2F?ssl_options=Xw9",
    ],
)
def test_a_url_that_does_not_parse_shows_no_password(
    kind: str, url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with pytest.raises(ConfigurationError) as info:
        connect(kind, url)
    assert str(info.value).startswith(("malformed broker URL amqp", "broker URL amqp"))
    assert shown(str(info.value), everything_logged(caplog)) == []


@pytest.mark.parametrize("kind", KINDS)
def test_username_and_password_options_override_the_url(kind: str) -> None:
    url = f"amqp://nobody:{quote(SECRET, safe='')}@{HOST}/%2F"
    text, error = connect(kind, url, username="guest", password="guest")
    assert error is None
    assert shown(text) == []


@pytest.mark.parametrize("kind", KINDS)
def test_a_publisher_with_a_password_option_confirms(kind: str) -> None:
    url = f"amqp://{HOST}/%2F"
    if kind == "sync":
        with Publisher(url, username="guest", password="guest") as publisher:
            confirmation = publisher.publish_and_wait(
                "", "secrets-test-no-queue", b"x", mandatory=False
            )
    else:

        async def run() -> Confirmation:
            async with AsyncPublisher(url, username="guest", password="guest") as publisher:
                return await publisher.publish_and_wait(
                    "", "secrets-test-no-queue", b"x", mandatory=False
                )

        confirmation = asyncio.run(run())
    assert isinstance(confirmation, Confirmation)
