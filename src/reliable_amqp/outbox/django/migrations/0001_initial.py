"""The outbox's tables, as ``Outbox().install()`` creates them on this database's vendor
(PostgreSQL, SQLite, MySQL or MariaDB): the library's DDL, so the relay and ``outbox status`` find
exactly what they expect. Reversible (drops both tables)."""

from __future__ import annotations

from typing import Any, ClassVar

from django.db import migrations

from reliable_amqp.outbox._django_writer import ddl_for
from reliable_amqp.outbox._schema import Tables
from reliable_amqp.outbox.django import outbox_table_name


def create(apps: Any, schema_editor: Any) -> None:
    tables = Tables.named(outbox_table_name())
    for statement in ddl_for(schema_editor.connection.vendor, tables):
        schema_editor.execute(statement)


def drop(apps: Any, schema_editor: Any) -> None:
    tables = Tables.named(outbox_table_name())
    for name in (tables.failed, tables.name):
        schema_editor.execute(f"DROP TABLE IF EXISTS {name}")


class Migration(migrations.Migration):  # type: ignore[misc]  # Django is untyped here
    initial = True
    dependencies: ClassVar[list[tuple[str, str]]] = []
    operations: ClassVar[list[Any]] = [migrations.RunPython(create, drop, elidable=False)]
