"""Fixtures of the inbox tests: a database of the test's own on PostgreSQL, MariaDB or SQLite
(each made and dropped by the test), and small Delivery-like values."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from support.inbox import Database
from support.outbox import mysql_database, pg_database


@pytest.fixture(params=["postgresql", "mariadb", "sqlite"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    """A fresh database of each kind (psycopg, PyMySQL, sqlite3 connections)."""
    kind = request.param
    if kind == "postgresql":
        with pg_database() as dsn:
            yield Database("postgresql", dsn)
    elif kind == "mariadb":
        with mysql_database() as dsn:
            yield Database("mysql", dsn)
    else:
        yield Database("sqlite", f"sqlite:///{tmp_path / 'inbox.db'}")


@pytest.fixture
def pg_dsn() -> Iterator[str]:
    with pg_database() as dsn:
        yield dsn


@pytest.fixture
def mysql_dsn() -> Iterator[str]:
    with mysql_database() as dsn:
        yield dsn
