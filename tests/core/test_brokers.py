"""Unit tests of ``_core/brokers.py``: the limits one broker has and another has not, which
broker a connection reached (its ``server_properties``), and the check of a message against it:
at ``publish()`` once the broker is known, when written for a message taken before."""

from __future__ import annotations

from typing import Any

import pytest

from reliable_amqp import InvalidMessage, MessageRejected
from reliable_amqp._core.brokers import (
    ANY_BROKER,
    LAVINMQ,
    LAVINMQ_EXPIRATION_MAX,
    RABBITMQ,
    RABBITMQ_EXPIRATION_MAX,
    BrokerLimitExceeded,
    broker_limits,
)
from reliable_amqp._core.builder import EXPIRATION_MAX, MessageBuilder, build_message
from reliable_amqp._core.entry import Entry
from reliable_amqp._core.frames import publish_frames
from reliable_amqp._core.message import OutgoingMessage, new_outgoing
from reliable_amqp._core.options import PublisherOptions
from reliable_amqp._core.supervisor import Supervisor
from support.engine import accept as accept_entry

FRAME_MAX = 131072
#: what LavinMQ 2.9.1 sends in connection.start (src/lavinmq/amqp/connection_factory.cr)
LAVINMQ_PROPERTIES: dict[str, Any] = {
    "product": "LavinMQ",
    "version": "2.9.1",
    "platform": "Crystal",
    "capabilities": {"publisher_confirms": True, "basic.nack": True},
}
RABBITMQ_PROPERTIES: dict[str, Any] = {"product": "RabbitMQ", "version": "4.3.0"}


# --- the table ------------------------------------------------------------------------------------


def test_the_product_name_picks_the_limits() -> None:
    assert broker_limits(LAVINMQ_PROPERTIES) is LAVINMQ
    assert broker_limits(RABBITMQ_PROPERTIES) is RABBITMQ
    assert broker_limits({"product": b"LavinMQ"}) is LAVINMQ  # a longstr left as bytes
    assert broker_limits({"product": " lavinmq "}) is LAVINMQ


@pytest.mark.parametrize(
    "properties", [None, {}, {"product": "Qpid"}, {"product": 7}, {"version": "1"}]
)
def test_an_unknown_broker_gets_what_every_broker_takes(properties: Any) -> None:
    assert broker_limits(properties) is ANY_BROKER
    assert ANY_BROKER.expiration_max == RABBITMQ_EXPIRATION_MAX == EXPIRATION_MAX


def test_lavinmq_takes_a_signed_32_bit_expiration_and_rabbitmq_ten_years() -> None:
    assert LAVINMQ.expiration_max == 2_147_483_647 == LAVINMQ_EXPIRATION_MAX
    assert RABBITMQ.expiration_max == 10 * 365 * 24 * 3600 * 1000
    assert LAVINMQ.checks_expiration and not RABBITMQ.checks_expiration
    assert not ANY_BROKER.checks_expiration


@pytest.mark.parametrize("value", ["0", "60000", "999999999", "2147483647", "0002147483647"])
def test_lavinmq_takes_an_expiration_up_to_its_limit(value: str) -> None:
    LAVINMQ.check_expiration(value)  # no error


@pytest.mark.parametrize("value", ["2147483648", "9999999999", "00002147483648", "31536000000"])
def test_lavinmq_refuses_an_expiration_over_its_limit_naming_it(value: str) -> None:
    with pytest.raises(BrokerLimitExceeded) as info:
        LAVINMQ.check_expiration(value)
    assert isinstance(info.value, InvalidMessage) and info.value.field == "expiration"
    assert "LavinMQ's limit of 2147483647 ms" in str(info.value)
    assert "Expiration not a number" in str(info.value)
    RABBITMQ.check_expiration(value)  # RabbitMQ takes it


# --- publish(): checked against the broker once it is known ---------------------------------


def _supervisor() -> Supervisor[Entry[int]]:
    options = PublisherOptions.create(["amqp://localhost/"], delivery_timeout=100.0)
    return Supervisor(options)


def _builder(sup: Supervisor[Entry[int]]) -> MessageBuilder[OutgoingMessage]:
    return MessageBuilder(new_outgoing, limits=sup)


def test_publish_refuses_over_lavinmqs_limit_once_connected_to_lavinmq() -> None:
    sup = _supervisor()
    builder = _builder(sup)
    big = str(LAVINMQ_EXPIRATION_MAX + 1)
    # not connected yet: the broker is not known, RabbitMQ's limit is the only one
    assert builder.message("", "q", b"x", None, {"expiration": big}).base.expiration == big
    assert sup.connection_opened(FRAME_MAX, 0, 0, 0.0, LAVINMQ_PROPERTIES) is None
    assert sup.broker is LAVINMQ
    for call in (
        lambda: builder.message("", "q", b"x", None, {"expiration": big}),
        lambda: builder.message("", "q", b"x", None, {"expiration": int(big)}),  # int: same
        lambda: builder.messages("", "q", [b"a", b"b"], None, {"expiration": big}, None),
        lambda: builder.from_message(build_message("", "q", b"x", properties={"expiration": big})),
    ):
        with pytest.raises(InvalidMessage, match="LavinMQ's limit of 2147483647 ms"):
            call()
    # the limit itself, and messages without an expiration, go as before
    at_limit = builder.message("", "q", b"x", None, {"expiration": str(LAVINMQ_EXPIRATION_MAX)})
    assert at_limit.base.expiration == "2147483647"
    assert builder.message("", "q", b"x", None, {}).base.expiration is None
    # a later connection to RabbitMQ (failover) takes it again
    assert sup.connection_opened(FRAME_MAX, 0, 0, 0.0, RABBITMQ_PROPERTIES) is None
    assert builder.message("", "q", b"x", None, {"expiration": big}).base.expiration == big


# --- written: a message taken before the broker was known fails alone -----------------------


def _accept(sup: Supervisor[Entry[int]], expirations: list[str | None]) -> list[Entry[int]]:
    entries = []
    for i, expiration in enumerate(expirations):
        properties = {} if expiration is None else {"expiration": expiration}
        message = build_message("", "q", b"m%d" % i, properties=properties)
        entries.append(accept_entry(sup.engine, message, i, 0.0))
    return entries


def _write(sup: Supervisor[Entry[int]]) -> tuple[int, list[Entry[int]], bytes]:
    out: list[bytes | memoryview] = []
    count, failed = sup.write(1, out)
    return count, failed, b"".join(out)


@pytest.mark.parametrize("dedup", [False, True], ids=["run", "alone"])
def test_a_message_over_the_limit_taken_before_the_broker_was_known_fails_alone(
    dedup: bool,
) -> None:
    # dedup: every message goes out alone with headers of its own (publish_frames), else as a
    # run through the encoder
    options = PublisherOptions.create(
        ["amqp://localhost/"], delivery_timeout=100.0, dedup_header="x-id" if dedup else None
    )
    sup: Supervisor[Entry[int]] = Supervisor(options)
    big, ok = str(LAVINMQ_EXPIRATION_MAX + 1), str(LAVINMQ_EXPIRATION_MAX)
    entries = _accept(sup, [None, big, ok, big, big, None])
    assert sup.connection_opened(FRAME_MAX, 0, 0, 0.0, LAVINMQ_PROPERTIES) is None
    sup.next_attempt()
    sup.channel_opened()
    count, failed, data = _write(sup)
    assert count == 3
    assert [e.handle for e in failed] == [1, 3, 4]
    for entry in failed:
        outcome = entry.outcome
        assert isinstance(outcome, MessageRejected) and outcome.reply_code == 0
        assert outcome.message.body == entry.body and outcome.attempts == 0
        assert "LavinMQ's limit of 2147483647 ms" in str(outcome)
        assert "could not be encoded" not in str(outcome)
    # nothing of the refused ones was written; the others went in their order, tags 1..3
    assert b"m1" not in data and b"m3" not in data and b"m4" not in data
    assert [e.handle for e in sup.engine.tracker] == [0, 2, 5]
    resolved = sup.on_confirm(sup.generation, True, 3, True, 1.0)
    assert sorted(e.handle for e in resolved) == [0, 2, 5]
    assert len(sup.engine) == 0
    assert entries[0].outcome is not None


def test_rabbitmq_writes_what_lavinmq_refuses() -> None:
    sup = _supervisor()
    big = str(LAVINMQ_EXPIRATION_MAX + 1)
    _accept(sup, [big])
    assert sup.connection_opened(FRAME_MAX, 0, 0, 0.0, RABBITMQ_PROPERTIES) is None
    sup.next_attempt()
    sup.channel_opened()
    count, failed, data = _write(sup)
    assert (count, failed) == (1, [])
    assert big.encode() in data


def test_publish_frames_checks_only_when_given_the_broker() -> None:
    message = build_message("", "q", b"x", properties={"expiration": "3000000000"})
    out: list[bytes | memoryview] = []
    publish_frames(1, message, None, FRAME_MAX, out)  # no broker: as before
    assert b"3000000000" in b"".join(out)
    out.clear()
    with pytest.raises(BrokerLimitExceeded):
        publish_frames(1, message, None, FRAME_MAX, out, broker=LAVINMQ)
    assert out == []  # nothing appended
