"""Shared between the matrix tests and the main venv's own check: the optional stacks, and the
script that shows the library works without them."""

from __future__ import annotations

#: The outbox's optional stacks (issue 30): no matrix leg installs them (``.[aio,dev]``), so
#: every leg shows that the library, its CLI and the outbox on sqlite3 work, and the contract
#: subset passes, without them. A leg where one is installed fails (the showing would be void).
OPTIONAL = ("sqlalchemy", "django", "asyncpg", "pymysql", "psycopg", "alembic")

#: run as ``python -c WITHOUT_OPTIONAL`` in a venv: imports the library, its CLI and the outbox,
#: writes a row through the outbox on sqlite3 (a transaction rolled back, one committed), then
#: checks that none of the optional packages was imported along the way.
WITHOUT_OPTIONAL = """
import sqlite3, sys
import reliable_amqp, reliable_amqp.cli
from reliable_amqp.outbox import Outbox
outbox = Outbox()
db = sqlite3.connect(":memory:", isolation_level=None)
outbox.install(db)
db.execute("BEGIN"); outbox.add(db, "", "q", b"rolled back"); db.execute("ROLLBACK")
db.execute("BEGIN"); outbox.add(db, "", "q", b"kept"); db.execute("COMMIT")
rows = db.execute("SELECT count(*) FROM amqp_outbox").fetchone()[0]
assert rows == 1, rows
loaded = sorted(set(sys.argv[1:]) & set(sys.modules))
assert not loaded, loaded
print("ok")
"""
