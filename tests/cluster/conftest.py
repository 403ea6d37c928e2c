"""The three-node RabbitMQ 4 cluster the tests of this directory share.

``cluster``: three nodes in one cluster (about 10-15 s to start), once per module (each module is
one pytest-xdist unit; a module-scoped cluster is stopped before the next module's starts, so two
clusters never run at once on the suite's two cores). ``healthy``: the same cluster with every
node running and joined, before and after the test (a node the test killed is started again).
A module may define its own ``cluster`` fixture; ``healthy`` then uses that one.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from harness.rabbitmq4 import Rabbitmq4Cluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[Rabbitmq4Cluster]:
    """Three RabbitMQ 4 nodes in one cluster, for the whole module."""
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
