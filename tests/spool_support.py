"""Helpers of the spool tests."""

from __future__ import annotations

from typing import Any

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
