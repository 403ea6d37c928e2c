"""The asyncio publisher; it needs the ``aio`` extra (aio-pika and aiormq)."""

try:
    import aio_pika  # noqa: F401
    import aiormq  # noqa: F401
except ImportError as exc:  # fail loudly, with the fix, rather than deep inside a module
    raise ImportError(
        "AsyncPublisher needs aio-pika and aiormq: install the 'aio' extra "
        "(in a checkout: pip install '.[aio]')"
    ) from exc

from reliable_amqp._async.publisher import AsyncPublisher

__all__ = ["AsyncPublisher"]
