"""Whether Spark is done with the running task: its Python worker's connection has hung up.

A PySpark Python worker cannot ask its executor whether the task was killed (the JVM's
``TaskContext.isInterrupted`` has no counterpart in Python), and the worker keeps reading the
rows already buffered in its socket after the kill. What it can see is the executor closing
that connection, which Spark does when it gives up on the task: from then on nobody reads what
the task produces, so the sink stops handing rows to the publisher (what is in flight stays
bounded by the publisher's window) instead of publishing the rest of a dead partition until
the executor kills the process.

The connection is the ``infile`` that ``pyspark.worker.main`` reads the task from; it is found
once per task by walking up the calling frames (no public API names it). Outside a Spark
worker (a sink called directly, or a PySpark that names it differently) nothing is found and
the task is never seen as interrupted: the sink then behaves as before.
"""

from __future__ import annotations

import select
import sys
from types import FrameType

from reliable_amqp import ReliableAmqpError

_HUNG_UP = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)


class TaskInterrupted(ReliableAmqpError):
    """Spark gave up on the task (cancelled, killed, or its query stopped) while it was
    publishing: it stopped handing rows to the publisher. Spark ignores what a killed task
    raises; the rows handed over before are in flight, bounded by ``max_in_flight``."""

    retriable = True

    def __init__(self, partition: int, handed: int) -> None:
        super().__init__(
            f"partition {partition}: Spark ended the task; stopped after handing {handed} rows "
            "to the publisher"
        )
        self.partition = partition
        self.handed = handed


def _executor_fd(frame: FrameType | None) -> int | None:
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("pyspark."):
            infile = frame.f_locals.get("infile")
            fileno = getattr(infile, "fileno", None)
            if fileno is not None:
                try:
                    fd = fileno()
                except (OSError, ValueError):
                    return None
                return fd if isinstance(fd, int) and fd >= 0 else None
        frame = frame.f_back
    return None


class TaskLink:
    """The running task's connection to its executor, polled without blocking."""

    __slots__ = ("_poll",)

    def __init__(self) -> None:
        self._poll: select.poll | None = None
        fd = _executor_fd(sys._getframe(1))
        if fd is not None and hasattr(select, "poll"):
            poll = select.poll()
            poll.register(fd, _HUNG_UP)
            self._poll = poll

    @property
    def watched(self) -> bool:
        """Whether a connection was found (inside a Spark Python worker)."""
        return self._poll is not None

    def ended(self) -> bool:
        """True once the executor has closed the connection (one ``poll`` system call)."""
        return self._poll is not None and bool(self._poll.poll(0))
