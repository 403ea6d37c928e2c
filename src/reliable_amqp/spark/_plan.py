"""Where a read starts and ends: offset specs resolved against the broker and checked on the
driver, before any task runs.

An offset range that cannot be read fails here with its reason: ``endingOffsets`` before
``startingOffsets``, or past the stream's end; ``startingOffsets`` past the stream's end. And
here is where retention's losses are found before a task would meet them: a start below the
stream's first offset (:class:`StreamDataLost`, or a WARNING with ``failOnDataLoss=false``), and
a stream that holds nothing while a remembered offset (a checkpoint's, or ``startingOffsets``)
is past the lowest offset a stream can have: such a stream held offsets once, and retention has
emptied it. A stream never written, read from its start, is empty without a word.
"""

from __future__ import annotations

from typing import Any

from reliable_amqp import ConfigurationError
from reliable_amqp.spark._logging import driver_log
from reliable_amqp.spark._read_options import ReadConfig
from reliable_amqp.spark._stream import (
    StreamDataLost,
    StreamReadStalled,
    end_offset,
    first_offset,
    lowest_offset,
    stream_empty,
)

#: "the stream's first offset", while a stream is empty
FIRST = -1

Offsets = dict[str, int]
Spec = str | int | dict[str, int]


def explicit(spec: Spec, stream: str) -> int | None:
    """The offset ``spec`` gives for ``stream`` as a number, or None for ``earliest``/``latest``."""
    if isinstance(spec, dict):
        if stream not in spec:
            raise ConfigurationError(f"the offsets given name no offset for stream {stream!r}")
        return spec[stream]
    return spec if isinstance(spec, int) else None


def resolve(spec: Spec, stream: str, connection: Any, edge: str) -> int:
    """An offset spec as a number for ``stream`` (``FIRST`` while the stream is empty)."""
    given = explicit(spec, stream)
    if given is not None:
        return given
    if spec == "earliest" or edge == "first":
        found = first_offset(connection, stream)
    else:
        found = end_offset(connection, stream)
    return FIRST if found is None else found


def confirmed_end(connection: Any, stream: str) -> int | None:
    """The stream's end, or None when it holds no message, looked at twice where the end probe
    saw nothing (its one-second wait is not enough to call a loss on): first-offset probes for
    a few seconds, and when they find a message, the end probe again."""
    tail = end_offset(connection, stream)
    if tail is not None or stream_empty(connection, stream):
        return tail
    tail = end_offset(connection, stream)
    if tail is None:
        raise StreamReadStalled(f"stream {stream!r}: it holds messages, but its end did not come")
    return tail


def lost_everything(config: ReadConfig, stream: str, start: int) -> None:
    """The stream is empty, yet the read is at ``start`` (past the lowest offset): raise
    :class:`StreamDataLost`, or (``failOnDataLoss=false``) warn that the read goes on from the
    stream's next message."""
    if config.fail_on_data_loss:
        raise StreamDataLost(stream, start, None)
    driver_log().warning(
        "amqp: stream %r holds no message, yet this read is at offset %d: retention emptied "
        "it, and messages published from offset %d on before that are lost, in a number known "
        "only once its next message arrives; going on from there (failOnDataLoss=false)",
        stream,
        start,
        start,
    )


def _past_end(stream: str, name: str, offset: int, tail: int | None) -> ConfigurationError:
    where = (
        "the stream holds no message (never written, or emptied by retention)"
        if tail is None
        else f"the stream's last offset is {tail - 1}, so its end is {tail}"
    )
    return ConfigurationError(
        f"stream {stream!r}: {name} {offset} is past the stream's end: {where}. Offsets past "
        'the end do not exist yet: use "latest", or an offset the stream has'
    )


def batch_range(config: ReadConfig, stream: str, connection: Any, lowest: int) -> tuple[int, int]:
    """``spark.read``'s range ``[start, end)`` of ``stream``, checked (see the module's
    docstring); ``start`` is ``FIRST`` for ``earliest`` (:func:`check_heads` finds it)."""
    starting = explicit(config.starting, stream)
    ending = explicit(config.ending, stream)
    if starting is not None and ending is not None and ending < starting:
        raise ConfigurationError(
            f"stream {stream!r}: endingOffsets {ending} is before startingOffsets {starting}: "
            "the range [startingOffsets, endingOffsets) holds no offset (endingOffsets is "
            "exclusive)"
        )
    asked = max(o for o in (starting, ending, lowest) if o is not None)
    # the end probe's "nothing" decides a loss or an error only past the lowest offset
    tail = confirmed_end(connection, stream) if asked > lowest else end_offset(connection, stream)
    if tail is None:
        if starting is not None and starting > lowest:
            lost_everything(config, stream, starting)
        elif ending is not None and ending > lowest:
            raise _past_end(stream, "endingOffsets", ending, None)
        return lowest, lowest
    if ending is not None and ending > tail:
        raise _past_end(stream, "endingOffsets", ending, tail)
    stop = tail if ending is None else ending
    if starting is None and config.starting == "earliest":
        return FIRST, stop
    if starting is None:  # latest: the end
        begin, named = tail, f"latest ({tail})"
    else:
        begin, named = max(starting, lowest), str(starting)
        if begin > tail:
            raise _past_end(stream, "startingOffsets", starting, tail)
    if begin > stop:
        raise ConfigurationError(
            f"stream {stream!r}: endingOffsets {stop} is before startingOffsets {named}: "
            "the range holds no offset"
        )
    return begin, stop


def checked_start(
    config: ReadConfig, stream: str, connection: Any, lowest: int, told: set[tuple[str, int]]
) -> int:
    """``spark.readStream``'s first offset of ``stream`` for a new query: ``startingOffsets``
    resolved, and a number checked against the stream's end (``told``: the losses warned of
    already, so each is warned of once)."""
    starting = explicit(config.starting, stream)
    if starting is None:
        return resolve(config.starting, stream, connection, edge="start")
    if starting > lowest:
        tail = confirmed_end(connection, stream)
        if tail is None:
            if (stream, starting) not in told:
                lost_everything(config, stream, starting)
                told.add((stream, starting))
        elif starting > tail:
            raise _past_end(stream, "startingOffsets", starting, tail)
    return starting


def check_heads(config: ReadConfig, start: Offsets, end: Offsets, connection: Any) -> Offsets:
    """The range's starts, checked against retention: where a stream's first offset passed a
    start, raise :class:`StreamDataLost` or (``failOnDataLoss=false``) warn and move the start;
    ``FIRST`` becomes the stream's first offset. A stream found empty (its end was read when the
    range was fixed) was emptied by retention meanwhile: the same loss."""
    out: Offsets = {}
    lowest = lowest_offset(connection)  # (below it, offsets never existed: nothing lost)
    for stream, stop in end.items():
        begin = start.get(stream, FIRST)
        if begin != FIRST:
            begin = max(begin, lowest)
        if (begin >= stop and begin != FIRST) or stop == FIRST:
            out[stream] = begin  # nothing to read (an empty stream: no probe, no wait)
            continue
        first = first_offset(connection, stream, held=True)  # (stop != FIRST: it holds some)
        if first is None:  # it held offsets before stop, and none now
            lost_everything(config, stream, lowest if begin == FIRST else begin)
            out[stream] = stop
            continue
        if begin == FIRST:
            out[stream] = min(first, stop)
            continue
        if first > begin:
            if config.fail_on_data_loss:
                raise StreamDataLost(stream, begin, first)
            driver_log().warning(
                "amqp: stream %r: skipping %d offsets (%d..%d) removed by retention before "
                "this query read them (failOnDataLoss=false)",
                stream,
                min(first, stop) - begin,
                begin,
                min(first, stop) - 1,
            )
            begin = min(first, stop)
        out[stream] = begin
    return out
