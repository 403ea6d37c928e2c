"""docs/outbox.md shows the DDL install() runs, word for word (migration tools copy it)."""

from __future__ import annotations

from pathlib import Path

from reliable_amqp.outbox import Outbox

DOC = Path(__file__).resolve().parent.parent.parent / "docs" / "outbox.md"


def test_the_documented_ddl_is_what_install_runs() -> None:
    text = DOC.read_text(encoding="utf-8")
    for dialect in ("postgresql", "sqlite"):
        ddl = Outbox().ddl(dialect).rstrip("\n")
        assert f"```sql\n{ddl}\n```" in text, f"docs/outbox.md: the {dialect} DDL differs"
