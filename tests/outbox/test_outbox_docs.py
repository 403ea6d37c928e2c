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


def test_the_command_line_imports_no_outbox_module_until_an_outbox_action_runs() -> None:
    import subprocess
    import sys

    from reliable_amqp.cli._outbox import DEFAULT_TABLE
    from reliable_amqp.outbox import DEFAULT_TABLE as OUTBOX_DEFAULT

    assert DEFAULT_TABLE == OUTBOX_DEFAULT
    code = (
        "import sys, reliable_amqp.cli as cli; cli.build_parser; "
        "print(sorted(m for m in sys.modules if m.startswith(('reliable_amqp.outbox', "
        "'psycopg', 'pymysql'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"
