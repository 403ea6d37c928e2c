"""The test suite's helpers, apart from the test modules: no test is collected from here.

Each module serves the tests of one area and is imported as ``support.NAME`` (``tests/`` is on
``sys.path``: ``tests/conftest.py`` puts it there, and the child scripts the tests start put it
there themselves): ``support.broker`` (the admin client and unique names every broker test
uses), ``support.aio`` and ``support.aio_blocking`` (the async tests), ``support.cli``,
``support.consumer``, ``support.engine``, ``support.inbox``, ``support.inbox_consumer``,
``support.matrix``, ``support.otel``, ``support.outbox``, ``support.run_summary`` (lines for the
run's summary), ``support.spark``, ``support.spark_cluster`` (a Spark standalone cluster; also
run as a script by ``scripts/spark_cluster.sh``), ``support.spool``, ``support.stream`` and
``support.tls``.
"""
