"""Run by tests/inbox/test_crash.py in a process of its own, which the test kills -9: handles
``COUNT`` ids, each delivered twice, through ``Inbox.handler`` on the database ``DSN`` (kind
``DIALECT``), printing one line per delivery handled (the test kills it after some)."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reliable_amqp.inbox import Inbox
from support.inbox import Database, FakeDelivery, run


def main(dialect: str, dsn: str, count: int) -> None:
    db = Database(dialect, dsn)
    conn = db.connect()
    inbox = Inbox("billing")

    def handle(delivery: FakeDelivery, conn: object) -> None:
        run(
            conn,
            "INSERT INTO effects (message_id, note) VALUES (%s, %s)",
            (delivery.message_id, "x"),
        )

    handler = inbox.handler(lambda: contextlib.nullcontext(conn), handle)  # kept open
    for i in range(count):
        for redelivered in (False, True):
            handler(FakeDelivery(f"k{i}", redelivered=redelivered))
            print(f"handled k{i}", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
