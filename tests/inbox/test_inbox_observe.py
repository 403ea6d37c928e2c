"""The inbox's size reaches OpenTelemetry as observable gauges (issue 40: the attempts ledger's
size among the telemetry), read on a connection of their own when the SDK collects."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, NumberDataPoint

from reliable_amqp.inbox import Inbox, observe


class _Delivery:
    def __init__(self, message_id: str, redelivered: bool = False) -> None:
        self.message_id = message_id
        self.redelivered = redelivered
        self.headers: dict[str, Any] = {}
        self.attempt = 2 if redelivered else 1


def _gauges(reader: InMemoryMetricReader) -> dict[str, float]:
    found: dict[str, float] = {}
    data = reader.get_metrics_data()
    assert data is not None
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    assert isinstance(point, NumberDataPoint)
                    found[metric.name] = point.value
    return found


def test_rows_ledger_and_oldest_age_are_observed(tmp_path: Path) -> None:
    path = tmp_path / "inbox.db"
    conn = sqlite3.connect(path, isolation_level=None)
    inbox = Inbox("billing")
    conn.execute("BEGIN")
    inbox.install(conn)
    conn.execute("COMMIT")
    for i in range(3):
        conn.execute("BEGIN")
        assert inbox.claim(conn, _Delivery(f"m{i}"))
        conn.execute("COMMIT")
    ledger = sqlite3.connect(path, isolation_level=None)
    inbox.record_attempt(ledger, _Delivery("poison", redelivered=True))
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    try:
        assert observe(f"sqlite:///{path}", meter_provider=provider)
        gauges = _gauges(reader)
        assert gauges["reliable_amqp.inbox.rows"] == 3
        assert gauges["reliable_amqp.inbox.attempts"] == 1
        assert gauges["reliable_amqp.inbox.oldest_age"] > 0
        conn.execute("BEGIN")
        assert inbox.claim(conn, _Delivery("m3"))
        conn.execute("COMMIT")
        assert _gauges(reader)["reliable_amqp.inbox.rows"] == 4  # read again at each collection
    finally:
        provider.shutdown()
        conn.close()
        ledger.close()


def test_without_an_sdk_nothing_is_registered(tmp_path: Path) -> None:
    assert observe(f"sqlite:///{tmp_path / 'x.db'}") is False
