"""Configuring retry policies: how often, how far apart, for how long.

Two policies govern a publisher: ``nack_policy`` (what happens when the broker nacks a message)
and ``connect_policy`` (first connection and reconnects). Both are ``RetryPolicy`` objects, and
both accept plain dicts, kombu's ``retry_policy`` keys, or strings (command-line flags, Spark
options, environment variables). This example prints what each form means, then shows a nack
policy at work: a full queue nacks a message, the policy retries it with backoff, and it is
confirmed once a consumer makes room.
"""

from __future__ import annotations

import os
import sys
import time
import uuid

import pika

from reliable_amqp import Publisher, PublisherOptions, RetryPolicy

URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")


def schedule(policy: RetryPolicy, failures: int = 12) -> str:
    """The waits (without jitter) after 1, 2, ... failures, while the policy allows another try."""
    waits: list[str] = []
    elapsed = 0.0
    for n in range(1, failures + 1):
        if not policy.allows(n, elapsed):
            return ", ".join(waits) + f"; then it gives up ({n} attempts)"
        waits.append(f"{policy.base_delay(n):g}s")
        elapsed += policy.base_delay(n)
    return ", ".join(waits) + ", ..."


def show_policies() -> None:
    exponential = RetryPolicy(max_attempts=6, initial_delay=0.1, max_delay=1.0, multiplier=2.0)
    print(f"exponential:  {exponential}\n  waits: {schedule(exponential)}")

    # kombu's retry_policy: max_retries counts retries (attempts = retries + 1) and the wait grows
    # linearly by interval_step up to interval_max.
    kombu = RetryPolicy.from_dict(
        {"max_retries": 3, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.5}
    )
    print(f"kombu keys:   {kombu}\n  waits: {schedule(kombu)}")

    # A deadline bounds the total time, whatever the count.
    bounded = RetryPolicy(max_attempts=None, initial_delay=1, max_delay=8, deadline=20)
    print(f"deadline:     {bounded}\n  waits: {schedule(bounded, 10)}")

    # Strings, as from flags or environment variables: dotted keys build the policies.
    options = PublisherOptions.from_strings(
        URL,
        {
            "nack_policy.max_attempts": "10",
            "nack_policy.initial_delay": "0.05",
            "connect_policy.deadline": "30",
            "delivery_timeout": "60",
        },
    )
    print(f"from strings: nack_policy={options.nack_policy}")
    print(f"              connect_policy={options.connect_policy}")


def nack_policy_at_work() -> bool:
    queue = f"example-retry-{uuid.uuid4().hex[:8]}"
    admin = pika.BlockingConnection(pika.URLParameters(URL))  # plays the consumer
    channel = admin.channel()
    try:
        channel.queue_declare(
            queue, durable=True, arguments={"x-max-length": 2, "x-overflow": "reject-publish"}
        )
        # --8<-- [start:at-work]
        patient = RetryPolicy(max_attempts=20, initial_delay=0.05, max_delay=0.2, jitter=0.0)
        with Publisher(URL, nack_policy=patient) as publisher:
            futures = [publisher.publish("", queue, b"job %d" % i) for i in range(3)]
            time.sleep(0.5)  # job 2 is being nacked and retried meanwhile
            _method, _, body = channel.basic_get(queue, auto_ack=True)  # make room for one
            print(f"consumer took {body!r}; job 2 gets in on its next retry")
            publisher.flush(timeout=10)
        # --8<-- [end:at-work]
        ok = True
        for i, future in enumerate(futures):
            error = future.exception()
            if error is None:
                print(f"job {i}: confirmed after {future.result().attempts} attempt(s)")
            else:
                print(f"job {i}: {error}")
                ok = False
        return ok and futures[2].result().attempts > 1
    finally:
        channel.queue_delete(queue)
        admin.close()


def main() -> int:
    show_policies()
    print()
    return 0 if nack_policy_at_work() else 1


if __name__ == "__main__":
    sys.exit(main())
