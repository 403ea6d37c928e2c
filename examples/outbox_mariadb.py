"""The order service of ``outbox_orders.py`` on MariaDB (or MySQL), through PyMySQL: the order
and its "order created" event are written in one InnoDB transaction, and a relay thread
publishes the event once that transaction has committed, deleting its row only after the
broker's confirm.

Needs ``pip install '.[outbox-mysql]'`` and a MariaDB server: by default the local
one as root without a password (``MYSQL_ADMIN_URL=mysql://user:password@host:port/`` for
another). It creates a database of its own and drops it at the end.
"""

from __future__ import annotations

import json
import os
import threading
import urllib.parse
import uuid
from typing import Any

import pika
import pymysql

from reliable_amqp import Publisher
from reliable_amqp.outbox import Outbox, OutboxRelay, status

URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
ADMIN = urllib.parse.urlsplit(os.environ.get("MYSQL_ADMIN_URL", "mysql://root@127.0.0.1:3306/"))
DATABASE = f"outbox_example_{uuid.uuid4().hex[:8]}"
QUEUE = f"outbox-mariadb-orders-{uuid.uuid4().hex[:8]}"
outbox = Outbox()


def connect(database: str | None = None, **options: Any) -> Any:
    return pymysql.connect(
        host=ADMIN.hostname or "127.0.0.1",
        port=ADMIN.port or 3306,
        user=urllib.parse.unquote(ADMIN.username or "root"),
        password=urllib.parse.unquote(ADMIN.password or ""),
        database=database,
        **options,
    )


def create_order(db: Any, customer: str, total_cents: int, fail: bool = False) -> str:
    """Insert an order and add its event, in one transaction (PyMySQL's connections are not in
    autocommit mode: every statement joins the open transaction until commit or rollback)."""
    order_id = str(uuid.uuid4())
    try:
        with db.cursor() as cur:
            cur.execute(
                "INSERT INTO orders (id, customer, total_cents) VALUES (%s, %s, %s)",
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
            raise RuntimeError("payment declined")
        db.commit()
    except BaseException:
        db.rollback()  # the order and its event go together
        raise
    return order_id


def main() -> None:
    db = connect(DATABASE)
    with db.cursor() as cur:
        cur.execute(
            "CREATE TABLE orders (id char(36) PRIMARY KEY, customer varchar(100),"
            " total_cents integer) ENGINE=InnoDB"
        )
    outbox.install(db)  # DDL: MariaDB commits it at once
    with Publisher(URL) as setup:  # the consumers' queue exists before anything is relayed
        setup.declare_queue(QUEUE, durable=False)

    netloc = ADMIN.netloc or "root@127.0.0.1:3306"
    dsn = f"mysql://{netloc}/{DATABASE}"
    relay = OutboxRelay(dsn, URL)
    thread = threading.Thread(target=relay.run, name="outbox-relay")
    thread.start()
    created = [create_order(db, "alice", 1250), create_order(db, "bob", 990)]
    try:
        create_order(db, "carol", 4200, fail=True)
    except RuntimeError as exc:
        print(f"carol's order rolled back ({exc}): no event for it")
    created.append(create_order(db, "alice", 300))

    # the relay deletes each row once the broker confirmed its message
    while status(dsn).pending:
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
    admin = connect(autocommit=True)
    with admin.cursor() as cur:
        cur.execute(f"CREATE DATABASE {DATABASE} CHARACTER SET utf8mb4")
    try:
        main()
    finally:
        with admin.cursor() as cur:
            cur.execute(f"DROP DATABASE IF EXISTS {DATABASE}")
        admin.close()
