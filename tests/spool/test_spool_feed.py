"""Unit tests of what a spooled publish decides, written once in ``_spool/_feed.SpoolFeed`` for
both publishers: keeping the broker's pace, where a message appended the slow way goes, what a
read back issues. (The publishers' behaviour is tests/spool/test_spool_publisher.py's.)"""

from __future__ import annotations

from collections.abc import Callable

from reliable_amqp._core.builder import build_message
from reliable_amqp._core.entry import new_entry
from reliable_amqp._core.window import Window
from reliable_amqp._spool import Spool
from reliable_amqp._spool._feed import PACE_WAIT, SpoolFeed

OpenSpool = Callable[..., Spool]


def _feed(open_spool: OpenSpool) -> SpoolFeed[str]:
    return SpoolFeed(open_spool(), lambda handle: False)


def _append(feed: SpoolFeed[str], count: int) -> list[int]:
    """Append ``count`` messages to the feed's spool without feeding them; their seqs."""
    spool = feed.spool
    seqs = []
    for n in range(count):
        message = build_message("ex", "rk", b"m%d" % n)
        meta, size = spool.encode(message)
        seqs.append(spool.try_append(meta, message.body, size))
    return seqs


def _three_unfed(open_spool: OpenSpool) -> tuple[SpoolFeed[str], Window, list[int]]:
    """A feed whose spool holds three messages not fed yet, a window of two, their seqs."""
    feed = _feed(open_spool)
    return feed, Window(max_count=2, max_bytes=10**6), _append(feed, 3)


def test_a_publish_keeps_pace_a_while_then_takes_the_broker_for_stalled(
    open_spool: OpenSpool,
) -> None:
    feed = _feed(open_spool)
    window = Window(max_count=1, max_bytes=10**6)
    assert feed.pace_until(window, 1, 0.0, now=5.0) == 0.0  # room: go on
    window.issue(1)  # full
    end = feed.pace_until(window, 1, 0.0, now=5.0)
    assert end == 5.0 + PACE_WAIT
    assert feed.pace_until(window, 1, end, now=5.5) == end and not feed.stalled
    assert feed.pace_until(window, 1, end, now=end) == 0.0 and feed.stalled  # no room came
    assert feed.pace_until(window, 1, 0.0, now=9.0) == 0.0  # stalled: no more waiting
    feed.resolved([])  # confirms flow: publishes keep pace again
    assert not feed.stalled
    assert feed.pace_until(window, 1, 0.0, now=9.0) == 9.0 + PACE_WAIT


def test_a_backlog_the_window_takes_at_once_counts_against_the_room(
    open_spool: OpenSpool,
) -> None:
    feed = _feed(open_spool)
    window = Window(max_count=4, max_bytes=10**6)
    _append(feed, 2)  # two messages on disk ahead of the next
    window.issue(1)
    assert feed.pace_until(window, 1, 0.0, now=0.0) == 0.0  # 3 free slots, 2 ahead
    window.issue(1)
    assert feed.pace_until(window, 1, 0.0, now=0.0) == PACE_WAIT  # 2 free, 2 ahead: drain first
    _append(feed, 2)  # 4 ahead, a window's worth: read back behind, not waited for
    assert feed.pace_until(window, 1, 0.0, now=0.0) == 0.0


def test_a_message_appended_the_slow_way_goes_at_once_only_with_nothing_ahead_and_room(
    open_spool: OpenSpool,
) -> None:
    feed, window, (first, second, third) = _three_unfed(open_spool)
    assert feed.issue_appended(second, 10, window, 1) == 0  # the first is ahead on disk
    assert feed.issue_appended(first, 10, window, 1, queued=True) == 0  # others wait first
    assert window.count == 0 and feed.held == 0
    assert feed.issue_appended(first, 10, window, 1) == 1
    assert feed.issue_appended(second, 10, window, 1) == 2
    assert (feed.fed, feed.held, window.count) == (second, 2, 2)
    assert feed.issue_appended(third, 10, window, 1) == 0  # the window is full
    assert not feed.park("third's handle", third, window)  # and nothing to read back now
    assert feed.park("third's handle", third, Window(max_count=2, max_bytes=10**6))


def test_a_read_back_issues_in_order_what_the_window_takes_with_the_kept_handles(
    open_spool: OpenSpool,
) -> None:
    feed, window, (first, second, third) = _three_unfed(open_spool)
    feed.park("second's handle", second, window)  # its caller keeps it; the others' dropped
    assert feed.spool.persist(10) == 0
    entries = feed.read(3, new_entry)
    assert [entry.seq for entry in entries] == [first, second, third]
    assert feed.issue_read(entries, window) == [None, "second's handle"]
    assert [entry.message.index for entry in entries[:2]] == [1, 2]  # type: ignore[attr-defined]
    assert (feed.fed, feed.held, window.count) == (second, 2, 2)
    assert feed.issue_read(entries, Window(max_count=9, max_bytes=10**6)) == []  # went already
