"""Supervisor: every decision about a publisher's connection, with no I/O (the h11 way).

Both adapters feed it what happened (a connection attempt failed, a channel opened, the broker
closed a channel, a confirm arrived, the link went silent, the clock moved) and do what it answers:
which URL to try next and after how long, whether to give up and with what error, whether a
closed channel is reopened at once or after a backoff, when to wake up next. It owns the
:class:`PublishEngine` (what becomes of each message), the :class:`StateMachine` (where the
connection is) and the :class:`Lifecycle` (events for ``on_event``). The adapters move bytes, run
the timers it asks for, and turn the resolved entries it returns into futures.

Not thread-safe: called from the I/O thread or the event loop only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from reliable_amqp._core.brokers import ANY_BROKER, BrokerLimits, broker_limits
from reliable_amqp._core.engine import PublishEngine
from reliable_amqp._core.entry import Entry
from reliable_amqp._core.errors import (
    REPLY_CODE_ERRORS,
    AmqpConnectionError,
    PublishError,
    RecoveryFailed,
    ReliableAmqpError,
)
from reliable_amqp._core.lifecycle import Lifecycle
from reliable_amqp._core.liveness import LinkWatch
from reliable_amqp._core.options import PublisherOptions, redact_url
from reliable_amqp._core.state import State, StateMachine
from reliable_amqp._core.stats import EventKind, Stats

E = TypeVar("E", bound="Entry[Any]")

log = logging.getLogger("reliable_amqp")

#: seconds to wait for the broker's close-ok (a stalled broker never sends one)
CLOSE_GRACE = 2.0
#: AMQP's frame-min-size: no broker may negotiate a smaller frame_max
FRAME_MIN_SIZE = 4096
#: connection closes that blame something the client wrote (frame error, syntax error,
#: unexpected frame), or that one message can cause (RabbitMQ closes with 541 on a publish to a
#: direct reply-to address whose requester has gone): they have a culprit like a channel close
CONNECTION_CULPRIT_CODES = frozenset({501, 502, 505, 541})


def is_permanent_channel_close(reply_code: int | None, reply_text: str) -> bool:
    """Whether a channel close with this code blames a message (not the connection): a
    message that keeps causing it must fail. Anything else (320 forced, 541 internal, a
    resource problem, a lost socket) is the connection's fault and the messages are
    republished."""
    if reply_code is None:
        return False
    if reply_code == 406 and "disk" in reply_text.lower():
        # LavinMQ closes channels with 406 when its disk is low: a resource problem, retriable.
        return False
    cls = REPLY_CODE_ERRORS.get(reply_code)
    return cls is not None and not cls.retriable and reply_code != 320


@dataclass(frozen=True, slots=True)
class Reconnect:
    """Try ``urls[url_index]`` after ``delay`` seconds."""

    url_index: int
    delay: float


@dataclass(frozen=True, slots=True)
class GiveUp:
    """Recovery is over: every pending message fails, ``error`` is what callers see."""

    error: ReliableAmqpError


class Supervisor(Generic[E]):
    """The connection's life and the engine's clock, for one publisher."""

    def __init__(self, options: PublisherOptions, *, borrowed: bool = False) -> None:
        self.options = options
        self.engine: PublishEngine[E] = PublishEngine(
            delivery_timeout=options.delivery_timeout,
            nack_policy=options.nack_policy,
            dedup_header=options.dedup_header,
        )
        self.state = StateMachine()
        self.events = Lifecycle(options.on_event, self.engine.counters)
        engine = self.engine
        # The engine's calls an adapter makes, as they are (no call of the supervisor's own
        # between: these run per publish or per batch). The adapters call nothing else of it.
        #: take entries (:meth:`PublishEngine.accept`)
        self.accept = engine.accept
        #: whether anything waits to be written (:meth:`PublishEngine.has_sendable`)
        self.has_sendable = engine.has_sendable
        #: a ``basic.return`` (:meth:`PublishEngine.on_return`)
        self.on_return = engine.on_return
        #: whether an interrupted admission's message is in the engine (:meth:`PublishEngine.holds`)
        self.holds = engine.holds
        #: True when the connection is lent by the caller and reconnects by itself
        self.borrowed = borrowed
        #: why the publisher gave up for good (wrong credentials, connect policy spent)
        self.fatal: ReliableAmqpError | None = None
        #: close() was asked for: no more recovery
        self.stopping = False
        self._attempts = 0  # connection attempts started
        self._failures = 0  # consecutive losses since a connection last opened a channel
        self._first_failure = 0.0
        self._round_opened = False
        self._channel_failures = 0
        self._link = LinkWatch()  # is the current connection alive (the heartbeat rule)
        self._blocked = False  # connection.blocked without unblocked, on this connection
        #: the frame_max the broker negotiated on the current (or last) connection; 0: unknown
        self.frame_max = 0
        #: the limits of the broker of the current (or last) connection, by its product name
        #: (``_core.brokers``); what every broker takes until one is known
        self.broker: BrokerLimits = ANY_BROKER

    # --- connecting ---------------------------------------------------------------------------

    def next_attempt(self) -> int:
        """Start a connection attempt; returns the index of the URL to try."""
        index = self._attempts % len(self.options.urls)
        self._attempts += 1
        self._round_opened = False
        self._link.reset()
        self._blocked = False
        return index

    def describe(self, url_index: int) -> str:
        """The URL of ``url_index``, password redacted (for logs)."""
        return redact_url(self.options.urls[url_index])

    def connection_opened(
        self,
        frame_max: int,
        heartbeat: int,
        received: float,
        now: float,
        server_properties: Mapping[str, object] | None = None,
    ) -> ReliableAmqpError | None:
        """The AMQP handshake is done: what the broker negotiated, and ``received`` as
        :meth:`check_liveness` takes it.

        ``heartbeat`` is the negotiated interval (0: the adapter's client library watches the
        link itself, or nobody does). ``server_properties`` are the broker's, from
        ``connection.start``: its product name says which limits of its own apply
        (:attr:`broker`). Returns an error when the broker's values are unusable (the adapter
        then drops the connection with it).
        """
        if frame_max and frame_max < FRAME_MIN_SIZE:
            # Not retriable: the same broker will say the same again.
            return ReliableAmqpError(
                f"the broker negotiated frame_max {frame_max}, below AMQP's minimum of "
                f"{FRAME_MIN_SIZE}: not a usable AMQP 0-9-1 broker"
            )
        self.frame_max = frame_max
        self.broker = broker_limits(server_properties)
        self._link.reset(now, heartbeat)
        self.check_liveness(received, now)
        return None

    @property
    def isolating(self) -> bool:
        """True while suspects of a frame error go out one at a time: write after each confirm."""
        return self.engine.isolating

    @property
    def generation(self) -> int:
        """The channel generation: the adapter tags a channel it opens with it, and hands it
        back with each confirm and return from that channel (stale ones are ignored)."""
        return self.engine.tracker.generation

    def stats(self) -> Stats:
        """A snapshot of the counters (safe to call from another thread)."""
        return self.engine.stats()

    def listen_resends(self, listener: Callable[[E, str], None] | None) -> None:
        """Tell ``listener`` of each message that goes out again (telemetry's span events)."""
        self.engine.on_resend = listener

    def channel_opened(self) -> bool:
        """The confirm-mode channel is open; False when the publisher is closing (the adapter
        then leaves it unused), True when messages may be written (unless blocked)."""
        if self.stopping or self.state.state in (State.CLOSING, State.CLOSED):
            return False
        self._round_opened = True
        self.state.transition(State.OPEN)
        self.events.opened()
        if self._blocked:  # connection.blocked came while the channel was being opened
            self.state.transition(State.BLOCKED)
        return True

    def connection_lost(
        self,
        loss: ReliableAmqpError | None,
        now: float,
        *,
        established: bool,
        reply: tuple[int, str] | None = None,
    ) -> tuple[list[E], Reconnect | GiveUp | None]:
        """The connection is gone, or an attempt failed (``established`` False).

        ``reply`` is the broker's ``connection.close`` (code, text) when it sent one. Whatever
        was on the wire is queued to go out again, in order, except the culprit of a close for
        a frame or syntax error (see :meth:`PublishEngine.on_connection_lost`). Returns the
        resolved entries and what to do next: reconnect (to which URL, after how long), give
        up, or nothing (the publisher is closing).
        """
        blame = None
        if reply is not None and reply[0] in CONNECTION_CULPRIT_CODES:
            # a message's doing (501, 502, 505): it fails with MessageRejected, and the retry's
            # WARNING below says the connection was lost and why; not a third time here
            log.debug("reliable-amqp: the broker closed the connection: %s %s", *reply)
            blame = reply
        resolved = self.engine.on_connection_lost(blame, now)
        if self.stopping:
            return resolved, None
        if loss is None:
            loss = AmqpConnectionError("connection lost")
        if established:
            self.events.lost("connection", EventKind.CONNECTION_LOST, str(loss))
        if self._round_opened:
            self._failures = 0
        if self._failures == 0:
            self._first_failure = now
        self._failures += 1
        self.state.transition(State.RECOVERING)
        self._link.reset(now)  # no liveness checks until the next connection opens
        policy = self.options.connect_policy
        failures = self._failures
        urls = len(self.options.urls)
        # Fail over through the other URLs at once; back off after each full round. A borrowed
        # connection reconnects by itself (its owner's policy); the adapter waits for it.
        in_round = self.borrowed or (urls > 1 and failures % urls != 0)
        wait = 0.0 if in_round else policy.base_delay(failures)
        if not loss.retriable or not policy.allows(failures, now - self._first_failure, wait):
            return resolved, GiveUp(self.give_up(loss, failures))
        delay = 0.0 if in_round else policy.delay(failures)
        index = self._attempts % urls
        self.events.retrying(
            self.describe((self._attempts - 1) % urls),
            self.describe(index),
            loss,
            failures + 1,
            delay,
            established=established,
        )
        return resolved, Reconnect(index, delay)

    def give_up(self, error: ReliableAmqpError, failures: int = 0) -> ReliableAmqpError:
        """End recovery with ``error`` (a retriable one becomes :class:`RecoveryFailed`)."""
        fatal = error
        if error.retriable:
            fatal = RecoveryFailed(f"gave up connecting after {failures} attempts: {error}")
            fatal.__cause__ = error
        self.events.gave_up(fatal)
        self.fatal = fatal
        return fatal

    # --- the channel ----------------------------------------------------------------------------

    def channel_closed(
        self, reply_code: int | None, reply_text: str, now: float
    ) -> tuple[list[E], float]:
        """The broker closed the publishing channel while its connection stays open.

        The message that caused a permanent close (404, 406, ...) fails alone; the others go out
        again on a new channel. Returns the resolved entries and the delay before the next
        channel: 0 after a permanent close (the culprit is out of the way), a backoff after a
        resource problem (LavinMQ's low disk, 506) so the broker is not hammered.
        """
        # A permanent close (404, 406, ...) is a message's doing: that message fails with
        # MessageRejected (now, or once isolating the suspects one at a time found it), which
        # says all of this to the caller who holds it, so the library does not say it twice (a
        # failure nobody retrieves is reported as such). Any other close (a resource problem)
        # is the library's to report.
        blame = None
        if reply_code is not None and is_permanent_channel_close(reply_code, reply_text):
            blame = (reply_code, reply_text)
        permanent = blame is not None
        resolved = self.engine.on_channel_lost(blame, now)
        log.log(
            logging.DEBUG if permanent else logging.WARNING,
            "reliable-amqp: channel closed: %s %s",
            reply_code,
            reply_text,
        )
        self.events.lost(
            "channel", EventKind.CHANNEL_LOST, f"channel closed: {reply_code} {reply_text}"
        )
        if self.state.state is not State.CLOSING:
            self.state.transition(State.RECOVERING)
        if permanent:
            return resolved, 0.0
        return resolved, self.channel_failed()

    def channel_failed(self) -> float:
        """A channel could not be opened or was closed for a resource problem: the backoff."""
        self._channel_failures += 1
        return self.options.connect_policy.delay(self._channel_failures)

    def on_confirm(
        self, generation: int, ack: bool, tag: int, multiple: bool, now: float
    ) -> list[E]:
        """``basic.ack`` (``ack``) or ``basic.nack`` from the channel of ``generation``."""
        self._channel_failures = 0
        if ack:
            return self.engine.on_ack(generation, tag, multiple, now)
        return self.engine.on_nack(generation, tag, multiple, now)

    def blocked(self, reason: str) -> None:
        """``connection.blocked``: nothing is written until unblocked; deadlines run on."""
        log.warning("reliable-amqp: broker blocked the connection: %s", reason)
        self.events.emit(EventKind.BLOCKED, reason)
        self._blocked = True
        if self.state.state is State.OPEN:
            self.state.transition(State.BLOCKED)

    def unblocked(self) -> bool:
        """``connection.unblocked``; True when writing may resume now."""
        self.events.emit(EventKind.UNBLOCKED, "connection unblocked")
        self._blocked = False
        if self.state.state is State.BLOCKED:
            self.state.transition(State.OPEN)
            return True
        return False

    @property
    def writable(self) -> bool:
        """Whether messages may be written now (channel open, not blocked, not closing)."""
        return self.state.writable and not self.stopping

    def write(self, channel: int, out: list[bytes | memoryview]) -> tuple[int, list[E]]:
        """Append the frames of the next batch to ``out`` (:meth:`PublishEngine.write`, at the
        ``frame_max`` this connection negotiated, refusing what its broker cannot take):
        (messages written, resolved entries)."""
        return self.engine.write(channel, self.frame_max, out, self.broker)

    # --- time -----------------------------------------------------------------------------------

    def tick(self, now: float) -> list[E]:
        """Release due nack retries and expire messages past their deadline."""
        return self.engine.tick(now)

    def next_wakeup(self) -> float | None:
        """When :meth:`tick` or :meth:`check_liveness` next has work (None: nothing pending)."""
        due = self.engine.next_wakeup()
        check = self._link.check_at
        if check is not None:
            due = check if due is None else min(due, check)
        return due

    def check_liveness(self, received: float, now: float) -> AmqpConnectionError | None:
        """Watch what the broker sends on an open connection; an error once the link is silent.

        ``received`` is anything that changes whenever the broker sends something: pika's byte
        count, the time aiormq read its last frame. Call it when the connection opens and
        whenever :meth:`next_wakeup` comes due.

        The rule (two heartbeats without a byte) is
        :class:`~reliable_amqp._core.liveness.LinkWatch`, which the consumer uses too.
        """
        return self._link.check(received, now)

    # --- closing --------------------------------------------------------------------------------

    def begin_close(self) -> None:
        """``close()`` was called: no more recovery."""
        self.stopping = True
        if self.state.state not in (State.CLOSING, State.CLOSED):
            self.state.transition(State.CLOSING)

    def shutdown(self) -> list[E]:
        """The end (closing begins if it had not): fail what is left, with the fatal error as
        cause when the publisher gave up."""
        self.begin_close()
        resolved = self.engine.close_all(self._end_reason())
        if self.fatal is not None:
            for r in resolved:
                if isinstance(r.outcome, PublishError):
                    r.outcome.__cause__ = self.fatal  # AuthenticationFailed, RecoveryFailed, ...
        return resolved

    def closed(self) -> None:
        """The connection is torn down: report it (once)."""
        if self.state.state is not State.CLOSED:
            self.begin_close()
            self.state.transition(State.CLOSED)
            self.events.emit(EventKind.CLOSED, self._end_reason())

    def _end_reason(self) -> str:
        return str(self.fatal) if self.fatal is not None else "publisher closed"
