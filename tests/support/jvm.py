"""The JVM flags of every Spark JVM the suite starts: its session, the child drivers, the
examples, and the standalone cluster's daemons and executors.

``-XX:TieredStopAtLevel=1`` compiles with C1 only and ``-XX:+UseSerialGC`` collects on one
thread: on a 2-core machine, C2's compiler threads and the parallel collector's compete with the
test (and the broker) for the CPU while a JVM starts and runs short jobs. Measured on 2026-11-29
(load 5 to 9, alternating, a ``local[2]`` session started and one job run): 9.8-14.0 s with them
against 15.3-40.2 s without. They change how fast Spark runs, not what it does; they are the
suite's, not the library's (a user's Spark keeps its own flags).
"""

from __future__ import annotations

import os

#: the flags (see the module's docstring)
SPARK_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def use_for_local_drivers() -> None:
    """Give :data:`SPARK_JVM_OPTIONS` to every driver PySpark launches from this process or its
    children (``PYSPARK_SUBMIT_ARGS``, which PySpark passes to ``spark-submit``), unless the
    environment already sets ``PYSPARK_SUBMIT_ARGS`` (``PYSPARK_SUBMIT_ARGS=pyspark-shell``
    runs the suite without them)."""
    os.environ.setdefault(
        "PYSPARK_SUBMIT_ARGS", f"--driver-java-options '{SPARK_JVM_OPTIONS}' pyspark-shell"
    )
