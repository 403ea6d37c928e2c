"""Fixtures of the outbox tests: a PostgreSQL database and a SQLite file of their own each."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from support.outbox import pg_database


@pytest.fixture
def pg_dsn() -> Iterator[str]:
    """A fresh PostgreSQL database (its DSN), dropped after the test."""
    with pg_database() as dsn:
        yield dsn


@pytest.fixture
def sqlite_dsn(tmp_path: Path) -> str:
    """A SQLite database file of the test's own (its DSN)."""
    return f"sqlite:///{tmp_path / 'app.db'}"
