"""Applying topology declarations on a pika connection (I/O thread only).

Declarations run on a short-lived channel of their own: a failing declare (406 for mismatched
arguments, 404 binding to a missing exchange) closes that channel, never the publishing one.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

from pika.adapters.select_connection import SelectConnection
from pika.channel import Channel

from reliable_amqp._core.errors import ReliableAmqpError, broker_error
from reliable_amqp._core.topology import TopologyOp

log = logging.getLogger("reliable_amqp")

#: A declaration and, for a caller's request, the future that waits for it (None on replay).
Request = tuple[TopologyOp, "Future[Any] | None"]


def apply_topology(
    connection: SelectConnection,
    requests: Iterable[Request],
    on_applied: Callable[[TopologyOp], None],
    then: Callable[[], None],
) -> None:
    """Run ``requests`` in order; call ``on_applied`` per success and ``then`` once at the end.

    A failed declaration resolves its future with the broker's error (or is logged, on replay)
    and the rest go on, on a fresh channel.
    """
    pending: deque[Request] = deque(requests)
    if not pending:
        then()
        return

    def open_channel() -> None:
        if not pending:
            then()
            return
        if not connection.is_open:
            _fail_all(pending, "connection closed before the declaration was made")
            return
        connection.channel(on_open_callback=run)

    def run(channel: Channel) -> None:
        current: list[Request] = []

        def on_close(_channel: Channel, reason: Exception) -> None:
            if not current:
                return  # closed by us after the last step
            op, future = current.pop()
            error = broker_error(
                getattr(reason, "reply_code", 0) or 0, getattr(reason, "reply_text", str(reason))
            )
            if future is not None:
                _settle(future, error=error)
            else:
                log.error("reliable-amqp: could not declare %s again: %s", op.describe(), error)
            open_channel()

        def step(frame: Any = None) -> None:
            if current:
                op, future = current.pop()
                on_applied(op)
                if future is not None:
                    method = getattr(frame, "method", None)
                    _settle(future, result=getattr(method, "queue", None))
            # a caller's declaration that timed out (its future cancelled) is not made later
            while pending and pending[0][1] is not None and pending[0][1].cancelled():
                pending.popleft()
            if not pending:
                if channel.is_open:
                    channel.close()
                then()
                return
            request = pending.popleft()
            current.append(request)
            op = request[0]
            getattr(channel, op.method)(callback=step, **op.args)

        channel.add_on_close_callback(on_close)
        step()

    open_channel()


def _settle(future: Future[Any], *, result: Any = None, error: BaseException | None = None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


def _fail_all(pending: deque[Request], reason: str) -> None:
    while pending:
        _, future = pending.popleft()
        if future is not None:
            _settle(future, error=ReliableAmqpError(reason))
