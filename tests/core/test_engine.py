"""Unit tests of ``_core/engine.py`` (the engine's frame handling is property-tested in
``test_engine_properties.py``)."""

from __future__ import annotations

from typing import Any

import pytest

from reliable_amqp._core.builder import build_message
from reliable_amqp._core.engine import PublishEngine
from reliable_amqp._core.entry import Entry
from reliable_amqp._core.message import Confirmation
from reliable_amqp._core.policy import RetryPolicy
from reliable_amqp._core.supervisor import is_permanent_channel_close
from reliable_amqp._core.tracker import ATTEMPT_HEADER
from support.engine import accept


@pytest.mark.parametrize(
    "code, text, permanent",
    [
        (404, "NOT_FOUND - no exchange 'x' in vhost '/'", True),
        (406, "PRECONDITION_FAILED - message size 9 is larger than configured max size 8", True),
        (406, "PRECONDITION_FAILED - low disk space", False),
        (403, "ACCESS_REFUSED", True),
        (320, "CONNECTION_FORCED", False),
        (541, "INTERNAL_ERROR", False),
        (506, "RESOURCE_ERROR", False),
        (None, "socket closed", False),
        (999, "unknown", False),
    ],
)
def test_which_channel_closes_blame_a_message(code: int | None, text: str, permanent: bool) -> None:
    assert is_permanent_channel_close(code, text) is permanent


def _next(engine: PublishEngine[Entry[Any]]) -> Entry[Any] | None:
    """The next message :meth:`PublishEngine.next_run` gives, taken alone."""
    taken, _ = engine.next_run(1, 1)
    return taken[0] if taken else None


# --- what mark_sent writes --------------------------------------------------------------------


def _engine(dedup_header: str | None = None) -> PublishEngine[Entry[str]]:
    return PublishEngine(
        delivery_timeout=10.0,
        nack_policy=RetryPolicy(max_attempts=2, jitter=0.0),
        dedup_header=dedup_header,
    )


def test_plain_messages_go_out_with_their_own_headers() -> None:
    engine = _engine()
    entry = accept(engine, build_message("ex", "rk", b"", properties={"headers": {"a": 1}}), "h", 0)
    assert _next(engine) is entry
    assert engine.mark_sent(entry) is None


def test_mandatory_messages_carry_their_attempt_tag() -> None:
    engine = _engine()
    own = {"a": 1}
    message = build_message("ex", "rk", b"", mandatory=True, properties={"headers": own})
    entry = accept(engine, message, "h", 0)
    assert engine.mark_sent(_next(engine) or entry) == {"a": 1, ATTEMPT_HEADER: "0.1"}
    assert message.properties.headers == own  # the message itself is left as it was


def test_the_dedup_header_carries_the_message_id() -> None:
    engine = _engine(dedup_header="x-dedup")
    message = build_message("ex", "rk", b"", properties={"message_id": "m-9"})
    entry = accept(engine, message, "h", 0)
    assert engine.mark_sent(entry) == {"x-dedup": "m-9"}
    resolutions = engine.on_ack(0, 1, multiple=False, now=0.5)
    assert [r.ok for r in resolutions] == [True]
    assert resolutions[0].outcome == Confirmation("m-9", 1) and resolutions[0] is entry
    stats = engine.stats()
    assert (stats.published, stats.confirmed, stats.in_flight) == (1, 1, 0)
    assert stats.latency is not None and stats.latency.max == 0.5


# --- a connection closed for a frame error (501, 502, 505) -------------------------------------


def _sent(engine: PublishEngine[Entry[str]], count: int) -> list[str]:
    """Take up to ``count`` messages off the send queue as the adapter would; their handles."""
    sent = []
    for _ in range(count):
        entry = _next(engine)
        if entry is None:
            break
        engine.mark_sent(entry)
        sent.append(entry.handle)
    return sent


def test_a_frame_error_with_one_message_on_the_wire_fails_that_message_alone() -> None:
    engine = _engine()
    for name in ("a", "b"):
        accept(engine, build_message("", "q", name.encode()), name, 0)
    assert _sent(engine, 1) == ["a"]
    [failed] = engine.on_connection_lost((501, "FRAME_ERROR - type 2, all octets"), 1.0)
    assert failed.handle == "a" and not failed.ok
    assert type(failed.outcome).__name__ == "MessageRejected"
    assert "501" in str(failed.outcome)
    assert not engine.isolating
    assert _sent(engine, 5) == ["b"]  # b goes on as usual


def test_suspects_of_a_frame_error_go_one_at_a_time_until_the_culprit_is_named() -> None:
    engine = _engine()
    for name in "abcd":
        accept(engine, build_message("", "q", name.encode()), name, 0)
    assert _sent(engine, 3) == ["a", "b", "c"]  # d is still waiting
    assert engine.on_connection_lost((501, "FRAME_ERROR"), 1.0) == []  # who did it? not known
    assert engine.isolating and engine.counters.republished == 3
    gen = engine.tracker.generation
    # a, b, c are suspects: each goes alone, the next only once the wire is empty
    assert _sent(engine, 5) == ["a"]
    [ok] = engine.on_ack(gen, 1, False, 2.0)
    assert ok.handle == "a" and ok.ok
    assert _sent(engine, 5) == ["b"]
    # b is alone on the wire when the broker closes the connection again: b did it
    [failed] = engine.on_connection_lost((501, "FRAME_ERROR"), 3.0)
    assert failed.handle == "b" and not failed.ok
    gen = engine.tracker.generation
    assert _sent(engine, 5) == ["c"]
    [ok] = engine.on_ack(gen, 1, False, 4.0)
    assert ok.handle == "c"
    assert not engine.isolating  # every suspect is settled: streaming again
    assert _sent(engine, 5) == ["d"]
    [ok] = engine.on_ack(gen, 2, False, 5.0)
    assert ok.handle == "d" and len(engine) == 0


def test_isolation_ends_when_the_suspects_expire_or_close() -> None:
    engine = _engine()
    for name in "ab":
        accept(engine, build_message("", "q", name.encode()), name, 0)
    _sent(engine, 2)
    engine.on_connection_lost((502, "SYNTAX_ERROR"), 1.0)
    assert engine.isolating
    assert [r.handle for r in engine.close_all("closed")] == ["a", "b"]
    assert not engine.isolating


def test_resolved_messages_are_not_kept_until_the_next_deadline() -> None:
    # The adapters' timer fires only for deadlines and retries; a confirmed message must not
    # stay referenced (its future, its body) until then, even behind an older one in flight.
    import gc
    import weakref

    class Handle:
        pass

    engine: PublishEngine[Entry[Handle]] = PublishEngine(
        delivery_timeout=120.0, nack_policy=RetryPolicy(max_attempts=2, jitter=0.0)
    )
    accept(engine, build_message("", "q", b"slow"), Handle(), 0.0)  # tag 1: never confirmed
    handles = [Handle() for _ in range(5000)]
    refs = [weakref.ref(h) for h in handles]
    for h in handles:
        accept(engine, build_message("", "q", b"x"), h, 0.0)
    while (entry := _next(engine)) is not None:
        engine.mark_sent(entry)
    generation = engine.tracker.generation
    confirmed = sum(len(engine.on_ack(generation, tag, False, 1.0)) for tag in range(2, 5002))
    assert confirmed == 5000 and len(engine) == 1
    del handles, h
    assert engine.next_wakeup() == 120.0  # the slow one's deadline
    gc.collect()
    assert sum(1 for r in refs if r() is not None) == 0
