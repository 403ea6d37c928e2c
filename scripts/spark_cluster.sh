#!/usr/bin/env bash
# A Spark standalone cluster from the venv's PySpark: a master and two workers on loopback
# (1 core, 1 GiB each; own ports and work directories), in the foreground; Ctrl-C stops them by
# their pids. Prints the master URL to give SparkSession.builder.master(...).
#
#   bash scripts/spark_cluster.sh
#
# The same cluster the tests use (tests/support/spark_cluster.py; tests/spark/test_cluster.py).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$ROOT/scripts/paths.sh"   # this checkout's venv, or $RELIABLE_AMQP_VENV
exec "$RELIABLE_AMQP_VENV/bin/python" "$ROOT/tests/support/spark_cluster.py" "$@"
