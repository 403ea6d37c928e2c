"""The inbox: each message's effects exactly once, in the handler's own transaction.

:class:`Inbox` (and :class:`AsyncInbox`) claim a delivery's ``message_id`` on the caller's
connection, inside the transaction in which the handler writes its effects: the claim and the
effects commit together, and the message is acked after that commit. A duplicate finds the
claim and is skipped; a crash before the commit redoes the work. ``handler()`` wraps a
``handle(delivery, conn)`` into the ``handler(delivery)`` a consumer runs; ``record_attempt()``
counts redeliveries durably (a message that crashes the process every time); ``prune()`` keeps
the table bounded. The same connections as the outbox (psycopg 3, sqlite3, SQLAlchemy, Django,
asyncpg, PyMySQL). See docs/inbox.md.
"""

from reliable_amqp._core.errors import MissingMessageId
from reliable_amqp.inbox._inbox import (
    ATTEMPT_HEADER,
    AsyncInbox,
    DeliveryLike,
    Inbox,
    InboxStats,
)
from reliable_amqp.inbox._schema import (
    DEFAULT_RETENTION,
    DEFAULT_TABLE,
    MIN_RETENTION,
    PRUNE_BATCH,
)
from reliable_amqp.inbox._tools import InboxStatus, install, observe, prune, status

__all__ = [
    "ATTEMPT_HEADER",
    "DEFAULT_RETENTION",
    "DEFAULT_TABLE",
    "MIN_RETENTION",
    "PRUNE_BATCH",
    "AsyncInbox",
    "DeliveryLike",
    "Inbox",
    "InboxStats",
    "InboxStatus",
    "MissingMessageId",
    "install",
    "observe",
    "prune",
    "status",
]
