"""The share each member of a partitioned consumer's group takes (sans-I/O: no broker).

A simulation plays members joining, dying and rounds in random order against the broker's one
rule (one exclusive holder per partition, freed when its holder dies) and checks that the group
always settles on an even spread with every partition held.
"""

from __future__ import annotations

import random

import pytest

from reliable_amqp import ConfigurationError
from reliable_amqp._core.partitions import (
    MAX_PARTITIONS,
    Plan,
    check_partitions,
    config_queue,
    lock_queue,
    member_queue,
    partition_queue,
    partition_queues,
    plan,
    shares,
    wanting_queue,
)


def test_names() -> None:
    assert partition_queue("orders", 3) == "orders.3"
    assert partition_queues("orders", 3) == ["orders.0", "orders.1", "orders.2"]
    assert member_queue("orders", 2) == "orders.member.2"
    assert wanting_queue("orders", 2) == "orders.wanting.2"
    assert lock_queue("orders", 3) == "orders.3.lock"
    assert config_queue("orders") == "orders.partitions"


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "8", None, MAX_PARTITIONS + 1])
def test_bad_partition_counts_are_refused_by_name(bad: object) -> None:
    with pytest.raises(ConfigurationError, match="partitions must be an integer"):
        check_partitions(bad)


def test_shares() -> None:
    assert shares(8, 3) == (2, 3)
    assert shares(8, 4) == (2, 2)
    assert shares(8, 1) == (8, 8)
    assert shares(3, 5) == (0, 1)
    assert shares(8, 0) == (8, 8)  # no member seen yet: this one is the group


def test_alone_takes_everything_free() -> None:
    assert plan(8, 1, [], range(8), 0) == Plan(take=tuple(range(8)))


def test_gives_up_the_excess_highest_first() -> None:
    assert plan(8, 2, range(8), [], 0) == Plan(release=(7, 6, 5, 4))


def test_kept_partitions_are_not_given_up() -> None:
    step = plan(8, 2, range(8), [], 0, keep={7, 6})
    assert step.release == (5, 4, 3, 2)


def test_starving_member_wants_when_nothing_is_free() -> None:
    assert plan(10, 4, [9], [], 0) == Plan(want=True)


def test_a_full_member_gives_one_up_to_a_starving_one_eventually() -> None:
    rng = random.Random(1)
    steps = [plan(10, 4, [0, 1, 2], [], 1, rng=rng) for _ in range(20)]
    assert any(step.release == (2,) for step in steps)
    assert all(step.release in ((), (2,)) for step in steps)


def test_at_the_least_share_no_one_gives_up_for_nothing() -> None:
    rng = random.Random(2)
    for _ in range(50):
        assert plan(8, 4, [0, 1], [], 3, rng=rng) == Plan()


class _Broker:
    """The broker's rule for exclusive consumers: one holder per partition."""

    def __init__(self, partitions: int) -> None:
        self.holder: list[int | None] = [None] * partitions

    def take(self, member: int, partition: int) -> bool:
        if self.holder[partition] is None:
            self.holder[partition] = member
            return True
        return False  # 403: another member holds it

    def free(self) -> list[int]:
        return [i for i, h in enumerate(self.holder) if h is None]

    def held_by(self, member: int) -> list[int]:
        return [i for i, h in enumerate(self.holder) if h == member]

    def drop(self, member: int) -> None:
        self.holder = [None if h == member else h for h in self.holder]


def _settle(broker: _Broker, members: list[int], rng: random.Random, rounds: int = 200) -> int:
    """Play rounds (members in random order) until the spread is even and all held; returns
    the rounds it took (fails if it never settles)."""
    wanting: set[int] = set()
    for n in range(rounds):
        for member in rng.sample(members, len(members)):
            mine = broker.held_by(member)
            step = plan(
                len(broker.holder), len(members), mine, broker.free(), len(wanting), rng=rng
            )
            for partition in step.release:
                assert partition in mine
                broker.holder[partition] = None
            for partition in step.take:
                broker.take(member, partition)
            if step.want:
                wanting.add(member)
            else:
                wanting.discard(member)
        counts = [len(broker.held_by(m)) for m in members]
        if not broker.free() and max(counts) - min(counts) <= 1:
            return n
    raise AssertionError(f"never settled: {[broker.held_by(m) for m in members]}")


@pytest.mark.parametrize("seed", range(200))
def test_the_group_settles_even_through_joins_and_deaths(seed: int) -> None:
    rng = random.Random(seed)
    partitions = rng.choice([1, 2, 3, 7, 8, 10, 16, 64])
    broker = _Broker(partitions)
    members = [0]
    next_id = 1
    for _ in range(6):
        _settle(broker, members, rng)
        if len(members) > 1 and rng.random() < 0.4:  # a member killed -9: its partitions free
            dead = rng.choice(members)
            members.remove(dead)
            broker.drop(dead)
        else:
            members.append(next_id)
            next_id += 1
        rounds = _settle(broker, members, rng)
        assert rounds < 60, f"took {rounds} rounds to settle"
