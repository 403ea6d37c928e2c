"""Partitions over several consumer processes: the names and the share each member takes.

``Consumer(url, NAME, partitions=N)`` consumes the queues ``NAME.0`` .. ``NAME.<N-1>``, bound
to the consistent-hash exchange ``NAME`` (one routing key always lands in the same queue). The
members of a group (every consumer started with the same ``NAME``) share the partitions:

- **who is a member**: the holder of an exclusive queue ``NAME.member.<slot>`` (slots
  0..N-1: more members than partitions would hold nothing; a spare waits for a slot);
- **who owns a partition**: the holder of the exclusive queue ``NAME.<i>.lock``. An exclusive
  queue belongs to one connection: the broker refuses it to any other (405) and deletes it
  with its connection, so a member killed -9, or whose node died, loses its slot and locks at
  once, and nothing of the group is left on a node that went down. (LavinMQ 2.9.1 grants a
  new exclusive queue to two connections whose declarations meet: a member checks each slot
  and lock it is granted, ``_consume._group_view.GroupView._claim``.) The partition queues
  themselves have *single active consumer*: the broker's guard that one member at a time gets
  a partition's messages, whatever the members believe;
- **the share**: every ``interval`` each member probes the slots and locks (a passive declare:
  404 free, 405 held) and takes free partitions up to its fair share (:func:`plan`), gives up
  what it holds beyond it, and says it is starving (its exclusive ``NAME.wanting.<slot>``)
  when it holds less than the least share and nothing is free, so that a member holding the
  most gives one up;
- **the number of partitions** is recorded in the durable queue ``NAME.partitions`` (its
  ``x-max-length``): a member that counts otherwise is refused (406).

This module decides; :mod:`reliable_amqp._consume._group` does the I/O.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

from reliable_amqp._core.errors import ConfigurationError

#: the most partitions a group may have (each owned partition is a connection of its member)
MAX_PARTITIONS = 1024
#: the exchange type of RabbitMQ's ``rabbitmq_consistent_hash_exchange`` plugin (and LavinMQ's)
HASH_EXCHANGE_TYPE = "x-consistent-hash"
#: each partition queue's binding weight (the consistent-hash exchange's binding key): equal
#: for all, so keys spread evenly; 100, not 1, because LavinMQ's default hash is a ring with
#: that many points per queue (with 1, 50 keys landed in 2 of 8 partitions there)
BINDING_WEIGHT = "100"
#: the plugin to enable when the broker does not know that exchange type
HASH_PLUGIN = "rabbitmq_consistent_hash_exchange"
#: the partition queues' argument: one active consumer at a time, whatever the members think
SAC = "x-single-active-consumer"


def partition_queue(name: str, index: int) -> str:
    """The queue of partition ``index`` of the group ``name``."""
    return f"{name}.{index}"


def partition_queues(name: str, partitions: int) -> list[str]:
    """Every partition queue of the group, in order."""
    return [partition_queue(name, i) for i in range(partitions)]


def lock_queue(name: str, index: int) -> str:
    """The queue whose exclusive consumer is the member holding partition ``index``."""
    return f"{name}.{index}.lock"


def member_queue(name: str, slot: int) -> str:
    """The exclusive queue that is a member's slot: held by one member's connection."""
    return f"{name}.member.{slot}"


def wanting_queue(name: str, slot: int) -> str:
    """The exclusive queue of the member in ``slot`` while it holds less than its share and
    no partition is free."""
    return f"{name}.wanting.{slot}"


def config_queue(name: str) -> str:
    """The durable queue whose ``x-max-length`` records the group's number of partitions."""
    return f"{name}.partitions"


def check_partitions(partitions: object) -> int:
    """``partitions`` as given, or :class:`ConfigurationError` naming what is wrong."""
    if type(partitions) is not int or not 1 <= partitions <= MAX_PARTITIONS:
        raise ConfigurationError(
            f"partitions must be an integer from 1 to {MAX_PARTITIONS}, got {partitions!r}"
        )
    return partitions


@dataclass(frozen=True)
class Plan:
    """What one member does this round."""

    #: partitions to try to take (an exclusive subscription each; a race lost is harmless)
    take: tuple[int, ...] = ()
    #: partitions to give up (finish what was started on them, then close)
    release: tuple[int, ...] = ()
    #: hold a consumer on the wanting queue (this member starves: nothing is free)
    want: bool = False


def shares(partitions: int, members: int) -> tuple[int, int]:
    """The least and the most partitions a member should hold: ``floor`` and ``ceil`` of
    ``partitions / members``."""
    members = max(1, members)
    low = partitions // members
    high = low + (1 if partitions % members else 0)
    return low, high


def plan(
    partitions: int,
    members: int,
    mine: Iterable[int],
    free: Iterable[int],
    wanting: int,
    *,
    keep: Iterable[int] = (),
    rng: random.Random | None = None,
) -> Plan:
    """This member's moves, from what it sees: ``members`` live (itself included), the
    partitions it holds (``mine``), those nobody holds (``free``), and how many members starve.

    - Holding more than the most share: give up the excess.
    - Holding less than the least share: take free ones up to it; with nothing free, want.
    - Between: take one free partition at most (others below the least share take first: a
      member at its least share takes only every other round, at random), and give one up when
      a member starves and this one holds the most share (at random, half the rounds, so that
      not every full member gives one up at once).

    ``keep``: partitions not to give up now (their keys wait for a retry in this process:
    moving them would lose that key's order); the member gives up others instead, or none.
    """
    rng = rng or random.Random()
    mine_sorted = sorted(set(mine))
    free_sorted = sorted(set(free) - set(mine_sorted))
    kept = set(keep)
    low, high = shares(partitions, members)
    held = len(mine_sorted)
    if held > high:
        return Plan(release=_pick_release(mine_sorted, kept, held - high))
    if held < low:
        if free_sorted:
            return Plan(take=tuple(_spread(free_sorted, low - held, rng)))
        return Plan(want=True)
    if free_sorted and held < high and (held < low or rng.random() < 0.5):
        return Plan(take=tuple(_spread(free_sorted, 1, rng)))
    if wanting and held == high and high > low and not free_sorted and rng.random() < 0.5:
        return Plan(release=_pick_release(mine_sorted, kept, 1))
    return Plan()


def _pick_release(mine: list[int], kept: set[int], count: int) -> tuple[int, ...]:
    """The last-numbered partitions not kept (a member keeps its lowest: fewer moves when the
    group changes again)."""
    movable = [p for p in reversed(mine) if p not in kept]
    return tuple(movable[:count])


def _spread(free: list[int], count: int, rng: random.Random) -> list[int]:
    """``count`` free partitions at random: members taking at once seldom race for the same."""
    if count >= len(free):
        return list(free)
    return sorted(rng.sample(free, count))
