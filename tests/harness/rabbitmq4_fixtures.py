"""Pytest support for the RabbitMQ 4 tests (tests/rabbitmq4, tests/cluster).

- :func:`broker_versions`: what a RabbitMQ node says about itself when a client connects.
"""

from __future__ import annotations

import pika

__all__ = ["broker_versions"]


def broker_versions(url: str) -> dict[str, str]:
    """{"product": "RabbitMQ", "version": "4.3.6", "platform": "Erlang/OTP 29.1.1"} of ``url``."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        props = connection._impl.server_properties
    finally:
        connection.close()
    return {
        key: value.decode() if isinstance(value, bytes) else str(value)
        for key, value in props.items()
        if key in ("product", "version", "platform")
    }
