"""A scripted, in-process AMQP 0-9-1 peer for tests that need no broker (see :mod:`fake.peer`)."""

from fake.peer import (
    ACK,
    HOLD,
    NACK,
    RETURN,
    Declaration,
    FakeBroker,
    FakeConnection,
    Message,
    SentConfirm,
)

__all__ = [
    "ACK",
    "HOLD",
    "NACK",
    "RETURN",
    "Declaration",
    "FakeBroker",
    "FakeConnection",
    "Message",
    "SentConfirm",
]
