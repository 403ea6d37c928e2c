"""Handlers that tests/cli/test_worker.py runs with ``reliable-amqp worker worker_handlers:NAME``
(the worker imports this module from its current directory, tests/cli).

Each handled message appends ``<pid> <message_id>`` to the file named by ``$WORKER_TEST_OUT``
(one ``O_APPEND`` write per line: whole lines, whatever the number of processes), after
``$WORKER_TEST_SLEEP`` seconds of work.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import Iterator

from reliable_amqp import Delivery

#: the exit status of the crashing handlers (what the worker's ERROR line must report)
CRASH_STATUS = 17
NOT_CALLABLE = 42


def _record(delivery: Delivery) -> None:
    line = f"{os.getpid()} {delivery.message_id}\n".encode()
    fd = os.open(os.environ["WORKER_TEST_OUT"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def _work() -> float:
    return float(os.environ.get("WORKER_TEST_SLEEP") or 0)


def handle(delivery: Delivery) -> None:
    time.sleep(_work())
    _record(delivery)


async def handle_async(delivery: Delivery) -> None:
    await asyncio.sleep(_work())
    _record(delivery)


def crash(delivery: Delivery) -> None:
    """Kills its process at every message."""
    os._exit(CRASH_STATUS)


def crash_on_poison(delivery: Delivery) -> None:
    """Kills its process at the message ``poison``; handles the others."""
    if delivery.message_id == "poison":
        os._exit(CRASH_STATUS)
    _record(delivery)


# --- handlers of the wrong kind, for the refusals -------------------------------------------------


async def _with_extra(delivery: Delivery, extra: int) -> None:
    await asyncio.sleep(0)


partial_coroutine = functools.partial(_with_extra, extra=1)


class _AsyncCallable:
    async def __call__(self, delivery: Delivery) -> None:
        await asyncio.sleep(0)


async_callable = _AsyncCallable()


def generator(delivery: Delivery) -> Iterator[None]:
    yield None
