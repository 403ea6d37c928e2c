"""The asyncio publisher (needs the ``aio`` extra: ``pip install reliable-amqp[aio]``)."""

from reliable_amqp._async.publisher import AsyncPublisher

__all__ = ["AsyncPublisher"]
