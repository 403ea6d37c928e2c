"""A Django view with a transactional outbox: the view inserts an order and adds its "order
created" event inside ``transaction.atomic()``; the event goes out if and only if that block
commits. ``manage.py outbox_relay`` (here ``call_command``) publishes committed events and
deletes each once the broker confirmed it.

A whole project in one file: the settings are configured here, with the outbox's app
(``reliable_amqp.outbox.django``, whose migration creates the outbox tables) and a SQLite
database in a temporary directory. The same view runs unchanged on PostgreSQL or MySQL.

Needs ``pip install '.[outbox-django]'`` (plus ``[outbox]`` for PostgreSQL).
"""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from typing import Any

import django
import pika
from django.conf import settings

from reliable_amqp import Publisher

URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
QUEUE = f"outbox-django-orders-{uuid.uuid4().hex[:8]}"


def configure(workdir: str) -> None:
    settings.configure(
        DEBUG=False,
        SECRET_KEY="example",
        ALLOWED_HOSTS=["testserver"],
        ROOT_URLCONF=__name__,
        INSTALLED_APPS=["reliable_amqp.outbox.django"],  # the outbox tables and outbox_relay
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.sqlite3",
                "NAME": os.path.join(workdir, "shop.db"),
            }
        },
        RELIABLE_AMQP_URL=URL,  # the broker outbox_relay publishes to
    )
    django.setup()


def create_order(request: Any) -> Any:  # a Django view (HttpRequest -> JsonResponse)
    """``POST /orders``: the order and its event in one transaction."""
    from django.db import connection, transaction
    from django.http import JsonResponse

    from reliable_amqp.outbox import Outbox

    payload = json.loads(request.body)
    order_id = str(uuid.uuid4())
    try:
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute(
                    "INSERT INTO orders (id, customer, total_cents) VALUES (%s, %s, %s)",
                    [order_id, payload["customer"], payload["total_cents"]],
                )
            Outbox().add(
                connection,  # Django's connection: the write joins the atomic() block
                "",
                QUEUE,
                json.dumps({"order_id": order_id, "total_cents": payload["total_cents"]}).encode(),
                key=payload["customer"],  # one customer's events arrive in commit order
                message_id=f"order-created-{order_id}",
                content_type="application/json",
                type="order.created",
            )
            if payload.get("card") == "declined":
                raise ValueError("payment declined")  # rolls back the order and its event
    except ValueError as exc:
        return JsonResponse({"error": str(exc)}, status=402)
    return JsonResponse({"order_id": order_id}, status=201)


urlpatterns: list[object] = []


def main(workdir: str) -> None:
    configure(workdir)
    from django.core.management import call_command
    from django.db import connection
    from django.test import RequestFactory

    call_command("migrate", verbosity=0)  # the outbox app's migration: amqp_outbox, ..._failed
    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE orders (id text PRIMARY KEY, customer text, total_cents int)")
    with Publisher(URL) as setup:  # the consumers' queue exists before anything is relayed
        setup.declare_queue(QUEUE, durable=False)

    requests = RequestFactory()
    created = []
    for body in [
        {"customer": "alice", "total_cents": 1250},
        {"customer": "bob", "total_cents": 990},
        {"customer": "carol", "total_cents": 4200, "card": "declined"},
        {"customer": "alice", "total_cents": 300},
    ]:
        response = create_order(
            requests.post("/orders", data=json.dumps(body), content_type="application/json")
        )
        answer = json.loads(response.content)
        print(f"POST /orders {body['customer']}: {response.status_code} {answer}")
        if response.status_code == 201:
            created.append(answer["order_id"])

    call_command("outbox_relay", "--until-empty")  # as `manage.py outbox_relay --until-empty`

    amqp = pika.BlockingConnection(pika.URLParameters(URL))
    channel = amqp.channel()
    seen = []
    while True:
        method, props, body = channel.basic_get(QUEUE, auto_ack=True)
        if method is None:
            break
        seen.append(json.loads(body)["order_id"])
        print(f"  {props.type} {props.message_id}")
    channel.queue_delete(QUEUE)
    amqp.close()
    assert seen == created, (seen, created)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        main(tmp)
