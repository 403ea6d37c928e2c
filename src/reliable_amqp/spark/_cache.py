"""The per-process publisher cache (like Spark's Kafka producer cache).

Each Python worker process keeps one :class:`Publisher` per distinct set of publisher options;
the tasks it runs reuse it. A publisher that closed is rebuilt on the next task; a forked child
starts with an empty cache (the parent's I/O threads are not in it).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading

from reliable_amqp import Publisher, PublisherOptions, State

log = logging.getLogger("reliable_amqp.spark")

_cache: dict[PublisherOptions, Publisher] = {}
_tags: dict[PublisherOptions, tuple[Publisher, str]] = {}  # "pid:serial" per built publisher
_built = [0]  # publishers built by this process
_cache_lock = threading.Lock()
_cache_owner = [os.getpid()]  # the pid the cache belongs to


def cached_publisher(options: PublisherOptions) -> Publisher:
    """The process's publisher for ``options``: reused across tasks, rebuilt if it closed."""
    with _cache_lock:
        if _cache_owner[0] != os.getpid():  # a forked child: the parent's I/O threads are gone
            _cache.clear()
            _tags.clear()
            _cache_owner[0] = os.getpid()
        publisher = _cache.get(options)
        if publisher is not None and publisher.state in (State.CLOSING, State.CLOSED):
            del _cache[options]
            publisher = None
        if publisher is None:
            publisher = Publisher(list(options.urls), **options.kwargs())
            _cache[options] = publisher
            _built[0] += 1
            _tags[options] = (publisher, f"{os.getpid()}:{_built[0]}")
        return publisher


def publisher_tag(options: PublisherOptions, publisher: Publisher) -> str:
    """``"pid:serial"`` naming a publisher this process built for ``options`` (else ``""``)."""
    with _cache_lock:
        built, tag = _tags.get(options, (None, ""))
        return tag if built is publisher else ""


def retire_publisher(options: PublisherOptions, publisher: Publisher, timeout: float = 0) -> None:
    """Drop ``publisher`` from the cache and close it (what it still holds fails as closed)."""
    with _cache_lock:
        if _cache.get(options) is publisher:
            del _cache[options]
    try:
        publisher.close(timeout)
    except Exception:  # closing a broken publisher must not hide why it was retired
        log.debug("reliable-amqp: closing a retired publisher failed", exc_info=True)


def close_cached_publishers(timeout: float = 5.0) -> None:
    """Close every cached publisher of this process (at exit; also handy in tests)."""
    with _cache_lock:
        publishers = list(_cache.items())
        _cache.clear()
    for _options, publisher in publishers:
        try:
            publisher.close(timeout)
        except Exception:
            log.debug("reliable-amqp: closing a cached publisher failed", exc_info=True)


atexit.register(close_cached_publishers)
