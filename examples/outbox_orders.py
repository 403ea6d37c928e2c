"""A small order service with a transactional outbox: the order and its "order created" event
are written in one database transaction, and a relay thread publishes the event once that
transaction has committed, deleting its row only after the broker's confirm.

An order whose transaction rolls back never announces itself; one that commits is announced even
if the process dies right after the commit (the row waits in the database for the next relay).
SQLite here (a file, nothing to run); the same code works on a psycopg 3 connection to
PostgreSQL, with ``postgresql://...`` for the relay (see docs/outbox.md).
"""

from __future__ import annotations

import json
import os
import sqlite3
import tempfile
import threading
import uuid

import pika

from reliable_amqp import Publisher
from reliable_amqp.outbox import Outbox, OutboxRelay

URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
QUEUE = f"outbox-orders-{uuid.uuid4().hex[:8]}"
outbox = Outbox()


def create_order(
    db: sqlite3.Connection, customer: str, total_cents: int, fail: bool = False
) -> str:
    """Insert an order and add its event, in one transaction (sqlite3's ``with`` commits it, or
    rolls it back on an exception)."""
    order_id = str(uuid.uuid4())
    with db:
        db.execute(
            "INSERT INTO orders (id, customer, total_cents) VALUES (?, ?, ?)",
            (order_id, customer, total_cents),
        )
        outbox.add(
            db,
            "",
            QUEUE,
            json.dumps({"order_id": order_id, "total_cents": total_cents}).encode(),
            key=customer,  # one customer's events arrive in the order they were committed
            message_id=f"order-created-{order_id}",
            content_type="application/json",
            type="order.created",
        )
        if fail:
            raise RuntimeError("payment declined")  # rolls back the order and its event
    return order_id


def main(workdir: str) -> None:
    path = os.path.join(workdir, "orders.db")
    db = sqlite3.connect(path)
    db.execute("PRAGMA journal_mode=WAL")  # the relay reads while the service writes
    db.execute("CREATE TABLE orders (id TEXT PRIMARY KEY, customer TEXT, total_cents INTEGER)")
    outbox.install(db)
    db.commit()
    with Publisher(URL) as setup:  # the consumers' queue exists before anything is relayed
        setup.declare_queue(QUEUE, durable=False)

    relay = OutboxRelay(f"sqlite:///{path}", URL)
    thread = threading.Thread(target=relay.run, name="outbox-relay")
    thread.start()
    created = [create_order(db, "alice", 1250), create_order(db, "bob", 990)]
    try:
        create_order(db, "carol", 4200, fail=True)
    except RuntimeError as exc:
        print(f"carol's order rolled back ({exc}): no event for it")
    created.append(create_order(db, "alice", 300))

    # the relay deletes each row once the broker confirmed its message
    while db.execute("SELECT count(*) FROM amqp_outbox").fetchone()[0]:
        thread.join(0.05)
    relay.stop()
    thread.join()
    db.close()
    print(f"{len(created)} orders committed, {relay.stats().confirmed} events confirmed")

    # what a consumer sees: one event per committed order, with a stable message id
    connection = pika.BlockingConnection(pika.URLParameters(URL))
    channel = connection.channel()
    seen = []
    while True:
        method, props, body = channel.basic_get(QUEUE, auto_ack=True)
        if method is None:
            break
        seen.append(json.loads(body)["order_id"])
        print(f"  {props.type} {props.message_id}")
    channel.queue_delete(QUEUE)
    connection.close()
    assert seen == created, (seen, created)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        main(tmp)
