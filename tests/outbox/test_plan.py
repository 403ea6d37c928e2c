"""The relay's decisions without a database: ownership of partitions, reading in passes (the
gap: rows that commit out of id order are never skipped), what an outcome means for a row."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from reliable_amqp import MessageNacked, MessageRejected, MessageReturned, OutgoingMessage
from reliable_amqp._core.errors import DeliveryTimeout, PublisherClosed
from reliable_amqp.outbox._plan import Ownership, ReadCursor, attempts_of, failure_reason
from reliable_amqp.outbox._schema import PARTITIONS, partition_of


class Table:
    """Rows with ids taken at insert and visible once their transaction commits."""

    def __init__(self) -> None:
        self.next_id = 1
        self.rows: dict[int, bool] = {}  # id -> committed

    def insert(self) -> int:
        row = self.next_id
        self.next_id += 1
        self.rows[row] = False
        return row

    def commit(self, row: int) -> None:
        self.rows[row] = True

    def read(self, after: int, skip: set[int], limit: int) -> list[int]:
        visible = sorted(i for i, done in self.rows.items() if done and i > after and i not in skip)
        return visible[:limit]

    def delete(self, ids: list[int]) -> None:
        for i in ids:
            del self.rows[i]


def relay_step(
    table: Table, cursor: ReadCursor, in_flight: set[int], now: float, limit: int
) -> list[int]:
    after = cursor.start(now)
    rows = table.read(after, in_flight, limit)
    cursor.read(rows, limit)
    in_flight.update(rows)
    return rows


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32), limit=st.integers(1, 6), rows=st.integers(1, 40))
def test_passes_never_skip_a_row_that_commits_late(seed: int, limit: int, rows: int) -> None:
    rng = random.Random(seed)
    table, cursor, in_flight = Table(), ReadCursor(rescan_interval=1e9), set[int]()
    open_rows: list[int] = []
    published: list[int] = []
    made = 0
    now = 0.0
    while made < rows or open_rows or in_flight or any(table.rows.values()):
        now += 1
        choice = rng.random()
        if made < rows and choice < 0.3:
            open_rows.append(table.insert())
            made += 1
        elif open_rows and choice < 0.55:
            table.commit(open_rows.pop(rng.randrange(len(open_rows))))
        elif in_flight and choice < 0.75:
            done = rng.sample(sorted(in_flight), rng.randint(1, len(in_flight)))
            in_flight.difference_update(done)
            table.delete(done)
        else:
            published += relay_step(table, cursor, in_flight, now, limit)
    assert sorted(published) == list(range(1, rows + 1))  # every row, once
    assert len(published) == len(set(published))


def test_the_naive_cursor_skips_the_row_that_commits_last_and_passes_do_not() -> None:
    # A takes id 1 and commits after B (id 2): "id > last seen" reads 2, then never 1
    table = Table()
    a, b = table.insert(), table.insert()
    table.commit(b)
    naive_last = max(table.read(0, set(), 10))
    table.commit(a)
    assert table.read(naive_last, set(), 10) == []  # the naive reader skipped A (the control)
    table = Table()
    a, b = table.insert(), table.insert()
    table.commit(b)
    cursor, in_flight = ReadCursor(), set[int]()
    assert relay_step(table, cursor, in_flight, 1.0, 10) == [b]
    table.commit(a)
    assert relay_step(table, cursor, in_flight, 2.0, 10) == [a]


def test_a_full_read_moves_the_pass_forward_and_the_interval_restarts_it() -> None:
    cursor = ReadCursor(rescan_interval=5.0)
    assert cursor.start(0.0) == 0
    cursor.read([1, 2, 3], 3)
    assert cursor.start(1.0) == 3  # within the pass
    cursor.read([4, 5, 6], 3)
    assert cursor.start(6.0) == 0  # a pass lasts rescan_interval at most
    cursor.read([7], 3)  # short: caught up
    assert cursor.start(6.5) == 0
    assert cursor.passes == 3


def test_relays_share_the_partitions_evenly_and_give_up_the_surplus() -> None:
    one, two = Ownership(offset=0), Ownership(offset=32)
    one.acquired(one.wanted(1))
    assert len(one.owned) == PARTITIONS and one.readable() is None
    # a second relay joins: the first gives up half, the second takes what is free
    surplus = one.surplus(2)
    assert len(surplus) == PARTITIONS // 2
    one.drain(surplus)
    assert sorted(one.readable() or []) == sorted(one.owned - set(surplus))
    one.released(surplus)
    free = [p for p in two.wanted(2) if p not in one.owned]
    two.acquired(free[: two.target(2)])
    assert one.owned.isdisjoint(two.owned)
    assert len(one.owned) == len(two.owned) == PARTITIONS // 2
    assert one.surplus(2) == [] and two.wanted(2) == []
    # the second one dies: the first wants everything back
    one_wants = one.wanted(1)
    assert sorted(one_wants) == sorted(set(range(PARTITIONS)) - one.owned)


def test_three_relays_cover_every_partition() -> None:
    relays = [Ownership(offset=o) for o in (0, 21, 42)]
    taken: set[int] = set()
    for relay in relays:
        got = [p for p in relay.wanted(3) if p not in taken][: relay.target(3)]
        relay.acquired(got)
        taken.update(got)
    assert taken == set(range(PARTITIONS))
    assert all(len(r.owned) <= r.target(3) == 22 for r in relays)


def test_a_key_always_maps_to_the_same_partition_and_keyless_rows_spread() -> None:
    assert partition_of("order-42", "a") == partition_of("order-42", "b")
    spread = {partition_of(None, f"id-{i}") for i in range(2000)}
    assert len(spread) == PARTITIONS


def test_refusals_fail_the_row_and_unsettled_outcomes_keep_it_pending() -> None:
    message = OutgoingMessage("", "q", b"x")
    refusals = [
        MessageReturned(message, 1, 312, "NO_ROUTE"),
        MessageRejected(message, 2, 404, "NOT_FOUND"),
        MessageNacked(message, 5),
    ]
    for refusal in refusals:
        assert str(failure_reason(refusal)).startswith(type(refusal).__name__)
    assert failure_reason(DeliveryTimeout(message, 3, 120.0)) is None
    assert failure_reason(PublisherClosed(message, 1)) is None
    assert attempts_of(MessageNacked(message, 5)) == 5


def test_ids_in_flight_are_skipped_as_runs_of_consecutive_ids() -> None:
    from reliable_amqp.outbox._plan import id_ranges

    assert id_ranges([]) == ([], [])
    assert id_ranges([7, 3, 4, 5, 9, 10]) == ([3, 7, 9], [5, 7, 10])
    window = list(range(1000, 6000))
    assert id_ranges(window) == ([1000], [5999])
