"""Spark fixtures: one local SparkSession for the whole run (helpers are in spark_support.py).

``local[2,3]`` runs two tasks at once and gives each task three attempts, so the sink's retry
behaviour is the real one. Workers run this interpreter (``PYSPARK_PYTHON``), where
``reliable_amqp`` is installed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable

from pyspark.sql import SparkSession

from reliable_amqp.spark import close_cached_publishers, register


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """A lean local SparkSession with task retries and the ``amqp`` data source registered."""
    session = (
        SparkSession.builder.master("local[2,3]")
        .appName("reliable-amqp-tests")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.memory", "1g")
        .config("spark.sql.streaming.forceDeleteTempCheckpointLocation", "true")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    register(session)
    yield session
    session.stop()
    close_cached_publishers()
