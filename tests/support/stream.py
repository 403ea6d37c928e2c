"""Helpers for the stream-reading tests: declare a stream, fill it fast, read parquet back."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pika

from reliable_amqp import Publisher


def stream_name(prefix: str) -> str:
    """A stream name no other test run uses."""
    return f"ra-test-stream-{prefix}-{uuid.uuid4().hex[:12]}"


def declare_stream(url: str, name: str, **arguments: Any) -> str:
    """Declare a stream queue (``arguments`` with dashes: ``x_max_length_bytes``)."""
    args: dict[str, Any] = {"x-queue-type": "stream"}
    args.update({k.replace("_", "-"): v for k, v in arguments.items()})
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        connection.channel().queue_declare(name, durable=True, arguments=args)
    finally:
        connection.close()
    return name


def delete_queue(url: str, name: str) -> None:
    """Delete a queue (a stream) if it exists."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        connection.channel().queue_delete(name)
    finally:
        connection.close()


def publish(
    url: str,
    stream: str,
    start: int,
    count: int,
    *,
    size: int = 0,
    exchange: str = "",
    max_in_flight: int = 5000,
) -> None:
    """Publish messages ``start`` .. ``start + count - 1`` with confirms: message id ``m{i}``,
    body ``event {i}`` (padded to ``size`` bytes), a ``seq`` header and a ``traceparent``.

    ``max_in_flight`` bounds the unconfirmed messages, and so the chunks RabbitMQ writes: its
    stream writer puts every message it has at hand into one chunk (hundreds at the default)."""
    with Publisher(url, max_in_flight=max_in_flight) as publisher:
        futures = []
        for i in range(start, start + count):
            body = f"event {i}".encode()
            if size > len(body):
                body += b"." * (size - len(body))
            futures.append(
                publisher.publish(
                    exchange,
                    stream,
                    body,
                    message_id=f"m{i}",
                    headers={"seq": i, "traceparent": f"00-{i:032x}-{i:016x}-01"},
                    content_type="text/plain",
                    correlation_id=f"c{i % 7}",
                    type="test.event",
                    timestamp=1_700_000_000 + i,
                )
            )
        assert publisher.flush(120) == 0
        for future in futures:
            future.result(0)


def wait_for(
    predicate: Any,
    timeout: float,
    what: str,
    step: float = 0.2,
    detail: Callable[[], str] | None = None,
) -> None:
    """Poll ``predicate`` until it is true; fail after ``timeout`` seconds (with ``detail()``,
    what the process under test printed, in the failure)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            extra = f"\n{detail()}" if detail is not None else ""
            raise AssertionError(f"timed out after {timeout} s waiting for {what}{extra}")
        time.sleep(step)


def committed_ids(output: Path) -> list[str]:
    """The message ids in the files a parquet file sink committed (its ``_spark_metadata`` log;
    a failed task's files are left out, as Spark's own reader leaves them out)."""
    import json

    import pyarrow.parquet as pq

    paths: set[str] = set()
    for entry in sorted((output / "_spark_metadata").iterdir()):
        if entry.name.startswith("."):
            continue
        for line in entry.read_text().splitlines()[1:]:  # first line: the log's version
            record = json.loads(line)
            if record.get("action") == "add":
                paths.add(record["path"])
            elif record.get("action") == "delete":
                paths.discard(record["path"])
    ids: list[str] = []
    for path in sorted(paths):
        local = path.removeprefix("file://").removeprefix("file:")
        ids += pq.read_table(local, columns=["message_id"])["message_id"].to_pylist()
    return ids
