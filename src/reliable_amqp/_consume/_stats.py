"""A consumer's counters (each written by one thread only, read by any)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ConsumerStats:
    """What a consumer did so far (see docs/consumer.md, "Observability").

    ``consumed`` deliveries were taken off the wire and handed on; ``handled`` returned from
    the handler (their ack is sent in batches); ``retried`` were republished to a delay queue;
    ``dead_lettered`` are confirmed in the dead-letter queue; ``redelivered`` came with the
    broker's redelivered flag; ``stale`` arrived on a channel that died before their turn (the
    broker gives them back); ``republish_failed`` could not be retried or dead-lettered and went
    back to the queue; ``parked`` were set aside behind their key's retried message (``key=``);
    ``handler_seconds`` is the handlers' total time.
    """

    consumed: int = 0
    handled: int = 0
    retried: int = 0
    dead_lettered: int = 0
    redelivered: int = 0
    stale: int = 0
    republish_failed: int = 0
    parked: int = 0
    handler_seconds: float = 0.0
