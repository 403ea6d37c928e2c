"""A ``Consumer`` whose handler is ``Inbox.handler``, in a process of its own (kill -9 is real).

Run as ``python inbox_child.py CONFIG_JSON`` by the tests of this directory. The handler records
what it does in the file ``out``, one line per event, each one ``os.write`` on an ``O_APPEND``
descriptor (a kill -9 never leaves half a line; two processes never interleave within one):

- ``S <message_id> <body> <attempt> <redelivered> <pid> <time>``: the inbox handler was
  called (``time``: ``time.monotonic()``, one clock for every process of the machine);
- ``H ...``: the same, when it returned (committed; the ack follows);
- ``SUBSCRIBED <pid>``: the first subscription is live;
- ``EXIT <json>``: ``run()`` returned; the consumer's counters and the inbox's.

Config keys: ``url``, ``queue``, ``out``, ``dialect`` (``postgresql``, ``mysql``, ``sqlite``),
``dsn`` (required); ``scope``, ``prefetch``, ``redelivery`` (a RetryPolicy dict), ``mode``
(``effect``: one row in ``effects``; ``chain``: a row in ``payments`` and an outgoing message in
the database's outbox, in the claim's transaction), ``crash_on`` (a message id whose handle
SIGKILLs its own process, inside the handler's open transaction), ``ledger`` (count the
redeliveries in the inbox's attempts ledger through the consumer's ``attempts`` option, on a
connection of its own). WARNINGs go to stderr.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reliable_amqp import Consumer, Delivery, RetryPolicy
from reliable_amqp.inbox import Inbox
from reliable_amqp.outbox import Outbox
from support.inbox import Database, run


def fast_commits(db: Database, conn: Any) -> None:
    """Commits that return before the database flushes them to disk: what a kill -9 of *this*
    process tests is unchanged (a committed transaction is visible and kept while the database
    server lives: PostgreSQL's ``synchronous_commit=off`` and SQLite's WAL ``synchronous=NORMAL``
    lose commits only when the machine or the server crashes), and the runs take a fifth of the
    time. MariaDB's flush setting is global, so it is left as it is."""
    if db.dialect == "postgresql":
        conn.execute("SET synchronous_commit = off")
        conn.commit()
    elif db.dialect == "sqlite":
        conn.execute("PRAGMA synchronous = NORMAL")


def main(config: dict[str, Any]) -> int:
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(message)s"
    )
    out = os.open(config["out"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def record(line: str) -> None:
        os.write(out, (line + "\n").encode())

    db = Database(config["dialect"], config["dsn"])
    conn = db.connect()  # one connection, kept open: the handler's transactions run on it
    fast_commits(db, conn)
    inbox = Inbox(config.get("scope", "billing"))
    outbox = Outbox()
    mode = config.get("mode", "effect")
    crash_on = config.get("crash_on")

    def handle(delivery: Delivery, conn: Any) -> None:
        if delivery.message_id == crash_on:
            os.kill(os.getpid(), signal.SIGKILL)  # dies inside the open transaction, each time
        if mode == "chain":
            order = json.loads(delivery.body)
            run(
                conn,
                "INSERT INTO payments (order_id, amount) VALUES (%s, %s)",
                (order["order_id"], order["amount"]),
            )
            outbox.add(
                conn,
                "",
                "billing-events",
                json.dumps({"order_id": order["order_id"], "paid": order["amount"]}).encode(),
                message_id=f"payment-{order['order_id']}",
            )
        else:
            run(
                conn,
                "INSERT INTO effects (message_id, note) VALUES (%s, %s)",
                (delivery.message_id, delivery.body.decode()),
            )

    # the connection is kept open between messages (nullcontext: the handler leaves it open)
    inbox_handler = inbox.handler(lambda: contextlib.nullcontext(conn), handle)
    pid = os.getpid()

    def handler(delivery: Delivery) -> None:
        body = delivery.body.decode() if mode != "chain" else "-"
        facts = f"{delivery.message_id} {body} {delivery.attempt} {int(delivery.redelivered)}"
        record(f"S {facts} {pid} {time.monotonic()}")
        inbox_handler(delivery)
        record(f"H {facts} {pid} {time.monotonic()}")

    options: dict[str, Any] = {}
    if "prefetch" in config:
        options["prefetch"] = config["prefetch"]
    if "redelivery" in config:
        options["redelivery"] = RetryPolicy(**config["redelivery"])
    if config.get("ledger"):
        # a connection of its own for each count: the ledger commits outside the handler's
        # transaction, which a crash rolls back
        options["attempts"] = lambda d: inbox.record_attempt(db.connect, d)
    consumer = Consumer(config["url"], config["queue"], **options)
    io = consumer._core.io

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
                "consumed": stats.consumed,
                "handled": stats.handled,
                "dead_lettered": stats.dead_lettered,
                "claimed": inbox.stats.claimed,
                "duplicates": inbox.stats.duplicates,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
