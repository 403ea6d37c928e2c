"""AsyncPublishFuture: the asyncio future AsyncPublisher.publish() returns is also its message's
engine entry (reliable_amqp._async._future). It cannot subclass Entry (two C layouts), so it
carries Entry's slots and methods by name: these tests keep the two in step."""

from __future__ import annotations

import asyncio
import types

import pytest

from reliable_amqp import Confirmation, MessageReturned
from reliable_amqp._async import AsyncPublisher
from reliable_amqp._async._future import AsyncPublishFuture, future_entry, future_of
from reliable_amqp._core.entry import Entry, new_entry
from reliable_amqp._core.message import MessageProperties
from support.aio import aio
from support.broker import BrokerAdmin, unique


def test_it_has_every_field_and_method_of_an_entry() -> None:
    assert set(Entry.__slots__) <= set(AsyncPublishFuture.__slots__)
    for klass in Entry.__mro__:
        if klass.__module__ in ("builtins", "typing"):
            continue
        for name, value in vars(klass).items():
            if isinstance(value, (types.FunctionType, property)) and not name.startswith("__"):
                assert getattr(AsyncPublishFuture, name) is value, name
    assert issubclass(AsyncPublishFuture, asyncio.Future)


@aio
async def test_future_entry_sets_what_fresh_entry_sets() -> None:
    loop = asyncio.get_running_loop()
    base = MessageProperties(content_type="text/plain", headers={"a": 1})
    args = ("ex", "key", b"body", base, True, "id-1")
    made = future_entry(loop, *args)
    plain = new_entry(*args)
    for name in Entry.__slots__:
        unset = object()
        assert getattr(made, name, unset) == getattr(plain, name, unset), name
    assert isinstance(made, Entry) and asyncio.isfuture(made)
    assert made.get_loop() is loop
    assert future_of(made) is made
    plain.handle = loop.create_future()
    assert future_of(plain) is plain.handle
    # Entry's methods work on it: its message, headers added, outcome
    assert made.message.message_id == "id-1" and made.message.body == b"body"
    made.add_headers({"b": 2})
    assert made.base.headers == {"a": 1, "b": 2} and base.headers == {"a": 1}
    assert made.outcome is None and not made.ok
    made.set_result(Confirmation("id-1", 1))
    assert (await made).message_id == "id-1"


@pytest.mark.broker
@aio
async def test_a_publish_returns_its_entry_as_its_future(
    amqp_url: str, broker: BrokerAdmin
) -> None:
    queue = broker.queue()
    async with AsyncPublisher(amqp_url) as publisher:
        future = await publisher.publish("", queue, b"one")
        many = await publisher.publish_many("", queue, [b"two", b"three"])
        returned = await publisher.publish("", unique("nowhere"), b"x", mandatory=True)
        assert isinstance(future, AsyncPublishFuture)
        assert all(isinstance(f, AsyncPublishFuture) for f in many)
        assert await publisher.flush(timeout=30) == 0
    confirmation = await future
    assert type(confirmation) is Confirmation and confirmation.attempts == 1
    entries = [f for f in many if isinstance(f, AsyncPublishFuture)]
    assert [(await f).message_id for f in entries] == [f.message_id for f in entries]
    with pytest.raises(MessageReturned):
        await returned
    assert broker.count(queue) == 3
    assert repr(future).startswith("<Future finished")  # as asyncio's own futures read


@pytest.mark.broker
@aio
async def test_a_spooled_publisher_keeps_plain_futures(
    amqp_url: str, broker: BrokerAdmin, tmp_path: object
) -> None:
    queue = broker.queue()
    async with AsyncPublisher(amqp_url, spool=str(tmp_path)) as publisher:
        await publisher.declare_queue(queue)
        future = await publisher.publish("", queue, b"one")
        assert type(future) is not AsyncPublishFuture
        assert await publisher.flush(timeout=30) == 0
    assert (await future).attempts == 1
