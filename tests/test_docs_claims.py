"""What docs/async.md and docs/sync.md say, checked against the real broker (issue 20, "docs
that match"): what a float header becomes on the wire and what each decoder reads back, and which
timeout bounds a ``declare_*`` call while the broker is down. Also figures the docs state that a
test can check (issue 33): the default connect budget, the stylesheet that wraps code."""

from __future__ import annotations

import asyncio
import re
import socket
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import aio_pika
import pytest

from reliable_amqp import (
    AmqpConnectionError,
    AsyncPublisher,
    OperationTimeout,
    Publisher,
    RecoveryFailed,
    RetryPolicy,
)
from support.broker import BrokerAdmin, unique

pytestmark = pytest.mark.broker

HEADERS: dict[str, Any] = {"f": 0.1, "neg": -2.5, "nested": {"x": 3.25}}


def test_float_headers_go_out_as_doubles_which_pika_reads_back_truncated(
    amqp_url: str, broker: BrokerAdmin
) -> None:
    queue = broker.queue()
    with Publisher(amqp_url) as publisher:
        publisher.publish("", queue, b"sync", headers=HEADERS).result(timeout=10)

    async def publish_and_read() -> list[dict[str, Any]]:
        async with AsyncPublisher(amqp_url) as publisher:
            await (await publisher.publish("", queue, b"async", headers=HEADERS))
        # pamqp (aio-pika, aiormq) decodes the table of each message as sent
        connection = await aio_pika.connect(amqp_url)
        try:
            channel = await connection.channel()
            source = await channel.get_queue(queue, ensure=False)
            read = []
            for _ in range(2):
                message = await source.get(timeout=5, no_ack=False)
                read.append(dict(message.headers))
                await message.nack(requeue=True)  # back for pika to read
            return read
        finally:
            await connection.close()

    assert asyncio.run(publish_and_read()) == [HEADERS, HEADERS]  # doubles, exact
    # pika's decoder (through 1.4) turns an AMQP double into an int: 0.1 -> 0, -2.5 -> -2
    read_by_pika = [props.headers for props, _ in broker.drain(queue)]
    assert read_by_pika == [{"f": 0, "neg": -2, "nested": {"x": 3}}] * 2
    # what the docs advise instead: a Decimal, which pika reads back exactly
    with Publisher(amqp_url) as publisher:
        publisher.publish("", queue, b"d", headers={"f": Decimal("0.1")}).result(timeout=10)
    assert [props.headers for props, _ in broker.drain(queue)] == [{"f": Decimal("0.1")}]


def refused_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"amqp://guest:guest@127.0.0.1:{port}/%2F"


POLICY = RetryPolicy(max_attempts=2, initial_delay=0.05, max_delay=0.05, jitter=0)


def test_a_declaration_before_any_connection_is_bounded_by_the_connect_policy() -> None:
    publisher = Publisher(refused_url(), connect_policy=POLICY)
    with pytest.raises(RecoveryFailed, match="gave up connecting after 2 attempts"):
        publisher.declare_queue(unique("never"), timeout=60)
    publisher.close()

    async def declare() -> None:
        publisher = AsyncPublisher(refused_url(), connect_policy=POLICY)
        try:
            with pytest.raises(RecoveryFailed, match="gave up connecting after 2 attempts"):
                await publisher.declare_queue(unique("never"), timeout=60)
        finally:
            await publisher.aclose()

    asyncio.run(declare())


@pytest.mark.faults
def test_a_declaration_while_recovering_waits_timeout_then_raises(
    broker: BrokerAdmin, make_proxy: Any
) -> None:
    proxy = make_proxy()
    policy = RetryPolicy(max_attempts=None, deadline=None, initial_delay=0.2, max_delay=0.2)
    queue = unique("declared-later")
    broker._queues.append(queue)  # deleted at teardown
    publisher = Publisher(proxy.url(), connect_policy=policy)
    publisher.connect()
    proxy.refuse()
    proxy.cut()
    started = time.monotonic()
    with pytest.raises(OperationTimeout, match=r"took over 0\.5 s"):
        publisher.declare_queue(queue, timeout=0.5)
    assert time.monotonic() - started < 3
    # declarations are idempotent: the same call succeeds once a connection is back
    proxy.accept()
    assert publisher.declare_queue(queue, timeout=15) == queue
    broker._ch().queue_declare(queue, passive=True)
    publisher.close()

    other = make_proxy()

    async def declare_while_down() -> None:
        publisher = AsyncPublisher(other.url(), connect_policy=policy)
        try:
            await publisher.connect()
            other.refuse()
            other.cut()
            started = time.monotonic()
            # OperationTimeout, or the connection error when the dying connection took the
            # declaration before the publisher saw it die: both retriable, both within timeout
            with pytest.raises((OperationTimeout, AmqpConnectionError)) as info:
                await publisher.declare_queue(unique("not-declared"), timeout=0.5)
            assert info.value.retriable
            assert time.monotonic() - started < 3
        finally:
            await publisher.aclose()

    asyncio.run(declare_while_down())


ROOT = Path(__file__).resolve().parent.parent


def test_the_default_connect_budget_the_docs_state() -> None:
    from reliable_amqp._core.options import DEFAULT_CONNECT_POLICY as policy

    text = " ".join((ROOT / "docs" / "faults.md").read_text(encoding="utf-8").split())
    said = re.search(r"tries up to (\d+) times within (\d+) s \(([\d.]+) s after the first", text)
    assert said is not None
    assert (int(said[1]), float(said[2])) == (policy.max_attempts, policy.deadline)
    assert float(said[3]) == policy.initial_delay
    between = f"at most {policy.max_delay:g} s between attempts, plus up to {policy.jitter:g} s"
    assert between in text


def test_code_in_the_docs_wraps_rather_than_running_off_the_page() -> None:
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert "stylesheets/extra.css" in config and "pygments_lang_class: true" in config
    css = (ROOT / "docs" / "stylesheets" / "extra.css").read_text(encoding="utf-8")
    assert ".language-bash" in css and "white-space: pre-wrap" in css
