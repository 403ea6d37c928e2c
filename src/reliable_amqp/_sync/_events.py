"""An event a signal handler may set.

Python runs a signal handler on the main thread, between two bytecodes of whatever that thread
was doing. :class:`threading.Event` guards its flag with a plain (non-reentrant) lock, held
inside ``wait()``, ``clear()`` and ``set()``: a handler that interrupts the main thread there
and sets the same event (``relay.stop()`` from SIGTERM, ``Consumer.stop()`` from Ctrl-C) waits
for its own thread forever. A relay once hung so on SIGTERM in the test suite.
"""

from __future__ import annotations

import threading


class SignalSafeEvent(threading.Event):
    """A :class:`threading.Event` whose lock is reentrant: ``set()`` from a signal handler that
    interrupted this event's ``wait()``, ``clear()`` or ``set()`` on the same thread goes
    through (a waiter on another thread is woken as usual)."""

    def __init__(self) -> None:
        super().__init__()
        self._cond = threading.Condition(threading.RLock())
