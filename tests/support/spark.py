"""Helpers for the Spark tests: unique names and a fast way to read a queue back."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pika

#: what a local Spark Connect session leaves in os.environ: the spark fixture removes it when the
#: session stops, and subprocesses (the examples) never get it
CONNECT_ENV = (
    "SPARK_CONNECT_MODE_ENABLED",
    "SPARK_LOCAL_REMOTE",
    "SPARK_REMOTE",
    "SPARK_CONNECT_AUTHENTICATE_TOKEN",
)


#: what a Spark Connect server says at a query's start when the foreachBatch worker it started
#: did not connect back within the 10 s Spark waits, hard-coded in
#: PythonWorkerFactory.createSimpleWorker (Spark 4.0 to 4.3). The worker imports pyspark from
#: SPARK_HOME/python/lib/pyspark.zip, compiling it (1.8 s of CPU here): with the suite's two
#: workers and the matrix legs on two cores it once took longer (CI, 2026-11-30), and under 14
#: busy loops it always does. Nothing ran; the query did not start.
WORKER_DID_NOT_CONNECT_BACK = "Python worker failed to connect back"

#: how many times :func:`start_query` starts a query Spark's worker start failed
START_ATTEMPTS = 3


def start_query(start: Callable[[], Any]) -> Any:
    """``start()`` (a ``DataStreamWriter.start`` call), again when Spark's driver could not start
    its Python worker in time (:data:`WORKER_DID_NOT_CONNECT_BACK`), up to
    :data:`START_ATTEMPTS` times. Any other error, and the last, goes on up."""
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            return start()
        except Exception as exc:
            if attempt == START_ATTEMPTS or WORKER_DID_NOT_CONNECT_BACK not in str(exc):
                raise
            print(f"start_query: attempt {attempt}: {WORKER_DID_NOT_CONNECT_BACK}", file=sys.stderr)
    raise AssertionError("unreachable")


def unique_name(prefix: str) -> str:
    """A queue or id prefix no other test run uses (several runs share the broker)."""
    return f"ra-test-spark-{prefix}-{uuid.uuid4().hex[:12]}"


@dataclass
class Received:
    """One message read back from a queue."""

    body: bytes
    message_id: str | None
    headers: dict[str, Any]
    properties: pika.BasicProperties


def read_all(
    url: str, queue: str, expected: int | None = None, idle: float = 1.0, patience: float = 20.0
) -> list[Received]:
    """Consume every message in ``queue`` (prefetch 2000, auto-ack): far faster than basic_get.

    Stops once the queue has been idle for ``idle`` seconds, or, while fewer than ``expected``
    messages arrived, for ``patience`` seconds.
    """
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        channel.basic_qos(prefetch_count=2000)
        out: list[Received] = []
        waited = 0.0
        for method, props, body in channel.consume(queue, auto_ack=True, inactivity_timeout=idle):
            if method is None:
                waited += idle
                if expected is None or len(out) >= expected or waited >= patience:
                    break
                continue
            waited = 0.0
            out.append(Received(body, props.message_id, dict(props.headers or {}), props))
        channel.cancel()
        return out
    finally:
        connection.close()
