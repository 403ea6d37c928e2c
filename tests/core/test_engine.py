"""Unit tests of ``_core/engine.py`` (the engine's frame handling is property-tested in
``test_engine_properties.py``)."""

from __future__ import annotations

import pytest

from reliable_amqp._core.engine import PublishEngine, is_permanent_channel_close
from reliable_amqp._core.message import Confirmation, build_message
from reliable_amqp._core.policy import RetryPolicy
from reliable_amqp._core.tracker import ATTEMPT_HEADER


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


# --- what mark_sent writes --------------------------------------------------------------------


def _engine(dedup_header: str | None = None) -> PublishEngine[str]:
    return PublishEngine(
        delivery_timeout=10.0,
        nack_policy=RetryPolicy(max_attempts=2, jitter=0.0),
        dedup_header=dedup_header,
    )


def test_plain_messages_go_out_with_their_own_headers() -> None:
    engine = _engine()
    entry = engine.accept(build_message("ex", "rk", b"", properties={"headers": {"a": 1}}), "h", 0)
    assert engine.next_to_send() is entry
    assert engine.mark_sent(entry) is None


def test_mandatory_messages_carry_their_attempt_tag() -> None:
    engine = _engine()
    own = {"a": 1}
    message = build_message("ex", "rk", b"", mandatory=True, properties={"headers": own})
    entry = engine.accept(message, "h", 0)
    assert engine.mark_sent(engine.next_to_send() or entry) == {"a": 1, ATTEMPT_HEADER: "0.1"}
    assert message.properties.headers == own  # the message itself is left as it was


def test_the_dedup_header_carries_the_message_id() -> None:
    engine = _engine(dedup_header="x-dedup")
    message = build_message("ex", "rk", b"", properties={"message_id": "m-9"})
    entry = engine.accept(message, "h", 0)
    assert engine.mark_sent(entry) == {"x-dedup": "m-9"}
    resolutions = engine.on_ack(0, 1, multiple=False, now=0.5)
    assert [r.ok for r in resolutions] == [True]
    assert resolutions[0].result == Confirmation("m-9", 1) and resolutions[0].entry is entry
    stats = engine.stats()
    assert (stats.published, stats.confirmed, stats.in_flight) == (1, 1, 0)
    assert stats.latency is not None and stats.latency.max == 0.5
