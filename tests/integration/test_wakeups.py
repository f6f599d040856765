"""Producers notify only while some worker waits for work, and a skipped NOTIFY strands no job.

Notifying commits serialise in PostgreSQL, so the trigger skips NOTIFY while every worker is busy
(migration 0004). These tests pin both halves of the protocol on a real database: the trigger's
choice, and the worker's announcement, which must catch producers that looked before it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

import pgqueue
from pgqueue.db import channel_for
from tests.helpers import listening, notifications, running_worker, wait_until_async

Conn = psycopg.Connection[tuple[Any, ...]]
# Polling once a minute: anything that runs within seconds was woken, not polled.
NO_POLL = {"lease": 5.0, "heartbeat_interval": 1.0, "poll_interval": 60.0, "reaper_interval": 1.0}


def waiting_workers(conn: Conn) -> int:
    """Sessions holding the "waiting" advisory lock of the public schema's channel."""
    row = conn.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
        " AND classid::bigint = (hashtext(%s)::bigint + 4294967296) %% 4294967296"
        " AND objid = 1 AND objsubid = 2",
        (channel_for("public"),),
    ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.fixture
def listener(dsn: str) -> Any:
    with listening(dsn) as connection:
        yield connection


def test_producers_notify_only_while_a_worker_waits(
    app: pgqueue.App, listener: Conn, dsn: str
) -> None:
    app.enqueue("t", {}, queue="nobody-waits", allow_unknown=True)
    assert notifications(listener) == []

    with psycopg.connect(dsn, autocommit=True) as worker:
        worker.execute(app.q.announce_waiting)
        app.enqueue("t", {}, queue="one-waits", allow_unknown=True)
        app.enqueue_many([{"task": "t", "queue": "bulk"}] * 3, allow_unknown=True)
        assert notifications(listener, expected=2) == [
            ("pgqueue", "one-waits"),
            ("pgqueue", "bulk"),
        ]

        worker.execute(app.q.withdraw_waiting)
        app.enqueue("t", {}, queue="busy-again", allow_unknown=True)
        assert notifications(listener) == []


def test_enqueuers_settled_until_every_transaction_with_ready_jobs_ends(
    app: pgqueue.App, dsn: str
) -> None:
    def settled(worker: Conn) -> bool:
        row = worker.execute(app.q.enqueuers_settled).fetchone()
        assert row is not None
        return bool(row[0])

    with (
        psycopg.connect(dsn, autocommit=True) as worker,
        psycopg.connect(dsn) as producer,
        psycopg.connect(dsn) as other,
    ):
        assert settled(worker)
        app.enqueue("t", {}, connection=producer, allow_unknown=True)
        app.enqueue("t", {}, connection=other, allow_unknown=True)
        assert not settled(worker)
        producer.commit()
        assert not settled(worker)  # the other one is still open
        other.rollback()
        assert settled(worker)
        # A job due later takes no part: the poll finds it, NOTIFY or not.
        app.enqueue("t", {}, delay=60, connection=producer, allow_unknown=True)
        assert settled(worker)
        producer.rollback()


async def test_a_job_whose_notify_was_skipped_still_wakes_a_worker_that_starts_waiting(
    app: pgqueue.App, listener: Conn, dsn: str
) -> None:
    done: list[int] = []

    @app.task
    async def ping(n: int) -> None:
        done.append(n)

    with psycopg.connect(dsn) as producer:
        # No worker waits yet: the producer looks, finds nobody and skips its NOTIFY, but has not
        # committed when the worker announces itself and makes its first claims.
        ping.configure(connection=producer).enqueue(n=1)
        async with running_worker(app, **NO_POLL) as worker:
            await wait_until_async(lambda: worker.notifier.announced, timeout=10)
            claims = worker.fetcher.claims
            await wait_until_async(lambda: worker.fetcher.claims > claims, timeout=10)
            assert done == []  # it claimed after announcing itself, and found nothing yet
            producer.commit()
            await wait_until_async(lambda: done == [1], timeout=10)
            assert notifications(listener, wait=0.05) == []  # it was not a NOTIFY
            # Once the producer is gone, the waiting worker is notified like before.
            ping.enqueue(n=2)
            await wait_until_async(lambda: done == [1, 2], timeout=10)
            assert notifications(listener, expected=1) == [("pgqueue", "default")]


async def test_a_busy_worker_stops_asking_for_notifications(
    app: pgqueue.App, conn: Conn, listener: Conn
) -> None:
    @app.task
    async def slow(n: int) -> None:
        await asyncio.sleep(0.05)

    def queued() -> int:
        row = conn.execute("SELECT count(*) FROM pgqueue_jobs WHERE status = 'queued'").fetchone()
        assert row is not None
        return int(row[0])

    async with running_worker(app, concurrency=1, **NO_POLL):
        await wait_until_async(lambda: waiting_workers(conn) == 1, timeout=10)
        app.enqueue_many([{"task": "slow", "args": {"n": n}} for n in range(40)])
        # It was waiting: woken by NOTIFY.
        assert notifications(listener, expected=1) == [("pgqueue", "default")]

        # Each claim comes back full: the worker says it no longer waits, producers stop
        # notifying, and it keeps claiming on its own.
        await wait_until_async(lambda: waiting_workers(conn) == 0, timeout=10)
        app.enqueue("slow", {"n": 40})
        assert notifications(listener) == []
        assert queued() > 0

        # Drained: it waits again, and producers wake it.
        await wait_until_async(lambda: queued() == 0, timeout=30)
        await wait_until_async(lambda: waiting_workers(conn) == 1, timeout=10)
        app.enqueue("slow", {"n": 41})
        assert notifications(listener, expected=1) == [("pgqueue", "default")]
        await wait_until_async(lambda: queued() == 0, timeout=10)
