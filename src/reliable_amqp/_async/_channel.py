"""The async publisher's confirm channel; it lives in :mod:`reliable_amqp._compat.aiormq`.

Everything here hooks aiormq internals, so it moved to the compat package, where each hook is
probed at import. These names stay importable from here for the modules that use them.
"""

from __future__ import annotations

from reliable_amqp._compat.aiormq import (
    ConfirmChannel,
    FrameSink,
    close_reason,
    frame_max,
    open_confirm_channel,
    translate_connection_error,
    wait_writable,
    write_payload,
)

__all__ = [
    "ConfirmChannel",
    "FrameSink",
    "close_reason",
    "frame_max",
    "open_confirm_channel",
    "translate_connection_error",
    "wait_writable",
    "write_payload",
]
