"""The liveness check with default options: a silent broker is left well within 20 s.

A frozen node (SIGSTOP, a long GC pause, a partition that drops packets) closes nothing: only the
silence says it is gone. These drive the core supervisor alone, with a fake clock, the way both
adapters do (``check_liveness`` whenever ``next_wakeup`` comes due); the cluster test
(tests/cluster, SIGSTOP of the connected node) shows the same against real nodes.
"""

from __future__ import annotations

import pytest

from reliable_amqp._core.entry import Entry
from reliable_amqp._core.errors import AmqpConnectionError
from reliable_amqp._core.options import PublisherOptions
from reliable_amqp._core.supervisor import Supervisor


def _opened(heartbeat: int | None = None) -> Supervisor[Entry[int]]:
    options = (
        PublisherOptions.create("amqp://h/")
        if heartbeat is None
        else PublisherOptions.create("amqp://h/", heartbeat=heartbeat)
    )
    sup: Supervisor[Entry[int]] = Supervisor(options)
    sup.next_attempt()
    # Both adapters negotiate the option's value (the client's heartbeat wins in pika and aiormq).
    assert sup.connection_opened(131072, options.heartbeat, 0, 0.0) is None
    return sup


def _loss_time(
    sup: Supervisor[Entry[int]], received: list[tuple[float, float]], until: float
) -> float:
    """Run the checks as an adapter's timer does; ``received`` is (time, stamp) of what the
    broker sent. Returns when the link was declared lost (inf: never before ``until``)."""
    stamp: float = 0
    while True:
        due = sup.next_wakeup()
        assert due is not None, "an open link with a heartbeat always has a check pending"
        if due > until:
            return float("inf")
        while received and received[0][0] <= due:
            stamp = received.pop(0)[1]
        loss = sup.check_liveness(stamp, due)
        if loss is not None:
            assert isinstance(loss, AmqpConnectionError) and loss.retriable
            assert "no data from the broker" in str(loss)
            return due


def test_the_default_heartbeat_is_in_rabbitmqs_recommended_range() -> None:
    # RabbitMQ's guidance: 5 to 20 s; below 5, false positives become likely.
    assert PublisherOptions.create("amqp://h/").heartbeat == 5


def test_a_broker_silent_from_the_start_is_left_within_20_s_by_default() -> None:
    lost = _loss_time(_opened(), [], until=1000.0)
    assert 10.0 < lost <= 12.5


def test_a_broker_that_goes_silent_mid_stream_is_left_within_20_s_by_default() -> None:
    # Confirms every 10 ms for 30 s (each changes the byte count), then nothing.
    traffic = [(i / 100, float(i)) for i in range(1, 3001)]
    lost = _loss_time(_opened(), traffic, until=1000.0)
    assert 30.0 + 10.0 < lost <= 30.0 + 15.0


def test_heartbeats_alone_keep_an_idle_link_alive() -> None:
    # The broker sends a heartbeat every interval when it has nothing else to say.
    heartbeats = [(5.0 * i, float(i)) for i in range(1, 400)]
    assert _loss_time(_opened(), heartbeats, until=1990.0) == float("inf")


def test_aiormqs_frame_times_serve_as_well_as_byte_counts() -> None:
    # The async adapter passes when aiormq last read a frame (loop time), not a byte count.
    frames = [(t, 8800.0 + t) for t in (1.0, 2.0, 3.0)]
    lost = _loss_time(_opened(), frames, until=1000.0)
    # The check notices the last frame up to half a heartbeat late (at 5.0): three heartbeats
    # after the last byte at worst.
    assert 3.0 + 10.0 < lost <= 3.0 + 15.0


@pytest.mark.parametrize("heartbeat", [1, 20, 60])
def test_the_heartbeat_stays_configurable(heartbeat: int) -> None:
    lost = _loss_time(_opened(heartbeat), [], until=10_000.0)
    assert 2 * heartbeat < lost <= 2.5 * heartbeat


def test_heartbeat_zero_turns_the_check_off() -> None:
    sup = _opened(0)
    assert sup.next_wakeup() is None
    assert sup.check_liveness(0, 10_000.0) is None
