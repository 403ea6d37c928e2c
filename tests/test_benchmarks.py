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
        timeout=180,
        # the rows' figures do not matter here: a broker busy with other tests' work must not
        # keep every row waiting its 30 s for idleness
        env={**os.environ, "AMQP_URL": amqp_url, "RELIABLE_AMQP_BENCH_IDLE_TIMEOUT": "2"},
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
        "reliable_amqp.Publisher (streaming confirms), mandatory=False",
        "reliable_amqp.Publisher.publish_many (1,000 a call)",
        "raw frames, no client work (broker ceiling)",
    ]
    assert len(rows) == 14
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


@pytest.mark.broker
def test_client_cpu_benchmark_compares_another_tree_pass_by_pass(amqp_url: str) -> None:
    script = BENCH.parent / "client_cpu.py"
    src = str(BENCH.parent.parent / "src")
    result = subprocess.run(
        [
            *(sys.executable, str(script), "--count", "200", "--repeat", "2", "--json"),
            *("--only", "publish,async-many", "--batch", "100", "--compare", src),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        # the rows' figures do not matter here: a broker busy with other tests' work must not
        # keep every row waiting its 30 s for idleness
        env={**os.environ, "AMQP_URL": amqp_url, "RELIABLE_AMQP_BENCH_IDLE_TIMEOUT": "2"},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    assert list(figures) == [
        "Publisher.publish()",
        "AsyncPublisher.publish_many(100)",
        f"[{src}] Publisher.publish()",
        f"[{src}] AsyncPublisher.publish_many(100)",
    ]
    for cpu, wall in figures.values():  # (CPU seconds, wall seconds) of each of the 2 passes
        assert len(cpu) == len(wall) == 2
        assert all(0 < seconds < 60 for seconds in cpu + wall)


@pytest.mark.broker
@pytest.mark.parametrize("row", ["publish", "many", "async", "async-many"])
def test_instruction_count_rows_publish_what_they_say(amqp_url: str, row: str) -> None:
    """benchmarks/instructions.py's measured loop (what valgrind runs), without valgrind."""
    script = BENCH.parent / "instructions.py"
    result = subprocess.run(
        [sys.executable, str(script), "--child", row, "--counts", "2000,2000", "--url", amqp_url],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["2000", "confirmed"]


def test_instruction_count_refuses_unknown_rows_and_bad_counts() -> None:
    script = BENCH.parent / "instructions.py"
    for args, says in (
        (["--only", "publish,bogus"], "unknown rows ['bogus']"),
        (["--counts", "60000,20000"], "--counts"),
    ):
        result = subprocess.run(
            [sys.executable, str(script), *args], capture_output=True, text=True, check=False
        )
        assert result.returncode == 2 and says in result.stderr


@pytest.mark.broker
def test_consume_benchmark_runs_every_row(amqp_url: str) -> None:
    """benchmarks/consume.py, tiny: every row consumes (and acks) all its messages."""
    result = subprocess.run(
        [sys.executable, str(BENCH.parent / "consume.py"), "--count", "300", "--json"],
        capture_output=True,
        text=True,
        timeout=180,
        env={
            **os.environ,
            "RELIABLE_AMQP_BENCH_IDLE_TIMEOUT": "2",
            "RELIABLE_AMQP_BENCH_ROW_TIMEOUT": "20",  # a stuck row says which, well before 180 s
            "AMQP_URL": amqp_url,
        },
        check=False,
    )
    assert result.returncode == 0, result.stderr
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    node = "Node amqplib channel.consume, ack each"
    assert set(rows) == {
        "pika BlockingConnection basic_consume, ack each",
        "pika SelectConnection basic_consume, ack each",
        "aio-pika queue.consume + message.process()",
        node,
        "reliable_amqp.Consumer (no-op handler)",
        "reliable_amqp.AsyncConsumer (no-op async handler)",
        "reliable_amqp.AsyncConsumer concurrency=16 (no-op)",
    }
    if "missing" in rows[node]:  # no node or amqplib here: said, not skipped in silence
        assert f"MISSING ROW {node}" in result.stderr
        del rows[node]
    for row in rows.values():
        assert row["msgs"] == 300 and row["prefetch"] == 200
        assert row["rate"] > 0 and 0 < row["cpu_us"] < 100_000
