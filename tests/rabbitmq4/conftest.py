"""One RabbitMQ 4 node for the directory (a package-scoped fixture): the harness's checks, the
Consumer's module and the contract subset's leg use it in turn, instead of starting one each (a
node's start and stop twice fewer). Under pytest-xdist the directory is one unit of work
(tests/conftest.py). A test may kill, restart, freeze or thaw it: ``rmq4`` hands it on running.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from harness.rabbitmq4 import Rabbitmq4Node
from harness.rabbitmq4_fixtures import broker_versions


@pytest.fixture(scope="package")
def rmq4_node() -> Iterator[Rabbitmq4Node]:
    """The directory's RabbitMQ 4 node."""
    with Rabbitmq4Node() as node:
        assert broker_versions(node.url)["version"].startswith("4."), broker_versions(node.url)
        yield node


@pytest.fixture
def rmq4(rmq4_node: Rabbitmq4Node) -> Iterator[Rabbitmq4Node]:
    """The directory's node, running (started again if an earlier test left it down or frozen)."""
    rmq4_node.thaw()
    rmq4_node.start()  # (nothing when it runs)
    yield rmq4_node
    rmq4_node.thaw()
    rmq4_node.start()
