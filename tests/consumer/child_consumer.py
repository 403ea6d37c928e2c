"""A Consumer in a process of its own, for the fault tests (kill -9 must be real).

Run as ``python child_consumer.py CONFIG_JSON``. The handler records what it does in the file
``out``, one line per event, each written with one ``os.write`` on an ``O_APPEND`` descriptor
(so a kill -9 never leaves half a line and two processes never interleave within one):

- ``S <message_id> <attempt> <redelivered>``: the handler started on a delivery;
- ``H <message_id> <attempt> <redelivered>``: the handler returned (the ack follows);
- ``SUBSCRIBED <pid>``: the first subscription is live;
- ``EXIT <json>``: ``run()`` returned; the consumer's recoveries and counters.

Config keys: ``url``, ``queue``, ``out`` (required); ``prefetch``, ``heartbeat``,
``connection_name``, ``stop_timeout``, ``redelivery`` (a RetryPolicy dict), ``pace`` (seconds
each handler call sleeps), ``slow`` (seconds a handler call sleeps, for the SIGTERM test),
``crash_on`` (a message id whose handler SIGKILLs its own process), ``gates`` (handled counts at
which the handler waits until the file ``<out>.gate<N>`` exists: the parent injects a fault
there, with the run paused at a known point). WARNINGs go to stderr.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from reliable_amqp import AsyncConsumer, Consumer, Delivery, RetryPolicy


def main(config: dict[str, Any]) -> int:
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(message)s"
    )
    out = os.open(config["out"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def record(line: str) -> None:
        os.write(out, (line + "\n").encode())

    options: dict[str, Any] = {}
    for key in ("prefetch", "heartbeat", "connection_name", "stop_timeout", "handler_timeout"):
        if key in config:
            options[key] = config[key]
    if "redelivery" in config:
        options["redelivery"] = RetryPolicy(**config["redelivery"])
    if config.get("concurrency"):
        return run_async(config, options, record)
    consumer = Consumer(config["url"], config["queue"], **options)

    pace = float(config.get("pace", 0.0))
    slow = float(config.get("slow", 0.0))
    crash_on = config.get("crash_on")
    gates = sorted(int(n) for n in config.get("gates", ()))
    gate_base = config["out"] + ".gate"
    handled = 0

    def handler(delivery: Delivery) -> None:
        nonlocal handled
        facts = f"{delivery.message_id} {delivery.attempt} {int(delivery.redelivered)}"
        record(f"S {facts}")
        if crash_on is not None and delivery.message_id == crash_on:
            os.kill(os.getpid(), signal.SIGKILL)  # the process dies inside the handler, each time
        if slow:
            time.sleep(slow)
        elif pace:
            time.sleep(pace)
        record(f"H {facts}")
        handled += 1
        if gates and handled == gates[0]:
            gate = Path(f"{gate_base}{gates.pop(0)}")
            deadline = time.monotonic() + 120
            while not gate.exists() and time.monotonic() < deadline:
                time.sleep(0.01)

    io = consumer._core.io  # the I/O thread: its subscription and recovery counters

    def announce() -> None:
        if io.consuming.wait(120):
            record(f"SUBSCRIBED {os.getpid()}")

    threading.Thread(target=announce, daemon=True).start()
    consumer.run(handler)
    stats = consumer.stats
    record(
        "EXIT "
        + json.dumps(
            {
                "recoveries": io.recoveries,
                "stale_settlements": io.stale_settlements,
                "consumed": stats.consumed,
                "handled": stats.handled,
                "stale": stats.stale,
                "dead_lettered": stats.dead_lettered,
            }
        )
    )
    return 0


def run_async(config: dict[str, Any], options: dict[str, Any], record: Any) -> int:
    """An AsyncConsumer with ``concurrency`` handlers at once, each sleeping a random 0 to
    2 ``pace`` so that they finish out of order (what the ack bookkeeping must get right)."""
    consumer = AsyncConsumer(
        config["url"], config["queue"], concurrency=int(config["concurrency"]), **options
    )
    pace = float(config.get("pace", 0.0))
    rng = random.Random(os.getpid())

    async def handler(delivery: Delivery) -> None:
        facts = f"{delivery.message_id} {delivery.attempt} {int(delivery.redelivered)}"
        record(f"S {facts}")
        await asyncio.sleep(rng.uniform(0, 2 * pace))
        record(f"H {facts}")

    io = consumer._core.io

    def announce() -> None:
        if io.consuming.wait(120):
            record(f"SUBSCRIBED {os.getpid()}")

    threading.Thread(target=announce, daemon=True).start()
    asyncio.run(consumer.run(handler))
    stats = consumer.stats
    record(
        "EXIT "
        + json.dumps({"recoveries": io.recoveries, "handled": stats.handled, "stale": stats.stale})
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
