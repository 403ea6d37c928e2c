"""Running topology declarations on an aiormq connection.

Each batch of declarations runs on a short-lived channel of its own: a failing declare (406 for
mismatched arguments, 404 binding to a missing exchange) closes that channel, never the
publishing one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from typing import Any

import aiormq.abc
import aiormq.exceptions

from reliable_amqp._compat.waits import wait_for
from reliable_amqp._core.errors import (
    AmqpConnectionError,
    BrokerError,
    OperationTimeout,
    ReliableAmqpError,
    broker_error,
)
from reliable_amqp._core.topology import TopologyOp

log = logging.getLogger("reliable_amqp")

# aiormq turns channel.close into these classes and keeps only the reply text.
_CHANNEL_ERROR_CODES: dict[type[aiormq.exceptions.ChannelClosed], int] = {
    aiormq.exceptions.ChannelAccessRefused: 403,
    aiormq.exceptions.ChannelNotFoundEntity: 404,
    aiormq.exceptions.ChannelLockedResource: 405,
    aiormq.exceptions.ChannelPreconditionFailed: 406,
}


async def declare(connection: aiormq.abc.AbstractConnection, op: TopologyOp, timeout: float) -> Any:
    """Run one declaration; return the queue name for a queue; raise the broker's error."""
    try:
        channel = await wait_for(connection.channel(publisher_confirms=False), timeout)
    except (asyncio.TimeoutError, TimeoutError):
        raise OperationTimeout(f"opening a channel to declare {op.describe()} timed out") from None
    except Exception as exc:
        raise AmqpConnectionError(f"could not open a channel: {exc!r}") from exc
    try:
        result = await wait_for(getattr(channel, op.method)(**op.args), timeout)
    except (asyncio.TimeoutError, TimeoutError):
        raise OperationTimeout(f"declaring {op.describe()} took over {timeout:g} s") from None
    except aiormq.exceptions.ChannelClosed as exc:
        raise channel_error(exc) from exc
    finally:
        with contextlib.suppress(Exception):
            await wait_for(channel.close(), timeout)
    return getattr(result, "queue", None)


async def replay(
    connection: aiormq.abc.AbstractConnection, ops: Iterable[TopologyOp], timeout: float
) -> None:
    """Declare ``ops`` again, in order, on a new connection; failures are logged, not raised."""
    for op in ops:
        try:
            await declare(connection, op, timeout)
        except ReliableAmqpError as exc:
            if connection.is_closed:
                raise
            log.error("reliable-amqp: could not declare %s again: %s", op.describe(), exc)


def channel_error(error: aiormq.exceptions.ChannelClosed) -> BrokerError:
    """The :class:`BrokerError` for a channel aiormq reports closed by the broker."""
    code = _CHANNEL_ERROR_CODES.get(type(error))
    if code is not None:
        return broker_error(code, str(error.args[0]) if error.args else "")
    if len(error.args) == 2 and isinstance(error.args[0], int):
        return broker_error(error.args[0], str(error.args[1]))
    return broker_error(0, str(error))
