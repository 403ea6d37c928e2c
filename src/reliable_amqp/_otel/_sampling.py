"""Knowing, before asking the SDK, that a span would be dropped.

The OpenTelemetry SDK's ``Tracer.start_span`` costs much of what a whole publish costs even when
its sampler drops the span (it builds the sampling arguments, mints ids and a
``NonRecordingSpan``; docs/benchmarks.md has the figure). The two samplers that drop without
looking at anything but the parent, ``ALWAYS_OFF`` and ``ParentBased`` with ``ALWAYS_OFF``
delegates, are read here once, so that a publish whose span they would drop asks nothing of
the SDK. Any other sampler (a ratio, a custom
one, a subclass that overrides ``should_sample``) is always asked.
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry.trace import SpanContext

#: the ParentBased cases, in the order :class:`DropRule` keeps them
_CASES = (
    "_root",
    "_remote_parent_sampled",
    "_remote_parent_not_sampled",
    "_local_parent_sampled",
    "_local_parent_not_sampled",
)


@dataclass(frozen=True, slots=True)
class DropRule:
    """Which parents' children the sampler drops without fail (True), per ParentBased case."""

    root: bool
    remote_sampled: bool
    remote_not_sampled: bool
    local_sampled: bool
    local_not_sampled: bool

    @property
    def drops_all(self) -> bool:
        """Every span is dropped, whatever its parent."""
        return (
            self.root
            and self.remote_sampled
            and self.remote_not_sampled
            and self.local_sampled
            and self.local_not_sampled
        )

    @property
    def drops_none(self) -> bool:
        """No case is known to drop: the SDK is asked every time."""
        return not (
            self.root
            or self.remote_sampled
            or self.remote_not_sampled
            or self.local_sampled
            or self.local_not_sampled
        )

    def drops(self, parent: SpanContext) -> bool:
        """Whether a child of ``parent`` (the current span's context) is certainly dropped."""
        if not parent.is_valid:
            return self.root
        if parent.is_remote:
            return self.remote_sampled if parent.trace_flags.sampled else self.remote_not_sampled
        return self.local_sampled if parent.trace_flags.sampled else self.local_not_sampled


def drop_rule(provider: object) -> DropRule | None:
    """The drop rule of an SDK ``TracerProvider``'s sampler; None when nothing is known."""
    sampler = getattr(provider, "sampler", None)
    if sampler is None:
        return None
    if _always_drops(sampler):
        return DropRule(True, True, True, True, True)
    try:
        from opentelemetry.sdk.trace.sampling import ParentBased
    except ImportError:  # pragma: no cover - a provider with a sampler is the SDK's
        return None
    if not isinstance(sampler, ParentBased):
        return None
    if type(sampler).should_sample is not ParentBased.should_sample:
        return None  # a subclass decides its own way
    delegates = [getattr(sampler, name, None) for name in _CASES]
    if any(d is None for d in delegates):
        return None  # another SDK version's layout: ask every time
    rule = DropRule(*(_always_drops(d) for d in delegates))
    return None if rule.drops_none else rule


def _always_drops(sampler: object) -> bool:
    """True for the SDK's ``ALWAYS_OFF`` (a StaticSampler whose decision is DROP), exactly."""
    try:
        from opentelemetry.sdk.trace.sampling import Decision, StaticSampler
    except ImportError:  # pragma: no cover
        return False
    return (
        isinstance(sampler, StaticSampler)
        and type(sampler).should_sample is StaticSampler.should_sample
        and getattr(sampler, "_decision", None) is Decision.DROP
    )
