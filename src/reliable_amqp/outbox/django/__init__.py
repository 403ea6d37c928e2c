"""The outbox as a Django app: add ``"reliable_amqp.outbox.django"`` to ``INSTALLED_APPS``.

- ``manage.py migrate`` creates the outbox's tables on the database's vendor (PostgreSQL, SQLite,
  MySQL or MariaDB), as ``Outbox().install()`` would;
- ``Outbox().add(django.db.connection, ...)`` inside ``transaction.atomic()`` writes a message in
  that transaction;
- ``manage.py outbox_relay`` runs the relay against the same database (``--until-empty`` for
  batch jobs).

Settings (all optional): ``RELIABLE_AMQP_OUTBOX_TABLE`` (the table, ``"amqp_outbox"``) and
``RELIABLE_AMQP_URL`` (the broker the relay publishes to; else the ``AMQP_URL`` environment
variable). Needs Django 4.2 or later (the ``outbox-django`` extra).
"""

from __future__ import annotations

from typing import Any

from reliable_amqp.outbox._schema import DEFAULT_TABLE

__all__ = ["outbox_table_name"]


def outbox_table_name() -> str:
    """The outbox table of this Django project (``settings.RELIABLE_AMQP_OUTBOX_TABLE``)."""
    from django.conf import settings

    name: Any = getattr(settings, "RELIABLE_AMQP_OUTBOX_TABLE", DEFAULT_TABLE)
    return str(name)
