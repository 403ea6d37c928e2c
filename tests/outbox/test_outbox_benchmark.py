"""benchmarks/outbox.py runs as documented (``--quick``: tiny sizes), every row with figures, so
the figures docs/outbox.md records can always be reproduced."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parent.parent.parent / "benchmarks" / "outbox.py"


def positive(row: dict[str, Any], *keys: str) -> None:
    for key in keys:
        value = row[key]
        assert isinstance(value, int | float) and math.isfinite(value) and value > 0, (key, row)


@pytest.mark.broker
def test_outbox_benchmark_prints_every_row(amqp_url: str, tmp_path: Path) -> None:
    saved = tmp_path / "figures.json"
    result = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--save", str(saved), "--url", amqp_url],
        capture_output=True,
        text=True,
        timeout=120,
        # the figures do not matter here: a broker busy with other tests' work must not keep
        # each row waiting for idleness
        env={**os.environ, "AMQP_URL": amqp_url, "RELIABLE_AMQP_BENCH_IDLE_TIMEOUT": "0"},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    figures = json.loads(saved.read_text())
    printed = result.stdout
    for section in ("drain", "relays", "latency", "writer", "commits", "sqlite", "mariadb",
                    "stacks"):  # fmt: skip
        for row in figures[section]:
            assert row["name"] in printed, (section, row["name"])
    assert "peak difference" in printed

    plain, relay, ceiling, fill = figures["drain"]
    assert plain["name"].startswith("Publisher.publish_many")
    assert relay["name"].startswith("OutboxRelay, 1 process, PostgreSQL")
    assert ceiling["name"].startswith("raw frames")
    for row in (plain, relay, ceiling, fill):
        positive(row, "msgs", "rate")
    positive(relay, "vs_publish_many", "cpu_us", "seconds", "rss_peak_mb")
    assert relay["extra_in_queue"] == 0 and relay["published"] == [relay["msgs"]]

    small, big = figures["rss"]
    assert small["msgs"] < big["msgs"]
    for row in (small, big):
        positive(row, "rss_ready_mb", "rss_peak_mb", "rss_hwm_mb")

    _one, two = figures["relays"]
    positive(two, "rate", "vs_one")
    assert sum(two["published"]) >= two["msgs"] and len(two["published"]) == 2

    on, off = figures["latency"]
    assert "NOTIFY on" in on["name"] and "NOTIFY off" in off["name"]
    for row in (on, off):
        assert row["delivered"] == row["commits"]
        positive(row, "commits", "confirm_p50_ms", "confirm_p99_ms", "delivery_p50_ms",
                 "delivery_p99_ms")  # fmt: skip

    writer = figures["writer"]
    assert [(r["name"], r["rows_per_txn"]) for r in writer] == [
        (name, per_txn)
        for per_txn in (1, 100)
        for name in ("Outbox.add(), NOTIFY on", "Outbox.add(), NOTIFY off", "plain INSERT")
    ]
    for row in writer:
        positive(row, "statement_us", "total_us", "cpu_us", "txn_rate")

    commits = figures["commits"]
    assert [(r["writers"], r["notify"]) for r in commits] == [
        (1, False), (1, True), (2, False), (2, True),
    ]  # fmt: skip
    for row in commits:
        positive(row, "commits", "commit_rate")
        assert len(row["runs"]) == 2 and 0 <= row["lock_wait"] <= 1

    for section, engine in (("sqlite", "SQLite"), ("mariadb", "MariaDB")):
        plain, relay, fill = figures[section]
        assert plain["name"].startswith("Publisher.publish_many") and plain["msgs"] == relay["msgs"]
        assert relay["name"].startswith(f"OutboxRelay, {engine} backlog of")
        positive(relay, "rate", "vs_publish_many", "cpu_us")
        assert relay["extra_in_queue"] == 0 and relay["published"] == [relay["msgs"]]
        assert fill["name"].startswith(f"Outbox.add_many on {engine}")
        positive(fill, "rate", "cpu_us")
    # MariaDB's CPU: its server process's, when this machine shows it (None otherwise)
    if figures["mariadb"][1]["backend_cpu_us"] is not None:
        positive(figures["mariadb"][1], "backend_cpu_us")

    stacks = figures["stacks"]
    assert [r["name"] for r in stacks] == [
        "psycopg (PostgreSQL)", "SQLAlchemy Session (psycopg)",
        "SQLAlchemy AsyncSession (asyncpg)", "asyncpg", "Django atomic() (PostgreSQL)",
        "PyMySQL (MariaDB)", "sqlite3",
    ]  # fmt: skip
    for row in stacks:
        positive(row, "txns", "add_cpu_us", "plain_cpu_us", "add_txn_us", "plain_txn_us")
        assert row["extra_cpu_us"] == row["add_cpu_us"] - row["plain_cpu_us"]
        assert len(row["extra_runs"]) == 4 and all(math.isfinite(x) for x in row["extra_runs"])
    assert "extra CPU" in printed
