"""The durable spool: publish() appends each message to a log on local disk, confirms remove it.

An adapter-level component (it does I/O and runs a thread), used by both publishers when they
are given ``spool=DIR``; the core never sees it. ``reliable-amqp spool DIR`` inspects one.
See ``docs/spool.md`` for what it guarantees.
"""

from reliable_amqp._spool._inspect import (
    SpoolSummary,
    check,
    drop_failed,
    failed_entries,
    inspect,
)
from reliable_amqp._spool._lock import LOCK_NAME
from reliable_amqp._spool._read import SpoolEntry
from reliable_amqp._spool._store import (
    DEFAULT_FSYNC,
    DEFAULT_MAX_BYTES,
    FSYNC_POLICIES,
    Spool,
    SpoolCounts,
)

__all__ = [
    "DEFAULT_FSYNC",
    "DEFAULT_MAX_BYTES",
    "FSYNC_POLICIES",
    "LOCK_NAME",
    "Spool",
    "SpoolCounts",
    "SpoolEntry",
    "SpoolSummary",
    "check",
    "drop_failed",
    "failed_entries",
    "inspect",
]
