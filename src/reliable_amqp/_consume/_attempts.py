"""A consumer's count of lost subscriptions against its connect policy.

Each lost connection or channel counts (:meth:`Attempts.count`) until a subscription is got
back (:meth:`Attempts.recovered`); the policy says whether another try is allowed and how long
to wait. A refusal before any subscription of the run (a missing queue, a permission) is
counted apart: it ends the run after a few tries, not after the policy's whole span.
"""

from __future__ import annotations

import time

from reliable_amqp._core.errors import RecoveryFailed, ReliableAmqpError
from reliable_amqp._core.policy import RetryPolicy


class Attempts:
    """Failures in a row, for one consumer's I/O (see the module docstring)."""

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self.failures = 0
        self.first_failure: float | None = None
        #: the last loss, as text (for the "recovered after ..." line)
        self.last_loss: str | None = None
        #: this run had a subscription
        self.subscribed_once = False
        #: refusals in a row before any subscription
        self.refused = 0
        #: subscriptions got back after a loss
        self.recoveries = 0

    def reset(self) -> None:
        """A new run."""
        self.failures, self.first_failure = 0, None
        self.subscribed_once, self.refused, self.last_loss = False, 0, None

    def count(self, loss: ReliableAmqpError) -> bool:
        """Count a lost connection or channel; True while the policy allows another try."""
        now = time.monotonic()
        if self.first_failure is None:
            self.first_failure = now
        self.failures += 1
        self.last_loss = str(loss)
        return self.policy.allows(self.failures, now - self.first_failure)

    def delay(self) -> float:
        """How long to wait before the next try."""
        return self.policy.delay(self.failures)

    def outage(self) -> float:
        """Seconds since the first failure in a row (0 without one)."""
        first = self.first_failure
        return time.monotonic() - first if first is not None else 0.0

    def recovered(self) -> None:
        """A subscription is live again: the count starts over."""
        if self.failures:
            self.recoveries += 1
        self.failures = 0
        self.first_failure = None
        self.subscribed_once = True
        self.refused = 0

    def gave_up(self, queue: str, loss: ReliableAmqpError) -> RecoveryFailed:
        """The error that ends a consumer whose policy is spent (caused by ``loss``)."""
        return gave_up(queue, self.failures, loss)


def gave_up(queue: str, failures: int, loss: ReliableAmqpError) -> RecoveryFailed:
    """The error that ends a consumer whose connect policy is spent (caused by ``loss``)."""
    error = RecoveryFailed(f"consumer of {queue!r} gave up after {failures} attempts: {loss}")
    error.__cause__ = loss
    return error
