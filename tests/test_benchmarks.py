"""The benchmark runs as documented (a short pass), so its figures can always be reproduced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "run.py"


@pytest.mark.broker
def test_sync_benchmark_runs_every_row_and_reports_medians(amqp_url: str) -> None:
    result = subprocess.run(
        [
            *(sys.executable, str(BENCH), "--only", "sync", "--count", "300", "--repeat", "2"),
            *("--sizes", "12,1024", "--json", "--url", amqp_url),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "AMQP_URL": amqp_url},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    names = [r["name"] for r in rows if r["body_bytes"] == 12]
    assert names == [
        "pika, no confirms",
        "pika, BlockingChannel.confirm_delivery()",
        "pika, transaction per message",
        "reliable_amqp.Publisher (streaming confirms)",
        "reliable_amqp.Publisher.publish_many (1,000 a call)",
        "raw frames, no client work (broker ceiling)",
    ]
    assert len(rows) == 12
    for row in rows:
        assert len(row["runs"]) == 2 and all(rate > 0 for rate in row["runs"])
        assert 0 < row["cpu_us"] < 100_000  # the client-CPU column, us per message
        assert min(row["runs"]) <= row["rate"] <= max(row["runs"])
        assert row["msgs"] == 300


@pytest.mark.broker
def test_client_cpu_benchmark_reports_every_row(amqp_url: str) -> None:
    script = BENCH.parent / "client_cpu.py"
    result = subprocess.run(
        [
            *(sys.executable, str(script), "--count", "400", "--batch", "100"),
            *("--repeat", "1", "--threads", "4"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "AMQP_URL": amqp_url},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    rows = [line.split()[0] for line in result.stdout.splitlines()[3:]]
    assert rows == [
        "Publisher.publish()",
        "Publisher.publish(),",
        "Publisher.publish_many(100)",
        "AsyncPublisher.publish()",
        "AsyncPublisher.publish_many(100)",
    ]
    for line in result.stdout.splitlines()[3:]:
        us = line.split()[-3] if "threads" in line else line.split()[1]
        assert 0 < float(us) < 10_000  # us per message
