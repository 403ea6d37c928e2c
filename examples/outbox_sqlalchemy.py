"""The order service of ``outbox_orders.py`` on SQLAlchemy 2 (sync ORM) and PostgreSQL: the order
and its "order created" event are written in one session transaction, and a relay thread
publishes the event once that transaction has committed, deleting its row only after the
broker's confirm.

The outbox's tables are part of the application's ``MetaData`` (``outbox_table``), so
``create_all()`` here, or Alembic's autogenerate in a real service, creates them with the rest.

Needs ``pip install '.[outbox,outbox-sqlalchemy]'`` and a PostgreSQL server: by
default the local one as ``postgres`` (``PG_ADMIN_URL=postgresql://user@host:port/postgres``
for another). It creates a database of its own and drops it at the end.
"""

from __future__ import annotations

import json
import os
import threading
import uuid

import pika
import psycopg
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from reliable_amqp import Publisher
from reliable_amqp.outbox import Outbox, OutboxRelay, status
from reliable_amqp.outbox.sqlalchemy import outbox_table

URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
ADMIN = os.environ.get("PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
DATABASE = f"outbox_example_{uuid.uuid4().hex[:8]}"
QUEUE = f"outbox-sqlalchemy-orders-{uuid.uuid4().hex[:8]}"
outbox = Outbox()


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[str] = mapped_column(primary_key=True)
    customer: Mapped[str]
    total_cents: Mapped[int]


outbox_table(Base.metadata)  # amqp_outbox and amqp_outbox_failed, beside the application's


def create_order(session: Session, customer: str, total_cents: int, fail: bool = False) -> str:
    """Insert an order and add its event in the session's transaction: committed together by
    ``session.commit()``, or rolled back together."""
    order = Order(id=str(uuid.uuid4()), customer=customer, total_cents=total_cents)
    session.add(order)
    outbox.add(
        session,
        "",
        QUEUE,
        json.dumps({"order_id": order.id, "total_cents": total_cents}).encode(),
        key=customer,  # one customer's events arrive in the order they were committed
        message_id=f"order-created-{order.id}",
        content_type="application/json",
        type="order.created",
    )
    if fail:
        raise RuntimeError("payment declined")
    return order.id


def main(db: str) -> None:
    engine = sa.create_engine(db.replace("postgresql://", "postgresql+psycopg://", 1))
    Base.metadata.create_all(engine)  # in a real service: `alembic upgrade head`
    with Publisher(URL) as setup:  # the consumers' queue exists before anything is relayed
        setup.declare_queue(QUEUE, durable=False)

    relay = OutboxRelay(db, URL)
    thread = threading.Thread(target=relay.run, name="outbox-relay")
    thread.start()
    created = []
    for customer, total, fail in [("alice", 1250, False), ("bob", 990, False),
                                  ("carol", 4200, True), ("alice", 300, False)]:  # fmt: skip
        with Session(engine) as session:
            try:
                created.append(create_order(session, customer, total, fail))
                session.commit()
            except RuntimeError as exc:
                session.rollback()
                print(f"{customer}'s order rolled back ({exc}): no event for it")

    while status(db).pending:  # the relay deletes each row once the broker confirmed it
        thread.join(0.05)
    relay.stop()
    thread.join()
    engine.dispose()
    print(f"{len(created)} orders committed, {relay.stats().confirmed} events confirmed")

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
    with psycopg.connect(ADMIN, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {DATABASE}")
    try:
        main(ADMIN.rsplit("/", 1)[0] + f"/{DATABASE}")
    finally:
        with psycopg.connect(ADMIN, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")
