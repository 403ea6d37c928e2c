"""Ctrl-C in ``reliable-amqp publish``: obeyed every time, and every message accounted for.

Python raises ``KeyboardInterrupt`` wherever the main thread happens to be. Most places are
fine; a few are not: between ``publish()`` handing a message to the publisher and the command
noting that it did, an interrupt would leave a message sent but counted as never sent (a
duplicate in ``--failed``), or sent and counted nowhere (a failure missing from ``--failed``);
between opening ``--failed`` and publishing, it would leave the file empty while nothing was
sent. In those stretches (:attr:`Interrupts.deferring`) a Ctrl-C is noted and acted on at the
next check (:meth:`Interrupts.check`, after each message), or at once when the main thread is
blocked in one of the publisher's waits (``publish()`` into a full window), where raising is
safe. In case the main thread enters such a wait after the signal was noted and before a check,
the signal is sent to it again shortly (:data:`REDELIVER`) until it is acted on. A second
Ctrl-C is never deferred.

Python itself can drop a Ctrl-C: a ``KeyboardInterrupt`` raised while the main thread runs a
callback that cannot raise (a weakref callback, such as the import system's module-lock
cleanup during a lazy import) is printed as "Exception ignored in ..." and the program goes
on, so the command ran on as if nobody had pressed anything. Inside the block such a dropped
interrupt is delivered again (``sys.unraisablehook``), as the same press, and not printed.

Leaving the block, a Ctrl-C noted and not acted on yet is raised there (``KeyboardInterrupt``
out of the ``with``), and a redelivery is never sent once the handler is gone: sent a moment
later, it met Python's default handler after the command had returned, and the process died of
SIGINT with a traceback instead of exiting 130.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType, TracebackType

from reliable_amqp._sync._handoff import safe_to_interrupt

#: seconds after which a noted Ctrl-C is sent to the main thread again, if not acted on yet
REDELIVER = 0.05


class Interrupts:
    """SIGINT for the duration of a ``with`` block (main thread only; elsewhere, nothing
    changes)."""

    def __init__(self) -> None:
        #: a Ctrl-C was noted and not acted on yet
        self.pending = False
        #: Ctrl-C is noted rather than raised, but where the main thread waits
        self.deferring = False
        #: how many times Ctrl-C was pressed
        self.presses = 0
        self._redelivering = False
        self._previous: object = None
        self._previous_hook: object = None
        self._installed = False
        # held while a redelivery decides and sends, and while the block's exit uninstalls
        self._lock = threading.Lock()

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_signal)
            self._previous_hook = sys.unraisablehook
            sys.unraisablehook = self._on_unraisable
            self._installed = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self._installed:
            return
        interrupted = False
        while True:  # (a press raised in here is noted, and raised once all is restored)
            try:
                with self._lock:  # no redelivery from now on; one already sent has arrived
                    self._installed = False
                # signal.signal() first runs the handler of a signal that has arrived (this
                # one: it raises for a press acted on at once, and notes a deferred one)
                signal.signal(signal.SIGINT, self._previous)  # type: ignore[arg-type]
                break
            except KeyboardInterrupt:
                interrupted = True
        if sys.unraisablehook == self._on_unraisable:  # (nobody replaced it meanwhile)
            sys.unraisablehook = self._previous_hook  # type: ignore[assignment]
        if (interrupted or self.pending) and exc_type is None:
            self.pending = False
            raise KeyboardInterrupt

    def check(self) -> None:
        """Raise ``KeyboardInterrupt`` for a Ctrl-C noted meanwhile."""
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._redelivering:
            self._redelivering = False
            if not self.pending:  # the press was acted on while this one was on its way
                return
        else:
            self.presses += 1
        if not self.deferring or self.presses > 1 or safe_to_interrupt(frame):
            self.pending = False
            raise KeyboardInterrupt
        self._note()

    def _note(self) -> None:
        """A Ctrl-C to act on: pending, and sent to the main thread again shortly if nothing
        acted on it by then."""
        self.pending = True
        timer = threading.Timer(REDELIVER, self._redeliver)
        timer.daemon = True
        timer.start()

    def _on_unraisable(self, unraisable: sys.UnraisableHookArgs) -> None:
        """A Ctrl-C that Python dropped (raised where nothing can raise): the same press again,
        to the main thread; anything else goes to the hook there was before."""
        if isinstance(unraisable.exc_value, KeyboardInterrupt) and self._installed:
            # sent again from another thread once this hook has returned (sent from here, the
            # handler would raise in the hook, and Python would drop it again)
            self._note()
            return
        previous = self._previous_hook
        (previous if callable(previous) else sys.__unraisablehook__)(unraisable)

    def _redeliver(self) -> None:
        with self._lock:
            if self.pending and self._installed:
                self._redelivering = True
                main = threading.main_thread().ident
                if main is not None:
                    signal.pthread_kill(main, signal.SIGINT)
