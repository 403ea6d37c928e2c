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

import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import quote

from pamqp import commands as spec

from fake.connection import DEFAULT_EXCHANGES, SERVER_PROPERTIES, TICK, FakeConnection
from fake.records import ACK, HOLD, Action, Declaration, Message, Policy, SentConfirm


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
        server_properties: dict[str, Any] | None = None,
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
        #: what connection.start says about the broker (``product`` "LavinMQ": a LavinMQ)
        self.server_properties = dict(
            SERVER_PROPERTIES if server_properties is None else server_properties
        )
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
        #: connections cut by :meth:`drop_next_logins` while the client was logging in
        self.dropped_logins = 0
        self._drop_logins = 0
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
        listener.settimeout(TICK)
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

    def drop_next_logins(self, n: int) -> None:
        """Cut the next ``n`` connections (a reset, no connection.close) once the client sent
        its credentials (connection.start-ok): a network failure mid-login, which a client must
        not take for a refusal of its credentials."""
        with self._lock:
            self._drop_logins = n

    def take_login_drop(self) -> bool:
        """True (and counted) when the login being answered is to be cut."""
        with self._lock:
            if self._drop_logins <= 0:
                return False
            self._drop_logins -= 1
            self.dropped_logins += 1
            return True

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
                self._changed.wait(min(remaining, TICK))

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
