"""Spark fixtures: one local SparkSession at a time, classic or Spark Connect (helpers are in
tests/support/spark.py).

``local[2,3]`` runs two tasks at once and gives each task three attempts, so the sink's retry
behaviour is the real one. Workers run this interpreter (``PYSPARK_PYTHON``), where
``reliable_amqp`` is installed.

Every test taking ``spark`` runs on a classic session; a test marked ``spark_connect`` runs a
second time through Spark Connect (an in-process Connect server on a free port, as
``SparkSession.builder.remote("local[2,3]")`` starts one, and a gRPC client session). Once a
Connect session exists, ``pyspark.sql.functions`` build Connect columns, so the two cannot
serve one process at once: ``spark`` is a session-scoped fixture parametrized by mode, and
pytest runs the classic tests, stops that session, then runs the Connect ones.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator
from typing import cast

import pytest

os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable

from pyspark.sql import SparkSession

from reliable_amqp.spark import close_cached_publishers, register
from support.spark import CONNECT_ENV

CONF = {
    "spark.app.name": "reliable-amqp-tests",
    "spark.sql.shuffle.partitions": "2",
    "spark.default.parallelism": "2",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.session.timeZone": "UTC",
    "spark.driver.memory": "1g",
    "spark.sql.streaming.forceDeleteTempCheckpointLocation": "true",
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``spark`` is classic, or classic then Connect for tests marked ``spark_connect``."""
    if "spark" in metafunc.fixturenames:
        both = metafunc.definition.get_closest_marker("spark_connect") is not None
        modes = ["classic", "connect"] if both else ["classic"]
        metafunc.parametrize("spark", modes, indirect=True, scope="session")


def _classic() -> SparkSession:
    builder = SparkSession.builder.master("local[2,3]")
    for key, value in CONF.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _connect() -> tuple[SparkSession, SparkSession]:
    """A local Spark Connect server and a client session on it: (client, server).

    This is what ``SparkSession.builder.remote("local[2,3]")`` does (a classic session with the
    Connect plugin, then a gRPC client), except for the port: ``remote("local")`` always dials
    15002 (an ephemeral port needs SPARK_TESTING, which changes Spark's behaviour), and several
    test runs share this machine. The server reuses the JVM the classic tests started.
    """
    port = _free_port()
    builder = SparkSession.builder.master("local[2,3]")
    for key, value in {
        **CONF,
        "spark.plugins": "org.apache.spark.sql.connect.SparkConnectPlugin",
        "spark.connect.grpc.binding.port": str(port),
        "spark.sql.artifact.isolation.enabled": "true",
        "spark.sql.artifact.isolation.alwaysApplyClassloader": "true",
    }.items():
        builder = builder.config(key, value)
    server = builder.getOrCreate()
    server.sparkContext.setLogLevel("ERROR")

    from pyspark.sql.connect.session import SparkSession as ConnectSession

    os.environ["SPARK_CONNECT_MODE_ENABLED"] = "1"  # pyspark.sql.functions build Connect columns
    client = ConnectSession.builder.remote(f"sc://127.0.0.1:{port}").getOrCreate()
    # cast: the tests drive a Connect session through the classic SparkSession's API
    return cast(SparkSession, client), server


@pytest.fixture(scope="session")
def spark(request: pytest.FixtureRequest) -> Iterator[SparkSession]:
    """A lean local SparkSession (classic or Connect) with task retries and ``amqp`` registered."""
    if getattr(request, "param", "classic") == "connect":
        session, server = _connect()
    else:
        session = server = _classic()
    register(session)
    try:
        yield session
    finally:
        session.stop()
        server.stop()
        for name in CONNECT_ENV:
            os.environ.pop(name, None)
        close_cached_publishers()
