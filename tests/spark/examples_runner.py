"""Run Spark examples one after another in this one process, each as its own ``__main__``.

    python examples_runner.py EXAMPLE.py...

tests/spark/test_examples_spark.py runs the Spark examples through this: each example starts
its own SparkSession (and stops it, or this runner stops what it left), but the JVM that the
first one launched serves the next ones, which saves a JVM start and its first job's warm-up
(about 15 s on a loaded machine) per example. Each example runs in a fresh directory of its own
(the working directory is ``EXAMPLE``'s stem under the current one), with ``sys.argv`` as if
run directly.

The JVM keeps the environment of the moment it started (its Python workers get that one): an
example that sets a variable for its workers must come first (spark_datasource.py sets
``RELIABLE_AMQP_SPARK_LOG``).

Before each example a line ``MARK start NAME`` goes to stdout and to stderr, after it a line
``MARK exit NAME CODE``; everything between is that example's (the JVM and its Python workers
write to the same stderr, and an example's jobs are over once it returned and its session was
stopped).
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

MARK = "=== reliable-amqp example runner:"


def _mark(line: str) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    data = f"{MARK} {line}\n".encode()
    os.write(1, data)
    os.write(2, data)


def _stop_sessions() -> None:
    from pyspark.sql import SparkSession

    session = SparkSession.getActiveSession()
    if session is not None:
        session.stop()


def run(path: Path) -> int:
    """Run ``path`` as ``__main__``; its exit code (an exception is 1, printed)."""
    here = Path.cwd()
    work = here / path.stem
    work.mkdir()
    os.chdir(work)
    argv = sys.argv
    sys.argv = [str(path)]
    try:
        runpy.run_path(str(path), run_name="__main__")
        return 0
    except SystemExit as exit_:
        code = exit_.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except BaseException:
        import traceback

        traceback.print_exc()
        return 1
    finally:
        sys.argv = argv
        os.chdir(here)
        _stop_sessions()


def main() -> int:
    for name in sys.argv[1:]:
        path = Path(name).resolve()
        _mark(f"start {path.name}")
        code = run(path)
        _mark(f"exit {path.name} {code}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
