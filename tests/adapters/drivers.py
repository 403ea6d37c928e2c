"""One blocking driver interface over both publishers, for tests that run against each.

``Publisher`` already has it. :class:`BlockingAsync` serves an :class:`AsyncPublisher` on an event
loop thread of its own behind the same methods (``publish`` returns a
``concurrent.futures.Future`` mirroring the asyncio one). It uses the public API only, so it keeps
working while the adapters' internals change.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from reliable_amqp import AsyncPublisher, Confirmation, State, Stats

T = TypeVar("T")


class BlockingAsync:
    """An AsyncPublisher driven from a plain thread (tests only)."""

    def __init__(self, url: str | Sequence[str], **options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="adapters-aio-loop", daemon=True
        )
        self._thread.start()
        self._publisher: AsyncPublisher = self._call(self._make(url, options))
        self._finished = False

    @staticmethod
    async def _make(url: str | Sequence[str], options: dict[str, Any]) -> AsyncPublisher:
        return AsyncPublisher(url, **options)

    def _call(self, coroutine: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        if self._loop.is_closed():
            # Closed: the loop is gone, and all a call can still do is raise PublisherClosed.
            return asyncio.run(coroutine)
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def connect(self) -> BlockingAsync:
        self._call(self._publisher.connect())
        return self

    def __enter__(self) -> BlockingAsync:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def state(self) -> State:
        return self._publisher.state

    @property
    def in_flight(self) -> int:
        return self._publisher.in_flight

    def stats(self) -> Stats:
        async def stats() -> Stats:
            return self._publisher.stats()

        return self._call(stats())

    def publish(
        self, exchange: str, routing_key: str, body: bytes, **kwargs: Any
    ) -> concurrent.futures.Future[Confirmation]:
        async def publish() -> concurrent.futures.Future[Confirmation]:
            future = await self._publisher.publish(exchange, routing_key, body, **kwargs)
            mirror: concurrent.futures.Future[Confirmation] = concurrent.futures.Future()
            future.add_done_callback(lambda f: _copy(f, mirror))
            return mirror

        return self._call(publish())

    def publish_and_wait(
        self, exchange: str, routing_key: str, body: bytes, **kwargs: Any
    ) -> Confirmation:
        return self._call(self._publisher.publish_and_wait(exchange, routing_key, body, **kwargs))

    def flush(self, timeout: float | None = None) -> int:
        return self._call(self._publisher.flush(timeout))

    def close(self, timeout: float | None = None) -> int:
        if self._finished:
            return 0
        self._finished = True
        try:
            return self._call(self._publisher.aclose(timeout))
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()

    def declare_exchange(self, *args: Any, **kwargs: Any) -> None:
        self._call(self._publisher.declare_exchange(*args, **kwargs))

    def declare_queue(self, *args: Any, **kwargs: Any) -> str:
        return self._call(self._publisher.declare_queue(*args, **kwargs))

    def bind_queue(self, *args: Any, **kwargs: Any) -> None:
        self._call(self._publisher.bind_queue(*args, **kwargs))


def _copy(source: asyncio.Future[T], target: concurrent.futures.Future[T]) -> None:
    if source.cancelled():
        target.cancel()
    elif (error := source.exception()) is not None:
        target.set_exception(error)
    else:
        target.set_result(source.result())


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0, what: str = "it") -> None:
    """Poll ``predicate`` until it holds; AssertionError after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


def outcomes(
    futures: Sequence[concurrent.futures.Future[Confirmation]], timeout: float = 10
) -> list[str]:
    """The outcome class name of each future, in order (each must resolve within ``timeout``)."""
    names = []
    for f in futures:
        exc = f.exception(timeout)
        names.append("Confirmation" if exc is None else type(exc).__name__)
    return names
