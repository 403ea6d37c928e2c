"""Fixtures of the adapter tests: a fake AMQP peer, and a factory for either publisher.

Every test here runs against the real adapters (pika's ``SelectConnection`` for ``Publisher``,
aiormq for ``AsyncPublisher``) talking to :class:`fake.FakeBroker` over a loopback socket. No
test may reach a real broker: the factory refuses any URL that is not a fake peer's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from fake import FakeBroker
from reliable_amqp import EventKind, Publisher, PublisherEvent, RetryPolicy
from support.aio_blocking import BlockingAsyncPublisher as BlockingAsync

#: quick reconnects, few of them: a test that loses its peer ends in seconds, not a minute
FAST_CONNECT = RetryPolicy(max_attempts=5, initial_delay=0.01, max_delay=0.05, jitter=0.0)
FAST_NACKS = RetryPolicy(max_attempts=3, initial_delay=0.01, max_delay=0.02, jitter=0.0)

#: options every publisher here gets unless the test says otherwise
DEFAULTS: dict[str, Any] = {
    "connect_timeout": 2.0,
    "close_timeout": 5.0,
    "delivery_timeout": 15.0,
    "publish_timeout": 5.0,
    "connect_policy": FAST_CONNECT,
    "nack_policy": FAST_NACKS,
}

PublisherFactory = Callable[..., Any]


class Peers:
    """Starts fake peers for a test and stops them after it."""

    def __init__(self) -> None:
        self.started: list[FakeBroker] = []

    def __call__(self, **config: Any) -> FakeBroker:
        peer = FakeBroker(**config).start()
        self.started.append(peer)
        return peer

    def ports(self) -> set[int]:
        return {p.port for p in self.started}


@pytest.fixture
def make_peer() -> Iterator[Peers]:
    """``make_peer(**config)``: another :class:`FakeBroker`, stopped after the test."""
    peers = Peers()
    yield peers
    for peer in peers.started:
        peer.close()
    for peer in peers.started:
        assert peer.errors == [], f"the fake peer itself failed: {peer.errors!r}"


@pytest.fixture
def peer(make_peer: Peers) -> FakeBroker:
    """A fake peer that acks every publish at once (tests switch it to manual as needed)."""
    return make_peer()


@pytest.fixture(params=["sync", "async"])
def kind(request: pytest.FixtureRequest) -> str:
    """Which publisher: ``Publisher`` (pika) or ``AsyncPublisher`` (aiormq)."""
    return str(request.param)


@pytest.fixture
def events() -> list[PublisherEvent]:
    """Events reported to ``on_event`` by the publisher ``make_publisher`` builds."""
    return []


def kinds(recorded: list[PublisherEvent]) -> list[EventKind]:
    """The kinds of recorded events, in order."""
    return [e.kind for e in list(recorded)]


@pytest.fixture
def make_publisher(
    kind: str, make_peer: Peers, events: list[PublisherEvent]
) -> Iterator[PublisherFactory]:
    """``make_publisher(url_or_urls, **options)``: a Publisher or an AsyncPublisher (driven by
    :class:`BlockingAsync`) with short timeouts, reporting to ``events``; closed after the test."""
    made: list[Any] = []

    def make(url: str | list[str], **options: Any) -> Any:
        urls = [url] if isinstance(url, str) else url
        for u in urls:
            port = urlsplit(u).port
            assert port in make_peer.ports(), f"{u} is not a fake peer: no real broker here"
        merged = {**DEFAULTS, "on_event": events.append, **options}
        publisher = Publisher(url, **merged) if kind == "sync" else BlockingAsync(url, **merged)
        made.append(publisher)
        return publisher

    yield make
    for publisher in made:
        publisher.close(timeout=1)
