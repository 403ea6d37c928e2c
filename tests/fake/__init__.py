"""A scripted, in-process AMQP 0-9-1 peer for tests that need no broker (see :mod:`fake.peer`)."""

from fake.connection import FakeConnection, ProtocolViolation
from fake.peer import FakeBroker
from fake.records import ACK, HOLD, NACK, RETURN, Declaration, Message, SentConfirm

__all__ = [
    "ACK",
    "HOLD",
    "NACK",
    "RETURN",
    "Declaration",
    "FakeBroker",
    "FakeConnection",
    "Message",
    "ProtocolViolation",
    "SentConfirm",
]
