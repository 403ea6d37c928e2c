"""Two clones never share a venv (issue 48): ``scripts/paths.sh`` gives each checkout a cache
directory of its own under ``~/.cache/reliable-amqp``, unless ``RELIABLE_AMQP_VENV`` or
``RELIABLE_AMQP_MATRIX_DIR`` say otherwise; the RabbitMQ 4 root stays one for all clones."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"


def paths(checkout: Path, **env: str) -> tuple[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RELIABLE_AMQP_")}
    out = subprocess.run(
        [
            "bash",
            "-c",
            'ROOT=$1; source "$2"; echo "$RELIABLE_AMQP_VENV"; echo "$RELIABLE_AMQP_MATRIX_DIR"',
            "-",
            str(checkout),
            str(SCRIPTS / "paths.sh"),
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**clean, "HOME": "/home/someone", **env},
        timeout=30,
    )
    venv, matrix = out.stdout.splitlines()
    return venv, matrix


def test_each_checkout_has_its_own_cache_directory(tmp_path: Path) -> None:
    (tmp_path / "one" / "clone").mkdir(parents=True)
    (tmp_path / "two" / "clone").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "one" / "clone")
    one = paths(tmp_path / "one" / "clone")
    two = paths(tmp_path / "two" / "clone")
    assert one != two
    venv, matrix = one
    assert venv == f"{matrix}/venv"
    assert Path(matrix).parent == Path("/home/someone/.cache/reliable-amqp")
    assert Path(matrix).name.startswith("clone-") and Path(matrix).name != "rabbitmq4"
    assert paths(tmp_path / "link") == one  # the same checkout through a symbolic link


def test_the_variables_override_the_defaults(tmp_path: Path) -> None:
    assert paths(tmp_path, RELIABLE_AMQP_VENV="/v", RELIABLE_AMQP_MATRIX_DIR="/m") == ("/v", "/m")


def test_the_rabbitmq4_root_is_shared_between_clones() -> None:
    text = (SCRIPTS / "rabbitmq4.sh").read_text(encoding="utf-8")
    assert "CACHE=${RELIABLE_AMQP_RABBITMQ4_DIR:-$HOME/.cache/reliable-amqp/rabbitmq4}" in text
    assert "paths.sh" not in text
