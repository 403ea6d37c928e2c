"""A scripted, in-process AMQP 0-9-1 peer: the broker side of a real socket, driven by a test.

:class:`FakeBroker` listens on 127.0.0.1 (a free port) and serves every connection on a thread of
its own, so that the real client libraries (pika's ``SelectConnection``, aiormq) run unchanged
against it. Frames are marshalled and unmarshalled with ``pamqp``; framing itself (the 7-octet
header, the size, the frame-end octet) is checked here, as a broker checks it.

What it speaks (AMQP 0-9-1 as RabbitMQ does):

- the protocol header; ``connection.start``/``start-ok`` (PLAIN; a wrong user or password is
  refused with ``connection.close`` 403 ACCESS_REFUSED, an unknown vhost with 530 NOT_ALLOWED on
  ``connection.open``); ``tune``/``tune-ok`` (``frame_max``, ``heartbeat``); ``open``/``open-ok``;
- ``channel.open``, ``confirm.select`` (delivery tags per channel, from 1), ``channel.close`` and
  ``close-ok`` both ways (a peer-closed channel discards frames until the client's close-ok);
- ``exchange.declare``, ``queue.declare``, ``queue.bind`` (ok, or the error configured for a
  name), ``basic.qos``;
- ``basic.publish`` + content header + body frames, reassembled into :class:`Message` records;
  publishing to an exchange that was never declared closes the channel with 404 NOT_FOUND;
- heartbeats (sent every ``heartbeat / 2`` seconds of outbound silence);
- ``connection.blocked``/``unblocked`` (only to clients that advertise the capability);
- ``connection.close``/``close-ok`` both ways.

What becomes of each publish is decided by :attr:`FakeBroker.policy` (a callback that returns
:data:`ACK`, :data:`NACK`, :data:`RETURN` or :data:`HOLD`), or by the automatic mode (ack at once,
optionally coalesced into ``multiple=True`` acks as LavinMQ does), or later by the test script
(:meth:`FakeBroker.ack`, :meth:`FakeBroker.nack`, :meth:`FakeBroker.return_`, ...).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from pamqp import commands as spec
from pamqp import frame as pframe
from pamqp.body import ContentBody
from pamqp.header import ContentHeader, ProtocolHeader
from pamqp.heartbeat import Heartbeat

#: what the policy may decide for a publish
ACK = "ack"
NACK = "nack"
RETURN = "return"
HOLD = None

Action = str | None
Policy = Callable[["Message"], Action]

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"
FRAME_END = 0xCE
_HEADER = struct.Struct(">BHI")
_FRAME_METHOD, _FRAME_HEADER, _FRAME_BODY, _FRAME_HEARTBEAT = 1, 2, 3, 8
_TICK = 0.05  # how often a connection thread looks up from its socket (heartbeats, stalls)
_CLOSE_OK_WAIT = 2.0  # how long a peer-initiated connection.close waits for close-ok

DEFAULT_EXCHANGES = frozenset(
    {"", "amq.direct", "amq.fanout", "amq.topic", "amq.headers", "amq.match"}
)

SERVER_PROPERTIES: dict[str, Any] = {
    "product": "FakeBroker",
    "version": "0.0.1",
    "platform": "Python",
    "capabilities": {
        "publisher_confirms": True,
        "exchange_exchange_bindings": True,
        "basic.nack": True,
        "consumer_cancel_notify": True,
        "connection.blocked": True,
        "authentication_failure_close": True,
        "per_consumer_qos": True,
        "direct_reply_to": True,
    },
}


class ProtocolViolation(Exception):
    """The client broke the protocol; the connection is closed with this code."""

    def __init__(self, code: int, text: str) -> None:
        super().__init__(f"{code} {text}")
        self.code = code
        self.text = text


@dataclass
class Message:
    """One ``basic.publish`` as the peer received it (method, header and body reassembled)."""

    #: 1-based index of the connection it came on (see :attr:`FakeBroker.connections`)
    connection: int
    #: channel number
    channel: int
    #: which channel opening on this peer it came on (1-based over all connections; a reused
    #: channel number gets a new serial)
    channel_serial: int
    #: delivery tag in confirm mode (per channel, from 1), None outside confirm mode
    tag: int | None
    exchange: str
    routing_key: str
    mandatory: bool
    properties: spec.Basic.Properties
    body: bytes
    #: True when the connection was blocked (``connection.blocked`` sent) as it arrived
    while_blocked: bool = False
    #: what was done with it: "ack", "nack", "return", "rejected" (closed the channel), or None
    outcome: str | None = None

    @property
    def headers(self) -> dict[str, Any]:
        """The message's header table ({} when it has none)."""
        return dict(self.properties.headers or {})

    @property
    def message_id(self) -> str | None:
        """The ``message_id`` property."""
        return self.properties.message_id


@dataclass
class Declaration:
    """A topology method the peer received (``exchange.declare``, ``queue.bind``, ...)."""

    connection: int
    method: str
    #: exchange or queue name (for a bind: the queue)
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass
class SentConfirm:
    """A ``basic.ack`` or ``basic.nack`` the peer sent."""

    connection: int
    channel: int
    ack: bool
    tag: int
    multiple: bool


@dataclass
class _Channel:
    number: int
    serial: int
    confirm: bool = False
    next_tag: int = 1
    #: unconfirmed messages by delivery tag, in tag order
    pending: dict[int, Message] = field(default_factory=dict)
    #: the peer sent channel.close and waits for close-ok (frames on it are discarded)
    closing: bool = False
    #: a publish being reassembled: [method, header or None, body parts, bytes so far]
    partial: list[Any] | None = None


class FakeConnection:
    """The peer's side of one client connection (its own thread; a test rarely needs it)."""

    def __init__(self, broker: FakeBroker, sock: socket.socket, index: int) -> None:
        self.broker = broker
        self.index = index
        self.sock = sock
        self.client_properties: dict[str, Any] = {}
        self.user: str | None = None
        self.vhost: str | None = None
        #: negotiated in tune-ok
        self.frame_max = broker.frame_max
        self.heartbeat = 0
        self.channels: dict[int, _Channel] = {}
        #: channel numbers in the order they were opened
        self.opened_channels: list[int] = []
        self.open = False  # connection.open-ok sent
        self.closed = False
        self.stalled = False
        self.blocked = False
        #: heartbeat frames the client sent
        self.heartbeats_received = 0
        #: why the socket ended (for debugging a test)
        self.ended: str | None = None
        self._state = "protocol-header"
        self._closing_since: float | None = None
        self._last_sent = time.monotonic()
        self._coalesced: dict[int, int] = {}
        self._thread = threading.Thread(
            target=self._run, name=f"fake-amqp-conn-{index}", daemon=True
        )

    def __repr__(self) -> str:
        return f"<FakeConnection #{self.index} {self._state} channels={sorted(self.channels)}>"

    @property
    def blocked_capable(self) -> bool:
        """The client advertised the ``connection.blocked`` capability."""
        caps = self.client_properties.get("capabilities") or {}
        return bool(caps.get("connection.blocked"))

    @property
    def publishing_channel(self) -> int:
        """The most recently opened channel in confirm mode that is still open."""
        for number in reversed(self.opened_channels):
            ch = self.channels.get(number)
            if ch is not None and ch.confirm and not ch.closing:
                return number
        raise LookupError(f"connection #{self.index} has no open confirm-mode channel")

    # --- writing (callers hold the broker's lock) --------------------------------------------

    def send(self, channel: int, *values: Any) -> None:
        """Write frames on ``channel`` (nothing while stalled or after the socket ended)."""
        if self.closed or self.stalled:
            return
        data = b"".join(pframe.marshal(v, channel) for v in values)
        try:
            self.sock.sendall(data)
        except OSError as exc:
            self._end(f"send failed: {exc!r}")
            return
        self._last_sent = time.monotonic()

    def send_content(self, channel: int, method: Any, message: Message) -> None:
        """A content-bearing method (basic.return) with the message's header and body frames."""
        header = ContentHeader(0, len(message.body), message.properties)
        chunk = (self.frame_max or 131072) - 8
        bodies = [
            ContentBody(message.body[i : i + chunk]) for i in range(0, len(message.body), chunk)
        ]
        self.send(channel, method, header, *bodies)

    def confirm(self, channel: int, ack: bool, tag: int, multiple: bool = False) -> None:
        """Send ``basic.ack``/``basic.nack`` and settle the pending messages it covers."""
        ch = self._confirm_channel(channel)
        if multiple:
            covered = [t for t in ch.pending if t <= tag]
        else:
            if tag not in ch.pending:
                raise ValueError(f"tag {tag} is not pending on channel {channel} of #{self.index}")
            covered = [tag]
        for t in covered:
            message = ch.pending.pop(t)
            if message.outcome is None:
                message.outcome = ACK if ack else NACK
        if ack:
            self.send(channel, spec.Basic.Ack(delivery_tag=tag, multiple=multiple))
        else:
            self.send(channel, spec.Basic.Nack(delivery_tag=tag, multiple=multiple, requeue=False))
        self.broker.confirms.append(SentConfirm(self.index, channel, ack, tag, multiple))
        self.broker._changed.notify_all()

    def return_message(
        self, channel: int, tag: int, reply_code: int = 312, reply_text: str = "NO_ROUTE"
    ) -> None:
        """``basic.return`` of the pending message ``tag`` (its properties and body), then the
        ack, as RabbitMQ does for an unroutable mandatory message."""
        ch = self._confirm_channel(channel)
        message = ch.pending.get(tag)
        if message is None:
            raise ValueError(f"tag {tag} is not pending on channel {channel} of #{self.index}")
        method = spec.Basic.Return(
            reply_code=reply_code,
            reply_text=reply_text,
            exchange=message.exchange,
            routing_key=message.routing_key,
        )
        self.send_content(channel, method, message)
        message.outcome = RETURN
        self.confirm(channel, True, tag)

    def close_channel(
        self, channel: int, code: int, text: str, class_id: int = 60, method_id: int = 40
    ) -> None:
        """Close ``channel`` from the peer's side; frames on it are discarded until close-ok."""
        ch = self.channels.get(channel)
        if ch is None or ch.closing:
            raise LookupError(f"channel {channel} of #{self.index} is not open")
        ch.closing = True
        ch.partial = None
        self.send(
            channel,
            spec.Channel.Close(
                reply_code=code, reply_text=text, class_id=class_id, method_id=method_id
            ),
        )
        self.broker._changed.notify_all()

    def close(self, code: int, text: str, class_id: int = 0, method_id: int = 0) -> None:
        """Send ``connection.close``; the socket ends on close-ok (or after a grace period)."""
        if self.closed or self._state == "closing":
            return
        self._state = "closing"
        self._closing_since = time.monotonic()
        self.send(
            0,
            spec.Connection.Close(
                reply_code=code, reply_text=text, class_id=class_id, method_id=method_id
            ),
        )

    def drop(self) -> None:
        """Cut the socket without a close handshake."""
        self._end("dropped by the test")

    def _end(self, why: str) -> None:
        if self.closed:
            return
        self.closed = True
        self.ended = why
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()
        self.broker._changed.notify_all()

    def _confirm_channel(self, channel: int) -> _Channel:
        ch = self.channels.get(channel)
        if ch is None or not ch.confirm:
            raise LookupError(f"channel {channel} of #{self.index} is not in confirm mode")
        return ch

    # --- the connection thread ---------------------------------------------------------------

    def start(self) -> None:
        """Serve the connection on its own thread."""
        self._thread.start()

    def join(self, timeout: float) -> None:
        """Wait for the connection thread to end."""
        self._thread.join(timeout)

    def _run(self) -> None:
        lock = self.broker._lock
        buffer = bytearray()
        self.sock.settimeout(_TICK)
        try:
            while not self.closed:
                if self.stalled:
                    # Neither read nor answer: the client sees a silent link.
                    self.broker._stop.wait(_TICK)
                    if self.broker._stop.is_set():
                        break
                    continue
                try:
                    data = self.sock.recv(65536)
                except TimeoutError:
                    data = None
                except OSError as exc:
                    with lock:
                        self._end(f"recv failed: {exc!r}")
                    break
                with lock:
                    if self.closed or self.stalled:
                        continue
                    if data == b"":
                        self._end("client closed the socket")
                        break
                    if data:
                        buffer += data
                        try:
                            self._consume(buffer)
                        except ProtocolViolation as exc:
                            buffer.clear()
                            self.close(exc.code, exc.text)
                        except Exception as exc:  # a bug in the fake: fail loudly, not silently
                            self.broker.errors.append(exc)
                            buffer.clear()
                            self.close(541, f"INTERNAL_ERROR - fake peer: {exc!r}")
                    self._flush_coalesced()
                    self._housekeeping()
        finally:
            with lock:
                self._end(self.ended or "connection thread ended")

    def _housekeeping(self) -> None:
        now = time.monotonic()
        if self._state == "closing" and self._closing_since is not None:
            if now - self._closing_since > _CLOSE_OK_WAIT:
                self._end("no connection.close-ok from the client")
            return
        if self.heartbeat and now - self._last_sent >= self.heartbeat / 2:
            self.send(0, Heartbeat())

    def _consume(self, buffer: bytearray) -> None:
        while buffer and not self.closed:
            if self._state == "protocol-header":
                if len(buffer) < 8:
                    return
                if bytes(buffer[:8]) != PROTOCOL_HEADER:
                    # The spec: answer with the header we support, then close.
                    with contextlib.suppress(OSError):
                        self.sock.sendall(ProtocolHeader().marshal())
                    self._end(f"bad protocol header {bytes(buffer[:8])!r}")
                    return
                del buffer[:8]
                self._state = "start-ok"
                self.send(
                    0,
                    spec.Connection.Start(
                        version_major=0,
                        version_minor=9,
                        server_properties=SERVER_PROPERTIES,
                        mechanisms="PLAIN AMQPLAIN",
                        locales="en_US",
                    ),
                )
                continue
            if len(buffer) < _HEADER.size:
                return
            frame_type, channel, size = _HEADER.unpack_from(buffer)
            end = _HEADER.size + size
            if len(buffer) < end + 1:
                return
            if buffer[end] != FRAME_END:
                raise ProtocolViolation(501, f"FRAME_ERROR - bad frame end octet {buffer[end]:#x}")
            if self.frame_max and end + 1 > self.frame_max and self._state == "open":
                raise ProtocolViolation(
                    501, f"FRAME_ERROR - frame of {end + 1} octets over frame_max {self.frame_max}"
                )
            raw = bytes(buffer[: end + 1])
            del buffer[: end + 1]
            if frame_type not in (_FRAME_METHOD, _FRAME_HEADER, _FRAME_BODY, _FRAME_HEARTBEAT):
                raise ProtocolViolation(501, f"FRAME_ERROR - unknown frame type {frame_type}")
            try:
                _, _, value = pframe.unmarshal(raw)
            except Exception as exc:
                raise ProtocolViolation(502, f"SYNTAX_ERROR - {exc}") from exc
            self._dispatch(channel, value)

    def _dispatch(self, channel: int, value: Any) -> None:
        broker = self.broker
        broker.frames_received += 1
        if isinstance(value, Heartbeat):
            if channel != 0:
                raise ProtocolViolation(501, "FRAME_ERROR - heartbeat on a non-zero channel")
            self.heartbeats_received += 1
            broker._changed.notify_all()
            return
        if self._state == "closing":
            # After connection.close, only close/close-ok count.
            if isinstance(value, (spec.Connection.CloseOk, spec.Connection.Close)):
                if isinstance(value, spec.Connection.Close):
                    self.send(0, spec.Connection.CloseOk())
                self._end("closed by the peer")
            return
        if channel == 0:
            self._connection_method(value)
            return
        if not self.open:
            raise ProtocolViolation(504, f"CHANNEL_ERROR - frame on channel {channel} before open")
        ch = self.channels.get(channel)
        if isinstance(value, spec.Channel.Open):
            if ch is not None:
                raise ProtocolViolation(504, f"CHANNEL_ERROR - channel {channel} already open")
            broker.channel_opens += 1
            self.channels[channel] = _Channel(channel, broker.channel_opens)
            self.opened_channels.append(channel)
            self.send(channel, spec.Channel.OpenOk())
            broker._changed.notify_all()
            return
        if ch is None:
            raise ProtocolViolation(504, f"CHANNEL_ERROR - expected channel.open on {channel}")
        if ch.closing:
            if isinstance(value, spec.Channel.CloseOk):
                del self.channels[channel]
                broker._changed.notify_all()
            elif isinstance(value, spec.Channel.Close):
                self.send(channel, spec.Channel.CloseOk())
            elif isinstance(value, spec.Basic.Publish):
                broker.discarded.append((self.index, ch.serial))
            return  # everything else on a closing channel is discarded (spec 4.2.2)
        if ch.partial is not None:
            self._content(ch, value)
            return
        self._channel_method(ch, value)

    def _connection_method(self, value: Any) -> None:
        broker = self.broker
        if isinstance(value, spec.Connection.StartOk) and self._state == "start-ok":
            self.client_properties = dict(value.client_properties or {})
            user, password = _plain_credentials(value.mechanism, value.response)
            self.user = user
            if broker.users.get(user) != password:
                broker.auth_refusals += 1
                self.close(
                    403,
                    "ACCESS_REFUSED - Login was refused using authentication mechanism "
                    f"{value.mechanism}. For details see the broker logfile.",
                )
                return
            self._state = "tune-ok"
            self.send(
                0,
                spec.Connection.Tune(
                    channel_max=2047, frame_max=broker.frame_max, heartbeat=broker.heartbeat
                ),
            )
        elif isinstance(value, spec.Connection.TuneOk) and self._state == "tune-ok":
            self.frame_max = value.frame_max
            self.heartbeat = value.heartbeat
            self._state = "open"
        elif isinstance(value, spec.Connection.Open) and self._state == "open":
            self.vhost = value.virtual_host
            if value.virtual_host not in broker.vhosts:
                self.close(530, f"NOT_ALLOWED - vhost {value.virtual_host} not found", 10, 40)
                return
            self.open = True
            self.send(0, spec.Connection.OpenOk())
            if broker.blocked_reason is not None and self.blocked_capable:
                self.blocked = True
                self.send(0, spec.Connection.Blocked(reason=broker.blocked_reason))
            broker._changed.notify_all()
        elif isinstance(value, spec.Connection.Close):
            self.send(0, spec.Connection.CloseOk())
            self._end("closed by the client")
        else:
            raise ProtocolViolation(
                503, f"COMMAND_INVALID - unexpected {value.name} in state {self._state}"
            )

    def _channel_method(self, ch: _Channel, value: Any) -> None:
        broker = self.broker
        number = ch.number
        if isinstance(value, spec.Basic.Publish):
            ch.partial = [value, None, [], 0]
        elif isinstance(value, spec.Confirm.Select):
            ch.confirm = True
            if not value.nowait:
                self.send(number, spec.Confirm.SelectOk())
            broker._changed.notify_all()
        elif isinstance(value, spec.Channel.Close):
            self.send(number, spec.Channel.CloseOk())
            del self.channels[number]
            broker._changed.notify_all()
        elif isinstance(value, spec.Exchange.Declare):
            if value.exchange not in broker.declare_errors:
                broker.exchanges.add(value.exchange)
            self._declare(ch, value, value.exchange, spec.Exchange.DeclareOk())
        elif isinstance(value, spec.Queue.Declare):
            name = value.queue or f"amq.gen-{self.index}-{len(broker.declarations)}"
            self._declare(
                ch, value, name, spec.Queue.DeclareOk(queue=name, message_count=0, consumer_count=0)
            )
        elif isinstance(value, (spec.Queue.Bind, spec.Exchange.Bind)):
            target = value.exchange if isinstance(value, spec.Queue.Bind) else value.source
            reply = (
                spec.Queue.BindOk()
                if isinstance(value, spec.Queue.Bind)
                else spec.Exchange.BindOk()
            )
            if target not in broker.exchanges and target not in broker.declare_errors:
                text = f"NOT_FOUND - no exchange '{target}' in vhost '{self.vhost}'"
                broker.declarations.append(
                    Declaration(self.index, value.name, _declared_name(value), _args(value))
                )
                self.close_channel(number, 404, text, *_ids(value))
                return
            self._declare(ch, value, _declared_name(value), reply)
        elif isinstance(value, spec.Basic.Qos):
            self.send(number, spec.Basic.QosOk())
        elif isinstance(value, spec.Channel.Flow):
            self.send(number, spec.Channel.FlowOk(active=value.active))
        else:
            raise ProtocolViolation(540, f"NOT_IMPLEMENTED - {value.name} in the fake peer")

    def _declare(self, ch: _Channel, value: Any, name: str, reply: Any) -> None:
        broker = self.broker
        broker.declarations.append(Declaration(self.index, value.name, name, _args(value)))
        broker._changed.notify_all()
        error = broker.declare_errors.get(name)
        if error is not None:
            self.close_channel(ch.number, error[0], error[1], *_ids(value))
            return
        if not getattr(value, "nowait", False):
            self.send(ch.number, reply)

    def _content(self, ch: _Channel, value: Any) -> None:
        partial = ch.partial
        assert partial is not None
        if partial[1] is None:
            if not isinstance(value, ContentHeader):
                raise ProtocolViolation(505, f"UNEXPECTED_FRAME - {value.name} instead of a header")
            partial[1] = value
        elif isinstance(value, ContentBody):
            partial[2].append(value.value)
            partial[3] += len(value.value)
        else:
            raise ProtocolViolation(505, f"UNEXPECTED_FRAME - {value.name} inside a content body")
        header: ContentHeader = partial[1]
        if partial[3] > header.body_size:
            raise ProtocolViolation(501, "FRAME_ERROR - body longer than the content header says")
        if partial[3] == header.body_size:
            ch.partial = None
            self._published(ch, partial[0], header, b"".join(partial[2]))

    def _published(
        self, ch: _Channel, method: spec.Basic.Publish, header: ContentHeader, body: bytes
    ) -> None:
        broker = self.broker
        tag = None
        if ch.confirm:
            tag = ch.next_tag
            ch.next_tag += 1
        message = Message(
            connection=self.index,
            channel=ch.number,
            channel_serial=ch.serial,
            tag=tag,
            exchange=method.exchange or "",
            routing_key=method.routing_key or "",
            mandatory=bool(method.mandatory),
            properties=header.properties,
            body=body,
            while_blocked=self.blocked,
        )
        broker.messages.append(message)
        broker._changed.notify_all()
        if message.exchange not in broker.exchanges:
            # RabbitMQ closes the channel; the message gets no confirm.
            message.outcome = "rejected"
            text = f"NOT_FOUND - no exchange '{message.exchange}' in vhost '{self.vhost}'"
            self.close_channel(ch.number, 404, text, 60, 40)
            return
        if tag is None:
            return
        ch.pending[tag] = message
        action = broker._decide(message)
        if action == ACK:
            if broker.coalesce:
                self._coalesced[ch.number] = tag
            else:
                self.confirm(ch.number, True, tag)
        elif action == NACK:
            self._flush_coalesced()  # nacks go singly, acks before them stay in order
            self.confirm(ch.number, False, tag)
        elif action == RETURN:
            self._flush_coalesced()
            self.return_message(ch.number, tag)
        elif action is not HOLD:
            raise ValueError(f"unknown policy action {action!r}")

    def _flush_coalesced(self) -> None:
        coalesced, self._coalesced = self._coalesced, {}
        for number, tag in coalesced.items():
            ch = self.channels.get(number)
            if ch is not None and not ch.closing and not self.closed:
                self.confirm(number, True, tag, multiple=True)


class FakeBroker:
    """A scripted AMQP 0-9-1 peer on 127.0.0.1 (see the module docstring).

    Use it as a context manager (``with FakeBroker() as peer:``); every method is thread-safe.
    """

    def __init__(
        self,
        *,
        auto_ack: bool = True,
        coalesce: bool = False,
        policy: Policy | None = None,
        frame_max: int = 131072,
        heartbeat: int = 60,
        users: dict[str, str] | None = None,
        vhosts: Iterable[str] = ("/",),
    ) -> None:
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._stop = threading.Event()
        #: ack every publish at once (when no policy is set)
        self.auto = auto_ack
        #: in automatic mode, ack with multiple=True once per batch of frames read (LavinMQ)
        self.coalesce = coalesce
        #: decides each publish: ACK, NACK, RETURN or HOLD (None); overrides ``auto``
        self.policy = policy
        #: frame_max and heartbeat proposed in connection.tune
        self.frame_max = frame_max
        self.heartbeat = heartbeat
        #: accepted credentials
        self.users = dict(users) if users is not None else {"guest": "guest"}
        self.vhosts = set(vhosts)
        #: exchanges that exist (the default ones and every one declared)
        self.exchanges: set[str] = set(DEFAULT_EXCHANGES)
        #: name -> (reply code, text): declaring (or binding to) that name closes the channel
        self.declare_errors: dict[str, tuple[int, str]] = {}
        #: reason of the current resource alarm (None: not blocked)
        self.blocked_reason: str | None = None
        # records
        self.connections: list[FakeConnection] = []
        self.messages: list[Message] = []
        self.declarations: list[Declaration] = []
        self.confirms: list[SentConfirm] = []
        #: TCP connections accepted (refused ones included)
        self.attempts = 0
        #: TCP connections refused by :meth:`refuse_next`
        self.refused = 0
        #: handshakes refused for wrong credentials
        self.auth_refusals = 0
        self.frames_received = 0
        #: (connection, channel serial) of each basic.publish discarded on a closing channel
        self.discarded: list[tuple[int, int]] = []
        #: channel.open methods received, over all connections
        self.channel_opens = 0
        #: exceptions the peer itself raised while serving (a fixture asserts there are none)
        self.errors: list[BaseException] = []
        self._refuse = 0
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self.port = 0

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> FakeBroker:
        """Listen on a free port of 127.0.0.1 and accept connections on a thread."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        listener.settimeout(_TICK)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept, name="fake-amqp-accept", daemon=True)
        self._acceptor.start()
        return self

    def close(self) -> None:
        """Stop listening and cut every connection."""
        self._stop.set()
        if self._acceptor is not None:
            self._acceptor.join(5)
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            connections = list(self.connections)
            for conn in connections:
                conn._end("peer shut down")
        for conn in connections:
            conn.join(5)

    def __enter__(self) -> FakeBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def url(
        self, user: str = "guest", password: str = "guest", vhost: str = "/", **query: Any
    ) -> str:
        """An ``amqp://`` URL of this peer."""
        url = f"amqp://{user}:{password}@127.0.0.1:{self.port}/{quote(vhost, safe='')}"
        if query:
            url += "?" + "&".join(f"{k}={v}" for k, v in query.items())
        return url

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self.attempts += 1
                if self._refuse > 0:
                    self._refuse -= 1
                    self.refused += 1
                    # A reset, as from a port nobody listens on (SO_LINGER 0).
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    sock.close()
                    self._changed.notify_all()
                    continue
                conn = FakeConnection(self, sock, len(self.connections) + 1)
                self.connections.append(conn)
                self._changed.notify_all()
            conn.start()

    # --- scripting ---------------------------------------------------------------------------

    def _decide(self, message: Message) -> Action:
        if self.policy is not None:
            return self.policy(message)
        return ACK if self.auto else HOLD

    def set_auto(self, enabled: bool = True, *, coalesce: bool | None = None) -> None:
        """Switch the automatic mode; switching it on also acks everything held on open
        channels (so no publish can slip between the switch and the sweep)."""
        with self._lock:
            self.auto = enabled
            if coalesce is not None:
                self.coalesce = coalesce
            if enabled:
                self.policy = None
                for conn in self.connections:
                    if conn.closed:
                        continue
                    for ch in list(conn.channels.values()):
                        if ch.confirm and not ch.closing and ch.pending:
                            conn.confirm(ch.number, True, max(ch.pending), multiple=True)

    def set_policy(self, policy: Policy | None) -> None:
        """Decide each new publish with ``policy`` (None: back to the automatic mode)."""
        with self._lock:
            self.policy = policy

    def _conn(self, connection: int | None) -> FakeConnection:
        if connection is not None:
            return self.connections[connection - 1]
        for conn in reversed(self.connections):
            if not conn.closed:
                return conn
        raise LookupError("no live connection")

    def connection(self, index: int | None = None) -> FakeConnection:
        """Connection ``index`` (1-based), or the most recent live one."""
        with self._lock:
            return self._conn(index)

    def ack(
        self,
        tag: int,
        multiple: bool = False,
        *,
        connection: int | None = None,
        channel: int | None = None,
    ) -> None:
        """Send ``basic.ack`` (default: on the latest connection's publishing channel)."""
        with self._lock:
            conn = self._conn(connection)
            conn.confirm(channel or conn.publishing_channel, True, tag, multiple)

    def nack(
        self,
        tag: int,
        multiple: bool = False,
        *,
        connection: int | None = None,
        channel: int | None = None,
    ) -> None:
        """Send ``basic.nack`` (requeue=False)."""
        with self._lock:
            conn = self._conn(connection)
            conn.confirm(channel or conn.publishing_channel, False, tag, multiple)

    def return_(
        self,
        tag: int,
        reply_code: int = 312,
        reply_text: str = "NO_ROUTE",
        *,
        connection: int | None = None,
        channel: int | None = None,
    ) -> None:
        """Send ``basic.return`` of message ``tag`` (with its headers), then its ack."""
        with self._lock:
            conn = self._conn(connection)
            conn.return_message(channel or conn.publishing_channel, tag, reply_code, reply_text)

    def pending(self, *, connection: int | None = None, channel: int | None = None) -> list[int]:
        """Delivery tags received and not yet acked or nacked on a channel."""
        with self._lock:
            conn = self._conn(connection)
            ch = conn.channels.get(channel or conn.publishing_channel)
            return list(ch.pending) if ch is not None else []

    def close_channel(
        self,
        code: int,
        text: str,
        *,
        connection: int | None = None,
        channel: int | None = None,
        class_id: int = 60,
        method_id: int = 40,
    ) -> None:
        """Send ``channel.close`` (default: the publishing channel of the latest connection)."""
        with self._lock:
            conn = self._conn(connection)
            conn.close_channel(channel or conn.publishing_channel, code, text, class_id, method_id)

    def close_connection(self, code: int, text: str, *, connection: int | None = None) -> None:
        """Send ``connection.close`` (e.g. 320 CONNECTION_FORCED)."""
        with self._lock:
            self._conn(connection).close(code, text)

    def drop(self, *, connection: int | None = None) -> None:
        """Cut the socket of a connection (default: the latest live one)."""
        with self._lock:
            self._conn(connection).drop()

    def stall(self) -> None:
        """Live connections stop reading and writing (no answers, no heartbeats); new
        connections are served normally."""
        with self._lock:
            for conn in self.connections:
                conn.stalled = True

    def resume(self) -> None:
        """Stalled connections read and answer again."""
        with self._lock:
            for conn in self.connections:
                conn.stalled = False

    def block(self, reason: str = "low on memory") -> None:
        """``connection.blocked`` to every live connection that advertised the capability (and
        to new ones, right after open-ok, until :meth:`unblock`)."""
        with self._lock:
            self.blocked_reason = reason
            for conn in self.connections:
                if conn.open and not conn.closed and conn.blocked_capable:
                    conn.blocked = True
                    conn.send(0, spec.Connection.Blocked(reason=reason))

    def unblock(self) -> None:
        """``connection.unblocked`` to the blocked connections."""
        with self._lock:
            self.blocked_reason = None
            for conn in self.connections:
                if conn.blocked and not conn.closed:
                    conn.blocked = False
                    conn.send(0, spec.Connection.Unblocked())

    def refuse_next(self, n: int) -> None:
        """Reset the next ``n`` TCP connections right after accepting them."""
        with self._lock:
            self._refuse = n

    # --- waiting and reading records ---------------------------------------------------------

    def wait_until(
        self, predicate: Callable[[], bool], timeout: float = 5.0, what: str = "a condition"
    ) -> None:
        """Wait (on the peer's records) until ``predicate()`` holds; AssertionError on timeout."""
        end = time.monotonic() + timeout
        with self._changed:
            while not predicate():
                remaining = end - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(
                        f"fake broker: timed out after {timeout} s waiting for {what}"
                    )
                self._changed.wait(min(remaining, _TICK))

    def wait_for_messages(self, n: int, timeout: float = 5.0, **match: Any) -> list[Message]:
        """Wait until ``n`` messages (matching ``connection=``, ``exchange=``, ...) arrived."""
        self.wait_until(
            lambda: len(self.received(**match)) >= n, timeout, f"{n} messages matching {match}"
        )
        return self.received(**match)

    def received(self, **match: Any) -> list[Message]:
        """Messages received so far whose attributes equal ``match``."""
        with self._lock:
            return [m for m in self.messages if all(getattr(m, k) == v for k, v in match.items())]

    def live_connections(self) -> list[FakeConnection]:
        """Connections whose socket is still up."""
        with self._lock:
            return [c for c in self.connections if not c.closed]


def _plain_credentials(mechanism: str, response: Any) -> tuple[str, str]:
    raw = response.encode("latin-1") if isinstance(response, str) else bytes(response or b"")
    if mechanism == "PLAIN":
        _, user, password = ([*raw.split(b"\x00"), b"", b""])[:3]
        return user.decode(), password.decode()
    raise ProtocolViolation(504, f"fake peer speaks only PLAIN, not {mechanism}")


def _declared_name(value: Any) -> str:
    return str(getattr(value, "queue", None) or getattr(value, "destination", "") or "")


def _args(value: Any) -> dict[str, Any]:
    names = ("exchange", "exchange_type", "queue", "routing_key", "source", "destination")
    args = {n: getattr(value, n) for n in names if getattr(value, n, None) not in (None, "")}
    for flag in ("durable", "exclusive", "auto_delete", "passive", "internal"):
        if hasattr(value, flag):
            args[flag] = bool(getattr(value, flag))
    if getattr(value, "arguments", None):
        args["arguments"] = dict(value.arguments)
    return args


def _ids(value: Any) -> tuple[int, int]:
    index = getattr(value, "index", 0) or 0
    return index >> 16, index & 0xFFFF
