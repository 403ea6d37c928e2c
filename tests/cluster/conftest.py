"""The three-node RabbitMQ 4 cluster the tests of this directory share.

``cluster``: three nodes in one cluster (about 10-15 s to start, 7 s to stop), once for the whole
directory (a package-scoped fixture: started by the first test that needs it, stopped after the
directory's last; under pytest-xdist the directory is one unit of work, tests/conftest.py
``SHARED_SESSION``, so two clusters never run at once on the suite's two cores). ``healthy``: the
same cluster with every node running and joined, before and after the test (a node the test
killed, or froze, is started again or thawed).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from harness.rabbitmq4 import Rabbitmq4Cluster


@pytest.fixture(scope="package")
def cluster() -> Iterator[Rabbitmq4Cluster]:
    """Three RabbitMQ 4 nodes in one cluster, for every module of this directory."""
    with Rabbitmq4Cluster(3) as started:
        yield started


def heal(cluster: Rabbitmq4Cluster) -> None:
    """Thaw every node, start those that are down, wait until all are members again."""
    for node in cluster.nodes:
        node.thaw()
        if not node.is_running():
            node.start()
    cluster.await_members()


@pytest.fixture
def healthy(cluster: Rabbitmq4Cluster) -> Iterator[Rabbitmq4Cluster]:
    """The cluster with every node running and joined, before and after the test."""
    heal(cluster)
    yield cluster
    heal(cluster)
