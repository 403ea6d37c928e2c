"""Header values the message checks admit must be publishable, or be refused at publish().

The async publisher encodes every type ``build_message`` admits (floats as doubles, tuples as
arrays). A Decimal that AMQP's decimal cannot hold is refused at publish() by both publishers;
the sync one also refuses floats there, since pika has no double encoding. (These tests first
ran as strict xfails against the sync publisher: it span on a float and died on the Decimal.)
"""

from __future__ import annotations

import decimal

import aio_pika
import pytest

from reliable_amqp import InvalidMessage, Publisher
from reliable_amqp._async import AsyncPublisher
from support.aio import aio
from support.broker import BrokerAdmin

pytestmark = pytest.mark.broker

BIG_DECIMAL = decimal.Decimal("1e20")  # AMQP decimals carry 32-bit digits


@aio
async def test_async_floats_and_tuples_arrive(amqp_url: str, broker: BrokerAdmin) -> None:
    queue = broker.queue()
    async with AsyncPublisher(amqp_url) as publisher:
        await publisher.publish_and_wait("", queue, b"x", headers={"f": 2.5, "t": (1, "a")})
    # Read with aio-pika's decoder (pamqp): pika's decoder truncates doubles to ints.
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        message = await (await channel.get_queue(queue)).get(no_ack=True)
        assert message is not None
        assert message.headers == {"f": 2.5, "t": [1, "a"]}
    finally:
        await connection.close()


@aio
async def test_async_oversize_decimal_is_refused_at_publish(
    amqp_url: str, broker: BrokerAdmin
) -> None:
    queue = broker.queue()
    async with AsyncPublisher(amqp_url) as publisher:
        with pytest.raises(InvalidMessage) as info:
            await publisher.publish("", queue, b"x", headers={"d": BIG_DECIMAL})
        assert info.value.field == "headers['d']"
        assert (await publisher.publish_and_wait("", queue, b"after")).attempts == 1


def test_sync_oversize_decimal_is_refused_at_publish(amqp_url: str, broker: BrokerAdmin) -> None:
    queue = broker.queue()
    with Publisher(amqp_url, delivery_timeout=2) as publisher:
        with pytest.raises(InvalidMessage):
            publisher.publish("", queue, b"x", headers={"d": BIG_DECIMAL}).exception(5)
        assert publisher.publish_and_wait("", queue, b"after").attempts == 1


@pytest.mark.parametrize("value", [2.5, (1, "a")])
def test_sync_float_or_tuple_header_is_published_or_refused(
    amqp_url: str, broker: BrokerAdmin, value: object
) -> None:
    queue = broker.queue()
    with Publisher(amqp_url, delivery_timeout=1) as publisher:
        try:
            future = publisher.publish("", queue, b"x", headers={"v": value})
        except InvalidMessage:
            return  # refusing at publish() would honour the contract too
        assert future.exception(5) is None
    assert broker.count(queue) == 1
