"""A spool's entry read back (checked by the segment reader's CRC, then decoded), and the
wording of one whose record checks but does not decode."""

from __future__ import annotations

from typing import NamedTuple

from reliable_amqp._core.errors import SpoolError
from reliable_amqp._core.message import MessageParts
from reliable_amqp._spool import _codec


class SpoolEntry(NamedTuple):
    """One message in the spool: ``seq`` is its place in the append order, ``size`` what it
    counts against ``spool_max_bytes``. (A tuple: a drain makes one a message.)"""

    seq: int
    message: MessageParts
    size: int


def undecodable(path: str, seq: int, exc: _codec.CodecError) -> SpoolError:
    """The error for entry ``seq`` of ``path``, whose record checks but does not decode."""
    return SpoolError(f"{path}: entry {seq} cannot be decoded: {exc}")
