"""Producers notify only while some worker waits for work, and a skipped NOTIFY strands no job.

Notifying commits serialise in PostgreSQL, so the trigger skips NOTIFY while every worker is busy
(migration 0004). These tests pin both halves of the protocol on a real database: the trigger's
choice, and the worker's announcement, which must catch producers that looked before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
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
    """Sessions holding the "waiting" advisory lock of the public schema's channel, in this
    test's database (pg_locks shows every database's, and tests run in parallel)."""
    row = conn.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
        " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
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


def test_the_trigger_function_is_called_only_while_a_worker_waits(
    app: pgqueue.App, dsn: str
) -> None:
    """The look for a waiting worker is the trigger's WHEN (migration 0019): on a busy system,
    where nobody waits, an insert calls no PL/pgSQL function at all (it cost a single enqueue
    0.04 ms of its 0.28 on the server)."""

    def calls_of_one_insert(producer: Conn) -> int:
        with producer.transaction():
            try:
                producer.execute("SET LOCAL track_functions = 'pl'")
            except psycopg.errors.InsufficientPrivilege:
                pytest.skip("SET track_functions needs a superuser")
            before = calls(producer)
            producer.execute("INSERT INTO pgqueue_jobs (queue, task, args) VALUES ('q', 't', '{}')")
            return calls(producer) - before

    def calls(producer: Conn) -> int:
        # Before and after, in one transaction: the view also shows calls of earlier
        # transactions whose statistics the session has not sent yet (PostgreSQL 15).
        row = producer.execute(
            "SELECT coalesce(sum(calls), 0) FROM pg_stat_xact_user_functions"
            " WHERE funcname = 'pgqueue_notify_ready'"
        ).fetchone()
        assert row is not None
        return int(row[0])

    with (
        psycopg.connect(dsn, autocommit=True) as producer,
        psycopg.connect(dsn, autocommit=True) as worker,
    ):
        assert calls_of_one_insert(producer) == 0
        worker.execute(app.q.announce_waiting)
        assert calls_of_one_insert(producer) == 1
        worker.execute(app.q.withdraw_waiting)
        assert calls_of_one_insert(producer) == 0


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
        # A job due later takes part too: a waiting worker sleeps until the earliest due job
        # it knows of, so it must not miss one whose NOTIFY was skipped (migration 0005).
        app.enqueue("t", {}, delay=60, connection=producer, allow_unknown=True)
        assert not settled(worker)
        producer.rollback()
        assert settled(worker)


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


# --- every way a job becomes ready wakes an idle worker ----------------------------------------


def status(conn: Conn, job_id: int) -> str | None:
    row = conn.execute("SELECT status::text FROM pgqueue_jobs WHERE id = %s", (job_id,)).fetchone()
    return None if row is None else str(row[0])


def started_at(conn: Conn, job_id: int) -> float | None:
    """Seconds from the job's run_at to its last claim (None until claimed)."""
    row = conn.execute(
        "SELECT extract(epoch FROM claimed_at - run_at)::float8 FROM pgqueue_jobs WHERE id = %s",
        (job_id,),
    ).fetchone()
    return None if row is None or row[0] is None else float(row[0])


async def test_retry_after_zero_runs_again_at_once(app: pgqueue.App, conn: Conn) -> None:
    attempts: list[float] = []

    @app.task
    async def once_more(ctx: pgqueue.JobContext) -> None:
        attempts.append(time.monotonic())
        if ctx.attempt == 1:
            raise pgqueue.Retry(after=0)

    async with running_worker(app, **NO_POLL) as worker:
        await wait_until_async(lambda: worker.notifier.announced, timeout=10)
        once_more.enqueue()
        await wait_until_async(lambda: len(attempts) == 2, timeout=15)
    assert attempts[1] - attempts[0] < 5  # the poll is a minute away


async def test_a_short_retry_delay_runs_when_due_not_at_the_next_poll(
    app: pgqueue.App, conn: Conn
) -> None:
    attempts: list[float] = []

    @app.task
    async def soon(ctx: pgqueue.JobContext) -> None:
        attempts.append(time.monotonic())
        if ctx.attempt == 1:
            raise pgqueue.Retry(after=1.5)

    async with running_worker(app, **NO_POLL):
        soon.enqueue()
        await wait_until_async(lambda: len(attempts) == 2, timeout=20)
    assert 1.4 <= attempts[1] - attempts[0] < 6


async def test_a_job_enqueued_to_run_later_starts_when_due(app: pgqueue.App, conn: Conn) -> None:
    @app.task
    async def later() -> None:
        return None

    async with running_worker(app, **NO_POLL) as worker:
        await wait_until_async(lambda: worker.notifier.announced, timeout=10)
        job_id = later.configure(delay=1.5).enqueue()
        # Until it ran, inside the block: a job claimed but not started when the worker stops is
        # handed back (due again from then on), which would make claimed_at - run_at negative.
        await wait_until_async(lambda: status(conn, job_id) == "succeeded", timeout=20)
        pickup = started_at(conn, job_id)
    assert pickup is not None and 0 <= pickup < 4, pickup


#: A worker that polls often: it re-reads its completion rate at each tick (see fetcher).
BUSY = {**NO_POLL, "poll_interval": 0.2}


def prefetching_jobs(app: pgqueue.App, release: asyncio.Event, ran: dict[int, float]) -> None:
    """Fast jobs first (so a worker learns to prefetch), then one that blocks its only slot,
    then jobs that wait behind it in its buffer."""

    @app.task
    async def work(n: int) -> None:
        if n == 300:
            await release.wait()
        ran[n] = time.monotonic()

    app.enqueue_many([("work", {"n": n}) for n in range(300)])
    app.enqueue("work", {"n": 300})
    app.enqueue_many([("work", {"n": n}) for n in range(301, 305)])


@pytest.mark.usefixtures("prefetch_learned_over_a_second")
async def test_jobs_handed_back_at_shutdown_wake_an_idle_worker(
    app: pgqueue.App, conn: Conn
) -> None:
    release = asyncio.Event()
    ran: dict[int, float] = {}
    prefetching_jobs(app, release, ran)
    # The busy worker polls, so that it re-reads its completion rate and prefetches; the idle
    # one, whose wake-up this is about, polls once a minute.
    async with running_worker(app, concurrency=1, prefetch=4, **BUSY) as busy:
        state = busy.state
        assert state is not None
        await wait_until_async(
            lambda: any(
                h.phase.value == "prefetched" and h.job.args["n"] > 300 for h in state.held.values()
            ),
            timeout=20,
        )
        async with running_worker(app, **NO_POLL) as idle:
            await wait_until_async(lambda: idle.notifier.announced, timeout=10)
            busy.stop()
            release.set()
            await wait_until_async(busy.stopped.is_set, timeout=15)
            stopped = time.monotonic()
            await wait_until_async(lambda: len(ran) == 305, timeout=15)
    assert max(ran.values()) - stopped < 5  # the poll is a minute away


@pytest.mark.usefixtures("prefetch_learned_over_a_second")
async def test_handed_back_jobs_notify_waiting_workers(app: pgqueue.App, dsn: str) -> None:
    release = asyncio.Event()
    ran: dict[int, float] = {}
    prefetching_jobs(app, release, ran)
    with contextlib.ExitStack() as stack:
        async with running_worker(app, concurrency=1, prefetch=4, grace_period=0.1, **BUSY) as w:
            state = w.state
            assert state is not None
            await wait_until_async(
                lambda: any(
                    h.phase.value == "prefetched" and h.job.args["n"] > 300
                    for h in state.held.values()
                ),
                timeout=20,
            )
            waiting = stack.enter_context(listening(dsn, waiting=True))  # another, idle worker
        # The hand-back at shutdown told the waiting worker about the queue.
        assert notifications(waiting, expected=1) == [("pgqueue", "default")]


async def test_a_reaped_job_wakes_an_idle_worker(app: pgqueue.App, conn: Conn) -> None:
    app.backoff = pgqueue.Backoff(base=0.01, cap=0.01)
    done: list[int] = []

    @app.task
    async def orphan() -> None:
        done.append(1)

    async with running_worker(app, **NO_POLL) as worker:
        await wait_until_async(lambda: worker.notifier.announced, timeout=10)
        await wait_until_async(lambda: not worker.state or not worker.state.wakeup.is_set())
        # A job claimed by a worker that died at once: no worker row, an expired lease. It is
        # written as running, so no NOTIFY announces it; only its reap makes it ready.
        conn.execute(
            "INSERT INTO pgqueue_jobs (queue, task, status, attempts, lease_token, worker_id,"
            " claimed_at, lease_expires_at) VALUES ('default', 'orphan', 'running', 1,"
            " gen_random_uuid(), gen_random_uuid(), now() - interval '1 second',"
            " now() - interval '1 second')"
        )
        await wait_until_async(lambda: worker.state is not None and worker.state.counters.reaped)
        reaped = time.monotonic()
        await wait_until_async(lambda: done == [1], timeout=15)
    assert time.monotonic() - reaped < 5  # the poll is a minute away


async def test_a_schedule_tick_starts_its_job_at_the_tick(app: pgqueue.App, conn: Conn) -> None:
    @app.periodic(cron="*/2 * * * * *")
    @app.task
    async def tick() -> None:
        return None

    def succeeded() -> int:
        row = conn.execute("SELECT count(*) FROM pgqueue_jobs WHERE status = 'succeeded'")
        return int((row.fetchone() or (0,))[0])

    async with running_worker(app, **NO_POLL):
        await wait_until_async(lambda: succeeded() >= 2, timeout=20)
    pickups = conn.execute(
        "SELECT extract(epoch FROM claimed_at - run_at)::float8 FROM pgqueue_jobs"
        " WHERE status = 'succeeded'"
    ).fetchall()
    assert all(0 <= float(p) < 2 for (p,) in pickups), pickups
