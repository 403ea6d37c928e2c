"""A FastAPI-style service with a transactional outbox: a request handler on SQLAlchemy's
``AsyncSession`` (over asyncpg) inserts an order and adds its "order created" event in the
request's transaction; the event goes out if and only if that transaction commits.

FastAPI itself is not needed: ``session_scope()`` is what a ``Depends(get_session)`` dependency
does (one session per request, committed when the handler returns, rolled back when it
raises), and ``main()`` plays the server, calling the handler concurrently. The relay runs as a
task of the same event loop (``AsyncOutboxRelay``, publishing through an ``AsyncPublisher``).

Needs ``pip install '.[aio,outbox,outbox-sqlalchemy,outbox-asyncpg]'`` and a PostgreSQL
server: by default the local one as ``postgres`` (``PG_ADMIN_URL=postgresql://user@host:port/
postgres`` for another). It creates a database of its own and drops it at the end.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import pika
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from reliable_amqp import Publisher
from reliable_amqp.outbox import AsyncOutbox, AsyncOutboxRelay, status
from reliable_amqp.outbox.sqlalchemy import outbox_table

URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
ADMIN = os.environ.get("PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
DATABASE = f"outbox_example_{uuid.uuid4().hex[:8]}"
QUEUE = f"outbox-fastapi-orders-{uuid.uuid4().hex[:8]}"
outbox = AsyncOutbox()


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[str] = mapped_column(primary_key=True)
    customer: Mapped[str]
    total_cents: Mapped[int]


outbox_table(Base.metadata)  # Alembic's autogenerate sees the outbox with the orders


class PaymentDeclined(Exception):
    pass


@asynccontextmanager
async def session_scope(engine: AsyncEngine) -> AsyncIterator[AsyncSession]:
    """What FastAPI's ``Depends(get_session)`` gives a handler: one session per request,
    committed when the handler returns, rolled back when it raises."""
    async with AsyncSession(engine, expire_on_commit=False) as session:
        try:
            yield session
        except BaseException:
            await session.rollback()
            raise
        await session.commit()


async def create_order(payload: dict[str, Any], session: AsyncSession) -> dict[str, str]:
    """``@app.post("/orders")``: the order and its event, in the request's transaction."""
    order = Order(
        id=str(uuid.uuid4()), customer=str(payload["customer"]), total_cents=int(payload["total"])
    )
    session.add(order)
    await outbox.add(
        session,
        "",
        QUEUE,
        json.dumps({"order_id": order.id, "total_cents": order.total_cents}).encode(),
        key=order.customer,  # one customer's events arrive in the order they were committed
        message_id=f"order-created-{order.id}",
        content_type="application/json",
        type="order.created",
    )
    if payload.get("card") == "declined":
        raise PaymentDeclined(order.id)  # the order and its event roll back together
    return {"order_id": order.id}


async def main(db: str) -> None:
    engine = create_async_engine(db.replace("postgresql://", "postgresql+asyncpg://", 1))
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)  # a real service: `alembic upgrade head`
    with Publisher(URL) as setup:  # the consumers' queue exists before anything is relayed
        setup.declare_queue(QUEUE, durable=False)

    relay = AsyncOutboxRelay(db, URL)
    relay_task = asyncio.create_task(relay.run())  # on this loop, beside the handlers

    async def request(payload: dict[str, Any]) -> str | None:
        try:
            async with session_scope(engine) as session:
                return (await create_order(payload, session))["order_id"]
        except PaymentDeclined:
            print(f"{payload['customer']}'s payment was declined: no order, no event")
            return None

    payloads: list[dict[str, Any]] = [
        {"customer": f"customer-{i % 5}", "total": 100 + i} for i in range(20)
    ]
    payloads[7]["card"] = "declined"
    results = await asyncio.gather(*(request(p) for p in payloads))  # concurrent requests
    created = {r for r in results if r is not None}

    while (await asyncio.to_thread(status, db)).pending:  # deleted once confirmed
        await asyncio.sleep(0.05)
    relay.stop()
    await relay_task
    await engine.dispose()
    stats = relay.stats()
    print(f"{len(created)} orders committed, {stats.confirmed if stats else 0} events confirmed")

    connection = pika.BlockingConnection(pika.URLParameters(URL))
    channel = connection.channel()
    seen = set()
    while True:
        method, _props, body = channel.basic_get(QUEUE, auto_ack=True)
        if method is None:
            break
        seen.add(json.loads(body)["order_id"])
    channel.queue_delete(QUEUE)
    connection.close()
    assert seen == created, (len(seen), len(created))
    print(f"the queue holds exactly the {len(seen)} committed orders' events")


async def run() -> None:
    admin = await asyncpg.connect(ADMIN)
    await admin.execute(f"CREATE DATABASE {DATABASE}")
    try:
        await main(ADMIN.rsplit("/", 1)[0] + f"/{DATABASE}")
    finally:
        await admin.execute(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")
        await admin.close()


if __name__ == "__main__":
    asyncio.run(run())
