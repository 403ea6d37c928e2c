"""A broker's refusal of a consumer's set-up, turned into an error that names the remedy.

RabbitMQ answers a missing queue with 404, a queue another connection declared exclusive with
405, and a missing permission with 403 "access to queue 'q' in vhost '/' refused for user 'u'",
which says neither which permission nor that ``queue.declare`` needs *configure* even on a queue
that exists. These functions name the permission (read, write, configure), the object and the
command that grants it. No I/O: the adapters pass what they know.
"""

from __future__ import annotations

from reliable_amqp._core.errors import AccessRefused, BrokerError, NotFound, ResourceLocked

#: the permission each operation needs, on which kind of object (RabbitMQ's access control doc)
PERMISSIONS: dict[str, tuple[str, str]] = {
    "queue.declare": ("configure", "queue"),
    "basic.consume": ("read", "queue"),
    "basic.get": ("read", "queue"),
    "queue.purge": ("read", "queue"),
    "basic.publish": ("write", "exchange"),
}


class QueueNotFound(NotFound):
    """404: the queue to consume does not exist (``declare=True`` declares it)."""


def grant_command(vhost: str, user: str, permission: str, name: str) -> str:
    """The ``rabbitmqctl set_permissions`` line that grants ``permission`` on ``name`` alone.

    It replaces the user's permissions in ``vhost``: the text says to merge the pattern into
    the ones the user has.
    """
    patterns = {"configure": "''", "write": "''", "read": "''"}
    patterns[permission] = f"'^{_regex(name)}$'"
    return (
        f"rabbitmqctl set_permissions -p '{vhost}' '{user}' "
        f"{patterns['configure']} {patterns['write']} {patterns['read']}"
    )


def _regex(name: str) -> str:
    out = []
    for ch in name:
        out.append("\\" + ch if ch in ".^$*+?()[]{}|\\" else ch)
    return "".join(out)


def refusal(
    reply_code: int,
    reply_text: str,
    *,
    operation: str,
    name: str,
    vhost: str,
    user: str,
    why: str = "",
) -> BrokerError | None:
    """The error for a refusal of ``operation`` on ``name`` (None: not a refusal we explain).

    ``why`` says why the library did the operation (for its own queues), e.g. "the consumer
    declares its dead-letter and delay queues at start".
    """
    text = str(reply_text)
    if reply_code == 404 and operation in ("basic.consume", "queue.declare"):
        return QueueNotFound(
            404,
            f"{text}: queue {name!r} does not exist in vhost {vhost!r}; declare it first, or "
            "pass declare=True (and queue_arguments=...) so the consumer declares it, durable, "
            "and again after every reconnect",
        )
    if reply_code == 405:
        return ResourceLocked(
            405,
            f"{text}: queue {name!r} is exclusive to another connection, and only that "
            "connection may consume it; consume a queue that is not exclusive",
        )
    if reply_code == 403 and operation in PERMISSIONS:
        permission, kind = PERMISSIONS[operation]
        exists = " (even when it exists)" if operation == "queue.declare" else ""
        return AccessRefused(
            403,
            f"{text}: user {user!r} needs the {permission!r} permission on {kind} {name!r} in "
            f"vhost {vhost!r}: {operation} needs {permission}{exists}"
            f"{'; ' + why if why else ''}. Add the name to the user's {permission} pattern, "
            f"e.g. {grant_command(vhost, user, permission, name)} (this replaces the user's "
            "other patterns in that vhost: merge them)",
        )
    return None
