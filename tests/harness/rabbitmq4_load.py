"""Steady publishing for the cluster tests, and the count of what became of every message.

:class:`PublishLoad` runs one publisher (a sync :class:`~reliable_amqp.Publisher` in a thread, or
an :class:`~reliable_amqp.AsyncPublisher` on an event loop of its own thread) at a fixed rate with
a message id per message, and records each future's outcome and when it came. :meth:`tally`
then holds the outcomes against what the queue holds, by id: confirmed but missing (the contract
says 0), duplicates, failed but stored anyway, ids that nobody published.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import secrets
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import pika

from reliable_amqp import AsyncPublisher, Confirmation, Publisher, PublishError, PublishTimeout

__all__ = ["PublishLoad", "Tally", "drain_ids"]


@dataclass
class Tally:
    """What became of one publisher's messages, by id, against the queue's content."""

    kind: str
    published: int
    confirmed: int
    failed: Counter[str]
    unresolved: int
    duplicates: int
    failed_but_stored: int
    missing: list[str]
    strangers: int
    longest_gap: float

    def line(self, case: str) -> str:
        """One printable line: the counts the issue asks for."""
        failed = ", ".join(f"{n} {kind}" for kind, n in self.failed.most_common()) or "0"
        return (
            f"{case} [{self.kind}]: published {self.published}, confirmed {self.confirmed}, "
            f"failed {failed}, unresolved {self.unresolved}, duplicates {self.duplicates}, "
            f"failed-but-stored {self.failed_but_stored}, "
            f"confirmed-but-missing {len(self.missing)}, strangers {self.strangers}, "
            f"longest gap between confirms {self.longest_gap:.1f} s"
        )


class PublishLoad:
    """One publisher publishing ``rate`` messages a second to ``queue`` until :meth:`stop`."""

    def __init__(
        self,
        kind: str,
        urls: Sequence[str],
        queue: str,
        *,
        rate: float = 300.0,
        batch: int = 10,
        flush_timeout: float = 150.0,
        **options: Any,
    ) -> None:
        """``kind`` is ``"sync"`` or ``"async"``; ``options`` go to the publisher as they are."""
        if kind not in ("sync", "async"):
            raise ValueError(f"kind must be sync or async, got {kind!r}")
        self.kind = kind
        self.urls = list(urls)
        self.queue = queue
        self.rate = rate
        self.batch = batch
        self.flush_timeout = flush_timeout
        self.options = options
        self.ids: list[str] = []
        self.published_at: dict[str, float] = {}
        #: id -> "confirmed" or the exception's class name
        self.outcomes: dict[str, str] = {}
        #: id -> when its future resolved (time.monotonic())
        self.resolved_at: dict[str, float] = {}
        #: publish() itself raised (window full for publish_timeout, ...): class name -> count
        self.refused: Counter[str] = Counter()
        self.unresolved = -1  # flush()'s answer at the end; -1: it never returned
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name=f"load-{kind}", daemon=True)
        self._prefix = f"{kind}-{secrets.token_hex(4)}"

    def start(self) -> PublishLoad:
        """Start publishing in the background."""
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Stop publishing, flush and close the publisher; raise what the publisher raised.

        ``timeout`` bounds the wait (default: the flush timeout plus the close's own 30 s): a
        publisher that is still busy then is a hang, and fails the test.
        """
        self._stop.set()
        self._thread.join(timeout if timeout is not None else self.flush_timeout + 40)
        if self._thread.is_alive():
            raise AssertionError(f"the {self.kind} publisher did not finish: it hangs")
        if self.error is not None:
            raise self.error

    # -- what happened ---------------------------------------------------------------------------

    def confirm_times(self) -> list[float]:
        """When each confirmed message was confirmed, in order."""
        return sorted(t for i, t in self.resolved_at.items() if self.outcomes[i] == "confirmed")

    def confirmed_between(self, start: float, end: float = float("inf")) -> int:
        """Messages confirmed in [start, end)."""
        return sum(1 for t in self.confirm_times() if start <= t < end)

    def longest_gap(self) -> float:
        """The longest time between two consecutive confirms (0 with fewer than two)."""
        times = self.confirm_times()
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)

    def slowest_failure(self) -> float:
        """The longest time from publish() to a failed outcome (0 without failures)."""
        return max(
            (
                self.resolved_at[i] - self.published_at[i]
                for i, outcome in self.outcomes.items()
                if outcome != "confirmed"
            ),
            default=0.0,
        )

    def tally(self, present: Counter[str]) -> Tally:
        """Hold the outcomes against ``present`` (message id -> copies in the queue)."""
        mine = [i for i in present if i.startswith(self._prefix + "-")]
        confirmed = [i for i, o in self.outcomes.items() if o == "confirmed"]
        failed = Counter(o for o in self.outcomes.values() if o != "confirmed")
        published = set(self.ids)
        return Tally(
            kind=self.kind,
            published=len(self.ids),
            confirmed=len(confirmed),
            failed=failed,
            unresolved=len(published) - len(self.outcomes),
            duplicates=sum(present[i] - 1 for i in mine if present[i] > 1),
            failed_but_stored=sum(
                1 for i, o in self.outcomes.items() if o != "confirmed" and present[i] > 0
            ),
            missing=[i for i in confirmed if present[i] == 0],
            strangers=sum(1 for i in mine if i not in published),
            longest_gap=self.longest_gap(),
        )

    # -- the publishing thread -------------------------------------------------------------------

    def _next_id(self) -> str:
        message_id = f"{self._prefix}-{len(self.ids)}"
        self.ids.append(message_id)
        self.published_at[message_id] = time.monotonic()
        return message_id

    def _record(
        self, message_id: str, future: Future[Confirmation] | asyncio.Future[Confirmation]
    ) -> None:
        # Runs on the publisher's I/O thread or event loop: look, never wait.
        if future.cancelled():
            outcome = "cancelled"
        else:
            error = future.exception()
            outcome = "confirmed" if error is None else type(error).__name__
        self.resolved_at[message_id] = time.monotonic()
        self.outcomes[message_id] = outcome

    def _main(self) -> None:
        try:
            if self.kind == "sync":
                self._run_sync()
            else:
                asyncio.run(self._run_async())
        except BaseException as exc:  # reported by stop()
            self.error = exc

    def _run_sync(self) -> None:
        body = b"x" * 100
        with Publisher(self.urls, **self.options) as publisher:
            due = time.monotonic()
            while not self._stop.is_set():
                for _ in range(self.batch):
                    message_id = self._next_id()
                    try:
                        future = publisher.publish("", self.queue, body, message_id=message_id)
                    except (PublishError, PublishTimeout) as exc:
                        self.refused[type(exc).__name__] += 1
                        del self.published_at[self.ids.pop()]
                        continue
                    future.add_done_callback(functools.partial(self._record, message_id))
                due += self.batch / self.rate
                self._stop.wait(max(0.0, due - time.monotonic()))
            self.unresolved = publisher.flush(timeout=self.flush_timeout)

    async def _run_async(self) -> None:
        body = b"x" * 100
        async with AsyncPublisher(self.urls, **self.options) as publisher:
            due = time.monotonic()
            while not self._stop.is_set():
                for _ in range(self.batch):
                    message_id = self._next_id()
                    try:
                        future = await publisher.publish(
                            "", self.queue, body, message_id=message_id
                        )
                    except (PublishError, PublishTimeout) as exc:
                        self.refused[type(exc).__name__] += 1
                        del self.published_at[self.ids.pop()]
                        continue
                    future.add_done_callback(functools.partial(self._record, message_id))
                due += self.batch / self.rate
                await asyncio.sleep(max(0.0, due - time.monotonic()))
            self.unresolved = await publisher.flush(timeout=self.flush_timeout)


def drain_ids(url: str, queue: str) -> Counter[str]:
    """Take every message from ``queue``: message id -> copies.

    With a prefetch and an ack per message: RabbitMQ 4 gives a quorum queue's consumer without
    a prefetch 2,000 messages and no more until they are acked (``BrokerAdmin.drain`` acks at the
    end, so it stops there).
    """
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        channel.basic_qos(prefetch_count=1000)
        ids: Counter[str] = Counter()
        for method, props, _body in channel.consume(queue, inactivity_timeout=2.0):
            if method is None:
                ready = channel.queue_declare(queue, passive=True).method.message_count
                if ready == 0:
                    break
                continue
            ids[str(props.message_id)] += 1
            channel.basic_ack(method.delivery_tag)
        channel.cancel()
    finally:
        connection.close()
    return ids
