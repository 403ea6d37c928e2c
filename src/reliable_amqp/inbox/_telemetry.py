"""OpenTelemetry for the inbox, through the API only (the ``otel`` extra), and nothing at all
without it: counters of claims, duplicates skipped, rows pruned and redeliveries written to the
attempts ledger, each with the inbox's table and scope as attributes. Whether an SDK records
them is decided once, when the inbox is made: without one, a claim pays one attribute check."""

from __future__ import annotations

from typing import Any

from reliable_amqp._otel import _is_proxy_or_noop as is_proxy_or_noop

try:
    from opentelemetry import metrics as _metrics
except ImportError:  # pragma: no cover - without the otel extra
    _metrics = None  # type: ignore[assignment]

#: (attribute of InboxMetrics, instrument name, unit, description)
_COUNTERS = (
    ("claims", "reliable_amqp.inbox.claims", "{message}", "New claims: messages handled"),
    ("duplicates", "reliable_amqp.inbox.duplicates", "{message}", "Duplicates skipped"),
    ("pruned", "reliable_amqp.inbox.pruned", "{row}", "Claims and ledger rows pruned"),
    (
        "redeliveries",
        "reliable_amqp.inbox.redeliveries",
        "{message}",
        "Redeliveries counted in the attempts ledger",
    ),
)


class InboxMetrics:
    """The inbox's counters (None each without a meter provider): ``reliable_amqp.inbox.*``."""

    def __init__(self, table: str, scope: str, meter_provider: Any = None) -> None:
        self.attributes = {"reliable_amqp.inbox.table": table, "reliable_amqp.inbox.scope": scope}
        self.claims: Any = None
        self.duplicates: Any = None
        self.pruned: Any = None
        self.redeliveries: Any = None
        if _metrics is None:
            return
        provider = meter_provider if meter_provider is not None else _metrics.get_meter_provider()
        if is_proxy_or_noop(provider, _metrics):
            return
        meter = provider.get_meter("reliable_amqp.inbox")
        for attribute, name, unit, description in _COUNTERS:
            setattr(self, attribute, meter.create_counter(name, unit=unit, description=description))

    def add(self, counter: Any, count: int = 1) -> None:
        if counter is not None and count:
            counter.add(count, self.attributes)
