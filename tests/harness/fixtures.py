"""Pytest fixtures for fault-injection tests: a disposable broker node and TCP proxies to it.

Load them from a conftest with ``pytest_plugins = ["harness.fixtures"]`` (``tests/`` on sys.path)
or with ``from harness.fixtures import *``.

- ``disposable_broker_session``: the node, started once per session and stopped at its end.
- ``disposable_broker``: the same node, guaranteed running when a test starts. After the test it is
  started again if the test killed it, and memory/disk limits a test changed are restored, so
  the next test gets a healthy node whatever this one did.
- ``make_proxy``: factory ``make_proxy(target_port=None, target_host="127.0.0.1") -> TcpProxy``;
  with no port, a proxy to the test broker (``AMQP_TEST_URL``, or ``AMQP_TEST_HOST`` and
  ``AMQP_TEST_PORT``); every proxy it made is closed after the test.
- ``tcp_proxy``: a started proxy to the disposable broker.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from support.broker import AMQP_DEFAULT_PORT, AMQP_HOST, AMQP_PORT

from .node import DisposableBroker
from .proxy import TcpProxy

__all__ = [
    "ProxyFactory",
    "disposable_broker",
    "disposable_broker_session",
    "make_proxy",
    "tcp_proxy",
]

ProxyFactory = Callable[..., TcpProxy]


#: ``rabbitmq4`` makes the disposable node a RabbitMQ 4 one (the RabbitMQ 4 leg, tests/rabbitmq4)
DISPOSABLE_BROKER_ENV = "RELIABLE_AMQP_DISPOSABLE_BROKER"


@pytest.fixture(scope="session")
def disposable_broker_session() -> Iterator[DisposableBroker]:
    """One disposable node for the whole session (about 5 s to start)."""
    if os.environ.get(DISPOSABLE_BROKER_ENV) == "rabbitmq4":
        from .rabbitmq4 import Rabbitmq4Node

        with Rabbitmq4Node() as node:
            yield node
        return
    with DisposableBroker() as broker:
        yield broker


@pytest.fixture
def disposable_broker(disposable_broker_session: DisposableBroker) -> Iterator[DisposableBroker]:
    """The session's disposable node, running; a test may kill, restart or throttle it."""
    broker = disposable_broker_session
    broker.start()  # no-op unless an earlier teardown failed to bring it back
    yield broker
    if broker.is_running():
        broker.reset_limits()
    else:
        broker.start()


@pytest.fixture
def make_proxy() -> Iterator[ProxyFactory]:
    """Factory for started TcpProxy objects; all are closed (and checked) after the test."""
    proxies: list[TcpProxy] = []

    def factory(target_port: int | None = None, target_host: str = "127.0.0.1") -> TcpProxy:
        if target_port is None or (target_port, target_host) == (AMQP_DEFAULT_PORT, "127.0.0.1"):
            # The test broker, wherever it is (a RabbitMQ 4 node, another broker, on another
            # port). An explicit AMQP_DEFAULT_PORT still means it.
            target_port, target_host = AMQP_PORT, AMQP_HOST
        proxy = TcpProxy(target_port, target_host).start()
        proxies.append(proxy)
        return proxy

    yield factory
    errors: list[BaseException] = []
    for proxy in proxies:
        try:
            proxy.close()
        except Exception as exc:  # close them all before reporting the first failure
            errors.append(exc)
    if errors:
        raise errors[0]


@pytest.fixture
def tcp_proxy(disposable_broker: DisposableBroker, make_proxy: ProxyFactory) -> TcpProxy:
    """A started proxy in front of the disposable broker; ``tcp_proxy.url()`` reaches it."""
    return make_proxy(disposable_broker.port)
