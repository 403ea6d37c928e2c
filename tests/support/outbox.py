"""Test support for the outbox: databases of their own on the machine's PostgreSQL, a relay run
in a thread, and reading a queue back as (message_id, body) pairs.

PostgreSQL runs on every machine of this project (127.0.0.1:5432, trust auth, user postgres),
CI's included: a test that cannot reach it fails, it is never skipped.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg

from reliable_amqp.outbox import OutboxRelay
from support.broker import BrokerAdmin

PG_HOST = os.environ.get("PGTEST_HOST", "127.0.0.1")
PG_PORT = int(os.environ.get("PGTEST_PORT", "5432"))
PG_ADMIN = f"postgresql://postgres@{PG_HOST}:{PG_PORT}/postgres"


@contextlib.contextmanager
def pg_database() -> Iterator[str]:
    """A new database with a unique name (its DSN), dropped afterwards."""
    name = "ra_test_" + uuid.uuid4().hex[:12]
    try:
        admin = psycopg.connect(PG_ADMIN, autocommit=True, connect_timeout=10)
    except psycopg.OperationalError as exc:
        raise AssertionError(
            f"PostgreSQL does not answer at {PG_HOST}:{PG_PORT} (it runs on every machine of "
            f"this project, CI's included): {exc}"
        ) from exc
    with admin:
        admin.execute(f"CREATE DATABASE {name}")
    try:
        yield f"postgresql://postgres@{PG_HOST}:{PG_PORT}/{name}"
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


class RelayThread:
    """An :class:`OutboxRelay` running in a thread; ``stop()`` re-raises what ``run()`` raised."""

    def __init__(self, db: str, url: str, **options: Any) -> None:
        options.setdefault("poll_interval", 0.5)
        self.relay = OutboxRelay(db, url, **options)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="test-relay", daemon=True)

    def _run(self) -> None:
        try:
            self.relay.run()
        except BaseException as exc:
            self.error = exc

    def start(self) -> RelayThread:
        self._thread.start()
        return self

    def stop(self, timeout: float = 60.0) -> None:
        self.relay.stop()
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the relay did not stop"
        if self.error is not None:
            raise self.error

    def __enter__(self) -> RelayThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def read_ids(broker: BrokerAdmin, queue: str) -> list[tuple[str, bytes]]:
    """Every message in ``queue`` as (message_id, body), in queue order (taken from it)."""
    return [(props.message_id, body) for props, body in broker.drain(queue)]


def wait_for_count(broker: BrokerAdmin, queue: str, count: int, timeout: float) -> int:
    """Wait until ``queue`` holds at least ``count`` messages (polling the broker, bounded);
    how many it holds."""
    import time

    end = time.monotonic() + timeout
    seen = broker.count(queue)
    while seen < count and time.monotonic() < end:
        time.sleep(0.05)
        seen = broker.count(queue)
    return seen


# MariaDB runs on every machine of this project too (127.0.0.1:3306, root, empty password).
MYSQL_HOST = os.environ.get("MYSQLTEST_HOST", "127.0.0.1")
MYSQL_PORT = int(os.environ.get("MYSQLTEST_PORT", "3306"))


@contextlib.contextmanager
def mysql_database() -> Iterator[str]:
    """A new MariaDB database with a unique name (its ``mysql://`` DSN), dropped afterwards."""
    import pymysql

    name = "ra_test_" + uuid.uuid4().hex[:12]

    def admin() -> Any:
        return pymysql.connect(
            host=MYSQL_HOST, port=MYSQL_PORT, user="root", password="", autocommit=True,
            connect_timeout=10,
        )  # fmt: skip

    try:
        conn = admin()
    except pymysql.err.OperationalError as exc:
        raise AssertionError(
            f"MariaDB does not answer at {MYSQL_HOST}:{MYSQL_PORT} (it runs on every machine of "
            f"this project, CI's included): {exc}"
        ) from exc
    with conn, conn.cursor() as cur:
        cur.execute(f"CREATE DATABASE {name} CHARACTER SET utf8mb4")
    try:
        yield f"mysql://root@{MYSQL_HOST}:{MYSQL_PORT}/{name}"
    finally:
        with admin() as conn, conn.cursor() as cur:
            cur.execute(f"DROP DATABASE IF EXISTS {name}")


def mysql_connect(dsn: str, **options: Any) -> Any:
    """A PyMySQL connection to a test database's DSN (autocommit off: PyMySQL's default)."""
    import pymysql

    database = dsn.rsplit("/", 1)[1]
    return pymysql.connect(
        host=MYSQL_HOST, port=MYSQL_PORT, user="root", password="", database=database, **options
    )


def wait_until(predicate: Callable[[], object], timeout: float, what: str) -> float:
    """Poll ``predicate`` (a database's or broker's state) until it holds; how long that took.
    Fails naming ``what`` after ``timeout`` seconds."""
    import time

    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"timed out after {timeout} s: {what}"
        time.sleep(0.05)
    return time.monotonic() - start


def outbox_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``reliable-amqp outbox ARGS...`` in a process of its own."""
    return subprocess.run(
        [sys.executable, "-m", "reliable_amqp", "outbox", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
