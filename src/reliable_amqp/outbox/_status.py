"""What ``outbox status`` reports, as values."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class RelayInfo:
    """A relay at work: its name, database session, host, uptime and partitions owned."""

    name: str
    session: str
    host: str
    up_s: float
    partitions: int


@dataclass(frozen=True)
class OpenWriter:
    """A transaction still open that has written to the outbox: rows no relay can see yet."""

    session: str
    age_s: float
    application: str = ""
    state: str = ""


@dataclass(frozen=True)
class OutboxStatus:
    """The outbox at a glance.

    ``pending`` committed rows not yet confirmed, ``failed`` rows in the failed table,
    ``oldest_age_s`` the age in seconds of the oldest row a relay still has to deliver: the
    oldest committed pending row, or the oldest open transaction that has written to the outbox
    (whose rows nobody can see yet), whichever is older; None when neither exists.
    """

    pending: int
    failed: int
    oldest_age_s: float | None
    relays: list[RelayInfo] = field(default_factory=list)
    open_writers: list[OpenWriter] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (``outbox status --json``)."""
        return asdict(self)
