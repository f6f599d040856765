"""Upgrading a live system: migrations that change ``pgqueue_jobs`` (tests/upgrade/migrations: a
new column, then a concurrent index) applied while jobs are enqueued at a steady rate and
processed, with and without an old transaction holding a lock on the table.

An ``ALTER TABLE`` waits for an ACCESS EXCLUSIVE lock, and every enqueue, claim and ack that
arrives meanwhile queues behind its request: without a bounded lock wait, one long transaction
stalls the whole queue for as long as it lasts.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

import pgqueue
from pgqueue.migrate import migrate
from tests.helpers import wait_until, worker_process
from tests.upgrade import TEST_VERSIONS, UPGRADE, Migrator, backend_waiting, upgraded

pytestmark = pytest.mark.acceptance

APP = "tests.upgrade.app:app"
LOCK_TIMEOUT = 0.3
#: What an enqueue may take beyond the lock timeout on a loaded 2-core machine.
SLACK = 2.0

Conn = psycopg.Connection[tuple[Any, ...]]


class Steady(threading.Thread):
    """Calls ``action`` every ``interval`` seconds until stopped, timing each call: a producer (or
    an old release's worker) that keeps going while the schema changes under it."""

    def __init__(self, action: Callable[[], object], interval: float) -> None:
        super().__init__(daemon=True)
        self.action = action
        self.interval = interval
        self.calls: list[tuple[float, float]] = []  # (started, seconds it took)
        self.errors: list[BaseException] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            started = time.monotonic()
            try:
                self.action()
            except BaseException as exc:  # kept for the test to report
                self.errors.append(exc)
                return
            self.calls.append((started, time.monotonic() - started))
            self.stopping.wait(self.interval)

    def done_since(self, moment: float) -> int:
        return sum(1 for started, _ in self.calls if started >= moment)

    def worst(self) -> float:
        return max(took for _, took in self.calls)

    def stop(self) -> None:
        self.stopping.set()
        self.join(30)
        assert self.errors == [], self.errors


def count(conn: Conn, query: str) -> int:
    row = conn.execute(query).fetchone()
    assert row is not None
    return int(row[0])


def succeeded(conn: Conn) -> int:
    """Jobs done; -1 while the table cannot be read (the observer must not queue behind a
    migration's lock request forever either)."""
    try:
        return count(conn, "SELECT count(*) FROM pgqueue_jobs WHERE status = 'succeeded'")
    except psycopg.errors.LockNotAvailable:
        return -1


@pytest.fixture
def observer(dsn: str) -> Iterator[Conn]:
    """The test's own connection, whose reads give up after a short lock wait."""
    with psycopg.connect(dsn, autocommit=True) as connection:
        connection.execute("SET lock_timeout = '500ms'")
        yield connection


@pytest.fixture
def producer(app: pgqueue.App) -> Iterator[Steady]:
    """Enqueues a job every 20 ms (50 a second) through the app's pool, as a web app would."""
    steady = Steady(lambda: app.enqueue("touch", {}, allow_unknown=True), 0.02)
    try:
        yield steady
    finally:
        steady.stopping.set()
        steady.join(30)


def test_an_old_transaction_does_not_stall_the_queue_while_a_migration_waits_for_it(
    dsn: str, observer: Conn, producer: Steady
) -> None:
    conn = observer
    with worker_process(dsn, "--concurrency", "4", app=APP):
        producer.start()
        wait_until(lambda: succeeded(conn) >= 20, timeout=30, what="the worker runs jobs")

        # An old transaction that read the table: its ACCESS SHARE lock is held until it ends.
        blocker = psycopg.connect(dsn, application_name="report")
        blocker.execute("SELECT count(*) FROM pgqueue_jobs")
        migrator = Migrator(dsn, UPGRADE, lock_timeout=LOCK_TIMEOUT, timeout=120)
        done_before = succeeded(conn)
        try:
            migrator.start()
            wait_until(lambda: backend_waiting(conn, "migrator"), what="the migration waits")
            waiting_since = time.monotonic()

            # While the migration waits, jobs are enqueued and completed at the usual pace,
            # through many of its tries.
            wait_until(
                lambda: (
                    producer.done_since(waiting_since) >= 100
                    and succeeded(conn) - done_before >= 100
                    and time.monotonic() - waiting_since >= 10 * LOCK_TIMEOUT
                ),
                timeout=30,
                what="enqueues and completions go on while the migration waits",
            )
            assert migrator.is_alive() and not upgraded(conn)
        finally:
            blocker.rollback()
            blocker.close()

        # Once the old transaction ends, the migration completes.
        assert migrator.finish() == TEST_VERSIONS
        assert upgraded(conn)
        after_upgrade = time.monotonic()
        wait_until(
            lambda: producer.done_since(after_upgrade) >= 20,
            timeout=30,
            what="enqueues go on after the upgrade",
        )
        producer.stop()
        enqueued = len(producer.calls)
        wait_until(
            lambda: succeeded(conn) == enqueued,
            timeout=60,
            what="every enqueued job succeeds",
        )
    assert producer.worst() < LOCK_TIMEOUT + SLACK, (
        f"an enqueue waited {producer.worst():.2f} s behind the migration"
    )
    assert count(conn, "SELECT count(*) FROM pgqueue_jobs") == enqueued


# What a worker of the release before the upgrade does: its claim, heartbeat and ack, against the
# columns of version 4 (a worker of this release may not run on an older schema; one of the last
# release keeps running while the new schema arrives, which is what a rolling deploy does).
OLD_CLAIM = """
UPDATE pgqueue_jobs j
SET status = 'running', attempts = j.attempts + 1, lease_token = %(token)s,
    lease_expires_at = now() + interval '30 seconds', worker_id = %(worker)s,
    claimed_at = now(), started_at = now()
FROM (SELECT id FROM pgqueue_jobs
      WHERE status IN ('queued', 'retrying') AND run_at <= now()
      ORDER BY priority DESC, run_at, id
      LIMIT 10
      FOR UPDATE SKIP LOCKED) c
WHERE j.id = c.id
RETURNING j.id
"""
OLD_HEARTBEAT = """
UPDATE pgqueue_jobs SET lease_expires_at = now() + interval '30 seconds'
WHERE id = ANY(%(ids)s) AND lease_token = %(token)s AND status = 'running'
"""
OLD_ACK = """
UPDATE pgqueue_jobs
SET status = 'succeeded', finished_at = now(), result = 'null', lease_token = NULL,
    lease_expires_at = NULL
WHERE id = ANY(%(ids)s) AND lease_token = %(token)s AND status = 'running'
"""
OLD_ENQUEUE = "INSERT INTO pgqueue_jobs (queue, task, args) VALUES ('default', 'touch', '{}')"


class OldWorker:
    """Claims, heartbeats and acks as the last release's worker does, on a connection of its own
    (prepared statements included: psycopg prepares them after five runs, and they must survive
    the schema change)."""

    def __init__(self, dsn: str) -> None:
        self.conn: Conn = psycopg.connect(dsn, autocommit=True)
        self.id = uuid.uuid4()

    def step(self) -> None:
        token = uuid.uuid4()
        ids = [r[0] for r in self.conn.execute(OLD_CLAIM, {"token": token, "worker": self.id})]
        if ids:
            self.conn.execute(OLD_HEARTBEAT, {"ids": ids, "token": token})
            self.conn.execute(OLD_ACK, {"ids": ids, "token": token})


def test_an_upgrade_from_version_4_to_the_latest_with_live_workers(empty_dsn: str) -> None:
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute("SET lock_timeout = '500ms'")
        assert migrate(conn, migrations=[m for m in UPGRADE if m.version <= 4]) == [1, 2, 3, 4]
        producer_conn: Conn = psycopg.connect(empty_dsn, autocommit=True)
        workers = [OldWorker(empty_dsn) for _ in range(2)]
        producer = Steady(lambda: producer_conn.execute(OLD_ENQUEUE), 0.01)
        old_workers = [Steady(w.step, 0.01) for w in workers]
        try:
            for thread in [producer, *old_workers]:
                thread.start()
            wait_until(lambda: succeeded(conn) >= 50, timeout=30, what="old workers run jobs")

            migrator = Migrator(empty_dsn, UPGRADE, lock_timeout=LOCK_TIMEOUT, timeout=120)
            migrator.start()
            applied = migrator.finish()
            assert applied == [m.version for m in UPGRADE if m.version > 4]
            assert upgraded(conn)

            # The old release carries on against the new schema.
            after = time.monotonic()
            done = succeeded(conn)
            wait_until(
                lambda: producer.done_since(after) >= 50 and succeeded(conn) >= done + 50,
                timeout=30,
                what="old workers run jobs on the upgraded schema",
            )
            producer.stop()
            enqueued = len(producer.calls)
            wait_until(lambda: succeeded(conn) == enqueued, timeout=30, what="all jobs succeed")
            for thread in old_workers:
                thread.stop()
            worst = max(t.worst() for t in [producer, *old_workers])
            assert worst < LOCK_TIMEOUT + SLACK, f"a statement waited {worst:.2f} s"
        finally:
            for thread in [producer, *old_workers]:
                thread.stopping.set()
                thread.join(30)
            producer_conn.close()
            for w in workers:
                w.conn.close()
        rows = conn.execute("SELECT version FROM pgqueue_migrations ORDER BY 1").fetchall()
        assert [r[0] for r in rows] == [m.version for m in UPGRADE]
