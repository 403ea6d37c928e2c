"""Run by tests/inbox/test_inbox_stacks.py in a process of its own (Django's settings are once per
process), on the database ``INBOX_DJANGO_DB`` (a ``postgresql://`` URL or a SQLite file): the
inbox through Django's ``connection``: installed twice, each id delivered twice and one handler
failing after its claim, a claim outside ``atomic()`` refused, the attempts ledger on a second
alias, prune in its own transactions. Prints a JSON report on its last line."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import django
from django.conf import settings

_db = os.environ["INBOX_DJANGO_DB"]
if _db.startswith("postgresql://"):
    _url = urlsplit(_db)
    _default = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _url.path.lstrip("/"),
        "USER": _url.username or "",
        "HOST": _url.hostname or "",
        "PORT": str(_url.port or ""),
    }
else:
    _default = {"ENGINE": "django.db.backends.sqlite3", "NAME": _db}
# "ledger": a second connection to the same database, for the attempts ledger
settings.configure(DATABASES={"default": _default, "ledger": dict(_default)}, USE_TZ=True)
django.setup()

from django.db import connection, connections, transaction  # noqa: E402

from reliable_amqp import ConfigurationError  # noqa: E402
from reliable_amqp.inbox import Inbox  # noqa: E402
from support.inbox import FakeDelivery  # noqa: E402


def main() -> None:
    inbox = Inbox("svc")
    inbox.install(connection)
    inbox.install(connection)
    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE effects (message_id varchar(255) NOT NULL)")
    refused = False
    try:
        inbox.claim(connection, FakeDelivery("outside"))
    except ConfigurationError as exc:
        refused = "atomic" in str(exc)
    failed: set[str] = set()

    def handle(delivery: FakeDelivery, conn: object) -> None:
        with connection.cursor() as cursor:
            cursor.execute("INSERT INTO effects VALUES (%s)", [delivery.message_id])
        if delivery.message_id == "m3" and "m3" not in failed:
            failed.add("m3")
            raise RuntimeError("after the claim")

    handler = inbox.handler(lambda: connection, handle)
    ids = [f"m{i}" for i in range(10)]
    for delivery in [FakeDelivery(i) for i in ids] + [FakeDelivery(i, True) for i in ids]:
        with contextlib.suppress(RuntimeError):
            handler(delivery)
    handler(FakeDelivery("m3", True))
    with connection.cursor() as cursor:
        cursor.execute("SELECT message_id FROM effects ORDER BY message_id")
        effects = [row[0] for row in cursor.fetchall()]
    attempt = inbox.record_attempt(connections["ledger"], FakeDelivery("m9", True))
    inbox.forget_attempts(connection, FakeDelivery("m9"))  # autocommit: commits on its own
    pruned = inbox.prune(connection, older_than=0, batch=3)
    assert not connection.in_atomic_block
    with transaction.atomic(), connection.cursor() as cursor:  # the claims are gone for good
        cursor.execute("SELECT count(*) FROM amqp_inbox")
        assert cursor.fetchone()[0] == 0
    report = {"effects": effects, "refused": refused, "pruned": pruned, "attempt": attempt}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
