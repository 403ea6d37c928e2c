"""Every hook into another library's private parts, one module per upstream, probed at import.

- :mod:`reliable_amqp._compat.pika`: pika's ``_adapter_emit_data`` and ``_terminate_stream``;
- :mod:`reliable_amqp._compat.aiormq`: aiormq's channel frame queue, write queue and tune
  values, and aio-pika's ``close_called`` (aiormq and pamqp are only imported by it);
- :mod:`reliable_amqp._compat.futures`: CPython ``concurrent.futures.Future``'s fields.

Each module checks, when it is imported, that what it relies on is there. A pika or aiormq
release that drops a hook makes the import fail with :class:`IncompatibleDependency`, naming the
package, the installed version and the supported range, instead of publishes that hang or
confirms that never arrive. A Python whose ``Future`` changed is not an error: the futures
module then falls back to a plain ``Future`` (slower, correct) and says so in ``LIGHT_FUTURES``.

The ranges below are the ones ``pyproject.toml`` declares; keep the two in step.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from importlib.metadata import PackageNotFoundError, version

#: pika versions whose SelectConnection has the hooks of :mod:`._compat.pika`
PIKA_RANGE = ">=1.3,<2"
#: aio-pika versions the async publisher connects through (9.x runs on aiormq 6, 10.x on 7)
AIO_PIKA_RANGE = ">=9.4,<11"
#: aiormq versions whose channel internals :mod:`._compat.aiormq` hooks
AIORMQ_RANGE = ">=6.8,<8"
#: pamqp versions: aiormq 6.8-6.9 pin pamqp 3.3.0, aiormq 7 needs pamqp 4; the async channel
#: imports pamqp's ``commands`` and ``header`` itself, so the ``aio`` extra must list it
PAMQP_RANGE = ">=3.3,<5"

#: distribution name -> supported range, for messages and for tests
SUPPORTED = {
    "pika": PIKA_RANGE,
    "aio-pika": AIO_PIKA_RANGE,
    "aiormq": AIORMQ_RANGE,
    "pamqp": PAMQP_RANGE,
}


class IncompatibleDependency(ImportError):
    """An installed library lacks a private hook reliable-amqp relies on.

    An ``ImportError``: the module that needs the hook cannot work, so it does not import.
    ``package``, ``installed`` and ``supported`` say which library, which version is installed
    and which range reliable-amqp supports.
    """

    def __init__(self, package: str, problem: str) -> None:
        self.package = package
        self.installed = installed_version(package)
        self.supported = SUPPORTED.get(package, "")
        super().__init__(
            f"reliable-amqp needs {package} {self.supported}; {package} {self.installed} is "
            f"installed and {problem}. Install a supported version: pip install "
            f"'{package}{self.supported}'",
            name=package,
        )


def installed_version(package: str) -> str:
    """The installed version of the distribution ``package``, or ``"(unknown version)"``."""
    try:
        return version(package)
    except PackageNotFoundError:
        return "(unknown version)"


def require_attributes(package: str, owner: object, names: Iterable[str], what: str) -> None:
    """Raise :class:`IncompatibleDependency` unless ``owner`` has every attribute in ``names``.

    ``what`` names ``owner`` in the message (``"its Channel"``). An attribute counts when it is
    defined or only annotated on the class or one of its bases: aiormq declares instance
    attributes (``frames``, ``write_queue``) as annotations on its classes.
    """
    missing = [name for name in names if not _has_attribute(owner, name)]
    if missing:
        raise IncompatibleDependency(package, f"{what} has no {', '.join(missing)}")


def require_coroutine_functions(package: str, owner: type, names: Iterable[str], what: str) -> None:
    """Raise :class:`IncompatibleDependency` unless each name is an ``async def`` of ``owner``."""
    import inspect

    require_attributes(package, owner, names, what)
    wrong = [name for name in names if not inspect.iscoroutinefunction(getattr(owner, name))]
    if wrong:
        raise IncompatibleDependency(
            package, f"{what}.{', '.join(wrong)} is no longer a coroutine function"
        )


def _has_attribute(owner: object, name: str) -> bool:
    if hasattr(owner, name):
        return True
    if not isinstance(owner, type):
        return False
    return any(name in getattr(klass, "__annotations__", {}) for klass in owner.__mro__)


#: ``user:password@`` in anything that looks like a URL
_CREDENTIALS = re.compile(r"(\w+://)[^/@\s]*@")


def scrub_credentials(text: str) -> str:
    """``text`` with the user and password of any URL in it replaced by ``***``.

    For client libraries' error messages, which sometimes hold a connection's URL.
    """
    return _CREDENTIALS.sub(r"\1***@", text)
