"""Reading a stream queue over AMQP 0-9-1: its offsets, and one offset range at a time.

Everything here runs in one process and talks to the broker through pika's
``BlockingConnection``; the Spark classes (:mod:`reliable_amqp.spark._read`) call it on the driver
(where offsets are) and in tasks (where ranges are read).

How a stream is read over AMQP 0-9-1, on RabbitMQ (3.9+) and LavinMQ: ``basic.qos`` is required,
``basic.consume`` takes ``{"x-stream-offset": N}`` (or ``"first"``, ``"last"``, ``"next"``), each
delivery carries its offset in the ``x-stream-offset`` header, and acks only return credit: the
broker sends at most ``prefetch`` unacked deliveries. A range ``[start, end)`` holds at most
``end - start`` messages: not every offset is a message (on RabbitMQ a new segment file can
begin with an entry of the stream's own, and the stream protocol's offset tracking adds
entries; no consumer sees them), so a reader that never returns more credit than the range's
size is sent at most a few deliveries past it, which it drops.

Ending a consumer: pika's ``basic_cancel`` (and ``BlockingChannel.close``, which cancels first)
rejects deliveries still on the wire, and RabbitMQ answers a ``basic.reject`` on a stream by
closing the whole connection (540 NOT_IMPLEMENTED). Closing the channel through pika's own
``Channel`` object marks it closing at once, and later deliveries are then dropped unanswered,
which on a stream is harmless (there is nothing to requeue). See :func:`_close_quietly`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import pika
import pika.exceptions

from reliable_amqp import ConfigurationError, ReliableAmqpError
from reliable_amqp._compat.pika import scanner_takes_deliveries, scanning_blocking_connection
from reliable_amqp._core.brokers import BrokerLimits, broker_limits
from reliable_amqp._core.delivery import Delivery, DeliveryScanner, HeaderDecodeError
from reliable_amqp._core.options import PublisherOptions
from reliable_amqp._sync._pika import connection_parameters, translate_connection_error

log = logging.getLogger("reliable_amqp.spark")
T = TypeVar("T")

OFFSET_HEADER = "x-stream-offset"
#: how long a probe waits for the broker's first delivery before it calls the stream empty
PROBE_WAIT = 1.0
#: how many connections a probe may take, when the broker closes them under it
PROBE_ATTEMPTS = 3
#: how long a first-offset probe of a stream known to hold messages keeps trying
HELD_PROBE_BUDGET = 30.0
#: how long the end probe waits for one more delivery of the stream's last chunk
END_IDLE = 0.25
#: an end probe reads at most this long (a stream written without pause never goes idle)
END_BUDGET = 3.0
#: how often a channel being closed looks for the broker's close-ok
CLOSE_TICK = 0.002
#: how long a reader waits for the connected node's member of a stream to run
REPLICA_WAIT = 30.0
#: how long a stream must answer "nothing" to first-offset probes before it is called empty
#: where that decides a loss (a remembered offset past its start: see :func:`stream_empty`)
EMPTY_CONFIRM = 3.0
#: how long a range read waits for its first delivery before it asks whether the stream is empty
EMPTY_CHECK = 5.0


class NotAStream(ConfigurationError):
    """The named queue is a classic or quorum queue: it is not replayable, so Spark cannot read
    it exactly once (a consumer reads queues: ``reliable_amqp.Consumer``)."""


class StreamNotFound(ConfigurationError):
    """The named stream (or super stream) does not exist on the broker."""


class StreamDataLost(ReliableAmqpError):
    """Retention removed offsets that a query still had to read (``failOnDataLoss``).

    ``first`` is the stream's first offset now, or None when retention emptied the stream: a
    stream that holds nothing while the read is at ``start`` (past the lowest offset a stream
    can have) held the offsets below ``start`` once, and whatever came after them is gone too,
    in a number nobody can tell until the stream's next message arrives.
    """

    retriable = False

    def __init__(self, stream: str, start: int, first: int | None) -> None:
        self.stream = stream
        self.start = start
        self.first = first
        if first is None:
            what = (
                f"stream {stream!r} holds no message, yet this read is at offset {start}: the "
                f"stream held the offsets before {start} once, and retention (x-max-length-bytes, "
                "x-max-age) has removed every message since. Messages published from offset "
                f"{start} on before it emptied are lost; how many is known only once the "
                "stream's next message arrives (a startingOffsets past the end of a stream "
                "never written that far looks the same)"
            )
        else:
            what = (
                f"stream {stream!r}: offsets {start}..{first - 1} ({first - start} offsets) were "
                "removed by retention before this query read them (the stream now starts at "
                f"{first})"
            )
        super().__init__(
            f'{what}. Set .option("failOnDataLoss", "false") to skip them and go on, '
            "or start a new query (a new checkpoint) from startingOffsets"
        )


class StreamReadStalled(ReliableAmqpError):
    """A range read waited too long for its next delivery."""

    retriable = True


class StreamUnavailable(ReliableAmqpError):
    """The connected node has no running member (replica) of the stream, and none started
    within :data:`REPLICA_WAIT` seconds. RabbitMQ serves an AMQP 0-9-1 stream consumer only from
    a member on the node it is connected to."""

    retriable = True


@dataclass(frozen=True, slots=True)
class Connector:
    """Where the stream is and how to log in: the sink's connection options (TLS, credentials
    outside the URL, heartbeat, connect timeout, connection name). Picklable."""

    options: PublisherOptions

    def connect(self, *, scanning: bool = False) -> pika.BlockingConnection:
        """A connection to the first URL that answers (raises the last failure otherwise);
        ``scanning``: over a :class:`~reliable_amqp._compat.pika.ScanningConnection`."""
        failure: ReliableAmqpError | None = None
        for url in self.options.urls:
            params = connection_parameters(url, self.options)
            try:
                if scanning:
                    return scanning_blocking_connection(params)
                return pika.BlockingConnection(params)
            except Exception as exc:
                failure = translate_connection_error(exc, params)
        assert failure is not None
        raise failure

    def probing(self, probe: Callable[[pika.BlockingConnection], T]) -> T:
        """``probe(connection)`` on a connection of its own, closed after.

        Probes only read, so when the broker closes the connection under one it runs again on a
        new connection, up to :data:`PROBE_ATTEMPTS` times in all: RabbitMQ 3.10 closes it
        (541 INTERNAL_ERROR, its channel crashed in ``begin_stream``) when a probe's consumer
        starts on a segment that retention is deleting (seen in 2 of 3 runs of 150 probes of a
        stream written and trimmed). What is left after the last attempt is raised as the
        library's connection error.
        """
        for attempt in range(1, PROBE_ATTEMPTS + 1):
            connection = self.connect()
            try:
                return probe(connection)
            except pika.exceptions.AMQPConnectionError as exc:
                if attempt == PROBE_ATTEMPTS:
                    raise translate_connection_error(exc) from exc
                log.debug("amqp: a probe's connection was lost (%r): probing again", exc)
            finally:
                _close(connection)
        raise AssertionError("unreachable")  # (the loop returns or raises)


def _close_quietly(channel: Any, connection: pika.BlockingConnection) -> None:
    """Close ``channel`` without rejecting deliveries in flight (see the module's docstring)."""
    impl = getattr(channel, "_impl", None)  # pika's Channel behind the BlockingChannel
    try:
        if impl is not None and impl.is_open:
            impl.close()
            deadline = time.monotonic() + 10.0
            while not channel.is_closed and time.monotonic() < deadline:
                # a short tick: process_data_events returns at its time limit, not at the
                # close-ok (measured: 50 ms per close at 0.05 on RabbitMQ 3.10 and LavinMQ 2.9.1,
                # whose close-ok comes within a few ms), and every probe closes a channel
                connection.process_data_events(CLOSE_TICK)
        elif channel.is_open:
            channel.close()
    except (pika.exceptions.AMQPError, OSError):  # the read is complete; closing is tidying
        log.debug("closing a stream channel failed", exc_info=True)


def _close(connection: pika.BlockingConnection) -> None:
    try:
        if connection.is_open:
            connection.close()
    except (pika.exceptions.AMQPError, OSError):
        log.debug("closing a stream connection failed", exc_info=True)


def _not_a_stream(queue: str, why: str) -> NotAStream:
    return NotAStream(
        f"{queue!r} is a queue, not a stream ({why}). Queues are not replayable, so Spark "
        "cannot read them exactly once: read it with a consumer (reliable_amqp.Consumer), or "
        "publish into a stream in front of the queue and read that"
    )


def _offset_of(properties: Any, queue: str) -> int:
    headers = properties.headers or {}
    value = headers.get(OFFSET_HEADER)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _not_a_stream(queue, f"its delivery had no {OFFSET_HEADER} header")
    return value


def _consume(channel: Any, queue: str, on_message: Any, where: Any, direct: bool = False) -> None:
    """``basic.consume`` at offset ``where``; RabbitMQ refuses ``x-stream-offset`` on a queue
    that is not a stream (406 "invalid arg"), which :class:`NotAStream` reports.

    ``direct``: ``on_message`` runs as pika's ``Channel`` reads each delivery, without the
    ``BlockingChannel``'s queue of events in between (a third of pika's cost per delivery);
    it then gets that ``Channel``, whose ``basic_ack`` goes out with the next I/O.
    """
    try:
        impl = getattr(channel, "_impl", None) if direct else None
        if impl is not None:
            done: list[Any] = []
            closed: list[BaseException] = []
            impl.add_on_close_callback(lambda _ch, reason: closed.append(reason))
            impl.basic_consume(
                queue,
                on_message,
                arguments={OFFSET_HEADER: where},
                callback=done.append,
            )
            while not done and not closed:  # consume-ok, or the broker's refusal
                channel.connection.process_data_events(0.01)
            if closed:
                raise closed[0]
            return
        channel.basic_consume(queue, on_message, arguments={OFFSET_HEADER: where})
    except pika.exceptions.ChannelClosedByBroker as exc:
        if exc.reply_code == 406 and OFFSET_HEADER in str(exc.reply_text):
            raise _not_a_stream(queue, str(exc.reply_text)) from None
        raise


def _no_local_member(exc: pika.exceptions.ChannelClosedByBroker) -> bool:
    """RabbitMQ's refusal of a stream consumer on a node without a running member: "... does
    not have a (running) replica on the local node" (406)."""
    return exc.reply_code == 406 and "replica on the local node" in str(exc.reply_text)


def _consuming(
    connection: pika.BlockingConnection,
    queue: str,
    where: Any,
    prefetch: int,
    on_message: Any,
    *,
    direct: bool = False,
    bind: Callable[[Any], None] | None = None,
) -> Any:
    """A new channel with ``basic.qos(prefetch)`` and a consumer at ``where`` on it; the
    channel. ``on_message`` and ``direct``: see :func:`_consume`; ``bind(channel)`` runs
    before the consumer starts on each channel tried (what acks or reads frames there).

    RabbitMQ refuses the consumer (406, "does not have a replica on the local node") while the
    connected node's member of the stream is not running: just after the stream was declared
    (seen in a full suite on 3.10: a probe right after ``queue.declare``), while the node or the
    member restarts, or when no member was ever placed there. Each refusal closes the channel;
    a new one tries again, for up to :data:`REPLICA_WAIT` seconds in all, then
    :class:`StreamUnavailable`.
    """
    deadline = time.monotonic() + REPLICA_WAIT
    pause = 0.05
    while True:
        channel = connection.channel()
        channel.basic_qos(prefetch_count=prefetch)
        if bind is not None:
            bind(channel)
        try:
            _consume(channel, queue, on_message, where, direct=direct)
            return channel
        except pika.exceptions.ChannelClosedByBroker as exc:
            if not _no_local_member(exc):
                raise
            if time.monotonic() >= deadline:
                raise StreamUnavailable(
                    f"stream {queue!r}: the connected node has no running member of it "
                    f"({exc.reply_text}) after {REPLICA_WAIT:.0f} s. A stream is read over AMQP "
                    "0-9-1 from a node that holds one of its members: connect to such a node, "
                    "or add a member on this one (rabbitmq-streams add_replica)"
                ) from None
            log.debug("amqp: stream %r: no running member on this node yet; trying again", queue)
            connection.sleep(pause)
            pause = min(pause * 2, 1.0)


def check_stream(connection: pika.BlockingConnection, queue: str) -> bool | None:
    """Whether ``queue`` is a stream: True, False, or None when the broker's answer does not
    tell (the queue has other arguments, which RabbitMQ compares first).

    Raises :class:`StreamNotFound` when there is no such queue. The check redeclares the queue
    with ``x-queue-type: stream``, which changes nothing: an existing queue of another type is
    refused with 406, naming the argument.
    """
    channel = connection.channel()
    try:
        channel.queue_declare(queue, passive=True)
    except pika.exceptions.ChannelClosedByBroker as exc:
        if exc.reply_code == 404:
            raise StreamNotFound(f"no stream named {queue!r} on the broker") from None
        raise
    channel = connection.channel()
    try:
        channel.queue_declare(queue, durable=True, arguments={"x-queue-type": "stream"})
    except pika.exceptions.ChannelClosedByBroker as exc:
        if exc.reply_code != 406:
            raise
        text = str(exc.reply_text)
        if "x-queue-type" in text:
            return False
        return None
    channel.close()
    return True


def refuse_queue(queue: str, connection: pika.BlockingConnection) -> None:
    """Raise :class:`NotAStream` unless ``queue`` is a stream (see :func:`check_stream`).

    When the redeclare cannot tell, a consumer at offset ``first`` asks: RabbitMQ refuses
    ``x-stream-offset`` on other queue types; a broker that took it would deliver a message
    without an offset header (prefetch 1, never acked: it goes back to its queue, marked
    redelivered, and nothing is lost).
    """
    kind = check_stream(connection, queue)
    if kind is False:
        raise _not_a_stream(queue, "the broker refuses x-queue-type stream for it")
    if kind is None:
        _first_delivery(connection, queue, "first")


def _in_order(connection: pika.BlockingConnection) -> bool:
    """Whether the broker usually sends a new consumer's first deliveries before its answer to
    the channel's next method. RabbitMQ does (its channel process reads the stream when a
    consumer starts or an ack returns credit, before it handles the next method), so a
    ``basic.qos`` right after is a barrier: what came before its ``qos-ok`` is what the
    stream's reader had at hand. Usually, not always: while the stream is written (and more
    while retention removes segments) the reader sometimes has nothing at hand yet, on 3.10 and
    4.3 alike (measured: 1 to 14 probes in 180 saw nothing by the barrier). So an empty answer
    at the barrier is never taken as "the stream is empty": the probe then waits for
    :data:`PROBE_WAIT`, as it always does on other brokers (LavinMQ runs consumers apart from
    the channel). The broker table's ``stream_qos_barrier``."""
    return _broker(connection).stream_qos_barrier


def _broker(connection: pika.BlockingConnection) -> BrokerLimits:
    """The connected broker's entry in the table of broker differences (``_core.brokers``)."""
    return broker_limits(getattr(getattr(connection, "_impl", None), "server_properties", None))


def lowest_offset(connection: pika.BlockingConnection) -> int:
    """The lowest offset a stream on this broker can hold (``first_stream_offset``: LavinMQ
    numbers a stream's messages from 1, RabbitMQ from 0, and so does any other broker here: the
    protocol does not say). Offsets below it never existed: a range that starts there has lost
    nothing to retention."""
    return _broker(connection).first_stream_offset


def _await_first(
    channel: Any, connection: pika.BlockingConnection, got: list[Any], prefetch: int
) -> None:
    """After a probe's ``basic.consume``: the barrier (a ``basic.qos`` with the same
    ``prefetch``), then, while nothing came, up to :data:`PROBE_WAIT` for a first delivery into
    ``got`` (see :func:`_in_order`: nothing by the barrier is not "empty")."""
    channel.basic_qos(prefetch_count=prefetch)  # the barrier
    connection.process_data_events(0)
    deadline = time.monotonic() + PROBE_WAIT
    while not got and time.monotonic() < deadline:
        connection.process_data_events(0.02)


def _first_delivery(connection: pika.BlockingConnection, queue: str, where: Any) -> int | None:
    """The offset of the first message a consumer at ``where`` gets, or None if none came
    (prefetch 1 and no ack: the broker sends one at most). See :func:`_in_order`."""
    got: list[Any] = []
    channel = _consuming(connection, queue, where, 1, lambda _c, _m, props, _b: got.append(props))
    _await_first(channel, connection, got, 1)
    _close_quietly(channel, connection)
    return _offset_of(got[0], queue) if got else None


def first_offset(
    connection: pika.BlockingConnection,
    queue: str,
    *,
    held: bool = False,
    budget: float = HELD_PROBE_BUDGET,
) -> int | None:
    """The stream's first offset still held (after retention), or None if it is empty (no
    delivery within :data:`PROBE_WAIT`).

    ``held``: the stream is known to hold messages (its end was read, a delivery came). Then a
    probe that saw nothing is tried again, for up to ``budget`` seconds in all
    (:data:`HELD_PROBE_BUDGET`), before None: a broker busy with its writers and its retention
    can take longer than :data:`PROBE_WAIT` to send a new consumer's first delivery (seen once
    in a full suite on a loaded machine, RabbitMQ 3.10, a stream trimmed while written).
    """
    deadline = time.monotonic() + (budget if held else 0.0)
    while True:
        found = _first_delivery(connection, queue, "first")
        if found is not None or time.monotonic() >= deadline:
            return found


def stream_empty(connection: pika.BlockingConnection, queue: str) -> bool:
    """Whether the stream holds no message: first-offset probes saw nothing for
    :data:`EMPTY_CONFIRM` seconds (one probe's :data:`PROBE_WAIT` is too short to call a loss
    on: a loaded broker has taken longer to send a first delivery)."""
    return first_offset(connection, queue, held=True, budget=EMPTY_CONFIRM) is None


def _counts_stream(connection: pika.BlockingConnection) -> bool:
    """Whether the broker's ``queue.declare-ok`` counts a stream's messages and its offsets
    are one per message: LavinMQ's are (its stream store counts the messages it holds, and
    each message takes the next offset); RabbitMQ's count of a stream lags (3.10 answers 0
    until a stats tick, seconds after the writes), and RabbitMQ's offsets include entries of the
    stream's own. The broker table's ``stream_count_is_span``."""
    return _broker(connection).stream_count_is_span


def _message_count(connection: pika.BlockingConnection, queue: str) -> int:
    """The ``message_count`` of a passive ``queue.declare`` of ``queue``."""
    channel = connection.channel()
    try:
        count = channel.queue_declare(queue, passive=True).method.message_count
    finally:
        if channel.is_open:
            channel.close()
    return int(count)


def _counted_end(connection: pika.BlockingConnection, queue: str) -> int | None:
    """The stream's end from its first offset and its message count (see
    :func:`_counts_stream`), without waiting for deliveries to stop; None when that cannot be
    told so (an empty stream, or an answer that does not check out: then the caller probes).

    The first offset is read before the count: retention between the two only lowers the sum,
    so the end is never past the stream's (writes between the two make it a lower bound, as
    the probe's is). The sum is checked: a consumer at ``end - 1`` must get that very offset,
    which catches a count of offsets that do not exist (a broker that counts otherwise); a
    count below the stream's would pass, which is why only a broker whose count is its
    stream's number of messages takes this path.
    """
    if _message_count(connection, queue) == 0:
        return None  # (empty, or a broker that does not count: the probe tells which)
    first = _first_delivery(connection, queue, "first")
    if first is None:
        return None
    end = first + _message_count(connection, queue)
    last = _first_delivery(connection, queue, end - 1)
    if last != end - 1:
        log.debug(
            "amqp: stream %r: first offset %d and message count give end %d, but a consumer "
            "at %d got %r: probing the end instead",
            queue,
            first,
            end,
            end - 1,
            last,
        )
        return None
    return end


def end_offset(connection: pika.BlockingConnection, queue: str) -> int | None:
    """One past the last offset the broker delivers now, or None if the stream is empty (no
    delivery within :data:`PROBE_WAIT`).

    There is no AMQP 0-9-1 method that tells a stream's end (RabbitMQ 3.10's
    ``queue.declare-ok`` counts a stream's messages seconds late, and not its offsets), so this
    reads the stream's last chunk (``"last"``): once a first delivery came, on RabbitMQ up to a
    barrier (:func:`_in_order`), elsewhere until no delivery comes for :data:`END_IDLE` seconds
    (at most :data:`END_BUDGET` in all). The answer is exact when nothing is being written;
    otherwise it is a lower bound (offsets it returns always exist), which is all a micro-batch
    needs: the next one reads what this one did not.

    On LavinMQ, which delivers apart from the channel's methods (no barrier) and starts
    ``"last"`` at its last segment (8 MiB: tens of thousands of messages to read before the
    idle wait), the end comes from the stream's first offset and its message count instead
    (:func:`_counted_end`), when that checks out (LavinMQ 2.9.1, a stream of 20,000 or 200,000
    messages at rest, a loaded machine: 0.11 to 0.20 s, against 0.75 to 1.65 s reading from
    ``"last"``).
    """
    if _counts_stream(connection):
        counted = _counted_end(connection, queue)
        if counted is not None:
            return counted
    prefetch = 1000
    offsets: list[int] = []
    channel = _consuming(
        connection,
        queue,
        "last",
        prefetch,
        lambda _c, _m, props, _b: offsets.append(_offset_of(props, queue)),
    )
    started = time.monotonic()
    _await_first(channel, connection, offsets, prefetch)
    acked = 0
    if offsets and _in_order(connection):
        while time.monotonic() - started < END_BUDGET:
            channel.basic_qos(prefetch_count=prefetch)  # the barrier
            connection.process_data_events(0)
            if len(offsets) - acked < prefetch:
                break  # the broker had credit left: it sent all it had at hand
            channel.basic_ack(len(offsets), multiple=True)  # tags count deliveries (one consumer)
            acked = len(offsets)
    elif offsets:
        seen = len(offsets)
        deadline = time.monotonic() + END_IDLE
        while time.monotonic() < deadline and time.monotonic() - started < END_BUDGET:
            # credit back before each wait: the first wait may have brought the whole window
            # (LavinMQ sends `prefetch` deliveries at once), and a broker out of credit sends
            # nothing more, which the idle wait would take for the stream's end
            if seen - acked >= prefetch // 2:
                channel.basic_ack(seen, multiple=True)  # tags count deliveries (one consumer)
                acked = seen
            connection.process_data_events(0.02)
            if len(offsets) != seen:
                seen = len(offsets)
                deadline = time.monotonic() + END_IDLE
    _close_quietly(channel, connection)
    return max(offsets) + 1 if offsets else None


def super_stream_partitions(connection: pika.BlockingConnection, name: str) -> list[str]:
    """The partition streams of the RabbitMQ super stream ``name``: ``name-0``, ``name-1``...

    AMQP 0-9-1 cannot list an exchange's bindings, so the partitions are found by the names
    ``rabbitmq-streams add_super_stream`` gives them (and the stream Java client and
    Sparkling Rabbit use): the exchange ``name`` must exist, and ``name-0`` ... ``name-N`` up
    to the first missing one are its partitions.
    """
    channel = connection.channel()
    try:
        channel.exchange_declare(name, passive=True)
    except pika.exceptions.ChannelClosedByBroker as exc:
        if exc.reply_code == 404:
            raise StreamNotFound(f"no super stream (exchange) named {name!r}") from None
        raise
    found: list[str] = []
    while True:
        channel = connection.channel() if channel.is_closed else channel
        candidate = f"{name}-{len(found)}"
        try:
            channel.queue_declare(candidate, passive=True)
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code == 404:
                break
            raise
        found.append(candidate)
    if not found:
        raise StreamNotFound(f"super stream {name!r} has no partition stream named {name}-0")
    return found


# --- reading a range ------------------------------------------------------------------------


class Chunk(NamedTuple):
    """Messages of a range as they came, in order: their offsets and their deliveries."""

    offsets: list[int]
    deliveries: list[Delivery]


class _RangeRead:
    """The delivery side of one :func:`read_range`: pika's I/O calls :meth:`on_deliveries`
    (in the reading thread, inside ``process_data_events``); the read loop takes chunks."""

    __slots__ = (
        "ack", "ack_every", "acked", "before_start", "cap_base", "delivered", "deliveries",
        "end", "failure", "finished", "head", "last_offset", "offsets", "queue", "start",
    )  # fmt: skip

    def __init__(self, queue: str, start: int, end: int, prefetch: int, ack: Any) -> None:
        self.queue = queue
        self.start = start
        self.end = end
        self.ack = ack  # pika Channel.basic_ack: goes out with the connection's next write
        self.ack_every = max(1, prefetch // 4)
        #: the last delivery the range may need is this plus the deliveries before start
        self.cap_base = end - start - prefetch
        self.offsets: list[int] = []
        self.deliveries: list[Delivery] = []
        self.delivered = 0
        self.acked = 0
        self.before_start = 0  # deliveries before start (they take credit too)
        self.last_offset = start - 1  # the highest offset seen (start - 1: none yet)
        self.head: int | None = None  # the first offset from start on that came
        self.failure: BaseException | None = None
        self.finished = False

    def on_deliveries(self, batch: list[Delivery]) -> None:
        """Keep the batch's offsets in ``[start, end)``; return credit, never past the range."""
        if self.failure is not None or self.finished:
            return  # (what comes while the channel closes is not read)
        start, end = self.start, self.end
        offsets, deliveries = self.offsets, self.deliveries
        for d in batch:
            headers = d.headers
            offset = headers.get(OFFSET_HEADER) if headers else None
            if type(offset) is not int:
                self.failure = _undecodable(self.queue, d, self.last_offset)
                return
            self.last_offset = offset
            if offset < start:
                self.before_start += 1
                continue
            if self.head is None:
                self.head = offset
            if offset < end:
                offsets.append(offset)
                deliveries.append(d)
        delivered = self.delivered = self.delivered + len(batch)
        # credit: the broker sends delivery k only while k <= acked + prefetch; never let that
        # pass the last delivery the range needs
        cap = self.cap_base + self.before_start
        may_ack = min(delivered, cap)
        acked = self.acked
        if may_ack > acked and (may_ack - acked >= self.ack_every or may_ack == cap):
            # tags count deliveries: this channel has one consumer and starts at 1
            self.ack(may_ack, multiple=True)
            self.acked = may_ack

    def take(self) -> Chunk | None:
        """The messages kept since the last call, if any."""
        if not self.offsets:
            return None
        chunk = Chunk(self.offsets, self.deliveries)
        self.offsets, self.deliveries = [], []
        return chunk


def read_range(
    connector: Connector,
    queue: str,
    start: int,
    end: int,
    *,
    prefetch: int = 2000,
    stall_timeout: float = 60.0,
    fail_on_data_loss: bool = True,
) -> Iterator[Chunk]:
    """Yield the messages of ``queue`` with offsets in ``[start, end)``, in chunks, in order.

    The broker is never given more credit than the range needs, and acks (which on a stream
    only return credit) are batched with ``multiple``. Messages before ``start`` (RabbitMQ starts
    a consumer at the chunk that holds ``start``) and from ``end`` on are dropped. A first
    delivery past ``start`` means retention removed the range's head (or that those offsets are
    entries of the stream's own, not messages): the stream's first offset tells which;
    removed offsets raise :class:`StreamDataLost` or, with ``fail_on_data_loss=False``, are
    skipped with a WARNING. No delivery at all for :data:`EMPTY_CHECK` seconds asks whether
    the stream is empty: then retention emptied it after the range was planned, which is the
    same loss (the range's offsets existed when it was planned). No delivery for
    ``stall_timeout`` seconds raises :class:`StreamReadStalled`, which says where the stream
    is now (Spark retries the task; the retry reads the same range).

    Deliveries are decoded the consumer's way (:class:`~reliable_amqp.Delivery`, straight from
    the frames), not by pika: pika's decoding is most of a reader's cost per message.
    """
    if end <= start:
        return
    connection = connector.connect(scanning=True)
    try:
        start = max(start, lowest_offset(connection))  # (below it, offsets never existed)
        if end <= start:
            return
        prefetch = max(1, min(prefetch, end - start))
        scanning = connection._impl
        read = _RangeRead(queue, start, end, prefetch, None)  # acks on the channel bound below
        scanning.on_deliveries = read.on_deliveries

        def bind(channel: Any) -> None:
            read.ack = channel._impl.basic_ack
            scanning.scanner = DeliveryScanner(channel.channel_number, 0, queue)

        channel = _consuming(
            connection, queue, start, prefetch, scanner_takes_deliveries, direct=True, bind=bind
        )
        position = start  # the next offset this read expects
        checked_head = checked_empty = False
        seen = 0
        last_delivery = time.monotonic()
        while position < end:
            connection.process_data_events(0.05)
            if read.failure is not None:
                raise read.failure
            if read.delivered == seen:
                idle = time.monotonic() - last_delivery
                if not seen and not checked_empty and idle > min(EMPTY_CHECK, stall_timeout):
                    checked_empty = True
                    if connector.probing(lambda c: stream_empty(c, queue)):
                        _lost_everything(queue, start, end, fail_on_data_loss)
                        break
                if idle > stall_timeout:
                    raise StreamReadStalled(
                        f"stream {queue!r}: no delivery for {stall_timeout:.0f} s while reading "
                        f"offsets {position}..{end - 1} (range {start}..{end - 1}); "
                        f"{_stream_now(connector, queue, position, end)}"
                    )
                continue
            seen = read.delivered
            last_delivery = time.monotonic()
            if read.head is not None and not checked_head:
                checked_head = True
                if read.head > start:
                    _head_gap(connection, queue, start, read.head, fail_on_data_loss)
            chunk = read.take()
            if chunk is not None:
                position = chunk.offsets[-1] + 1
                yield chunk
            if read.last_offset >= end - 1:
                break
        read.finished = True
        _close_quietly(channel, connection)
    finally:
        _close(connection)


def _lost_everything(queue: str, start: int, end: int, fail: bool) -> None:
    """A range read found its stream empty: retention removed the range after it was planned."""
    if fail:
        raise StreamDataLost(queue, start, None)
    log.warning(
        "amqp: stream %r: skipped offsets %d..%d: retention emptied the stream before they "
        "were read (failOnDataLoss=false)",
        queue,
        start,
        end - 1,
    )


def _stream_now(connector: Connector, queue: str, position: int, end: int) -> str:
    """Where the stream is now, for a stalled read's error (what the broker answers, not a
    guess: the probes' own failure is reported as such)."""
    try:
        first, tail = connector.probing(lambda c: (first_offset(c, queue), end_offset(c, queue)))
    except Exception as exc:  # the stall is the error; this only describes it
        return f"the stream's offsets could not be probed ({exc!r})"
    if tail is None:
        return "the stream holds no message now"
    now = f"the stream holds offsets {first}..{tail - 1} now"
    if tail <= position:
        now += (
            f": offsets {tail}..{end - 1} do not exist yet (the range was planned past the "
            "stream's end, or the stream was deleted and declared again)"
        )
    return now


def _undecodable(queue: str, d: Delivery, last: int) -> ReliableAmqpError:
    """What a delivery without a readable offset means: not a stream, or bad properties."""
    if d.header_error is not None:
        return HeaderDecodeError(
            f"stream {queue!r}: the message after offset {last} cannot be read ({d.header_error})"
        )
    return _not_a_stream(queue, f"its delivery had no {OFFSET_HEADER} header")


def _head_gap(
    connection: pika.BlockingConnection, queue: str, start: int, got: int, fail: bool
) -> None:
    """The first delivery was ``got`` > ``start``: lost to retention, or never messages."""
    first = first_offset(connection, queue, held=True)
    if first is None:
        raise StreamReadStalled(f"stream {queue!r}: its first offset did not come")
    if first <= start:
        return  # offsets start..got-1 are the stream's own entries, not messages
    lost = min(first, got) - start
    if fail:
        raise StreamDataLost(queue, start, start + lost)
    log.warning(
        "amqp: stream %r: skipped %d offsets (%d..%d) removed by retention before they were "
        "read (failOnDataLoss=false)",
        queue,
        lost,
        start,
        start + lost - 1,
    )


def connector_from_strings(urls: list[str], options: Mapping[str, str]) -> Connector:
    """A :class:`Connector` from string options (see :data:`CONNECTION_OPTIONS`)."""
    unknown = sorted(set(options) - set(CONNECTION_OPTIONS))
    if unknown:
        raise ConfigurationError(f"unknown option {unknown[0]!r} for reading")
    return Connector(PublisherOptions.from_strings(urls, dict(options)))


#: the sink's options that concern the connection, accepted by the reader as well
CONNECTION_OPTIONS: tuple[str, ...] = (
    "username",
    "password",
    "ca_file",
    "cert_file",
    "key_file",
    "key_password",
    "server_hostname",
    "tls_verify",
    "heartbeat",
    "connect_timeout",
    "connection_name",
)
