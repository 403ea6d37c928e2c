"""What a publisher its user forgot to close reports, in one place for both publishers.

A script that ends without ``close()``, a publisher dropped by the garbage collector, an event
loop that stops under an ``AsyncPublisher``: none of them may lose messages without a word.
Whatever is still unconfirmed then is reported once, as Python reports an unclosed file (a
``ResourceWarning``, shown under ``-X dev`` or ``-W default``) and as one WARNING on the
``reliable_amqp`` logger (which Python prints to stderr even when logging is not configured),
naming the count and what to call instead.
"""

from __future__ import annotations

import logging
import warnings

log = logging.getLogger("reliable_amqp")


def report_unclosed(what: str, count: int, fate: str, spool: str | None, fix: str) -> None:
    """Report a publisher that was not closed: ``what`` happened to it, ``count`` messages were
    not confirmed then, ``fate`` says what became of them without a spool, ``fix`` what to call.

    With no message left, only the ResourceWarning (the user still forgot to close it).
    """
    if count and spool is not None:
        fate = f"they stay in the spool {spool} and the next publisher opened on it sends them"
    text = f"reliable-amqp: {what}" + (
        f", with {count} message{'s' if count != 1 else ''} not confirmed: {fate}. {fix}"
        if count
        else f". {fix}"
    )
    warnings.warn(text, ResourceWarning, stacklevel=2)
    if count:
        log.warning("%s", text)
