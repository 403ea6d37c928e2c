"""The peer's side of one client connection: framing, the handshake, channels, publishes.

Runs on a thread of its own; :class:`~fake.peer.FakeBroker` holds the shared state and the lock
every method here is called under.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pamqp import commands as spec
from pamqp import frame as pframe
from pamqp.body import ContentBody
from pamqp.header import ContentHeader, ProtocolHeader
from pamqp.heartbeat import Heartbeat

from fake.records import ACK, HOLD, NACK, RETURN, Declaration, Message, SentConfirm

if TYPE_CHECKING:
    from fake.peer import FakeBroker

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"
FRAME_END = 0xCE
_HEADER = struct.Struct(">BHI")
_FRAME_METHOD, _FRAME_HEADER, _FRAME_BODY, _FRAME_HEARTBEAT = 1, 2, 3, 8
TICK = 0.05  # how often a connection thread looks up from its socket (heartbeats, stalls)
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
        self.sock.settimeout(TICK)
        try:
            while not self.closed:
                if self.stalled:
                    # Neither read nor answer: the client sees a silent link.
                    self.broker._stop.wait(TICK)
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
                        server_properties=self.broker.server_properties,
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
            if broker.take_login_drop():
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self._end("login dropped by the test")  # SO_LINGER 0: a reset
                return
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
