"""Spark's Python workers must import ``reliable_amqp``: checked on the driver, before a job.

Executors run their Python functions in worker processes of the interpreter ``PYSPARK_PYTHON``
names (``python3`` on the ``PATH`` when it is not set), not necessarily the driver's. Without the
package there, every task fails with ``ModuleNotFoundError: No module named 'reliable_amqp'``
deep in a Java stack trace. Where the workers run on this machine (a ``local`` master), the
driver can tell beforehand: this module tries the import in that interpreter once per process
and raises a :class:`ConfigurationError` that says what to set. Elsewhere (a cluster, Spark
Connect) the workers are out of reach and nothing is checked.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from typing import Any

from reliable_amqp._core.errors import ConfigurationError

#: interpreters already tried, and whether they import reliable_amqp
_CHECKED: dict[str, bool] = {}
_LOCK = threading.Lock()


def check_workers(spark: Any) -> None:
    """Raise :class:`ConfigurationError` when the Python workers of ``spark`` (a classic
    ``SparkSession``, or its ``SparkContext``) run on this machine in an interpreter that cannot
    import ``reliable_amqp``; do nothing when that cannot be known."""
    try:
        context = getattr(spark, "sparkContext", spark)  # Spark Connect raises here
        master = str(context.master)
        python = str(getattr(context, "pythonExec", "") or "")
    except Exception:
        return
    if not master.startswith("local") or not python:
        return
    found = shutil.which(python)
    # (not realpath: a venv's python is a link to the base interpreter, with other packages)
    if found is not None and os.path.abspath(found) == os.path.abspath(sys.executable):
        return
    with _LOCK:
        if python not in _CHECKED:
            _CHECKED[python] = _imports(found)
        if _CHECKED[python]:
            return
    how = (
        "PYSPARK_PYTHON names it"
        if os.environ.get("PYSPARK_PYTHON")
        else "PYSPARK_PYTHON is not set, so Spark runs python3 from the PATH"
    )
    raise ConfigurationError(
        f"Spark's Python workers run {python} ({how}), which cannot import reliable_amqp: "
        "every task would fail with ModuleNotFoundError. Set PYSPARK_PYTHON to an interpreter "
        f"that has it, such as this one (PYSPARK_PYTHON={sys.executable}), before the "
        "SparkSession starts"
    )


def _imports(python: str | None) -> bool:
    if python is None:
        return False
    try:
        done = subprocess.run(
            [python, "-c", "import reliable_amqp.spark"],
            capture_output=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0
