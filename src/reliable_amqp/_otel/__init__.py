"""OpenTelemetry for the publishers: decided once per publisher, when it connects.

:func:`telemetry_for` returns a :class:`~reliable_amqp._otel._telemetry.Telemetry` when there
is something to record, else None, and the publishers skip every telemetry call on None. It
imports nothing from OpenTelemetry unless the process already uses it (a module of the API is
loaded, an ``OTEL_PYTHON_*_PROVIDER`` variable names a provider) or the options give a
provider; ``import reliable_amqp`` never does.

Nothing to record means: no provider in the options, and the global ones are still the API's
proxies (no SDK configured) or no-ops, or the tracer's sampler is ``ALWAYS_OFF`` and there is no
meter provider either. A publisher decides when it connects (``connect()``, ``with``, or its
first publish): configure the SDK before that, at start-up, as OpenTelemetry advises.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from reliable_amqp._core.errors import ConfigurationError
from reliable_amqp._core.options import PublisherOptions
from reliable_amqp._core.stats import Stats
from reliable_amqp._core.supervisor import Supervisor
from reliable_amqp._version import __version__

if TYPE_CHECKING:
    from reliable_amqp._otel._telemetry import Telemetry

#: the library's instrumentation scope name (tracer and meter)
SCOPE = "reliable_amqp"

#: environment variables through which the API loads a provider without the process importing
#: it first (``OTEL_PYTHON_TRACER_PROVIDER=sdk_tracer_provider``)
_PROVIDER_VARIABLES = ("OTEL_PYTHON_TRACER_PROVIDER", "OTEL_PYTHON_METER_PROVIDER")


def otel_in_use(options: PublisherOptions) -> bool:
    """Whether OpenTelemetry could have anything configured for a publisher with ``options``:
    a provider in the options, or the process has loaded the API or named a provider."""
    if options.tracer_provider is not None or options.meter_provider is not None:
        return True
    if "opentelemetry.trace" in sys.modules or "opentelemetry.metrics" in sys.modules:
        return True
    return any(os.environ.get(name) for name in _PROVIDER_VARIABLES)


def telemetry_for(options: PublisherOptions, stats: Callable[[], Stats]) -> Telemetry | None:
    """The telemetry of a publisher with ``options`` (``stats`` is its ``stats()``), or None
    when nothing would be recorded. Call it when the publisher connects."""
    if not otel_in_use(options):
        return None
    try:
        from opentelemetry import metrics, trace
    except ImportError:
        return None  # the extra is not installed (options cannot name a provider then)
    from reliable_amqp._otel._metrics import instruments_for
    from reliable_amqp._otel._sampling import drop_rule
    from reliable_amqp._otel._telemetry import Telemetry

    version = _version()
    tracer = None
    drop = None
    tracer_provider: Any = options.tracer_provider or trace.get_tracer_provider()
    if not isinstance(tracer_provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        tracer = tracer_provider.get_tracer(SCOPE, version)
        drop = drop_rule(tracer_provider)
        if isinstance(tracer, trace.NoOpTracer) or (drop is not None and drop.drops_all):
            tracer = None  # OTEL_SDK_DISABLED, or ALWAYS_OFF: no span is ever recorded
            drop = None
    instruments = None
    meter_provider: Any = options.meter_provider or metrics.get_meter_provider()
    if not _is_proxy_or_noop(meter_provider, metrics):
        meter = meter_provider.get_meter(SCOPE, version)
        if not isinstance(meter, metrics.NoOpMeter):
            instruments = instruments_for(meter_provider, meter)
    if tracer is None and instruments is None:
        return None
    return Telemetry(
        tracer=tracer, drop=drop, instruments=instruments, stats=stats, urls=options.urls
    )


class TelemetrySlot:
    """A publisher's telemetry, decided at its first ``connect()`` and the same ever after."""

    __slots__ = ("_decided", "_lock", "telemetry")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._decided = False
        #: what was decided (None: off, or not decided yet)
        self.telemetry: Telemetry | None = None

    def decide(
        self, options: PublisherOptions, supervisor: Supervisor[Any], stats: Callable[[], Stats]
    ) -> Telemetry | None:
        """The telemetry (made the first time), hooked into the engine's resends and the
        lifecycle's events."""
        if self._decided:
            return self.telemetry
        with self._lock:
            if not self._decided:
                telemetry = telemetry_for(options, stats)
                if telemetry is not None:
                    if telemetry.tracing:
                        supervisor.listen_resends(telemetry.on_resend)
                    if telemetry.metrics:
                        supervisor.events.listener = telemetry.on_publisher_event
                self.telemetry = telemetry
                self._decided = True
        return self.telemetry


def _is_proxy_or_noop(provider: object, metrics: Any) -> bool:
    if isinstance(provider, metrics.NoOpMeterProvider):
        return True
    # the API's global proxy (a private class): the placeholder until an SDK is set
    return type(provider).__name__ == "_ProxyMeterProvider"


def _version() -> str:
    return __version__


def check_provider_options(options: PublisherOptions, where: str) -> None:
    """Refuse provider objects where they cannot go (``where`` names the place)."""
    for name in ("tracer_provider", "meter_provider"):
        if getattr(options, name) is not None:
            raise ConfigurationError(
                f"{name} cannot be used with {where}: configure OpenTelemetry's global "
                "providers in the processes that publish (see docs/observability.md)"
            )


__all__ = ["SCOPE", "TelemetrySlot", "check_provider_options", "otel_in_use", "telemetry_for"]
