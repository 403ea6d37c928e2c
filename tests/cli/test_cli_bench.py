"""`reliable-amqp bench` run as a subprocess against the real broker."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pika
import pika.exceptions
import pytest

from support.broker import BrokerAdmin, unique

pytestmark = pytest.mark.broker

MODES = ["transactions", "confirm-each", "streaming", "streaming-many", "no-confirms"]


def bench(*args: str, url: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "AMQP_URL": url}
    return subprocess.run(
        [sys.executable, "-m", "reliable_amqp", "bench", *args],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_bench_json(amqp_url: str) -> None:
    result = bench(
        "--json", "--count", "200", "--slow-count", "50", "--body-size", "64", url=amqp_url
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["body_size"] == 64
    assert "guest:guest" not in result.stdout
    rows = {row["mode"]: row for row in report["results"]}
    assert list(rows) == MODES
    assert rows["transactions"]["messages"] == 50
    assert rows["confirm-each"]["messages"] == 50
    assert rows["streaming"]["messages"] == rows["streaming-many"]["messages"] == 200
    for row in rows.values():
        assert row["rate"] > 0
        assert 0 < row["cpu_us"] < 100_000  # client CPU per message, microseconds
        assert 0 < row["ratio"] <= 1
        assert row["queued"] == row["messages"]
    assert max(row["ratio"] for row in rows.values()) == 1


def queue_exists(url: str, queue: str) -> bool:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        connection.channel().queue_declare(queue, passive=True)
        return True
    except pika.exceptions.ChannelClosedByBroker as exc:
        assert exc.reply_code == 404
        return False
    finally:
        connection.close()


def test_bench_table_and_queue_cleanup(amqp_url: str) -> None:
    queue = unique("bench")
    result = bench(
        "--count", "100", "--modes", "streaming,no-confirms", "--queue", queue, url=amqp_url
    )
    assert result.returncode == 0, result.stderr
    assert "msgs/s" in result.stdout and "vs fastest" in result.stdout
    assert "streaming" in result.stdout and "transactions" not in result.stdout
    assert not queue_exists(amqp_url, queue)


def test_bench_refuses_an_existing_queue(amqp_url: str, broker: BrokerAdmin) -> None:
    queue = broker.queue()
    result = bench("--count", "10", "--queue", queue, url=amqp_url)
    assert result.returncode == 2
    assert "exists already" in result.stderr
    assert queue_exists(amqp_url, queue)


def test_bench_bad_mode_exits_2(amqp_url: str) -> None:
    result = bench("--modes", "carrier-pigeon", url=amqp_url)
    assert result.returncode == 2
    assert "carrier-pigeon" in result.stderr
