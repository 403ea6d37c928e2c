"""BlockingAsyncPublisher: the sync ``Publisher`` API, served by an AsyncPublisher on a loop thread.

It exists so that one behaviour suite, written against the sync API, runs against both
publishers: a test (or a parametrized ``publisher_class`` fixture) constructs either
``Publisher`` or ``BlockingAsyncPublisher`` with the same arguments and uses the same methods.
``publish()`` returns a ``concurrent.futures.Future`` that mirrors the AsyncPublisher's asyncio
future, so ``.result()``, ``.exception(timeout)`` and ``.done()`` behave as in the sync suite.

The adapter adds nothing to what is tested: every call is a coroutine of the AsyncPublisher, run
on the adapter's own event loop thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine, Sequence
from types import TracebackType
from typing import Any, TypeVar

from reliable_amqp import Confirmation, State, Stats
from reliable_amqp._async import AsyncPublisher

T = TypeVar("T")


class BlockingAsyncPublisher:
    """An AsyncPublisher behind the sync Publisher's methods (tests only)."""

    def __init__(self, url: str | Sequence[str], **options: Any) -> None:
        self._publisher = AsyncPublisher(url, **options)  # ConfigurationError raises here
        self.options = self._publisher.options
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="aio-blocking-loop", daemon=True
        )
        self._thread.start()
        self._finished = False

    def __repr__(self) -> str:
        return repr(self._publisher)

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        if self._finished:
            # Closed: the loop is gone, and all a call can still do is raise PublisherClosed.
            return asyncio.run(coroutine)
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    # --- the sync Publisher's surface -----------------------------------------------------------

    def connect(self) -> BlockingAsyncPublisher:
        """``Publisher.connect``."""
        self._call(self._publisher.connect())
        return self

    def __enter__(self) -> BlockingAsyncPublisher:
        return self.connect()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def state(self) -> State:
        """``Publisher.state``."""
        return self._publisher.state

    @property
    def in_flight(self) -> int:
        """``Publisher.in_flight``."""
        return self._publisher.in_flight

    def stats(self) -> Stats:
        """``Publisher.stats`` (read on the loop, where the engine lives)."""

        async def stats() -> Stats:
            return self._publisher.stats()

        return self._call(stats())

    def publish(
        self, exchange: str, routing_key: str, body: bytes, **kwargs: Any
    ) -> concurrent.futures.Future[Confirmation]:
        """``Publisher.publish``: the asyncio future's outcome, mirrored to a concurrent one."""

        async def publish() -> concurrent.futures.Future[Confirmation]:
            future = await self._publisher.publish(exchange, routing_key, body, **kwargs)
            mirror: concurrent.futures.Future[Confirmation] = concurrent.futures.Future()
            future.add_done_callback(lambda f: _copy(f, mirror))
            return mirror

        return self._call(publish())

    def publish_message(self, message: Any) -> concurrent.futures.Future[Confirmation]:
        """``Publisher.publish_message``: the asyncio future mirrored to a concurrent one."""

        async def publish_message() -> concurrent.futures.Future[Confirmation]:
            future = await self._publisher.publish_message(message)
            mirror: concurrent.futures.Future[Confirmation] = concurrent.futures.Future()
            future.add_done_callback(lambda f: _copy(f, mirror))
            return mirror

        return self._call(publish_message())

    def publish_many(
        self, exchange: str, routing_key: str, bodies: Any, **kwargs: Any
    ) -> list[concurrent.futures.Future[Confirmation]]:
        """``Publisher.publish_many``: each asyncio future mirrored to a concurrent one."""

        async def publish_many() -> list[concurrent.futures.Future[Confirmation]]:
            futures = await self._publisher.publish_many(exchange, routing_key, bodies, **kwargs)
            mirrors: list[concurrent.futures.Future[Confirmation]] = []
            for future in futures:
                mirror: concurrent.futures.Future[Confirmation] = concurrent.futures.Future()
                future.add_done_callback(lambda f, m=mirror: _copy(f, m))  # type: ignore[misc]
                mirrors.append(mirror)
            return mirrors

        return self._call(publish_many())

    def publish_and_wait(
        self, exchange: str, routing_key: str, body: bytes, **kwargs: Any
    ) -> Confirmation:
        """``Publisher.publish_and_wait``."""
        return self._call(self._publisher.publish_and_wait(exchange, routing_key, body, **kwargs))

    def flush(self, timeout: float | None = None) -> int:
        """``Publisher.flush``."""
        return self._call(self._publisher.flush(timeout))

    def close(self, timeout: float | None = None) -> int:
        """``Publisher.close``; also stops the loop thread."""
        if self._finished:
            return 0
        try:
            return self._call(self._publisher.aclose(timeout))
        finally:
            self._finished = True
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()

    def declare_exchange(self, *args: Any, **kwargs: Any) -> None:
        """``Publisher.declare_exchange``."""
        self._call(self._publisher.declare_exchange(*args, **kwargs))

    def declare_queue(self, *args: Any, **kwargs: Any) -> str:
        """``Publisher.declare_queue``."""
        return self._call(self._publisher.declare_queue(*args, **kwargs))

    def bind_queue(self, *args: Any, **kwargs: Any) -> None:
        """``Publisher.bind_queue``."""
        self._call(self._publisher.bind_queue(*args, **kwargs))


def _copy(source: asyncio.Future[T], target: concurrent.futures.Future[T]) -> None:
    if source.cancelled():
        target.cancel()
    elif (error := source.exception()) is not None:
        target.set_exception(error)
    else:
        target.set_result(source.result())
