"""Where ``reliable_amqp.spark`` logs: one line per event, whatever the application configured.

Spark's Python workers configure no logging, so the sink can print to stderr on its own
(``RELIABLE_AMQP_SPARK_LOG``, and the data source's driver-side ``commit``/``abort``). The
application may configure logging too (``logging.basicConfig`` on the driver, before or after
the import): a record must then print once, not once through the sink's handler and again
through the application's. The sink's handler therefore prints a record only when no handler
of the application would: the logger keeps propagating, and the application's handlers keep
receiving everything.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("reliable_amqp.spark")

#: Set to a level name (``INFO``) to log this package to stderr in every process that imports it:
#: the driver, the executors' Python workers, and the worker where a data source's ``commit``
#: runs. Spark's Python workers configure no logging of their own.
LOG_ENV = "RELIABLE_AMQP_SPARK_LOG"
_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def handled_elsewhere(logger: logging.Logger, record: logging.LogRecord) -> bool:
    """Whether a handler other than the sink's own prints ``record`` logged on ``logger``: one
    on the logger or, following propagation as :meth:`logging.Logger.callHandlers` does, on an
    ancestor, at a level that lets the record through."""
    current: logging.Logger | None = logger
    while current is not None:
        for handler in current.handlers:
            if not isinstance(handler, SinkStderrHandler) and record.levelno >= handler.level:
                return True
        if not current.propagate:
            return False
        current = current.parent
    return False


class SinkStderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """stderr, for records that no other handler prints (see the module's docstring)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter(_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        """Print ``record`` unless the application's logging prints it already."""
        source = logging.getLogger(record.name)
        if handled_elsewhere(source, record):
            return
        super().emit(record)


def _own_handler() -> SinkStderrHandler | None:
    for handler in log.handlers:
        if isinstance(handler, SinkStderrHandler):
            return handler
    return None


def log_from_env() -> None:
    """Log to stderr at the level ``RELIABLE_AMQP_SPARK_LOG`` names (INFO if unknown)."""
    level = os.environ.get(LOG_ENV, "").strip().upper()
    if not level or _own_handler() is not None:
        return
    log.addHandler(SinkStderrHandler())
    known = isinstance(logging.getLevelName(level), int)
    log.setLevel(level if known else "INFO")


def driver_log() -> logging.Logger:
    """The logger, printing to stderr at INFO when nothing else would: ``commit`` and
    ``abort`` run in a Python worker Spark starts on the driver, where nobody configures
    logging, and their totals should show by default. Where logging is configured already, or
    ``RELIABLE_AMQP_SPARK_LOG`` set it up, the logger is left as it is."""
    if _own_handler() is None and not log.handlers and not logging.getLogger().handlers:
        log.addHandler(SinkStderrHandler())
        if log.level == logging.NOTSET:
            log.setLevel(logging.INFO)
    return log
