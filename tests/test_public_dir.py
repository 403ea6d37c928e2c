"""The public surface of ``reliable_amqp`` (issues 20 and 24).

``__all__`` is the whole of it: ``dir()`` lists it and nothing else (no typing helpers), the
module holds no other public name, every name in it resolves (``AsyncPublisher`` too, loaded on
first use), and there are no function utilities at the top level. Every exception class a user
can catch from this library is exported under its own name: the ``ReliableAmqpError`` family
(walked through ``__subclasses__()`` once the optional parts are imported), every class that
``broker_error`` returns for a reply code, and ``IncompatibleDependency``. The Spark extra's own
errors are exported by ``reliable_amqp.spark``, where they live (importing it there would make
the top level pull in PySpark).
"""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType

import pytest

import reliable_amqp
from reliable_amqp._compat import IncompatibleDependency
from reliable_amqp._core import errors
from reliable_amqp._core.errors import REPLY_CODE_ERRORS, ReliableAmqpError, broker_error


def _spark() -> ModuleType | None:
    """``reliable_amqp.spark`` when PySpark is installed (importing it starts no Spark)."""
    try:
        return importlib.import_module("reliable_amqp.spark")
    except ImportError:
        return None


def test_all_has_no_duplicates_and_every_name_in_it_resolves() -> None:
    names = reliable_amqp.__all__
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert "AsyncPublisher" in names
    for name in names:  # each one is there, AsyncPublisher loaded on first use
        assert getattr(reliable_amqp, name) is not None, name
    star: dict[str, object] = {}
    exec("from reliable_amqp import *", star)
    assert set(star) - {"__builtins__"} == set(names)


def test_dir_lists_all_and_nothing_of_typing() -> None:
    names = dir(reliable_amqp)
    assert "Any" not in names and "TYPE_CHECKING" not in names
    assert names == sorted(names)
    assert set(names) == set(reliable_amqp.__all__)
    assert len(names) == len(reliable_amqp.__all__)


def test_the_package_holds_no_public_name_beyond_all() -> None:
    _spark()  # a submodule imported later is an attribute of the package, not a name of its own
    public = {
        name
        for name, value in vars(reliable_amqp).items()
        if not name.startswith("_") and not isinstance(value, ModuleType)
    }
    assert public <= set(reliable_amqp.__all__), sorted(public - set(reliable_amqp.__all__))
    eager = set(reliable_amqp.__all__) - {"AsyncPublisher"}  # the one loaded on first use
    assert eager <= set(vars(reliable_amqp)), sorted(eager - set(vars(reliable_amqp)))


def test_no_function_utilities_at_the_top_level() -> None:
    for name in reliable_amqp.__all__:
        value = getattr(reliable_amqp, name)
        assert not inspect.isroutine(value), name
        assert name == "__version__" or inspect.isclass(value), name
    for utility in ("redact_url", "broker_error"):
        assert not hasattr(reliable_amqp, utility), utility
        with pytest.raises(ImportError):
            exec(f"from reliable_amqp import {utility}", {})
    # where they are defined, they stay
    from reliable_amqp._core.options import redact_url

    assert callable(redact_url) and callable(broker_error)


def _family(root: type[BaseException]) -> set[type[BaseException]]:
    found = {root}
    for sub in root.__subclasses__():
        found |= _family(sub)
    return found


def _catchable() -> set[type[BaseException]]:
    importlib.import_module("reliable_amqp._async")
    _spark()
    classes = _family(ReliableAmqpError) | _family(IncompatibleDependency)
    classes |= {type(broker_error(code, "TEXT")) for code in REPLY_CODE_ERRORS}
    classes.add(type(broker_error(999, "unknown")))
    # subclasses some test module made are not the library's
    return {cls for cls in classes if cls.__module__.split(".")[0] == "reliable_amqp"}


def _defined_in(module: ModuleType) -> set[type[BaseException]]:
    """The exception classes ``module`` itself defines (not those it imports)."""
    return {
        value
        for value in vars(module).values()
        if inspect.isclass(value)
        and issubclass(value, BaseException)
        and value.__module__ == module.__name__
    }


def test_the_error_family_is_what_was_walked() -> None:
    """The walk finds every exception class the library defines, with or without the spark
    extra: the Spark errors count only where ``reliable_amqp.spark`` imports."""
    classes = _catchable()
    assert set(REPLY_CODE_ERRORS.values()) <= classes
    assert {errors.ContentTooLarge, errors.AmqpSyntaxError, errors.AmqpNotImplemented} <= classes
    assert IncompatibleDependency in classes
    expected = _defined_in(errors) | {IncompatibleDependency}
    spark = _spark()
    if spark is not None:
        exported = (getattr(spark, name) for name in spark.__all__)
        spark_errors = {v for v in exported if inspect.isclass(v) and issubclass(v, Exception)}
        assert spark_errors, "reliable_amqp.spark exports no exception class"
        expected |= spark_errors
    assert expected <= classes, sorted(c.__name__ for c in expected - classes)
    assert len(_defined_in(errors)) >= 38  # what the errors module defines today: found at all


def test_every_exception_a_user_can_catch_is_exported_under_its_own_name() -> None:
    spark = _spark()
    problems = []
    for cls in sorted(_catchable(), key=lambda c: c.__name__):
        name = cls.__name__
        home: ModuleType | None = reliable_amqp
        if cls.__module__.startswith("reliable_amqp.spark"):
            home = spark
        assert home is not None  # a class of reliable_amqp.spark was found, so it imported
        if name.startswith("_") or name.endswith("_"):
            problems.append(f"{name} is not a public name")
        if getattr(home, name, None) is not cls:
            problems.append(f"{home.__name__}.{name} is not {cls.__module__}.{name}")
        if name not in home.__all__:
            problems.append(f"{name} is not in {home.__name__}.__all__")
    assert not problems, "\n".join(problems)
