"""Test support shared by every test module: a blocking admin client and unique names.

Kept out of conftest.py so test modules can import it by a name no other conftest shadows
(``tests/spark/conftest.py`` is also a module named ``conftest``).
"""

from __future__ import annotations

import os
import time
import uuid
from urllib.parse import urlsplit

import pika

#: AMQP's own port, the test broker's when nothing else names one (the documented default)
AMQP_DEFAULT_PORT = 5672


def _test_broker() -> tuple[str, str, int]:
    """(URL, host, port) of the broker the suite runs against: ``AMQP_TEST_URL`` when set (its
    host and port then win), else ``AMQP_TEST_HOST`` (127.0.0.1) and ``AMQP_TEST_PORT``."""
    host = os.environ.get("AMQP_TEST_HOST", "127.0.0.1")
    port = int(os.environ.get("AMQP_TEST_PORT", AMQP_DEFAULT_PORT))
    url = os.environ.get("AMQP_TEST_URL")
    if url:
        parts = urlsplit(url)
        host = parts.hostname or host
        port = parts.port or (5671 if parts.scheme == "amqps" else AMQP_DEFAULT_PORT)
        return url, host, port
    return f"amqp://guest:guest@{_hostport(host, port)}/%2F", host, port


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


#: the test broker: every test that reaches a broker reaches this one (never a port of its own)
AMQP_URL, AMQP_HOST, AMQP_PORT = _test_broker()
#: ``host:port`` of the test broker, for tests that build URLs with other credentials or options
AMQP_HOSTPORT = _hostport(AMQP_HOST, AMQP_PORT)


class BrokerAdmin:
    """A blocking pika connection for declaring, counting and reading in tests."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._conn = pika.BlockingConnection(pika.URLParameters(url))
        self.channel = self._conn.channel()
        self._queues: list[str] = []
        self._exchanges: list[str] = []

    def _ch(self) -> pika.adapters.blocking_connection.BlockingChannel:
        if self.channel.is_closed:  # a failed passive declare closes the channel
            self.channel = self._conn.channel()
        return self.channel

    def queue(self, name: str | None = None, *, durable: bool = True, **arguments: object) -> str:
        """Declare a queue (deleted at teardown).

        ``arguments`` become x-arguments with dashes: ``x_max_length=5`` is ``x-max-length``.
        """
        name = name or unique("q")
        args = {key.replace("_", "-"): value for key, value in arguments.items()}
        self._ch().queue_declare(name, durable=durable, arguments=args or None)
        self._queues.append(name)
        return name

    def exchange(self, name: str | None = None, kind: str = "direct") -> str:
        """Declare an exchange (deleted at teardown)."""
        name = name or unique("x")
        self._ch().exchange_declare(name, exchange_type=kind, durable=True)
        self._exchanges.append(name)
        return name

    def bind(
        self,
        queue: str,
        exchange: str,
        routing_key: str,
        arguments: dict[str, object] | None = None,
    ) -> None:
        """Bind ``queue`` to ``exchange`` (``arguments``: a headers exchange's match)."""
        self._ch().queue_bind(queue, exchange, routing_key, arguments=arguments)

    def count(self, queue: str) -> int:
        """Messages ready in ``queue``."""
        return int(self._ch().queue_declare(queue, passive=True).method.message_count)

    def drain(self, queue: str) -> list[tuple[pika.spec.BasicProperties, bytes]]:
        """Take every message from ``queue`` (properties, body), in queue order."""
        out: list[tuple[pika.spec.BasicProperties, bytes]] = []
        ch = self._ch()
        expected = self.count(queue)
        if expected == 0:
            return out
        # basic.consume (not basic.get) so that draining 50,000 messages takes seconds. Manual
        # acks: what the consumer buffered beyond what we took is requeued on cancel, not lost.
        # A second without a delivery ends the drain only once the count at the start was
        # reached (or after a minute): on a loaded machine the broker pauses longer than that
        # (a full run on 2026-11-30: two matrix legs each read hundreds of messages short).
        last_tag = 0
        deadline = time.monotonic() + 60
        for method, props, body in ch.consume(queue, auto_ack=False, inactivity_timeout=1.0):
            if method is None:
                if len(out) >= expected or time.monotonic() > deadline:
                    break
                continue
            out.append((props, body))
            last_tag = method.delivery_tag
            if len(out) >= expected and self.count(queue) == 0:
                break
        if last_tag:
            ch.basic_ack(last_tag, multiple=True)
        ch.cancel()
        return out

    def purge(self, queue: str) -> None:
        self._ch().queue_purge(queue)

    def close(self) -> None:
        try:
            ch = self._ch()
            for q in self._queues:
                ch.queue_delete(q)
            for x in self._exchanges:
                ch.exchange_delete(x)
            self._conn.close()
        except pika.exceptions.AMQPError:
            pass


def unique(prefix: str) -> str:
    """A name no other test run uses (several runs may share the broker)."""
    return f"ra-test-{prefix}-{uuid.uuid4().hex[:12]}"
