"""What ``AsyncConsumer.run`` does around its workers: signals, and closing off the loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("reliable_amqp")


def install_signals(
    loop: asyncio.AbstractEventLoop, stop: Callable[[], None]
) -> Callable[[], None]:
    """SIGTERM and the first Ctrl-C call ``stop`` (main thread, Unix); the second Ctrl-C is
    Python's again (asyncio.run cancels the task: a close without waiting). Returns what puts
    the handlers back."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    installed: list[int] = []

    def on_signal(signum: int) -> None:
        if signum == signal.SIGINT:
            loop.remove_signal_handler(signal.SIGINT)
            installed.remove(signal.SIGINT)
            log.info("reliable-amqp: stopping the consumer (Ctrl-C again to stop at once)")
        stop()

    for signum in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(signum, on_signal, signum)
            installed.append(signum)
        except (NotImplementedError, RuntimeError, ValueError):
            pass

    def restore() -> None:
        for signum in installed:
            loop.remove_signal_handler(signum)

    return restore


async def off_the_loop(
    loop: asyncio.AbstractEventLoop, close: Callable[..., Any], *args: Any
) -> None:
    """``close(*args)`` on a thread of its own (not the default executor: under cancellation it
    must still finish) while this loop keeps running: the consumer's connection lives on it and
    sends its last frames there. A cancel meanwhile waits for the close too, then propagates."""
    closer = threading.Thread(target=close, args=args, name="reliable-amqp-consume-close")
    closer.start()
    done = loop.create_future()

    def report_closed() -> None:
        closer.join()
        _call_soon(loop, done)

    threading.Thread(target=report_closed, daemon=True).start()
    cancelled: asyncio.CancelledError | None = None
    while not done.done():
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError as exc:  # closing needs this loop: finish it first
            cancelled = exc
    if cancelled is not None:
        raise cancelled


def _call_soon(loop: asyncio.AbstractEventLoop, future: asyncio.Future[None]) -> None:
    def finish() -> None:
        if not future.done():
            future.set_result(None)

    with contextlib.suppress(RuntimeError):  # the loop closed
        loop.call_soon_threadsafe(finish)
