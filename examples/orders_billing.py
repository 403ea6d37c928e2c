"""Two services of an order flow, exactly once end to end over an at-least-once broker.

- The **order service** writes an order and its "order created" event in one transaction (the
  [outbox](../docs/outbox.md)); a relay publishes the event once the transaction committed.
- The **billing worker** consumes those events with the [inbox](../docs/inbox.md): for each one
  it claims the ``message_id``, records the payment, and adds its own "payment captured" event
  to its outbox, all in one transaction, committed before the ack. A second copy of an event
  (a relay that died between its publish and deleting the row sends it again) finds the claim
  and is skipped: one payment per order, one "payment captured" per order.

Both databases are SQLite files in a temporary directory (nothing to run but the broker); with
PostgreSQL the code is the same on psycopg connections. The example removes its queues at the
end.
"""

from __future__ import annotations

import json
import os
import sqlite3
import tempfile
import threading
import uuid
from contextlib import closing
from typing import Any

import pika

from reliable_amqp import Consumer, Delivery, Publisher, RetryPolicy
from reliable_amqp.inbox import Inbox
from reliable_amqp.outbox import Outbox, OutboxRelay

URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
RUN = uuid.uuid4().hex[:8]
ORDERS = f"orders-billing-{RUN}.orders"  # "order created" events: the billing worker's queue
PAYMENTS = f"orders-billing-{RUN}.payments"  # "payment captured" events, for whoever is next
outbox = Outbox()
inbox = Inbox("billing")  # the scope: this service


def open_db(path: str) -> sqlite3.Connection:
    db = sqlite3.connect(path)
    db.execute("PRAGMA journal_mode=WAL")  # the relay reads while the service writes
    return db


# --- the order service --------------------------------------------------------------------------


def create_order(db: sqlite3.Connection, customer: str, cents: int, fail: bool = False) -> str:
    """The order and its event in one transaction (sqlite3's ``with`` commits or rolls back)."""
    order_id = str(uuid.uuid4())
    with db:
        db.execute("INSERT INTO orders VALUES (?, ?, ?)", (order_id, customer, cents))
        body = json.dumps({"order_id": order_id, "cents": cents}).encode()
        outbox.add(db, "", ORDERS, body, message_id=f"order-created-{order_id}")
        if fail:
            raise RuntimeError("card declined at checkout")  # neither the order nor its event
    return order_id


# --- the billing worker -------------------------------------------------------------------------


def charge(delivery: Delivery, conn: Any) -> None:
    """Called once per ``message_id``, inside the transaction that holds the inbox's claim: the
    payment and the outgoing event commit with it, or not at all."""
    order = json.loads(delivery.body)
    conn.execute("INSERT INTO payments VALUES (?, ?)", (order["order_id"], order["cents"]))
    outbox.add(
        conn,
        "",
        PAYMENTS,
        json.dumps({"order_id": order["order_id"], "captured": order["cents"]}).encode(),
        message_id=f"payment-captured-{order['order_id']}",
    )
    print(f"  billing: charged {order['cents']} cents for order {order['order_id'][:8]}")


def main(workdir: str) -> int:
    orders_path = os.path.join(workdir, "orders.db")
    billing_path = os.path.join(workdir, "billing.db")
    orders_db, billing_db = open_db(orders_path), open_db(billing_path)
    orders_db.execute("CREATE TABLE orders (id TEXT PRIMARY KEY, customer TEXT, cents INTEGER)")
    outbox.install(orders_db)
    orders_db.commit()
    billing_db.execute("CREATE TABLE payments (order_id TEXT, cents INTEGER)")  # no unique key
    inbox.install(billing_db)
    outbox.install(billing_db)
    billing_db.commit()
    with Publisher(URL) as setup:  # the queues exist before anything is relayed
        setup.declare_queue(ORDERS, durable=True)
        setup.declare_queue(PAYMENTS, durable=True)

    relays = [OutboxRelay(f"sqlite:///{path}", URL) for path in (orders_path, billing_path)]
    threads = [threading.Thread(target=r.run, name="outbox-relay") for r in relays]
    for thread in threads:
        thread.start()

    print("order service:")
    created = [create_order(orders_db, "alice", 1250), create_order(orders_db, "bob", 990)]
    try:
        create_order(orders_db, "carol", 4200, fail=True)
    except RuntimeError as exc:
        print(f"  carol's order rolled back ({exc}): no event, no payment")
    created.append(create_order(orders_db, "alice", 300))
    print(f"  {len(created)} orders committed")
    # A relay killed between its publish and deleting the row publishes that event again on
    # restart: the same message, the same message_id. Here it is sent twice on purpose.
    first = created[0]
    with Publisher(URL) as again:
        body = json.dumps({"order_id": first, "cents": 1250}).encode()
        again.publish("", ORDERS, body, message_id=f"order-created-{first}")
    print(f"  (order {first[:8]}'s event sent a second time, as after a relay crash)")

    print("billing worker:")
    expected = len(created) + 1  # each order's event, and the second copy
    consumer = Consumer(URL, ORDERS, prefetch=10, redelivery=RetryPolicy(max_attempts=3))
    billing = inbox.handler(lambda: billing_db, charge)  # claim, charge, commit; then the ack
    seen = 0

    def handler(delivery: Delivery) -> None:
        nonlocal seen
        billing(delivery)
        seen += 1
        if seen == expected:  # a real worker runs until SIGTERM or Ctrl-C
            consumer.stop()

    consumer.run(handler)
    print(f"  {inbox.stats.claimed} events handled, {inbox.stats.duplicates} duplicate skipped")

    # the billing outbox's relay publishes the payment events once their transactions committed
    while billing_db.execute("SELECT count(*) FROM amqp_outbox").fetchone()[0]:
        threads[1].join(0.05)
    for relay in relays:
        relay.stop()
    for thread in threads:
        thread.join()
    paid = [r[0] for r in billing_db.execute("SELECT order_id FROM payments ORDER BY rowid")]
    orders_db.close()
    billing_db.close()

    with closing(pika.BlockingConnection(pika.URLParameters(URL))) as connection:
        channel = connection.channel()
        events = []
        while True:
            method, props, body = channel.basic_get(PAYMENTS, auto_ack=True)
            if method is None:
                break
            events.append(json.loads(body)["order_id"])
            print(f"  downstream: {props.message_id[:25]}...")
        for name in (ORDERS, PAYMENTS, *consumer.own_queues):  # dead letters, delay queues
            channel.queue_delete(name)
    ok = sorted(paid) == sorted(created) and sorted(events) == sorted(created)
    print(
        f"{len(paid)} payments for {len(created)} committed orders, {len(events)} "
        f"'payment captured' events: {'each exactly once' if ok else 'WRONG'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        raise SystemExit(main(tmp))
