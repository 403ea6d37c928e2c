"""Run by tests/outbox/test_stacks.py in a process of its own (Django's settings are once per
process): migrates the database, then writes ``COUNT`` transactions through
``transaction.atomic()``, rolling back about one in four, and prints the committed message ids
as a JSON list on its last line. Also shows that a write outside ``atomic()`` is refused."""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "settings")

import django

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connection, transaction  # noqa: E402

from reliable_amqp import ConfigurationError  # noqa: E402
from reliable_amqp.outbox import Outbox  # noqa: E402


class Rollback(Exception):
    pass


def main(queue: str, count: int) -> None:
    call_command("migrate", verbosity=0)
    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE orders (id integer PRIMARY KEY, note text)")
    outbox = Outbox()
    outbox.install(connection)  # idempotent: the migration made the tables already
    try:
        outbox.add(connection, "", queue, b"outside atomic")
    except ConfigurationError as exc:
        assert "atomic" in str(exc), exc
    else:
        raise AssertionError("a write outside atomic() was not refused")
    rng = random.Random(7)
    committed = []
    for i in range(count):
        try:
            with transaction.atomic():
                with connection.cursor() as cursor:
                    cursor.execute("INSERT INTO orders (id, note) VALUES (%s, %s)", (i, "x"))
                mid = outbox.add(connection, "", queue, b"order %d" % i, key=f"k{i % 7}")
                if i % 10 == 0:  # a nested block (a savepoint) that commits with the outer one
                    with transaction.atomic():
                        committed.append(outbox.add(connection, "", queue, b"nested %d" % i))
                if rng.random() < 0.25:
                    if i % 10 == 0:
                        committed.pop()
                    raise Rollback
            committed.append(mid)
        except Rollback:
            pass
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM amqp_outbox")
        (pending,) = cursor.fetchone()
    assert pending == len(committed), (pending, len(committed))
    print(json.dumps(committed))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
