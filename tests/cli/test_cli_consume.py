"""`reliable-amqp consume` and `reliable-amqp dead-letters`, run as subprocesses against the broker.

What they promise: a message leaves its queue only once it is safe elsewhere (its line written
and synced, its republish confirmed); the lines are what `publish --format jsonl` reads.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import resource
import signal
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import pika
import pytest

from reliable_amqp import Publisher
from support.broker import BrokerAdmin, unique
from support.cli import run_cli

pytestmark = pytest.mark.broker


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _publish(url: str, queue: str, bodies: list[bytes]) -> None:
    """Publish ``bodies`` to ``queue``, ids ``m-0``, ``m-1``..., each confirmed."""
    with Publisher(url) as publisher:
        futures = publisher.publish_many(
            "", queue, bodies, message_ids=[f"m-{n}" for n in range(len(bodies))]
        )
        assert publisher.flush(30) == 0
    assert all(future.exception() is None for future in futures)


def test_round_trip_publish_consume_publish(
    amqp_url: str, broker: BrokerAdmin, tmp_path: Path
) -> None:
    queue = broker.queue()
    sent: list[dict[str, Any]] = [
        {"body": "plain", "routing_key": queue},
        {
            "body": "AAEC/w==",
            "body_encoding": "base64",
            "routing_key": queue,
            "headers": {"tenant": "acme", "n": 3, "tags": ["a", "b"], "nested": {"k": True}},
            "message_id": "order-42",
            "content_type": "application/octet-stream",
            "priority": 5,
            "correlation_id": "c-1",
            "timestamp": "2024-05-01T12:00:00+00:00",
            "delivery_mode": 1,
            "type": "order",
            "app_id": "shop",
        },
        {"body": "ünïcode ✓", "routing_key": queue, "expiration": "600000"},
        {"body": "", "routing_key": queue},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in sent), encoding="utf-8")
    published = run_cli("publish", "--format", "jsonl", str(source), url=amqp_url)
    assert published.returncode == 0, published.stderr

    out = tmp_path / "out.jsonl"
    result = run_cli("consume", queue, "--to", str(out), "--until-empty", url=amqp_url)
    assert result.returncode == 0, result.stderr
    assert broker.count(queue) == 0  # every one acked
    got = _lines(out)
    assert [line["body"] for line in got] == ["plain", "AAEC/w==", "ünïcode ✓", ""]
    assert got[1]["body_encoding"] == "base64"  # bytes that are not UTF-8
    rich = got[1]
    for key in ("headers", "message_id", "content_type", "priority", "correlation_id", "type"):
        assert rich[key] == sent[1][key], key
    assert rich["delivery_mode"] == 1 and rich["app_id"] == "shop"
    assert rich["timestamp"] == 1714564800  # POSIX seconds, which publish reads back
    assert got[2]["expiration"] == "600000"
    assert all(line["exchange"] == "" and line["routing_key"] == queue for line in got)
    assert os.stat(out).st_mode & 0o777 == 0o600

    # the file is valid input: published again, the same messages (ids included) arrive
    again = run_cli("publish", "--format", "jsonl", str(out), url=amqp_url)
    assert again.returncode == 0, again.stderr
    drained = broker.drain(queue)
    assert [body for _, body in drained] == [
        b"plain",
        b"\x00\x01\x02\xff",
        "ünïcode ✓".encode(),
        b"",
    ]
    props = drained[1][0]
    assert props.message_id == "order-42" and props.headers == sent[1]["headers"]
    assert props.delivery_mode == 1 and props.priority == 5 and props.timestamp == 1714564800


def test_headers_json_has_no_type_for_are_written_as_text(
    amqp_url: str, broker: BrokerAdmin, tmp_path: Path
) -> None:
    """Bytes, decimals and timestamps in headers (which AMQP has and JSON has not) neither stop
    the run nor drop the header: they are written as text (bytes as base64)."""
    queue = broker.queue()
    headers = {
        "raw": b"\x00\xff",
        "price": Decimal("-0.01"),
        "at": dt.datetime(2024, 5, 1, 12, 0, tzinfo=dt.timezone.utc),
        "plain": "text",
    }
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    channel = connection.channel()
    channel.confirm_delivery()
    channel.basic_publish("", queue, b"x", pika.BasicProperties(headers=headers), mandatory=True)
    connection.close()
    out = tmp_path / "out.jsonl"
    result = run_cli("consume", queue, "--to", str(out), "--count", "1", url=amqp_url)
    assert result.returncode == 0, result.stderr
    (line,) = _lines(out)
    assert line["headers"] == {
        "raw": "AP8=",
        "price": "-0.01",
        "at": "2024-05-01T12:00:00+00:00",
        "plain": "text",
    }
    assert broker.count(queue) == 0


def test_count_takes_the_first_n_and_leaves_the_rest(
    amqp_url: str, broker: BrokerAdmin, tmp_path: Path
) -> None:
    queue = broker.queue()
    _publish(amqp_url, queue, [f"m{n}".encode() for n in range(10)])
    out = tmp_path / "out.jsonl"
    result = run_cli("consume", queue, "--to", str(out), "--count", "4", url=amqp_url)
    assert result.returncode == 0, result.stderr
    assert [line["body"] for line in _lines(out)] == ["m0", "m1", "m2", "m3"]
    assert "4 messages" in result.stderr
    # appended to, not overwritten: a second run adds the next three
    result = run_cli("consume", queue, "--to", str(out), "--count", "3", url=amqp_url)
    assert result.returncode == 0, result.stderr
    assert [line["body"] for line in _lines(out)] == [f"m{n}" for n in range(7)]
    assert [body for _, body in broker.drain(queue)] == [b"m7", b"m8", b"m9"]


def test_a_batch_that_cannot_be_written_is_not_acked(
    amqp_url: str, broker: BrokerAdmin, tmp_path: Path
) -> None:
    """The file may grow to 2,000 bytes (RLIMIT_FSIZE): the third batch of five ~150-byte lines
    fails half-written. Its messages stay in the queue and its half is cut off the file."""
    queue = broker.queue()
    _publish(amqp_url, queue, [f"{n:03d}".encode() * 25 for n in range(30)])
    out = tmp_path / "out.jsonl"

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))

    env = {k: v for k, v in os.environ.items() if not k.startswith(("AMQP_", "RELIABLE_AMQP_"))}
    result = subprocess.run(
        [
            *(sys.executable, "-m", "reliable_amqp", "consume", queue, "--to", str(out)),
            *("--batch", "5", "--prefetch", "5", "--until-empty", "--url", amqp_url),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        preexec_fn=limit,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    assert "cannot write" in result.stderr and "not acked" in result.stderr
    written = _lines(out)  # whole lines only: the failed batch was cut off again
    assert [line["message_id"] for line in written] == [f"m-{n}" for n in range(10)]
    left = [props.message_id for props, _ in broker.drain(queue)]
    assert sorted(left) == sorted(f"m-{n}" for n in range(10, 30))


def test_kill_9_loses_nothing(amqp_url: str, broker: BrokerAdmin, tmp_path: Path) -> None:
    """Killed at any point, every message is on disk or still in the queue (or both)."""
    queue = broker.queue()
    total = 20_000  # far more than it writes before the kill
    _publish(amqp_url, queue, [f"{n}".encode() for n in range(total)])
    out = tmp_path / "out.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AMQP_", "RELIABLE_AMQP_"))}
    child = subprocess.Popen(
        [
            *(sys.executable, "-m", "reliable_amqp", "consume", queue, "--to", str(out)),
            *("--batch", "20", "--url", amqp_url),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (not out.exists() or out.stat().st_size < 20_000):
            time.sleep(0.01)
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    on_disk = {line["message_id"] for line in _lines(out)}
    assert on_disk  # it was killed mid-run, not before
    in_queue = {props.message_id for props, _ in broker.drain(queue)}
    assert on_disk | in_queue == {f"m-{n}" for n in range(total)}
    assert 0 < len(in_queue) < total  # killed mid-run; what was written and acked left


def test_sigterm_stops_after_writing_what_was_taken(
    amqp_url: str, broker: BrokerAdmin, tmp_path: Path
) -> None:
    queue = broker.queue()
    _publish(amqp_url, queue, [b"one", b"two"])
    out = tmp_path / "out.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AMQP_", "RELIABLE_AMQP_"))}
    child = subprocess.Popen(
        [
            *(sys.executable, "-m", "reliable_amqp", "consume", queue, "--to", str(out)),
            *("--url", amqp_url),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (not out.exists() or len(_lines(out)) < 2):
            time.sleep(0.02)
        child.send_signal(signal.SIGTERM)
        _, stderr = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, stderr
    assert [line["body"] for line in _lines(out)] == ["one", "two"]
    assert broker.count(queue) == 0


def test_a_queue_deleted_under_it_is_a_loud_failure(
    amqp_url: str, broker: BrokerAdmin, tmp_path: Path
) -> None:
    """The broker cancels the subscription: the command says so and fails, not "done"."""
    queue = broker.queue()
    _publish(amqp_url, queue, [b"one"])
    out = tmp_path / "out.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AMQP_", "RELIABLE_AMQP_"))}
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "reliable_amqp",
            "consume",
            queue,
            "--to",
            str(out),
            "--url",
            amqp_url,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (not out.exists() or not out.read_text()):
            time.sleep(0.02)
        broker.channel.queue_delete(queue)
        _, stderr = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 3, stderr
    assert "cancelled the subscription" in stderr
    assert [line["body"] for line in _lines(out)] == ["one"]


def test_a_missing_queue_or_a_bad_flag_is_a_usage_error(amqp_url: str, tmp_path: Path) -> None:
    result = run_cli("consume", unique("absent"), "--to", str(tmp_path / "o"), url=amqp_url)
    assert result.returncode == 2
    assert "no queue" in result.stderr
    for flags, says in (
        (["--prefetch", "70000"], "--prefetch is at most 65,535"),
        (["--count", "0"], "expected a whole number >= 1"),
        (["--batch", "x"], "expected a whole number"),
    ):
        to = tmp_path / "bad.jsonl"
        result = run_cli("consume", "q", "--to", str(to), *flags, url=amqp_url)
        assert result.returncode == 2 and says in result.stderr, result.stderr
        assert not to.exists()  # refused before anything was opened


# --- dead-letters ----------------------------------------------------------------------------


def _dead_letters(url: str, queue: str, dead: str, n: int, origin: str | None = None) -> None:
    """``n`` dead letters in ``dead`` as the consumer writes them (published directly)."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    channel.confirm_delivery()
    for i in range(n):
        headers = {
            "x-death-reason": f"bad amount {i}",
            "x-exception-type": "ValueError",
            "x-attempts": 5,
            "x-original-queue": origin or queue,
            "x-original-exchange": "",
            "x-original-routing-key": queue,
            "x-consume-attempt": 5,
            "x-delivery-count": 4,  # as a quorum queue adds it
            "x-first-death-queue": queue,
            "tenant": "acme",
        }
        props = pika.BasicProperties(delivery_mode=2, message_id=f"dead-{i}", headers=headers)
        channel.basic_publish("", dead, f"body {i}".encode(), props, mandatory=True)
    connection.close()


def test_dead_letters_are_listed_and_exported_and_stay(
    amqp_url: str, broker: BrokerAdmin, tmp_path: Path
) -> None:
    queue = broker.queue()
    dead = broker.queue(f"{queue}.dead")
    _dead_letters(amqp_url, queue, dead, 3)
    result = run_cli("dead-letters", queue, url=amqp_url)
    assert result.returncode == 1, result.stderr  # there are some, left where they are
    assert f"3 dead letters in {dead}" in result.stdout
    for i in range(3):
        assert f"dead-{i}  attempts 5  ValueError: bad amount {i}  (from {queue})" in result.stdout

    export = tmp_path / "dead.jsonl"
    result = run_cli("dead-letters", queue, "--export", str(export), "--count", "2", url=amqp_url)
    assert result.returncode == 1, result.stderr
    lines = _lines(export)
    assert [line["message_id"] for line in lines] == ["dead-0", "dead-1"]
    assert all(line["routing_key"] == queue and line["exchange"] == "" for line in lines)
    assert lines[0]["headers"]["x-death-reason"] == "bad amount 0"
    assert broker.count(dead) == 3  # shown and exported, not taken
    assert broker.count(queue) == 0


def test_requeue_moves_them_back_each_after_its_confirm(amqp_url: str, broker: BrokerAdmin) -> None:
    queue = broker.queue()
    dead = broker.queue(f"{queue}.dead")
    _dead_letters(amqp_url, queue, dead, 3)
    result = run_cli("dead-letters", queue, "--requeue", "--count", "2", url=amqp_url)
    assert result.returncode == 0, result.stderr
    assert "2 dead letters moved back" in result.stdout
    assert broker.count(dead) == 1
    moved = broker.drain(queue)
    assert [(p.message_id, body) for p, body in moved] == [
        ("dead-0", b"body 0"),
        ("dead-1", b"body 1"),
    ]
    # a fresh start: the dead-letter headers and the attempt and delivery counts are gone,
    # the rest kept
    assert all(p.headers == {"tenant": "acme"} for p, _ in moved)
    result = run_cli("dead-letters", queue, "--requeue", url=amqp_url)
    assert result.returncode == 0, result.stderr
    assert broker.count(dead) == 0 and broker.count(queue) == 1
    result = run_cli("dead-letters", queue, url=amqp_url)
    assert result.returncode == 0, result.stderr  # none left
    assert f"0 dead letters in {dead}" in result.stdout


@pytest.mark.parametrize("origin", ["gone", "itself"])
def test_requeue_that_is_not_confirmed_leaves_the_dead_letter(
    amqp_url: str, broker: BrokerAdmin, origin: str
) -> None:
    """Its original queue is gone: the republish comes back unroutable, so it is not acked.
    Or it names the dead-letter queue itself: moving it there would never end."""
    queue = broker.queue()
    dead = broker.queue(f"{queue}.dead")
    _dead_letters(amqp_url, queue, dead, 2, origin=unique("gone") if origin == "gone" else dead)
    result = run_cli("dead-letters", queue, "--requeue", url=amqp_url)
    assert result.returncode == 1
    assert "2 stay in" in result.stderr
    if origin == "itself":
        assert f"its x-original-queue is {dead} itself" in result.stderr
    assert broker.count(dead) == 2


def test_dead_letters_of_a_queue_without_any(amqp_url: str, broker: BrokerAdmin) -> None:
    queue = broker.queue()
    result = run_cli("dead-letters", queue, url=amqp_url)
    assert result.returncode == 2
    assert f"no dead-letter queue '{queue}.dead'" in result.stderr
