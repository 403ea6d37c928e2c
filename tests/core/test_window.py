"""Unit tests of ``_core/window.py``: the in-flight window's bounds and ``flush()`` barriers."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from reliable_amqp._core.builder import build_message
from reliable_amqp._core.entry import Entry
from reliable_amqp._core.errors import PublisherClosed, PublishTimeout
from reliable_amqp._core.message import new_confirmation
from reliable_amqp._core.window import Barrier, Flush, Window
from support.engine import entry_for


@dataclass
class Handle:
    index: int


def resolved(index: int, size: int = 0, ok: bool = True) -> Entry[Handle]:
    """The resolved entry of the message issued ``index``-th, of ``size`` body bytes."""
    message = build_message("x", "rk", bytes(size))
    result = new_confirmation(message.message_id, 1) if ok else PublisherClosed(message, 0)
    return entry_for(message, Handle(index), 1.0, size, index=index, outcome=result)


def fill(window: Window, sizes: list[int]) -> list[int]:
    return [window.issue(size) for size in sizes]


# --- bounds -------------------------------------------------------------------------------------


def test_an_empty_window_fits_anything() -> None:
    window = Window(max_count=2, max_bytes=100)
    assert window.fits(0) and window.fits(100) and window.fits(10**9)


def test_the_count_bound() -> None:
    window = Window(max_count=2, max_bytes=100)
    fill(window, [1, 1])
    assert not window.fits(0)
    assert window.free_slots() == 0
    window.release([resolved(1, 1)])
    assert window.fits(0) and window.free_slots() == 1


def test_the_byte_bound_is_inclusive() -> None:
    window = Window(max_count=10, max_bytes=100)
    fill(window, [60])
    assert window.fits(40) and not window.fits(41)
    fill(window, [40])
    assert window.fits(0) and not window.fits(1)  # a full byte budget still takes 0 bytes
    assert window.free_slots() == 8


def test_an_oversize_message_is_let_through_alone() -> None:
    window = Window(max_count=10, max_bytes=100)
    assert window.fits(1000)
    fill(window, [1000])
    assert (window.count, window.bytes) == (1, 1000)
    assert not window.fits(0) and not window.fits(1)  # alone: nothing joins it
    window.release([resolved(1, 1000)])
    assert window.fits(1000)
    fill(window, [1])
    assert not window.fits(1000)  # not alone any more


def test_take_numbers_messages_from_one() -> None:
    window = Window(max_count=10, max_bytes=100)
    assert fill(window, [5, 6, 7]) == [1, 2, 3]
    assert (window.count, window.bytes, window.issued) == (3, 18, 3)
    window.release([resolved(2, 6)])
    assert window.issue(0) == 4  # numbers are never reused
    assert (window.count, window.bytes, window.issued) == (3, 12, 4)


@pytest.mark.parametrize(
    ("taken", "size"), [([], 1000), ([60], 40), ([60], 41), ([1] * 9, 1), ([1] * 10, 0), ([100], 0)]
)
def test_try_issue_issues_exactly_when_fits_says_so(taken: list[int], size: int) -> None:
    window = Window(max_count=10, max_bytes=100)
    fill(window, taken)
    before = (window.count, window.bytes, window.issued)
    fits = window.fits(size)
    index = window.try_issue(size)
    if fits:
        assert index == before[2] + 1
        assert (window.count, window.bytes, window.issued) == (
            before[0] + 1,
            before[1] + size,
            before[2] + 1,
        )
    else:
        assert index == 0 and (window.count, window.bytes, window.issued) == before


def test_release_subtracts_counts_and_bytes_of_every_outcome() -> None:
    window = Window(max_count=10, max_bytes=100)
    fill(window, [5, 6, 7])
    assert window.release([resolved(1, 5), resolved(3, 7, ok=False)]) == []
    assert (window.count, window.bytes) == (1, 6)
    assert window.release([]) == []
    assert (window.count, window.bytes) == (1, 6)


# --- barriers -----------------------------------------------------------------------------------


def test_a_barrier_counts_what_was_unresolved_when_it_began() -> None:
    window = Window(max_count=10, max_bytes=100)
    fill(window, [1, 1, 1])
    window.release([resolved(2, 1)])
    barrier = window.barrier()
    assert (barrier.mark, barrier.remaining) == (3, 2)
    assert barrier.waiter is None


def test_a_flush_waits_only_for_messages_issued_before_it() -> None:
    window = Window(max_count=10, max_bytes=100)
    fill(window, [1, 1])
    barrier = window.barrier()
    fill(window, [1, 1])  # 3 and 4 come after the flush
    assert window.release([resolved(3, 1), resolved(4, 1)]) == []
    assert barrier.remaining == 2
    assert window.release([resolved(1, 1)]) == []
    assert barrier.remaining == 1
    assert window.release([resolved(2, 1)]) == [barrier]
    assert barrier.remaining == 0


def test_a_barrier_that_reached_zero_is_returned_exactly_once() -> None:
    window = Window(max_count=10, max_bytes=100)
    fill(window, [1, 1])
    barrier = window.barrier()
    assert window.release([resolved(1, 1), resolved(2, 1)]) == [barrier]
    fill(window, [1])
    assert window.release([resolved(3, 1)]) == []  # not again, though not ended yet
    window.end_barrier(barrier)


def test_several_barriers_clear_in_their_own_time() -> None:
    window = Window(max_count=10, max_bytes=100)
    fill(window, [1])
    first = window.barrier()
    fill(window, [1, 1])
    second = window.barrier()
    assert (first.mark, first.remaining, second.mark, second.remaining) == (1, 1, 3, 3)
    assert window.release([resolved(3, 1), resolved(1, 1)]) == [first]
    assert second.remaining == 1
    assert window.release([resolved(2, 1)]) == [second]


def test_a_barrier_with_nothing_pending_is_done_and_not_kept() -> None:
    window = Window(max_count=10, max_bytes=100)
    barrier = window.barrier()
    assert (barrier.mark, barrier.remaining) == (0, 0)
    fill(window, [1])
    assert window.release([resolved(1, 1)]) == []
    window.end_barrier(barrier)  # ending a barrier that was never kept is harmless


def test_an_ended_barrier_stops_counting() -> None:
    window = Window(max_count=10, max_bytes=100)
    fill(window, [1, 1])
    barrier = window.barrier()
    window.end_barrier(barrier)  # the flush timed out
    assert window.release([resolved(1, 1), resolved(2, 1)]) == []
    assert barrier.remaining == 2
    window.end_barrier(barrier)


def test_end_barrier_removes_only_that_barrier() -> None:
    window = Window(max_count=10, max_bytes=100)
    fill(window, [1])
    first, second = window.barrier(), window.barrier()
    assert first is not second
    window.end_barrier(first)
    assert window.release([resolved(1, 1)]) == [second]
    assert first.remaining == 1


def test_barrier_slots() -> None:
    barrier = Barrier(mark=3, remaining=2)
    barrier.waiter = "future"
    with pytest.raises(AttributeError):
        barrier.other = 1  # type: ignore[attr-defined]


# --- the error ----------------------------------------------------------------------------------


def test_a_flush_is_over_when_nothing_is_left_or_its_time_is_up() -> None:
    window = Window(max_count=10, max_bytes=10**6)
    fill(window, [1, 1])
    barrier = window.barrier()
    flush = Flush(lambda: barrier.remaining, end=100.0)
    assert flush.wait_for(now=40.0) == 60.0 and flush.left == 2  # wait the rest of the time
    window.release([resolved(1, 1)])
    assert flush.wait_for(now=100.0) == 0.0 and flush.left == 1  # timed out, one left
    window.release([resolved(2, 1)])
    assert flush.wait_for(now=50.0) == 0.0 and flush.left == 0  # done


def test_a_flush_without_a_timeout_waits_as_long_as_it_takes() -> None:
    left = [3]
    flush = Flush(lambda: left[0], end=None)
    assert flush.wait_for(now=10**9) is None and flush.left == 3
    left[0] = -1  # (a count never makes a flush report less than nothing)
    assert flush.wait_for(now=10**9) == 0.0 and flush.left == 0


def test_full_error_names_the_counts_and_the_limits() -> None:
    window = Window(max_count=2, max_bytes=100)
    fill(window, [30, 40])
    error = window.full_error(2.5)
    assert isinstance(error, PublishTimeout) and error.retriable
    assert str(error) == (
        "in-flight window full for 2.5 s (2 messages, 70 bytes unconfirmed; "
        "max_in_flight=2, max_in_flight_bytes=100)"
    )
    assert "60 s" in str(window.full_error(60.0))


def test_issue_run_counts_what_fits_and_numbers_it_in_order() -> None:
    @dataclass
    class Issued:
        size: int
        index: int = 0

    window = Window(max_count=3, max_bytes=100)
    big = [Issued(500), Issued(1)]
    assert window.issue_run(big) == 1  # an empty window lets the first through alone
    assert big[0].index == 1 and big[1].index == 0
    assert window.issue_run(big, 1) == 0  # over the bytes now
    window.release([resolved(1, 500)])
    run = [Issued(10) for _ in range(5)]
    assert window.issue_run(run) == 3  # the count bound
    assert [e.index for e in run] == [2, 3, 4, 0, 0]
    assert (window.count, window.bytes, window.issued) == (3, 30, 4)
