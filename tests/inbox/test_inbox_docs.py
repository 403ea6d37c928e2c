"""docs/inbox.md shows the DDL ``install()`` runs and the ALTERs that migrate a MariaDB/MySQL
table made before the keys became varbinary, word for word (migration tools copy them)."""

from __future__ import annotations

from pathlib import Path

from reliable_amqp.inbox import Inbox
from reliable_amqp.inbox._schema import InboxTables, mysql_migration

DOC = Path(__file__).resolve().parent.parent.parent / "docs" / "inbox.md"


def test_the_documented_ddl_is_what_install_runs() -> None:
    text = DOC.read_text(encoding="utf-8")
    for dialect in ("postgresql", "mysql", "sqlite"):
        ddl = Inbox("-").ddl(dialect).rstrip("\n")
        assert f"```sql\n{ddl}\n```" in text, f"docs/inbox.md: the {dialect} DDL differs"


def test_the_documented_migration_is_what_the_warning_names() -> None:
    text = DOC.read_text(encoding="utf-8")
    alters = ";\n".join(mysql_migration(InboxTables.named("amqp_inbox"))) + ";"
    assert f"```sql\n{alters}\n```" in text
