"""Keeping pika's, aiormq's and aio-pika's log records about the library's own connections out
of the user's log, without touching those loggers' records for anybody else's connections.

A refused port costs seven pika ERROR records per attempt, tracebacks included, and aiormq adds
one of its own; the publisher reports the same failure itself, once, in its own words (a WARNING
per retry, then the error it raises). Those client libraries log through module loggers that
every other user of them shares, so neither their level nor their handlers may change.

Instead, the code that drives a connection the library owns runs in a context marked by
:data:`OWNED` (the sync publisher's I/O thread, the async publisher's supervisor task and
everything aiormq starts from it: tasks and callbacks copy the context they were made in; and
pika's host name resolver thread for one of the library's I/O loops), and a
:class:`logging.Filter` on those loggers drops a record emitted there, and only there. What it
drops is passed on at DEBUG to the ``reliable_amqp.client`` logger, so ``-vv`` (or a DEBUG
configuration of ``reliable_amqp``) still shows it. A connection the caller lends to an
``AsyncPublisher`` is the caller's: its records are left alone. Code of the caller's that runs
in a marked context (an ``on_event`` hook, a future's done-callback on the sync I/O thread) and
logs through those libraries' loggers itself is taken for the library's: a corner not worth a
per-call context switch.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import weakref

#: set in the context that drives a connection the library owns
OWNED: contextvars.ContextVar[bool] = contextvars.ContextVar("reliable_amqp_owned", default=False)

#: the client libraries whose records about our connections are ours to report
CLIENT_LOGGERS = ("pika", "aiormq", "aio_pika")
#: loggers those libraries create only when they first log (the filter must be on them before)
_LAZY_LOGGERS = ("aiormq.connection.marshall",)

relay = logging.getLogger("reliable_amqp.client")


class OwnedConnectionFilter(logging.Filter):
    """Drops a client library's record emitted while driving a connection the library owns
    (relayed at DEBUG to ``reliable_amqp.client``); passes every other record unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not OWNED.get() and not _owned_resolver():
            return True
        if relay.isEnabledFor(logging.DEBUG):
            try:
                copy = logging.makeLogRecord(record.__dict__)
                copy.name = relay.name
                copy.levelno, copy.levelname = logging.DEBUG, "DEBUG"
                copy.msg = f"{record.name}: {record.getMessage()}"
                copy.args = None
                relay.handle(copy)
            except Exception:  # a filter that raises would raise inside pika's own call
                pass
        return False


FILTER = OwnedConnectionFilter()

#: pika I/O loops of the library's connections: pika resolves a host name on a thread of its
#: own (a ``threading.Timer`` running its ``_AddressResolver``), which no context reaches
_OWNED_LOOPS: weakref.WeakSet[object] = weakref.WeakSet()


def own_loop(loop: object) -> None:
    """``loop`` (a pika I/O loop) drives a connection the library owns."""
    _OWNED_LOOPS.add(loop)


def _owned_resolver() -> bool:
    # pika's private names, read defensively: should they change, records pass as before
    function = getattr(threading.current_thread(), "function", None)  # a threading.Timer's
    loop = getattr(getattr(function, "__self__", None), "_loop", None)
    try:
        return loop is not None and loop in _OWNED_LOOPS
    except TypeError:  # not weak-referenceable: not one of ours
        return False


def install() -> None:
    """Put :data:`FILTER` on every logger of the client libraries (idempotent; cheap enough to
    call whenever a publisher starts, which catches the loggers created since)."""
    for name in _LAZY_LOGGERS:
        logging.getLogger(name)
    for name in CLIENT_LOGGERS:
        logging.getLogger(name)
    # a copy (one C-level call): another thread may create a logger meanwhile
    loggers = dict(logging.Logger.manager.loggerDict)
    for name, logger in loggers.items():
        if (
            isinstance(logger, logging.Logger)
            and name.partition(".")[0] in CLIENT_LOGGERS
            and FILTER not in logger.filters
        ):
            logger.addFilter(FILTER)


def own_context() -> None:
    """Mark the current context (a thread's, a task's) as driving an owned connection."""
    install()
    OWNED.set(True)


# --- failures nobody asked about ----------------------------------------------------------------

#: the library's own logger (what it reports in its own words)
library = logging.getLogger("reliable_amqp")


def unretrieved_text(error: BaseException) -> str:
    """What is said of a failed future nobody retrieved the exception of: asyncio's words for
    an ``AsyncPublisher``'s future ("Future exception was never retrieved"), so a
    ``Publisher``'s says the same."""
    return f"Future exception was never retrieved\nfuture: <Future finished exception={error!r}>"


def report_unretrieved(error: BaseException) -> None:
    """One WARNING for a sync publisher's failed future collected with its exception never
    retrieved (see docs/observability.md). Runs in a finalizer: it never raises."""
    with contextlib.suppress(Exception):  # logging torn down at interpreter exit
        library.warning(
            "%s", unretrieved_text(error), exc_info=(type(error), error, error.__traceback__)
        )


def report_spool_failed(error: BaseException, message_id: str) -> str:
    """One WARNING for a message recovered from the spool (no caller holds a future for it)
    that failed for good and went to the spool's failed table; returns the text (the detail of
    the ``SPOOL_FAILED`` event)."""
    text = f"recovered message {message_id!r} moved to the spool's failed table: {error}"
    library.warning("reliable-amqp: %s", text)
    return text


def report_interrupted(name: str, count: int, spool: str | None) -> None:
    """One WARNING when Ctrl-C cut a sync publisher's close short (its ``close()`` was
    interrupted, or its ``with`` block ended by ``KeyboardInterrupt``) with ``count`` messages
    not confirmed: nobody gets those failures as exceptions (the interrupt goes on instead)."""
    if not count:
        return
    fate = (
        f"they stay in the spool {spool} and the next publisher opened on it sends them"
        if spool is not None
        else "they failed with PublisherClosed"
    )
    noun = "message" if count == 1 else "messages"
    library.warning(
        "reliable-amqp: %s was closed by Ctrl-C (KeyboardInterrupt) with %d %s not confirmed: %s",
        name,
        count,
        noun,
        fate,
    )
