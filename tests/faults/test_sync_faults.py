"""The sync Publisher when the broker or the network fails mid-stream.

Every test counts every message: confirmed futures must all be in the queue, every other
future must have failed explicitly, and duplicates stay within the in-flight window per fault.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import Future

import pytest

from harness.fixtures import ProxyFactory
from harness.node import DisposableBroker
from reliable_amqp import (
    Confirmation,
    EventKind,
    Publisher,
    PublisherEvent,
    RetryPolicy,
)
from support.broker import BrokerAdmin, unique

pytestmark = [pytest.mark.broker, pytest.mark.faults]

WINDOW = 2000
PATIENT = RetryPolicy(max_attempts=None, initial_delay=0.1, max_delay=1.0, deadline=90.0)


class Events:
    """Collects publisher events; ``wait_for`` blocks until one of a kind arrives."""

    def __init__(self) -> None:
        self.seen: list[PublisherEvent] = []
        self._cond = threading.Condition()

    def __call__(self, event: PublisherEvent) -> None:
        with self._cond:
            self.seen.append(event)
            self._cond.notify_all()

    def count(self, kind: EventKind) -> int:
        return sum(1 for e in self.seen if e.kind is kind)

    def wait_for(self, kind: EventKind, n: int = 1, timeout: float = 60) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self.count(kind) >= n, timeout), (
                f"no {kind.value} event #{n} within {timeout} s: {self.seen}"
            )


def account(
    futures: list[Future[Confirmation]], received: list[bytes], faults: int
) -> dict[str, int]:
    """The accounting every fault test makes; returns the figures."""
    assert all(f.done() for f in futures), "a future was left unresolved"
    bodies = [f"{i:06d}".encode() for i in range(len(futures))]
    confirmed = {bodies[i] for i, f in enumerate(futures) if f.exception() is None}
    failed = {bodies[i] for i, f in enumerate(futures) if f.exception() is not None}
    counts = Counter(received)
    missing = confirmed - set(counts)
    assert not missing, f"{len(missing)} confirmed messages are not in the queue"
    unaccounted = set(bodies) - set(counts) - failed
    assert not unaccounted, f"{len(unaccounted)} messages neither arrived nor failed"
    duplicates = sum(n - 1 for n in counts.values())
    assert duplicates <= WINDOW * max(faults, 1), f"{duplicates} duplicates for {faults} faults"
    return {"confirmed": len(confirmed), "failed": len(failed), "duplicates": duplicates}


def stream(publisher: Publisher, queue: str, n: int, out: list[Future[Confirmation]]) -> None:
    for i in range(n):
        out.append(publisher.publish("", queue, f"{i:06d}".encode()))


@pytest.mark.slow
def test_broker_kill_9_mid_stream_loses_nothing(disposable_broker: DisposableBroker) -> None:
    admin = BrokerAdmin(disposable_broker.url)
    queue = admin.queue(unique("kill"))
    # The queue's declaration on disk now, so that the kill below is a bare SIGKILL that lands
    # while the stream runs (the flush before a kill is a CLI call of seconds on a loaded
    # machine: CI once saw all 50,000 confirmed before it struck, and nothing to republish).
    disposable_broker.sync_metadata()
    events = Events()
    futures: list[Future[Confirmation]] = []
    lost = threading.Event()

    def stream_through_the_kill() -> None:
        # Publishes until the loss is seen and 20,000 past it: the kill always finds messages
        # written and not yet confirmed, however slowly it comes.
        extra = 20_000
        while not lost.is_set() or extra > 0:
            if lost.is_set():
                extra -= 1
            futures.append(publisher.publish("", queue, f"{len(futures):06d}".encode()))

    with Publisher(
        disposable_broker.url,
        max_in_flight=WINDOW,
        connect_policy=PATIENT,
        delivery_timeout=120,
        on_event=events,
    ) as publisher:
        producer = threading.Thread(target=stream_through_the_kill)
        producer.start()
        while publisher.stats().confirmed < 15_000:
            time.sleep(0.01)
        disposable_broker.kill(sync_metadata=False)
        events.wait_for(EventKind.CONNECTION_LOST)
        lost.set()
        disposable_broker.restart()
        events.wait_for(EventKind.RECOVERED)
        producer.join()
        assert publisher.flush(timeout=120) == 0
        stats = publisher.stats()
    admin = BrokerAdmin(disposable_broker.url)  # the old connection died with the node
    figures = account(futures, [b for _, b in admin.drain(queue)], faults=1)
    assert figures["confirmed"] == len(futures)  # nothing had to fail: the node came back in time
    assert stats.recoveries == 1 and stats.republished > 0
    admin.close()


def test_five_connection_cuts_during_one_stream(
    amqp_url: str, broker: BrokerAdmin, make_proxy: ProxyFactory
) -> None:
    queue = broker.queue()
    proxy = make_proxy()
    events = Events()
    futures: list[Future[Confirmation]] = []
    with Publisher(
        proxy.url(), max_in_flight=WINDOW, connect_policy=PATIENT, on_event=events
    ) as publisher:
        producer = threading.Thread(target=stream, args=(publisher, queue, 30_000, futures))
        producer.start()
        for cut in range(1, 6):
            target = cut * 4000
            while publisher.stats().confirmed < target and producer.is_alive():
                time.sleep(0.005)
            proxy.cut()
            events.wait_for(EventKind.RECOVERED, n=cut)
        producer.join()
        assert publisher.flush(timeout=60) == 0
    assert events.count(EventKind.CONNECTION_LOST) == 5
    figures = account(futures, [b for _, b in broker.drain(queue)], faults=5)
    assert figures["confirmed"] == 30_000


def test_stalled_link_is_detected_by_heartbeat_then_recovered(
    amqp_url: str, broker: BrokerAdmin, make_proxy: ProxyFactory
) -> None:
    queue = broker.queue()
    proxy = make_proxy()
    events = Events()
    with Publisher(proxy.url(), heartbeat=1, connect_policy=PATIENT, on_event=events) as publisher:
        first = [publisher.publish("", queue, f"{i:06d}".encode()) for i in range(100)]
        assert publisher.flush(timeout=10) == 0
        proxy.stall()
        stalled_at = time.monotonic()
        futures = first + [
            publisher.publish("", queue, f"{i:06d}".encode()) for i in range(100, 200)
        ]
        events.wait_for(EventKind.CONNECTION_LOST, timeout=15)
        detected = time.monotonic() - stalled_at
        proxy.resume()
        events.wait_for(EventKind.RECOVERED, timeout=30)
        assert publisher.flush(timeout=30) == 0
    assert detected < 6, f"stall noticed only after {detected:.1f} s with heartbeat=1"
    figures = account(futures, [b for _, b in broker.drain(queue)], faults=1)
    assert figures["confirmed"] == 200


def test_memory_alarm_pauses_publishing_without_failing(
    disposable_broker: DisposableBroker,
) -> None:
    admin = BrokerAdmin(disposable_broker.url)
    queue = admin.queue(unique("alarm"))
    events = Events()
    with Publisher(disposable_broker.url, on_event=events, delivery_timeout=60) as publisher:
        assert publisher.publish_and_wait("", queue, b"000000").attempts == 1
        disposable_broker.ctl("set_vm_memory_high_watermark", "0.0000001")
        futures = [publisher.publish("", queue, f"{i:06d}".encode()) for i in range(1, 500)]
        events.wait_for(EventKind.BLOCKED, timeout=20)
        time.sleep(2)
        assert not any(f.done() and f.exception() is not None for f in futures)
        assert publisher.in_flight > 0, "the alarm did not hold anything back"
        disposable_broker.reset_limits()
        events.wait_for(EventKind.UNBLOCKED, timeout=20)
        assert publisher.flush(timeout=30) == 0
    assert all(f.exception() is None for f in futures)
    assert admin.count(queue) == 500
    admin.close()


@pytest.mark.slow
def test_topology_is_declared_again_after_a_restart(disposable_broker: DisposableBroker) -> None:
    queue = unique("transient")
    events = Events()
    with Publisher(disposable_broker.url, connect_policy=PATIENT, on_event=events) as publisher:
        exchange = unique("x")
        publisher.declare_exchange(exchange, "direct", durable=False)
        publisher.declare_queue(queue, durable=False)
        publisher.bind_queue(queue, exchange, "rk")
        assert publisher.publish_and_wait(exchange, "rk", b"before").attempts == 1
        disposable_broker.kill()
        disposable_broker.restart()
        events.wait_for(EventKind.RECOVERED, timeout=60)
        futures = [publisher.publish(exchange, "rk", b"%d" % i, mandatory=True) for i in range(100)]
        assert publisher.flush(timeout=30) == 0
    assert all(f.exception() is None for f in futures)  # mandatory: routed, so the binding is back
    admin = BrokerAdmin(disposable_broker.url)
    assert admin.count(queue) == 100  # the non-durable queue is back, without "before"
    admin.channel.queue_delete(queue)
    admin.channel.exchange_delete(exchange)
    admin.close()


def test_failover_to_the_second_url(
    amqp_url: str, broker: BrokerAdmin, make_proxy: ProxyFactory
) -> None:
    queue = broker.queue()
    dead = make_proxy()
    dead.refuse()
    alive = make_proxy()
    events = Events()
    with Publisher([dead.url(), alive.url()], on_event=events) as publisher:
        futures = [publisher.publish("", queue, f"{i:06d}".encode()) for i in range(1000)]
        assert publisher.flush(timeout=30) == 0
    figures = account(futures, [b for _, b in broker.drain(queue)], faults=0)
    assert figures["confirmed"] == 1000
    assert alive.accepted_count >= 1
