"""Helpers of the spool tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aio_blocking import BlockingAsyncPublisher
from reliable_amqp._core.message import OutgoingMessage, build_message


def messages(
    count: int, size: int = 16, start: int = 0, **properties: Any
) -> list[OutgoingMessage]:
    """``count`` messages with ids ``m-<start>``, ``m-<start+1>``, ...; bodies of ``size`` bytes."""
    return [
        build_message(
            "",
            "q",
            f"{i:0{size}d}".encode()[-size:] if size else b"",
            properties={"message_id": f"m-{i}", **properties},
        )
        for i in range(start, start + count)
    ]


class SpooledAsync(BlockingAsyncPublisher):
    """The blocking AsyncPublisher driver, with ``persist()``."""

    def persist(self, timeout: float | None = None) -> int:
        """``AsyncPublisher.persist``."""
        return self._call(self._publisher.persist(timeout))


#: a publisher class under test: Publisher, or AsyncPublisher behind a blocking driver
Kind = Callable[..., Any]
