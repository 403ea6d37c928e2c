"""Fixtures of the inbox's consumer-level tests: a database of the test's own (PostgreSQL,
MariaDB or SQLite, made and dropped by the test) with the inbox and an effects table, and the
queues a consumer declares for itself, deleted after."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from reliable_amqp.inbox import Inbox
from support.consumer import QUICK, delete_queues, side_queues
from support.inbox import Database
from support.inbox_consumer import Children
from support.outbox import mysql_database, pg_database


def _database(kind: str, tmp_path: Path) -> Iterator[Database]:
    if kind == "postgresql":
        with pg_database() as dsn:
            yield Database("postgresql", dsn)
    elif kind == "mariadb":
        with mysql_database() as dsn:
            yield Database("mysql", dsn)
    else:
        yield Database("sqlite", f"sqlite:///{tmp_path / 'inbox.db'}")


def ready(db: Database) -> Database:
    """The inbox's tables and the handler's effects table (no unique key of its own)."""
    conn = db.connect()
    try:
        Inbox("billing").install(conn)
        conn.commit()
        db.create_effects(conn)
    finally:
        conn.close()
    return db


@pytest.fixture(params=["postgresql", "mariadb", "sqlite"])
def any_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    """A fresh database of each kind, ready for the inbox."""
    for db in _database(request.param, tmp_path):
        yield ready(db)


@pytest.fixture
def pg_db(tmp_path: Path) -> Iterator[Database]:
    """A fresh PostgreSQL database, ready for the inbox."""
    for db in _database("postgresql", tmp_path):
        yield ready(db)


@pytest.fixture
def children(tmp_path: Path, amqp_url: str) -> Iterator[Callable[..., Children]]:
    """``children(queue, db, **config)``: child consumers of ``queue``, killed after the test;
    the queues they declared for themselves (dead letters, delay levels) deleted."""
    made: list[Children] = []

    def factory(queue: str, db: Database, **config: object) -> Children:
        group = Children(
            tmp_path / f"children{len(made)}",
            url=amqp_url,
            queue=queue,
            dialect=db.dialect,
            dsn=db.dsn,
            **config,
        )
        made.append(group)
        return group

    yield factory
    for group in made:
        group.close()
    for queue in {g.config["queue"] for g in made}:
        delete_queues(amqp_url, side_queues(str(queue), QUICK))
