"""A member of a partitioned consumer group, handling through the inbox, in a process of its own.

Run as ``python partition_child.py CONFIG_JSON`` by the partition tests
(``tests/consumer/test_partitions_chain.py``, ``tests/cluster/test_cluster_partitions.py``). It
runs ``Consumer(url, name, partitions=N, key="routing_key", declare=True)`` whose handler is
``Inbox.handler`` on one long-lived PostgreSQL connection: the claim and one row in ``effects``
(``tests/support/partitions.py``: message id, key, seq, this pid, the partition the delivery
came from, when the handler started and when it wrote, on ``time.monotonic()``: one clock for
every process of the machine) commit in one transaction, then the consumer acks. Message
bodies are ``<key>:<seq>``.

It appends to the file ``out`` (one ``os.write`` per line on an ``O_APPEND`` descriptor: a kill
-9 never leaves half a line, two processes never interleave within one):

- ``MEMBER <pid> <time>``: the group's connection is up and this process is a member;
- ``HELD <pid> <time> <p,q,...>``: the partitions this member holds changed (``-`` for none);
- ``EXIT <json>``: ``run()`` returned; the consumer's counters and the inbox's.

Config keys: ``url`` (one URL or a list), ``name``, ``partitions``, ``out``, ``dsn``
(required); ``prefetch``, ``queue_arguments``, ``redelivery`` (a RetryPolicy dict),
``connection_name``, ``interval`` (the group's look interval, seconds), ``gate`` (true: each
handler takes PostgreSQL's shared advisory lock ``support.partitions.GATE`` in its transaction,
so that a test holding it exclusively pauses every handler: ``support.partitions.Gate``). The
library's INFO lines (partitions taken, given up, lost) go to stderr with their time and pid.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reliable_amqp import Consumer, Delivery, RetryPolicy
from reliable_amqp._consume._group import PartitionGroup
from reliable_amqp.inbox import Inbox
from support.partitions import GATE, INBOX_SCOPE


def main(config: dict[str, Any]) -> int:
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(created).3f %(process)d %(levelname)s %(message)s",
    )
    logging.getLogger("reliable_amqp").setLevel(logging.INFO)
    out = os.open(config["out"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    pid = os.getpid()

    def record(line: str) -> None:
        os.write(out, (line + "\n").encode())

    conn = psycopg.connect(config["dsn"])  # one connection, kept open: every handler's
    conn.execute("SET synchronous_commit = off")  # transaction runs on it (see inbox_child.py)
    conn.commit()
    inbox = Inbox(INBOX_SCOPE)

    gated = bool(config.get("gate"))

    def handle(delivery: Delivery, conn: Any) -> None:
        key, _, seq = delivery.body.decode().rpartition(":")
        if gated:
            conn.execute("SELECT pg_advisory_xact_lock_shared(%s)", (GATE,))
        conn.execute(
            "INSERT INTO effects (message_id, key, seq, pid, partition, redelivered, started, at)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
            (
                delivery.message_id,
                key,
                int(seq),
                pid,
                int(delivery.queue.rpartition(".")[2]),
                delivery.redelivered,
                started,
                time.monotonic(),
            ),
        )

    inbox_handler = inbox.handler(lambda: contextlib.nullcontext(conn), handle)
    started = 0.0

    def handler(delivery: Delivery) -> None:
        nonlocal started
        started = time.monotonic()
        inbox_handler(delivery)

    options: dict[str, Any] = {}
    for name in ("prefetch", "queue_arguments", "connection_name"):
        if name in config:
            options[name] = config[name]
    if "redelivery" in config:
        options["redelivery"] = RetryPolicy(**config["redelivery"])
    consumer = Consumer(
        config["url"],
        config["name"],
        partitions=int(config["partitions"]),
        key="routing_key",
        declare=True,
        **options,
    )
    group = consumer._core.io
    assert isinstance(group, PartitionGroup), type(group)
    if "interval" in config:
        group._interval = float(config["interval"])

    def watch() -> None:
        """Report membership, then every change of the partitions held (every 20 ms)."""
        if not group.consuming.wait(120):
            return
        record(f"MEMBER {pid} {time.monotonic()}")
        last: list[int] | None = None
        while not group.ended.is_set():
            held = group.held
            if held != last:
                record(f"HELD {pid} {time.monotonic()} {','.join(map(str, held)) or '-'}")
                last = held
            time.sleep(0.02)

    threading.Thread(target=watch, daemon=True).start()
    consumer.run(handler)
    stats = consumer.stats
    record(
        "EXIT "
        + json.dumps(
            {
                "pid": pid,
                "consumed": stats.consumed,
                "handled": stats.handled,
                "retried": stats.retried,
                "dead_lettered": stats.dead_lettered,
                "claimed": inbox.stats.claimed,
                "duplicates": inbox.stats.duplicates,
            }
        )
    )
    conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
