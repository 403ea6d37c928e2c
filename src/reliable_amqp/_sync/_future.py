"""PublishFuture: the cheaper ``concurrent.futures.Future`` that ``Publisher.publish()`` returns.

The machinery (CPython ``Future`` fields, the shared-lock condition) is in
:mod:`reliable_amqp._compat.futures`, where it is probed at import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from reliable_amqp._compat.futures import LightFuture, SharedLockCondition
from reliable_amqp._core.message import Confirmation, MessageProperties
from reliable_amqp._core.tracker import Entry, fresh_entry

__all__ = ["PublishFuture", "SharedLockCondition", "WaitGuard", "future_factory"]


class WaitGuard(Protocol):
    """Says whether a thread may block on a publisher's future (see :class:`Handoff`)."""

    def check_wait(self, what: str) -> None:
        """Raise when waiting here could never end (on the publisher's own I/O thread)."""


class PublishFuture(LightFuture[Confirmation], Entry[Any]):
    """The future ``Publisher.publish()`` returns; ``index`` orders it for ``flush()``.

    It is also the engine's entry for its message (:class:`Entry`), on every path (with a spool,
    with telemetry): a message in flight is one object for the garbage collector, which made
    the collector's full passes over the messages in flight the largest cost left per message.
    Its attributes beyond the ``Future`` ones (``exchange``, ``body``, ``message_id``,
    ``attempts``, ...) are the publisher's bookkeeping, not API. Made by :func:`future_factory`
    only.

    Waiting for it (``result()``, ``exception()``) on the publisher's own I/O thread, say in a
    done-callback, raises at once: only that thread can resolve it.
    """

    guard: WaitGuard | None

    def result(self, timeout: float | None = None) -> Confirmation:
        """The :class:`Confirmation`, or raise what became of the message."""
        guard = self.guard
        if guard is not None and not self.done():
            guard.check_wait("future.result()")
        result: object = super().result(timeout)
        if isinstance(result, Confirmation):
            return result
        # settled with the entry's raw resolution (CONFIRMED): its Confirmation is built now
        outcome = self.outcome
        assert isinstance(outcome, Confirmation)
        return outcome

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """What became of the message (None when it was confirmed)."""
        guard = self.guard
        if guard is not None and not self.done():
            guard.check_wait("future.exception()")
        return super().exception(timeout)


def future_factory(
    condition: SharedLockCondition, guard: WaitGuard | None
) -> Callable[[str, str, bytes, MessageProperties, bool, str], PublishFuture]:
    """How a publisher makes the future of a ``publish()``: the message and its entry too,
    built from checked parts (what :func:`~reliable_amqp._core.tracker.new_entry` does)."""

    def new_future(  # noqa: PLR0917
        exchange: str,
        routing_key: str,
        body: bytes,
        base: MessageProperties,
        mandatory: bool,
        message_id: str,
    ) -> PublishFuture:
        future = fresh_entry(
            PublishFuture, exchange, routing_key, body, base, mandatory, message_id
        )
        future.init_light(condition)
        future.guard = guard
        return future

    return new_future
