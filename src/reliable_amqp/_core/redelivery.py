"""What becomes of a delivery: its attempt number, and whether a failure is retried or dead.

No I/O: the consumer asks, then carries the answer out (republish to a delay queue and ack, or
publish to the dead-letter queue and ack; both confirmed before the ack).

Attempts. The first delivery is attempt 1. A retry is a *new* message (republished to a delay
queue, which dead-letters it back to the queue when its TTL ends) carrying the attempt in
:data:`ATTEMPT_HEADER`. A copy the broker itself redelivers (the consumer died, its channel
closed) counts too: quorum queues say how often in ``x-delivery-count``; classic queues and
streams only set ``redelivered``, which counts as one more attempt (a lower bound: a message
that crashes the process every time on a classic queue is seen as attempt 2 forever, which is
why :mod:`reliable_amqp.inbox` keeps a durable count).

Delays. Per-message TTL expires only at the head of a classic queue, so a long delay must not
sit in front of a short one: each delay *level* has its own queue with a queue TTL. The policy's
delay is rounded *up* to the next level of a fixed ladder (1, 1.5, 2, 3, 5, 7 times a power of
ten, in milliseconds), so a retry never comes sooner than the policy says and a policy needs
only a handful of queues.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from reliable_amqp._core.errors import ConfigurationError
from reliable_amqp._core.policy import RetryPolicy

__all__ = [
    "ATTEMPT_HEADER",
    "BROKER_HEADERS",
    "DEAD_HEADERS",
    "NO_ID_HEADER",
    "MAX_DELAY_MS",
    "DeadLetter",
    "Retry",
    "attempt_of",
    "dead_letter_headers",
    "delay_levels",
    "delay_queue",
    "on_failure",
    "before_handler",
    "retry_headers",
]

#: the attempt a retried copy is on (1 is the first delivery)
ATTEMPT_HEADER = "x-consume-attempt"
#: on a copy of a message that had no message_id: the publisher had to give the copy one, and
#: the consumer's decoder takes it back out (a copy must not look like a message of its own)
NO_ID_HEADER = "x-consume-no-message-id"
REASON_HEADER = "x-death-reason"
EXCEPTION_HEADER = "x-exception-type"
ATTEMPTS_HEADER = "x-attempts"
ORIGIN_QUEUE_HEADER = "x-original-queue"
ORIGIN_EXCHANGE_HEADER = "x-original-exchange"
ORIGIN_ROUTING_KEY_HEADER = "x-original-routing-key"
DEAD_HEADERS = (
    REASON_HEADER,
    EXCEPTION_HEADER,
    ATTEMPTS_HEADER,
    ORIGIN_QUEUE_HEADER,
    ORIGIN_EXCHANGE_HEADER,
    ORIGIN_ROUTING_KEY_HEADER,
)
#: headers the broker adds when it delivers or dead-letters (a delay queue's TTL does): dropped
#: from the copies the consumer republishes (they would grow with every retry, and a stale
#: x-delivery-count would count the old copy's deliveries again)
BROKER_HEADERS = (
    "x-delivery-count",
    "x-death",
    "x-first-death-exchange",
    "x-first-death-queue",
    "x-first-death-reason",
    "x-last-death-exchange",
    "x-last-death-queue",
    "x-last-death-reason",
)
#: the longest delay queue TTL: LavinMQ refuses a TTL above a signed 32-bit count of ms
MAX_DELAY_MS = 2**31 - 1
_LADDER = (10, 15, 20, 30, 50, 70)
#: a reason longer than this is cut (a header is not a log; the frame has a size limit)
MAX_REASON = 2000


def attempt_of(headers: dict[str, Any], redelivered: bool) -> int:
    """The attempt a delivery is on (1 the first time); see the module's docstring."""
    base = headers.get(ATTEMPT_HEADER, 1) if headers else 1
    if type(base) is not int or base < 1:
        base = 1
    count = headers.get("x-delivery-count") if headers else None
    if type(count) is int and count >= 0:
        return base + count
    return base + 1 if redelivered else base


@dataclass(frozen=True, slots=True)
class Retry:
    """Republish to ``queue`` (a delay queue), carrying ``attempt``, then ack the original."""

    queue: str
    delay_ms: int
    attempt: int


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """Publish to the dead-letter queue with these facts, then ack the original."""

    reason: str
    exception_type: str
    attempts: int


def _level(ms: float) -> int:
    """The smallest ladder level >= ``ms`` (at least 1 ms, at most :data:`MAX_DELAY_MS`)."""
    if ms <= 1:
        return 1
    if ms >= MAX_DELAY_MS:
        return MAX_DELAY_MS
    exponent = math.floor(math.log10(ms)) - 1
    while True:
        for step in _LADDER:
            level = step * 10**exponent
            if level >= ms:
                return int(min(math.ceil(level), MAX_DELAY_MS))
        exponent += 1


def delay_queue(queue: str, delay_ms: int) -> str:
    """The name of ``queue``'s delay queue for one level."""
    return f"{queue}.retry.{delay_ms}ms"


def delay_levels(policy: RetryPolicy) -> list[int]:
    """Every delay level (ms) a policy can ask for, so the queues exist before any retry."""
    if policy.max_attempts is None:
        raise ConfigurationError(
            "a consumer's redelivery policy needs max_attempts: a message that keeps failing "
            "must end in the dead-letter queue, never be retried forever"
        )
    levels: set[int] = set()
    for failures in range(1, policy.max_attempts):
        low = _level(policy.base_delay(failures) * 1000)
        high = _level((policy.base_delay(failures) + policy.jitter) * 1000)
        level = low
        while True:
            levels.add(level)
            if level >= high:
                break
            level = _level(level + 1)
    return sorted(levels)


def before_handler(attempt: int, header_error: str | None, max_attempts: int) -> DeadLetter | None:
    """Dead before the handler runs: undecodable headers, or too many attempts already.

    The second is how a message that kills the process each time ends: the broker redelivers
    it (quorum queues count it), and past ``max_attempts`` it goes to the dead letters without
    another call.
    """
    if header_error is not None:
        return DeadLetter(header_error, "HeaderDecodeError", attempt)
    if attempt > max_attempts:
        return DeadLetter(
            f"delivered {attempt} times, more than max_attempts={max_attempts}, without the "
            "handler finishing (the consumer died or lost its connection during each attempt)",
            "AttemptsExceeded",
            attempt,
        )
    return None


def on_failure(
    queue: str,
    attempt: int,
    error: BaseException,
    policy: RetryPolicy,
    *,
    rejected: bool,
    rng: Any = None,
) -> Retry | DeadLetter:
    """A handler raised ``error`` on ``attempt``: retry it after the policy's delay, or dead.

    ``rejected`` (the handler raised :class:`~reliable_amqp.Reject`) is dead at once.
    """
    module = type(error).__module__
    if module.startswith("reliable_amqp."):
        module = "reliable_amqp"  # the public name (Reject, HandlerTimeout), not a private path
    exc_type = f"{module}.{type(error).__qualname__}"
    text = str(error) or type(error).__name__
    if len(text) > MAX_REASON:
        text = text[: MAX_REASON - 1] + "\u2026"
    if rejected:
        return DeadLetter(text, exc_type, attempt)
    max_attempts = policy.max_attempts or 1
    if attempt >= max_attempts:
        return DeadLetter(text, exc_type, attempt)
    delay = policy.delay(attempt) if rng is None else policy.delay(attempt, rng)
    level = _level(delay * 1000)
    return Retry(delay_queue(queue, level), level, attempt + 1)


def _carried(headers: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in headers.items() if k not in BROKER_HEADERS}


def retry_headers(
    headers: dict[str, Any], retry: Retry, queue: str, exchange: str, routing_key: str
) -> dict[str, Any]:
    """The headers of a retried copy: the original's, the attempt, and where it came from."""
    carried = _carried(headers)
    carried[ATTEMPT_HEADER] = retry.attempt
    carried.setdefault(ORIGIN_QUEUE_HEADER, queue)
    carried.setdefault(ORIGIN_EXCHANGE_HEADER, exchange)
    carried.setdefault(ORIGIN_ROUTING_KEY_HEADER, routing_key)
    return carried


def dead_letter_headers(
    headers: dict[str, Any], dead: DeadLetter, queue: str, exchange: str, routing_key: str
) -> dict[str, Any]:
    """The headers of a dead letter: the original's, why it died, and where it came from."""
    carried = _carried(headers)
    carried[REASON_HEADER] = dead.reason
    carried[EXCEPTION_HEADER] = dead.exception_type
    carried[ATTEMPTS_HEADER] = dead.attempts
    carried.setdefault(ORIGIN_QUEUE_HEADER, queue)
    carried.setdefault(ORIGIN_EXCHANGE_HEADER, exchange)
    carried.setdefault(ORIGIN_ROUTING_KEY_HEADER, routing_key)
    return carried
