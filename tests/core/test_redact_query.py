"""redact_url shows what a query parameter that a publisher option replaces says: only a
password is secret there (issue 20); TLS and unknown parameters stay hidden."""

from __future__ import annotations

import pytest

from reliable_amqp import ConfigurationError, Publisher
from reliable_amqp._core.options import redact_url


@pytest.mark.parametrize(
    "url, shown",
    [
        (
            "amqp://u:pw@h/?connection_attempts=3&retry_delay=2",
            "amqp://u:***@h/?connection_attempts=3&retry_delay=2",
        ),
        (
            "amqp://h/?heartbeat=5&socket_timeout=7&name=app",
            "amqp://h/?heartbeat=5&socket_timeout=7&name=app",
        ),
        (
            "amqp://u:pw@h/?timeout=3&cafile=/x&token=t0k",
            "amqp://u:***@h/?timeout=3&cafile=***&token=***",
        ),
        ("amqps://h/?ssl_options={'password':'pw'}", "amqps://h/?ssl_options=***"),
    ],
)
def test_redact_url_shows_the_values_an_option_replaces(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_the_refusal_of_connection_attempts_echoes_its_value() -> None:
    with pytest.raises(ConfigurationError) as info:
        Publisher("amqp://guest:s3cret@h/?connection_attempts=3")
    assert "amqp://guest:***@h/?connection_attempts=3: the URL parameter" in str(info.value)
    assert "s3cret" not in str(info.value)
