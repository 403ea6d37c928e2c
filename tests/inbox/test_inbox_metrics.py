"""The inbox's OpenTelemetry counters (claims, duplicates, pruned rows, redeliveries counted),
read back through the SDK's in-memory reader, on SQLite; and nothing made without an SDK."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, NumberDataPoint

from reliable_amqp.inbox import Inbox
from support.inbox import FakeDelivery


def _sums(reader: InMemoryMetricReader) -> dict[str, Any]:
    found: dict[str, Any] = {}
    data = reader.get_metrics_data()
    assert data is not None
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    assert isinstance(point, NumberDataPoint)
                    found[metric.name] = (point.value, dict(point.attributes or {}))
    return found


def test_the_counters(tmp_path: Path) -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    inbox = Inbox("billing", meter_provider=provider)
    path = str(tmp_path / "m.db")
    conn = sqlite3.connect(path)
    inbox.install(conn)
    conn.commit()
    with conn:
        assert inbox.claim(conn, FakeDelivery("a"))
        assert not inbox.claim(conn, FakeDelivery("a"))
        assert inbox.claim(conn, FakeDelivery("b"))
    assert inbox.record_attempt(lambda: sqlite3.connect(path), FakeDelivery("a", True)) == 2
    assert inbox.prune(conn, older_than=0) == 3
    sums = _sums(reader)
    attributes = {"reliable_amqp.inbox.table": "amqp_inbox", "reliable_amqp.inbox.scope": "billing"}
    assert sums == {
        "reliable_amqp.inbox.claims": (2, attributes),
        "reliable_amqp.inbox.duplicates": (1, attributes),
        "reliable_amqp.inbox.redeliveries": (1, attributes),
        "reliable_amqp.inbox.pruned": (3, attributes),
    }
    conn.close()
    provider.shutdown()


def test_without_an_sdk_nothing_is_made() -> None:
    inbox = Inbox("billing")  # the global provider is the API's placeholder here
    assert inbox.metrics.claims is None and inbox.metrics.pruned is None
