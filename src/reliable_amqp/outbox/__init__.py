"""The transactional outbox: a message goes out if and only if the application's transaction
commits.

:class:`Outbox` (and :class:`AsyncOutbox`) write messages as rows on the caller's own
connection, inside the caller's transaction; :class:`OutboxRelay` publishes committed rows
through a confirming publisher and deletes each one only once the broker confirmed it
(:class:`AsyncOutboxRelay` as a task of an asyncio application). Needs
the ``outbox`` extra for PostgreSQL (psycopg 3) or ``outbox-mysql`` for MariaDB and MySQL
(PyMySQL); SQLite needs nothing. See docs/outbox.md.
"""

from reliable_amqp.outbox._loop import RelayStats
from reliable_amqp.outbox._relay import AsyncOutboxRelay, OutboxRelay
from reliable_amqp.outbox._schema import DEFAULT_TABLE, PARTITIONS
from reliable_amqp.outbox._status import OpenWriter, OutboxStatus, RelayInfo
from reliable_amqp.outbox._tools import FailedRow, drop_failed, failed_rows, retry_failed, status
from reliable_amqp.outbox._writer import AsyncOutbox, Outbox

__all__ = [
    "DEFAULT_TABLE",
    "PARTITIONS",
    "AsyncOutbox",
    "AsyncOutboxRelay",
    "FailedRow",
    "OpenWriter",
    "Outbox",
    "OutboxRelay",
    "OutboxStatus",
    "RelayInfo",
    "RelayStats",
    "drop_failed",
    "failed_rows",
    "retry_failed",
    "status",
]
