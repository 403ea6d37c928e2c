"""Unit tests of ``_core/tracker.py`` (the tracker's frame handling is property-tested in
``test_tracker_properties.py``): attempt tags, keys, and taking a publish back."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from reliable_amqp._core.builder import build_message
from reliable_amqp._core.entry import Entry
from reliable_amqp._core.tracker import (
    ATTEMPT_HEADER,
    ConfirmTracker,
    attempt_tag,
    pack_key,
    parse_attempt_tag,
    returns_altered,
    unpack_key,
)
from support.engine import entry_for


def _entry(name: str) -> Entry[str]:
    return entry_for(build_message("ex", "rk", b"x"), name, deadline=60.0, size=1)


def test_keys_pack_generation_above_forty_bits_of_seq() -> None:
    assert pack_key(0, 1) == 1
    assert pack_key(1, 2) == (1 << 40) | 2
    assert unpack_key(pack_key(7, 2**40 - 1)) == (7, 2**40 - 1)
    assert attempt_tag(pack_key(3, 17)) == "3.17"
    assert ATTEMPT_HEADER == "x-reliable-amqp-attempt"


@pytest.mark.parametrize(
    "value",
    [
        "",
        "1",
        "1.",
        ".1",
        "a.1",
        "1.b",
        "-1.2",
        "1.-2",
        "1.2.3",
        " 1.2",
        "1.2 ",
        "1,2",
        b"x.y",
        b"\xff.1",
        None,
        12,
        1.5,
        ["1.2"],
    ],
)
def test_values_that_are_not_attempt_tags_parse_to_none(value: object) -> None:
    assert parse_attempt_tag(value) is None


@pytest.mark.parametrize(
    "value",
    [
        "\u00b2.1",  # superscript two: str.isdigit() says yes, int() refuses it
        "1.\u00b9",
        "\u0661.1",  # Arabic-Indic one: int() accepts it, but no tag of ours has it
        "\uff11.\uff12",  # fullwidth digits
        "1" * 5000 + ".1",  # int() refuses 4300+ digits
        f"0.{1 << 40}",  # a seq past its 40 bits would alias (generation 1, seq 0)
    ],
)
def test_only_ascii_digits_in_range_make_an_attempt_tag(value: str) -> None:
    assert parse_attempt_tag(value) is None
    assert parse_attempt_tag(value.encode()) is None


def test_the_largest_seq_still_parses() -> None:
    assert parse_attempt_tag(f"3.{(1 << 40) - 1}") == pack_key(3, (1 << 40) - 1)


def test_on_return_with_an_unknown_attempt_marks_nothing() -> None:
    tracker: ConfirmTracker[Entry[str]] = ConfirmTracker()
    entry = _entry("a")
    tracker.track(entry)
    assert tracker.on_return("0.2", 312, "NO_ROUTE") is None  # no such seq
    assert tracker.on_return("1.1", 312, "NO_ROUTE") is None  # a later generation
    assert tracker.on_return(None, 312, "NO_ROUTE") is None
    assert entry.returned is None
    assert tracker.on_return(b"0.1", 312, "NO_ROUTE") is entry
    assert entry.returned == (312, "NO_ROUTE")


def _mandatory(
    body: bytes, message_id: str, routing_key: str = "rk", headers: dict[str, Any] | None = None
) -> Entry[str]:
    properties: dict[str, Any] = {"message_id": message_id}
    if headers is not None:
        properties["headers"] = headers
    message = build_message("ex", routing_key, body, mandatory=True, properties=properties)
    return entry_for(message, message_id, deadline=60.0)


def test_a_return_without_attempt_header_names_its_message_by_what_it_carries() -> None:
    tracker: ConfirmTracker[Entry[str]] = ConfirmTracker()
    routed, lost, other = _mandatory(b"r", "same"), _mandatory(b"l", "same"), _mandatory(b"o", "o")
    tracker.track_all([routed, lost, other])
    # the same id on two messages: the body tells them apart
    assert (
        tracker.on_return(None, 312, "NO_ROUTE", returned=("same", "ex", "rk", b"l", None)) is lost
    )
    assert routed.returned is None and lost.returned == (312, "NO_ROUTE")
    # nothing on the wire carries all four (another route, a stale channel): nothing marked
    assert tracker.on_return(None, 312, "NO_ROUTE", returned=("o", "ex", "x", b"o", None)) is None
    assert (
        tracker.on_return(None, 312, "X", returned=("o", "ex", "rk", b"o", None), generation=1)
        is None
    )
    # searched after the last match first, then from the start: an earlier one is found too
    assert tracker.on_return(None, 312, "NO_ROUTE", returned=("o", "ex", "rk", b"o", None)) is other
    assert (
        tracker.on_return(None, 312, "NO_ROUTE", returned=("same", "ex", "rk", b"r", None))
        is routed
    )
    # not mandatory: a return cannot be its
    plain = _entry("plain")
    tracker.track(plain)
    assert (
        tracker.on_return(
            None, 312, "NO_ROUTE", returned=(plain.message_id, "ex", "rk", b"x", None)
        )
        is None
    )


def test_messages_alike_but_for_their_headers_are_told_apart_by_them() -> None:
    # Headers route too: the same id, route and body with a CC header to a queue that exists is
    # routed, and without it returned (found by the broker test of publish() inputs, where the
    # return was settled on the routed one). A decoder gives back str, bytes and datetimes its
    # own way; they are compared as values.
    when = dt.datetime(2026, 11, 24, 12, 0, 0, 700000)
    cc = _mandatory(b"b", "id", headers={"CC": ["q"], "at": when, "raw": b"\xff"})
    bare = _mandatory(b"b", "id")
    bool_one = _mandatory(b"b", "id", headers={"f": True})
    int_one = _mandatory(b"b", "id", headers={"f": 1})
    tracker: ConfirmTracker[Entry[str]] = ConfirmTracker()
    tracker.track_all([cc, bare, bool_one, int_one])
    assert tracker.on_return(None, 312, "NO_ROUTE", returned=("id", "ex", "rk", b"b", {})) is bare
    assert cc.returned is None
    assert tracker.on_return(None, 312, "X", returned=("id", "ex", "rk", b"b", {"f": 1})) is int_one
    decoded = {"at": dt.datetime(2026, 11, 24, 12, 0, 0), "raw": bytearray(b"\xff"), "CC": [b"q"]}
    assert tracker.on_return(None, 312, "X", returned=("id", "ex", "rk", b"b", decoded)) is cc
    # headers no entry has (a decoder's own rendering of something): the first carrying the
    # other four, rather than none
    got = tracker.on_return(None, 312, "X", returned=("id", "ex", "rk", b"b", {"other": 1}))
    assert got is bool_one
    assert tracker.on_return(None, 312, "X", returned=("id", "ex", "rk", b"b", {"f": 1})) is None


def test_headers_a_decoder_renders_its_own_way_still_name_their_message() -> None:
    # pika truncates a double to an int and pamqp reads a stamp after 2106 as milliseconds: the
    # return of the second message below came back as {"f": 5, ...} or with a 1970s datetime,
    # matched neither exactly, and was settled on the first (found by the broker test of
    # publish() inputs in CI, where hypothesis sent a float header)
    late = dt.datetime(2500, 1, 1, tzinfo=dt.timezone.utc)
    routed = _mandatory(b"b", "id", headers={"CC": ["q"], "f": 5.5, "at": late})
    lost = _mandatory(b"b", "id", headers={"f": 5.5, "at": late})
    tracker: ConfirmTracker[Entry[str]] = ConfirmTracker()
    tracker.track_all([routed, lost])
    by_pika = {"f": 5, "at": dt.datetime(2500, 1, 1)}
    assert tracker.on_return(None, 312, "X", returned=("id", "ex", "rk", b"b", by_pika)) is lost
    lost.returned = None
    by_pamqp = {
        "f": 5.5,
        "at": dt.datetime.fromtimestamp(late.timestamp() // 1000, dt.timezone.utc),
    }
    assert tracker.on_return(None, 312, "X", returned=("id", "ex", "rk", b"b", by_pamqp)) is lost
    assert routed.returned is None


def test_only_the_latest_publish_can_be_taken_back() -> None:
    tracker: ConfirmTracker[Entry[str]] = ConfirmTracker()
    first, second = _entry("a"), _entry("b")
    assert (tracker.track(first), tracker.track(second)) == (1, 2)
    assert tracker.untrack(first) is False and first.attempts == 1
    assert tracker.untrack(second) is True
    assert (second.key, second.attempts, len(tracker)) == (-1, 0, 1)
    assert tracker.untrack(second) is False  # not tracked any more
    assert tracker.track(second) == 2  # the tag is reused: it never reached the broker


def test_discard_forgets_only_a_tracked_entry() -> None:
    tracker: ConfirmTracker[Entry[str]] = ConfirmTracker()
    entry = _entry("a")
    assert tracker.discard(entry) is False
    tracker.track(entry)
    assert tracker.discard(entry) is True and entry.key == -1 and len(tracker) == 0
    assert tracker.pop_settled(0, 1, multiple=False) == []


def test_a_return_without_attempt_header_is_never_a_message_with_bcc() -> None:
    # RabbitMQ hands a return back without its BCC header, so a message with BCC goes out with
    # the attempt header (returns_altered) and a return without one is another message's: here
    # the one without BCC, though listed after (CI found the return settled on the routed one).
    routed = _mandatory(b"b", "id", headers={"BCC": ["q"], "n": 1})
    lost = _mandatory(b"b", "id", headers={"n": 1})
    tracker: ConfirmTracker[Entry[str]] = ConfirmTracker()
    tracker.track_all([routed, lost])
    assert returns_altered({"BCC": []}) and not returns_altered({"CC": ["q"]})
    assert tracker.on_return(None, 312, "X", returned=("id", "ex", "rk", b"b", {"n": 1})) is lost
    assert routed.returned is None
    lost.returned = None
    # alike but for BCC: nothing on the wire went untagged with these headers
    tracker.track(_mandatory(b"c", "id", headers={"BCC": ["q"]}))
    assert tracker.on_return(None, 312, "X", returned=("id", "ex", "rk", b"c", {})) is None
