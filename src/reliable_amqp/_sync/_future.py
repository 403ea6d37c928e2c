"""PublishFuture: the cheaper ``concurrent.futures.Future`` that ``Publisher.publish()`` returns.

The machinery (CPython ``Future`` fields, the shared-lock condition) is in
:mod:`reliable_amqp._compat.futures`, where it is probed at import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from reliable_amqp._compat.futures import LightFuture, SharedLockCondition
from reliable_amqp._core.entry import Entry, fresh_entry
from reliable_amqp._core.message import Confirmation, MessageProperties
from reliable_amqp._logs import report_unretrieved

__all__ = [
    "PublishFuture",
    "SharedLockCondition",
    "WaitGuard",
    "failed",
    "future_factory",
    "retrieved",
]


class WaitGuard(Protocol):
    """Says whether a thread may block on a publisher's future (see :class:`Handoff`)."""

    def check_wait(self, what: str) -> None:
        """Raise when waiting here could never end (on the publisher's own I/O thread)."""


class _Unretrieved:
    """Held by a failed :class:`PublishFuture` until its exception is retrieved: collected with
    the future while ``error`` is still set, it reports it (one WARNING, asyncio's words: see
    :func:`~reliable_amqp._logs.report_unretrieved`). Only failed futures get one, so a
    confirmed message costs nothing for it."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error: BaseException | None = error

    def __del__(self) -> None:
        error = self.error
        if error is not None:
            self.error = None
            report_unretrieved(error)


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
    #: set when the future failed, until its exception is retrieved (see _Unretrieved)
    _unretrieved: _Unretrieved | None = None
    #: False for a message read back from the spool that no caller holds: a failure of one
    #: recovered from an earlier process is reported by the spool, not as a future
    _report: bool = True

    def result(self, timeout: float | None = None) -> Confirmation:
        """The :class:`Confirmation`, or raise what became of the message."""
        guard = self.guard
        if guard is not None and not self.done():
            guard.check_wait("future.result()")
        try:
            result: object = super().result(timeout)
        except BaseException:
            retrieved(self)
            raise
        if isinstance(result, Confirmation):
            return result
        # settled with the entry's raw outcome (CONFIRMED): its Confirmation is built now
        outcome = self.outcome
        assert isinstance(outcome, Confirmation)
        return outcome

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """What became of the message (None when it was confirmed)."""
        guard = self.guard
        if guard is not None and not self.done():
            guard.check_wait("future.exception()")
        error = super().exception(timeout)
        if error is not None:
            retrieved(self)
        return error

    def set_exception(self, exception: BaseException | None) -> None:
        """As ``Future.set_exception`` (the publisher sets most failures through
        :func:`~reliable_amqp._compat.futures.resolve_futures` instead, with :func:`failed`)."""
        if exception is not None and not self.done():
            failed(self, exception)
        super().set_exception(exception)


def failed(future: PublishFuture, error: BaseException) -> None:
    """``future`` fails with ``error``: reported if nobody retrieves it (see _Unretrieved).
    Called before its callbacks run (they may retrieve it)."""
    if future._report:
        future._unretrieved = _Unretrieved(error)


def retrieved(future: PublishFuture) -> None:
    """Somebody has seen what became of ``future`` (or it is reported another way)."""
    unretrieved = future._unretrieved
    if unretrieved is not None:
        unretrieved.error = None
        future._unretrieved = None


def future_factory(
    condition: SharedLockCondition, guard: WaitGuard | None
) -> Callable[[str, str, bytes, MessageProperties, bool, str], PublishFuture]:
    """How a publisher makes the future of a ``publish()``: the message and its entry too,
    built from checked parts (what :data:`~reliable_amqp._core.entry.new_entry` does)."""

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
