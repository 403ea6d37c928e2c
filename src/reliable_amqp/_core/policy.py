"""RetryPolicy: a frozen description of "how often, how far apart, for how long", on tenacity.

The same policy type configures reconnects and nack retries. Adapters ask it two questions,
``delay(n)`` and ``allows(n, elapsed)``, so that waiting stays theirs (an I/O loop timer, not a
sleep); :meth:`RetryPolicy.retrying` hands the same policy to tenacity for code that just wants to
retry a call.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, SupportsFloat, SupportsInt

import tenacity

from reliable_amqp._core.errors import ConfigurationError

_KOMBU_KEYS = {"max_retries", "interval_start", "interval_step", "interval_max"}


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """When to try again.

    The wait before attempt ``n + 1`` (after ``n`` failures) is
    ``min(max_delay, initial_delay * multiplier ** (n - 1) + step * (n - 1))`` plus a uniform
    random ``[0, jitter]`` seconds. Attempts stop at ``max_attempts`` (None: no count limit) or
    when the next attempt would start after ``deadline`` seconds from the first (None: no limit).
    """

    max_attempts: int | None = 5
    initial_delay: float = 0.1
    max_delay: float = 10.0
    multiplier: float = 2.0
    step: float = 0.0
    jitter: float = 0.1
    deadline: float | None = None

    def __post_init__(self) -> None:
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ConfigurationError(f"max_attempts must be at least 1, got {self.max_attempts}")
        for name in ("initial_delay", "max_delay", "step", "jitter"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ConfigurationError(f"{name} must be a finite number >= 0, got {value!r}")
        if not math.isfinite(self.multiplier) or self.multiplier < 1:
            raise ConfigurationError(f"multiplier must be >= 1, got {self.multiplier!r}")
        if self.deadline is not None and not self.deadline > 0:
            raise ConfigurationError(f"deadline must be > 0 seconds, got {self.deadline!r}")

    # --- the two questions adapters ask -------------------------------------------------------

    def base_delay(self, failures: int) -> float:
        """The wait after ``failures`` failed attempts, without jitter."""
        n = max(failures, 1) - 1
        if self.initial_delay == 0:
            grown = 0.0
        else:
            try:
                grown = self.initial_delay * self.multiplier**n
            except OverflowError:
                grown = math.inf
        return min(self.max_delay, grown + self.step * n)

    def delay(self, failures: int, rng: Callable[[], float] = random.random) -> float:
        """The wait (with jitter) before trying again after ``failures`` failed attempts."""
        return self.base_delay(failures) + self.jitter * rng()

    def allows(self, failures: int, elapsed: float = 0.0, wait: float | None = None) -> bool:
        """Whether another attempt may follow ``failures`` failures, ``elapsed`` s in.

        ``wait`` is how long the caller will wait before that attempt (default: the backoff,
        :meth:`base_delay`); the attempt must start within the deadline.
        """
        if self.max_attempts is not None and failures >= self.max_attempts:
            return False
        if wait is None:
            wait = self.base_delay(failures)
        return self.deadline is None or elapsed + wait <= self.deadline

    # --- tenacity -----------------------------------------------------------------------------

    def retrying(self, **overrides: Any) -> tenacity.Retrying:
        """A ``tenacity.Retrying`` following this policy; it retries ``retriable`` errors only."""
        stops: list[tenacity.stop.stop_base] = []
        if self.max_attempts is not None:
            stops.append(tenacity.stop_after_attempt(self.max_attempts))
        if self.deadline is not None:
            stops.append(tenacity.stop_before_delay(self.deadline))
        options: dict[str, Any] = {
            "stop": tenacity.stop_any(*stops) if stops else tenacity.stop_never,
            "wait": _PolicyWait(self),
            "retry": tenacity.retry_if_exception(lambda exc: getattr(exc, "retriable", False)),
            "reraise": True,
        }
        options.update(overrides)
        return tenacity.Retrying(**options)

    # --- configuration ------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The policy as a plain dict (round-trips through :meth:`from_dict`)."""
        return asdict(self)

    @classmethod
    def from_dict(
        cls, config: Mapping[str, Any] | RetryPolicy | None, base: RetryPolicy | None = None
    ) -> RetryPolicy:
        """Build a policy from a dict of its fields, or of kombu's ``retry_policy`` keys.

        Values may be strings (as Spark options and environment variables are); ``"none"`` or an
        empty string for ``max_attempts``/``max_retries``/``deadline`` means no limit. kombu's
        ``max_retries`` counts retries (attempts = retries + 1), its intervals grow linearly by
        ``interval_step`` up to ``interval_max``. Fields not given come from ``base`` (default:
        ``RetryPolicy()``), so ``{"deadline": 30}`` changes only the deadline.
        """
        base = base if base is not None else cls()
        if config is None:
            return base
        if isinstance(config, RetryPolicy):
            return config
        if not isinstance(config, Mapping):
            raise ConfigurationError(
                f"a retry policy must be a RetryPolicy or a mapping, not {type(config).__name__}"
            )
        fields = set(cls.__dataclass_fields__)
        unknown = sorted(set(config) - fields - _KOMBU_KEYS)
        if unknown:
            raise ConfigurationError(
                f"unknown retry policy key {unknown[0]!r} "
                f"(known: {', '.join(sorted(fields | _KOMBU_KEYS))})"
            )
        values: dict[str, Any] = {}
        if _KOMBU_KEYS & set(config):
            # kombu: interval_start, then + interval_step each retry, capped at interval_max.
            values.update(multiplier=1.0, jitter=0.0)
            if "max_retries" in config:
                retries = _optional_int("max_retries", config["max_retries"])
                values["max_attempts"] = None if retries is None else retries + 1
            if "interval_start" in config:
                values["initial_delay"] = _float("interval_start", config["interval_start"])
            if "interval_step" in config:
                values["step"] = _float("interval_step", config["interval_step"])
            if "interval_max" in config:
                values["max_delay"] = _float("interval_max", config["interval_max"])
        for name in fields & set(config):
            raw = config[name]
            if name == "max_attempts":
                values[name] = _optional_int(name, raw)
            elif name == "deadline":
                values[name] = None if _is_none(raw) else _float(name, raw)
            else:
                values[name] = _float(name, raw)
        return replace(base, **values)


class _PolicyWait(tenacity.wait.wait_base):
    """tenacity wait strategy computed by a :class:`RetryPolicy`."""

    def __init__(self, policy: RetryPolicy) -> None:
        self._policy = policy

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        return self._policy.delay(retry_state.attempt_number)


def _is_none(raw: object) -> bool:
    return raw is None or (isinstance(raw, str) and raw.strip().lower() in ("", "none", "null"))


def _optional_int(name: str, raw: object) -> int | None:
    if _is_none(raw):
        return None
    try:
        if isinstance(raw, str):
            value = int(raw.strip())
        elif isinstance(raw, SupportsInt):  # int, float, Decimal, ...
            value = int(raw)
        else:
            raise TypeError(raw)
    except (TypeError, ValueError, OverflowError):
        raise ConfigurationError(f"{name} must be a whole number or none, got {raw!r}") from None
    if isinstance(raw, float) and raw != value:
        raise ConfigurationError(f"{name} must be a whole number or none, got {raw!r}")
    return value


def _float(name: str, raw: object) -> float:
    if isinstance(raw, bool):
        raise ConfigurationError(f"{name} must be a number of seconds, got {raw!r}")
    try:
        if isinstance(raw, (str, SupportsFloat)):
            return float(raw)
        raise TypeError(raw)
    except (TypeError, ValueError, OverflowError):
        raise ConfigurationError(f"{name} must be a number, got {raw!r}") from None
