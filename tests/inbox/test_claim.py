"""The inbox's guarantees at the storage level, on the real PostgreSQL, MariaDB and SQLite:
duplicates give one effect, two transactions racing on one claim give exactly one True (the
loser waits, then answers as the winner ended), a handler that fails after claiming is retried
and takes effect once, a delivery without an id is refused, prune removes old rows in batches
without holding up a writer's claims, install is idempotent, and the attempts ledger counts
redeliveries outside the handler's transaction."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from typing import Any

import psycopg
import pytest

from reliable_amqp import ConfigurationError, ReliableAmqpError
from reliable_amqp.inbox import Inbox, MissingMessageId
from support.inbox import Database, FakeDelivery, fetch, run
from support.outbox import wait_until


def _installed(db: Database, inbox: Inbox) -> Any:
    conn = db.connect()
    inbox.install(conn)
    inbox.install(conn)  # idempotent
    conn.commit()
    db.create_effects(conn)
    return conn


def _effect(delivery: FakeDelivery, conn: Any) -> None:
    run(conn, "INSERT INTO effects (message_id, note) VALUES (%s, %s)", (delivery.message_id, "x"))


def test_duplicates_give_one_effect_each(db: Database) -> None:
    inbox = Inbox("billing")
    check = _installed(db, inbox)
    conn = db.connect()  # one long-lived connection, given as it is (left open)
    handler = inbox.handler(lambda: contextlib.nullcontext(conn), _effect)
    ids = [f"m{i}" for i in range(40)]
    copies = [FakeDelivery(i) for i in ids] + [FakeDelivery(i, redelivered=True) for i in ids]
    random.Random(1).shuffle(copies)
    for delivery in copies:
        handler(delivery)
    assert db.effects(check) == sorted(ids)
    assert inbox.stats.claimed == 40 and inbox.stats.duplicates == 40
    # another scope handles the same messages once of its own
    other = Inbox("shipping").handler(db.connect, _effect)
    for delivery in copies[:10]:
        other(delivery)
    assert len(db.effects(check)) == 40 + len({d.message_id for d in copies[:10]})
    check.close()
    conn.close()


def test_a_handler_that_fails_after_claiming_is_retried_and_takes_effect_once(
    db: Database,
) -> None:
    inbox = Inbox("billing")
    check = _installed(db, inbox)
    failures = {"m1": 2}

    def handle(delivery: FakeDelivery, conn: Any) -> None:
        _effect(delivery, conn)
        key = str(delivery.message_id)
        if failures.get(key, 0) > 0:
            failures[key] -= 1
            raise RuntimeError("crash after the claim and the effect")

    handler = inbox.handler(db.connect, handle)
    for attempt in (1, 2):
        with pytest.raises(RuntimeError):
            handler(FakeDelivery("m1", redelivered=attempt > 1))
        # the claim rolled back with the effect
        assert fetch(check, "SELECT count(*) FROM amqp_inbox")[0][0] == 0
        check.commit()
    handler(FakeDelivery("m1", redelivered=True))
    handler(FakeDelivery("m1", redelivered=True))  # a duplicate of the handled one
    assert db.effects(check) == ["m1"]
    check.close()


def _lock_waits(db: Database, admin: Any) -> int:
    """Sessions waiting on a row lock right now (PostgreSQL, MariaDB)."""
    if db.dialect == "postgresql":
        sql = (
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND datname = current_database()"
        )
    else:
        sql = "SELECT count(*) FROM information_schema.innodb_trx WHERE trx_state = 'LOCK WAIT'"
    rows = fetch(admin, sql)
    admin.commit()
    return int(rows[0][0])


@pytest.mark.parametrize("winner_commits", [True, False], ids=["commit", "rollback"])
def test_two_transactions_racing_on_one_claim(db: Database, winner_commits: bool) -> None:
    """The second claim waits for the first transaction, then answers as it ended: False after
    its commit, True after its rollback. Exactly one effect either way."""
    inbox = Inbox("billing")
    check = _installed(db, inbox)
    first, second = db.connect(), db.connect()
    delivery = FakeDelivery("race-1")
    assert inbox.claim(first, delivery) is True
    _effect(delivery, first)
    started, done = threading.Event(), threading.Event()
    result: dict[str, Any] = {}

    def loser() -> None:
        started.set()
        try:
            result["claimed"] = inbox.claim(second, delivery)
            if result["claimed"]:
                _effect(delivery, second)
            second.commit()
            result["at"] = time.monotonic()
        except BaseException as exc:
            result["error"] = exc
        finally:
            done.set()

    thread = threading.Thread(target=loser, daemon=True)
    thread.start()
    assert started.wait(10)
    if db.dialect != "sqlite":  # the database shows the second claim waiting on the row lock
        admin = db.connect()
        wait_until(lambda: _lock_waits(db, admin) >= 1, 20, "the second claim waits on the lock")
        admin.close()
        assert not done.is_set()
    ended = time.monotonic()
    if winner_commits:
        first.commit()
    else:
        first.rollback()
    assert done.wait(30), "the second claim did not return after the first transaction ended"
    thread.join(5)
    assert "error" not in result, result.get("error")
    assert result["claimed"] is (not winner_commits)
    assert result["at"] >= ended
    assert db.effects(check) == ["race-1"]
    for conn in (first, second, check):
        conn.close()


def test_a_delivery_without_message_id_is_refused(db: Database) -> None:
    inbox = Inbox("billing")
    conn = _installed(db, inbox)
    for missing in (None, ""):
        with pytest.raises(MissingMessageId) as caught:
            inbox.claim(conn, FakeDelivery(missing))
        assert isinstance(caught.value, ReliableAmqpError)
        assert "key=" in str(caught.value)
        with pytest.raises(MissingMessageId):
            inbox.handler(db.connect, _effect)(FakeDelivery(missing))
    # a key the caller derives takes its place, and dedups like an id
    assert inbox.claim(conn, FakeDelivery(None), key="order-7") is True
    conn.commit()
    assert inbox.claim(conn, FakeDelivery(None), key="order-7") is False
    conn.commit()
    assert fetch(conn, "SELECT count(*) FROM amqp_inbox")[0][0] == 1
    conn.close()


def test_a_claim_that_would_commit_on_its_own_is_refused(pg_dsn: str) -> None:
    inbox = Inbox("billing")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        inbox.install(conn)
        with pytest.raises(ConfigurationError, match=r"claim\(\).*autocommit"):
            inbox.claim(conn, FakeDelivery("m1"))
        with conn.transaction():  # inside a transaction block it is fine
            assert inbox.claim(conn, FakeDelivery("m1")) is True


def test_prune_removes_old_rows_in_batches_while_a_writer_claims(db: Database) -> None:
    """20,000 rows older than the retention, pruned 1,000 a statement while another connection
    claims new messages without pause: every old row goes, every new claim stays, and claims
    complete between prune's batches."""
    inbox = Inbox("billing")
    setup = _installed(db, inbox)
    old = time.time() - 10 * 86400
    mark = "?" if db.dialect == "sqlite" else "%s"
    rows = [("billing", f"old-{i}", old + i * 0.001) for i in range(20_000)]
    cur = setup.cursor()
    cur.executemany(
        f"INSERT INTO amqp_inbox (scope, message_id, claimed_at) VALUES ({mark}, {mark}, {mark})",
        rows,
    )
    setup.commit()
    stop, first = threading.Event(), threading.Event()
    latencies: list[tuple[float, float]] = []  # (started, seconds) of each claim
    errors: list[BaseException] = []

    def writer() -> None:
        conn = db.connect()
        try:
            n = 0
            while not stop.is_set():
                start = time.monotonic()
                claimed = inbox.claim(conn, FakeDelivery(f"new-{n}"))
                latencies.append((start, time.monotonic() - start))
                assert claimed
                conn.commit()
                n += 1
                first.set()
        except BaseException as exc:
            errors.append(exc)
            first.set()
        finally:
            conn.close()

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    assert first.wait(30)
    pruner = db.connect()
    began = time.monotonic()
    pruned = inbox.prune(pruner, older_than=86400, batch=1000)
    ended = time.monotonic()
    stop.set()
    thread.join(30)
    assert not errors, errors
    assert pruned == 20_000
    assert fetch(setup, "SELECT count(*) FROM amqp_inbox WHERE message_id LIKE 'old-%%'")[0][0] == 0
    kept = fetch(setup, "SELECT count(*) FROM amqp_inbox")[0][0]
    setup.commit()
    assert kept == len(latencies)  # every committed claim is still there
    # claims started and committed while prune ran: prune goes in batches and claims go on
    # between them. One lock over the whole prune would hold every claim started after it took
    # the lock until the prune ended: none could complete inside it. (No bound on a claim's
    # latency here: on a loaded machine one claim can stall as long as a short prune.)
    inside = [seconds for start, seconds in latencies if began <= start and start + seconds < ended]
    worst = max(seconds for _, seconds in latencies)
    print(f"{db.dialect}: prune {ended - began:.3f} s, {len(inside)} claims completed meanwhile, "
          f"worst claim {worst * 1000:.1f} ms")  # fmt: skip
    assert len(inside) >= 3, f"{len(inside)} claims completed while prune ran"
    assert inbox.prune(pruner, older_than=86400) == 0
    for conn in (pruner, setup):
        conn.close()


def test_prune_inside_the_callers_transaction_leaves_the_commit_to_it(db: Database) -> None:
    inbox = Inbox("billing")
    conn = _installed(db, inbox)
    assert inbox.claim(conn, FakeDelivery("a")) is True
    conn.commit()
    assert inbox.claim(conn, FakeDelivery("b")) is True  # a transaction left open
    assert inbox.prune(conn, older_than=0, batch=1) == 2
    conn.rollback()
    assert fetch(conn, "SELECT count(*) FROM amqp_inbox")[0][0] == 1  # "a" came back
    conn.commit()
    # another scope's rows are not this inbox's to prune, unless asked for all scopes
    assert Inbox("shipping").prune(conn, older_than=0) == 0
    assert Inbox("shipping").prune(conn, older_than=0, all_scopes=True) == 1
    conn.close()


def test_the_attempts_ledger_counts_redeliveries_outside_the_handlers_transaction(
    db: Database,
) -> None:
    inbox = Inbox("billing")
    check = _installed(db, inbox)
    ledger = db.connect()

    def ledger_rows() -> list[tuple[Any, ...]]:
        rows = fetch(
            check,
            "SELECT message_id, attempt, redeliveries FROM amqp_inbox_attempts ORDER BY attempt",
        )
        check.commit()
        # MariaDB's keys are varbinary (byte for byte): read back as bytes
        return [(bytes(r[0]).decode(), *r[1:]) if db.dialect == "mysql" else tuple(r) for r in rows]

    # a first delivery pays nothing: no statement, no row
    assert inbox.record_attempt(ledger, FakeDelivery("m1")) == 1
    assert ledger_rows() == []
    # each redelivery is counted and committed at once, whatever the handler does next
    handler_conn = db.connect()
    for expected in (2, 3, 4):
        assert inbox.record_attempt(ledger, FakeDelivery("m1", redelivered=True)) == expected
        assert inbox.claim(handler_conn, FakeDelivery("m1")) is True
        handler_conn.rollback()  # the handler crashed: its transaction is gone, not the count
    assert ledger_rows() == [("m1", 1, 3)]
    # a factory opens a connection of its own (closed afterwards)
    assert inbox.record_attempt(db.connect, FakeDelivery("m1", redelivered=True)) == 5
    # a copy the consumer republished (attempt 3 in its header) counts from its own number;
    # Delivery.attempt says 3, then 4 once redelivered (the header plus one): the ledger
    # agrees the first time and counts on where the broker's flag cannot
    third = {"x-consume-attempt": 3}
    assert inbox.record_attempt(ledger, FakeDelivery("m1", headers=third, attempt=3)) == 3
    for expected in (4, 5):
        copy = FakeDelivery("m1", redelivered=True, headers=third, attempt=4)
        assert inbox.record_attempt(ledger, copy) == expected
    # a quorum queue's x-delivery-count, in Delivery.attempt, wins when it says more
    quorum = FakeDelivery("m1", redelivered=True, headers=third, attempt=9)
    assert inbox.record_attempt(ledger, quorum) == 9
    assert ledger_rows() == [("m1", 1, 4), ("m1", 3, 3)]
    # the handler's connection, with its transaction open, is refused
    assert inbox.claim(handler_conn, FakeDelivery("m2")) is True
    with pytest.raises(ConfigurationError, match="transaction of its own"):
        inbox.record_attempt(handler_conn, FakeDelivery("m2", redelivered=True))
    handler_conn.rollback()
    # once handled, the message's ledger rows go with the handler's commit
    inbox.handler(db.connect, _effect)(FakeDelivery("m1", redelivered=True))
    assert ledger_rows() == []
    assert db.effects(check) == ["m1"]
    for conn in (ledger, handler_conn, check):
        conn.close()


def test_install_twice_and_ddl() -> None:
    inbox = Inbox("billing", table="app.inbox")
    for dialect in ("postgresql", "sqlite", "mysql"):
        text = inbox.ddl(dialect)
        assert "IF NOT EXISTS" in text and "claimed_at" in text
    with pytest.raises(ConfigurationError):
        inbox.ddl("oracle")
    with pytest.raises(ConfigurationError):
        Inbox("billing", table="bad name")
    with pytest.raises(ConfigurationError):
        Inbox("")
    with pytest.raises(ConfigurationError):
        inbox.key_of(FakeDelivery("x" * 256))


def test_two_handlers_racing_on_the_same_duplicates_give_one_effect_each(db: Database) -> None:
    """Two threads, each with its own connections, run the handler over the same 150 ids in
    different orders (each id twice per thread): exactly one effect per id, and every id was
    claimed by exactly one of them."""
    inbox = Inbox("billing")
    check = _installed(db, inbox)
    ids = [f"r{i}" for i in range(150)]
    errors: list[BaseException] = []
    go = threading.Barrier(2)

    def worker(seed: int) -> None:
        conn = db.connect()  # one connection a thread, given as it is
        run_one = inbox.handler(lambda: contextlib.nullcontext(conn), _effect)
        copies = [FakeDelivery(i) for i in ids] * 2
        random.Random(seed).shuffle(copies)
        try:
            go.wait(30)
            for delivery in copies:
                run_one(delivery)
        except BaseException as exc:
            errors.append(exc)
        finally:
            conn.close()

    threads = [threading.Thread(target=worker, args=(seed,), daemon=True) for seed in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    assert db.effects(check) == sorted(ids)
    assert inbox.stats.claimed == len(ids) and inbox.stats.duplicates == 3 * len(ids)
    check.close()


def test_repeatable_read_raises_a_serialization_failure_then_the_retry_skips(pg_dsn: str) -> None:
    """PostgreSQL under REPEATABLE READ: a claim meeting a key committed after the snapshot was
    taken raises (the handler fails and the message is retried); the retry returns False."""
    inbox = Inbox("billing")
    with psycopg.connect(pg_dsn) as conn:
        inbox.install(conn)
    first, second = psycopg.connect(pg_dsn), psycopg.connect(pg_dsn)
    second.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    second.execute("SELECT 1")  # the snapshot is taken here
    assert inbox.claim(first, FakeDelivery("m1")) is True
    first.commit()
    with pytest.raises(psycopg.errors.SerializationFailure):
        inbox.claim(second, FakeDelivery("m1"))
    second.rollback()
    assert inbox.claim(second, FakeDelivery("m1")) is False
    second.rollback()
    for conn in (first, second):
        conn.close()
