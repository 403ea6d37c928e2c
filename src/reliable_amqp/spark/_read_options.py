"""The options of a read (``spark.read`` / ``spark.readStream`` with format ``"amqp"``).

Checked on the driver, where Spark builds the reader; the result is pickled to the tasks with
each partition. Spark passes option names lower-cased and values as strings; the options Spark
adds itself (``path``, ``checkpointLocation``, ``queryName``) are let through.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from reliable_amqp import ConfigurationError
from reliable_amqp.spark._publish import SPARK_OPTIONS
from reliable_amqp.spark._stream import (
    CONNECTION_OPTIONS,
    Connector,
    connector_from_strings,
    refuse_queue,
    super_stream_partitions,
)

#: the heartbeat a read's connections ask for unless the ``heartbeat`` option says otherwise
READ_HEARTBEAT = 30
#: options of the reader itself (lower-cased, as Spark passes them)
READ_OPTIONS: tuple[str, ...] = (
    "url",
    "stream",
    "superstream",
    "startingoffsets",
    "endingoffsets",
    "maxmessagespertrigger",
    "minpartitions",
    "failondataloss",
    "prefetch",
)


def _spec(name: str, raw: str | None, allowed: tuple[str, ...]) -> str | int | dict[str, int]:
    """``earliest``/``latest``, a number, or a JSON object ``{"stream": number}``."""
    if raw is None:
        raise AssertionError(name)
    value = raw.strip()
    if value.lower() in allowed:
        return value.lower()
    if value.startswith("{"):
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in parsed.values()
        ):
            return {str(k): int(v) for k, v in parsed.items()}
        raise ConfigurationError(f"{name} must map stream names to offsets >= 0, got {raw!r}")
    try:
        number = int(value)
    except ValueError:
        raise ConfigurationError(
            f"{name} must be {', '.join(allowed)}, an offset or a JSON object of offsets, "
            f"got {raw!r}"
        ) from None
    if number < 0:
        raise ConfigurationError(f"{name} must be >= 0, got {raw!r}")
    return number


def _positive(name: str, raw: str) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigurationError(f"{name} must be a whole number >= 1, got {raw!r}")
    return value


@dataclass(frozen=True)
class ReadConfig:
    """A read's options, checked on the driver and pickled to the tasks."""

    connector: Connector
    stream: str | None
    super_stream: str | None
    starting: str | int | dict[str, int]
    ending: str | int | dict[str, int]
    max_per_trigger: int | None
    min_partitions: int
    fail_on_data_loss: bool
    prefetch: int

    @classmethod
    def from_strings(cls, options: Mapping[str, str], streaming: bool) -> ReadConfig:
        """Build from a data source's options (lower-cased keys, string values)."""
        given = {k.lower(): v for k, v in options.items() if k.lower() not in SPARK_OPTIONS}
        unknown = sorted(set(given) - set(READ_OPTIONS) - set(CONNECTION_OPTIONS))
        if unknown:
            raise ConfigurationError(
                f"unknown option {unknown[0]!r} for reading (known: startingOffsets, "
                "endingOffsets, maxMessagesPerTrigger, minPartitions, failOnDataLoss, prefetch, "
                f"stream, superStream, url, {', '.join(CONNECTION_OPTIONS)})"
            )
        url = given.pop("url", None)
        if not url:
            raise ConfigurationError(
                'the amqp data source needs .option("url", "amqp://user:pass@host:5672/vhost")'
            )
        stream, sup = given.pop("stream", None) or None, given.pop("superstream", None) or None
        if (stream is None) == (sup is None):
            raise ConfigurationError(
                'reading needs one of .option("stream", NAME) or .option("superStream", NAME)'
            )
        if "endingoffsets" in given and streaming:
            raise ConfigurationError("endingOffsets is for spark.read (batch) only")
        if "maxmessagespertrigger" in given and not streaming:
            raise ConfigurationError("maxMessagesPerTrigger is for spark.readStream only")
        starting = _spec(
            "startingOffsets",
            given.pop("startingoffsets", "latest" if streaming else "earliest"),
            ("earliest", "latest"),
        )
        ending = _spec("endingOffsets", given.pop("endingoffsets", "latest"), ("latest",))
        per_trigger = given.pop("maxmessagespertrigger", None)
        fail = given.pop("failondataloss", "true").strip().lower()
        if fail not in ("true", "false"):
            raise ConfigurationError(f"failOnDataLoss must be true or false, got {fail!r}")
        urls = [u.strip() for u in url.split(",") if u.strip()]
        connection = {k: v for k, v in given.items() if k in CONNECTION_OPTIONS}
        # a task's connection waits while Spark consumes what it read (pika answers heartbeats
        # only between batches): the publisher's 5 s would drop it under a slow downstream
        connection.setdefault("heartbeat", str(READ_HEARTBEAT))
        limit = _positive("maxMessagesPerTrigger", per_trigger) if per_trigger else None
        return cls(
            connector=connector_from_strings(urls, connection),
            stream=stream,
            super_stream=sup,
            starting=starting,
            ending=ending,
            max_per_trigger=limit,
            min_partitions=_positive("minPartitions", given.pop("minpartitions", "1")),
            fail_on_data_loss=fail == "true",
            prefetch=_positive("prefetch", given.pop("prefetch", "2000")),
        )

    def streams(self) -> list[str]:
        """The streams to read (a super stream's partitions, found on the broker), each checked
        to be a stream; raises :class:`NotAStream` for a queue."""

        def found(connection: Any) -> list[str]:
            if self.super_stream is not None:
                names = super_stream_partitions(connection, self.super_stream)
            else:
                assert self.stream is not None
                names = [self.stream]
            for name in names:
                refuse_queue(name, connection)
            return names

        return self.connector.probing(found)
