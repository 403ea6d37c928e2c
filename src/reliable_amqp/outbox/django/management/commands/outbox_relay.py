"""``manage.py outbox_relay``: the outbox's relay on this project's database (``DATABASES``).

Publishes committed rows through the confirming publisher and deletes each once confirmed, until
SIGTERM or SIGINT (then waits for the confirms in flight, bounded by ``--stop-timeout``), or,
with ``--until-empty``, until nothing is pending.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import connections

from reliable_amqp.outbox import OutboxRelay
from reliable_amqp.outbox.django import outbox_table_name

#: libpq parameters of DATABASES[...]["OPTIONS"] that the relay's DSN carries
_PG_OPTIONS = (
    "sslmode", "sslrootcert", "sslcert", "sslkey", "sslpassword", "passfile", "service",
    "connect_timeout", "target_session_attrs", "options",
)  # fmt: skip


def database_dsn(alias: str = "default") -> str:
    """The relay's DSN for ``settings.DATABASES[alias]`` (PostgreSQL, SQLite, MySQL/MariaDB)."""
    if alias not in settings.DATABASES:
        raise CommandError(f"--database: no database {alias!r} in settings.DATABASES")
    db = settings.DATABASES[alias]
    vendor = connections[alias].vendor
    if vendor == "sqlite":
        name = str(db.get("NAME") or "")
        if not name or name == ":memory:" or name.startswith("file:"):
            raise CommandError(f"database {alias!r}: a relay needs a SQLite file, got {name!r}")
        return f"sqlite:///{Path(name).resolve()}"
    scheme = {"postgresql": "postgresql", "mysql": "mysql"}.get(vendor)
    if scheme is None:
        raise CommandError(f"database {alias!r}: the outbox has no relay for {vendor!r}")
    user = quote(str(db.get("USER") or ""), safe="")
    password = quote(str(db.get("PASSWORD") or ""), safe="")
    auth = f"{user}:{password}@" if password else (f"{user}@" if user else "")
    host = str(db.get("HOST") or "")
    query: dict[str, str] = {}
    if host.startswith("/"):  # a Unix socket directory
        query["host"], host = host, ""
    elif ":" in host:
        host = f"[{host}]"
    port = f":{db['PORT']}" if db.get("PORT") else ""
    if vendor == "postgresql":
        options = db.get("OPTIONS") or {}
        query.update({k: str(options[k]) for k in _PG_OPTIONS if k in options})
    suffix = f"?{urlencode(query)}" if query else ""
    return f"{scheme}://{auth}{host}{port}/{quote(str(db.get('NAME') or ''))}{suffix}"


class Command(BaseCommand):  # type: ignore[misc]  # Django is untyped here
    help = (
        "Relay the transactional outbox: publish committed rows through a confirming publisher "
        "and delete each once the broker confirmed it (reliable_amqp.outbox)."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--url",
            default=None,
            help="the broker's URL (default: settings.RELIABLE_AMQP_URL, else $AMQP_URL)",
        )
        parser.add_argument("--database", default="default", help="the DATABASES alias")
        parser.add_argument(
            "--table", default=None, help="the outbox table (settings.RELIABLE_AMQP_OUTBOX_TABLE)"
        )
        parser.add_argument(
            "--until-empty", action="store_true", help="exit once nothing is pending"
        )
        parser.add_argument("--batch", type=int, default=1000, help="rows read at a time")
        parser.add_argument("--name", default=None, help="this relay's name (outbox status)")
        parser.add_argument(
            "--stop-timeout",
            type=float,
            default=30.0,
            help="on SIGTERM/SIGINT, how long to wait for the confirms in flight",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        url = (
            options["url"]
            or getattr(settings, "RELIABLE_AMQP_URL", None)
            or os.environ.get("AMQP_URL")
        )
        if not url:
            raise CommandError("no broker: pass --url, or set RELIABLE_AMQP_URL or $AMQP_URL")
        if options["batch"] <= 0:
            raise CommandError(f"--batch: expected a positive number, got {options['batch']}")
        table = options["table"] or outbox_table_name()
        log = logging.getLogger("reliable_amqp.outbox")
        if not log.handlers and not logging.getLogger().handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
            log.addHandler(handler)
            log.setLevel(logging.INFO)
        relay = OutboxRelay(
            database_dsn(options["database"]), url, table=table, batch=options["batch"],
            name=options["name"], stop_timeout=options["stop_timeout"],
        )  # fmt: skip
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, lambda _signum, _frame: relay.stop())
        relay.run(until_empty=options["until_empty"])
        stats = relay.stats()
        self.stdout.write(
            f"outbox {table}: relay {relay.name} stopped: {stats.published} published, "
            f"{stats.confirmed} confirmed, {stats.failed} failed"
        )
