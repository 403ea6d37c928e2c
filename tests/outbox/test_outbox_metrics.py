"""The relay's metrics through the OpenTelemetry API (an SDK with an in-memory reader here):
commit-to-confirm latency, failed rows, backlog and oldest age."""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from reliable_amqp.outbox import Outbox, status
from support.broker import BrokerAdmin
from support.outbox import RelayThread, wait_for_count

pytestmark = pytest.mark.broker


def _points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    found: dict[str, list[Any]] = {}
    data = reader.get_metrics_data()
    assert data is not None
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name.startswith("reliable_amqp.outbox."):
                    found[metric.name] = list(metric.data.data_points)
    return found


def test_latency_failures_backlog_and_oldest_age_are_measured(
    pg_dsn: str, amqp_url: str, broker: BrokerAdmin
) -> None:
    queue = broker.queue()
    outbox = Outbox()
    with psycopg.connect(pg_dsn) as conn:
        outbox.install(conn)
        conn.commit()
        for i in range(50):
            outbox.add(conn, "", queue, b"%d" % i)
        outbox.add(conn, "", f"{queue}-nowhere", b"unroutable")
    reader = InMemoryMetricReader()
    with RelayThread(pg_dsn, amqp_url, meter_provider=MeterProvider(metric_readers=[reader])):
        assert wait_for_count(broker, queue, 50, 30) == 50
        end = time.monotonic() + 30
        while status(pg_dsn).failed < 1:  # the unroutable row's return, then its move
            assert time.monotonic() < end, "the unroutable row did not fail"
            time.sleep(0.05)
        points = _points(reader)
    latency = points["reliable_amqp.outbox.commit_to_confirm"]
    assert sum(p.count for p in latency) == 50 and all(p.min >= 0 for p in latency)
    assert sum(p.value for p in points["reliable_amqp.outbox.failed"]) == 1
    # the first look (before any row was read) saw the 51 rows and the oldest one's age
    assert [p.value for p in points["reliable_amqp.outbox.backlog"]] == [51]
    assert points["reliable_amqp.outbox.oldest_age"][0].value >= 0
    table = points["reliable_amqp.outbox.backlog"][0].attributes
    assert table == {"reliable_amqp.outbox.table": "amqp_outbox"}
