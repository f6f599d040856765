"""The prefetch buffer: bounded, heartbeated, released on shutdown; and pruning that keeps up."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

import pgqueue
from pgqueue.worker.reaper import PRUNE_BATCH, Reaper
from pgqueue.worker.state import Phase, WorkerState
from tests.helpers import running_worker, wait_until_async

Conn = psycopg.Connection[tuple[Any, ...]]
FAST = {"lease": 1.0, "heartbeat_interval": 0.25, "poll_interval": 0.2, "reaper_interval": 0.3}


def statuses(conn: Conn) -> dict[str, int]:
    rows = conn.execute("SELECT status::text, count(*) FROM pgqueue_jobs GROUP BY 1").fetchall()
    return {str(status): int(count) for status, count in rows}


def unfinished(state: WorkerState) -> int:
    return sum(1 for h in state.held.values() if h.phase in (Phase.RUNNING, Phase.PREFETCHED))


async def test_prefetch_never_holds_more_than_concurrency_plus_prefetch(
    app: pgqueue.App, conn: Conn
) -> None:
    @app.task
    async def short() -> None:
        await asyncio.sleep(0.002)

    app.enqueue_many([("short", {}) for _ in range(600)])
    peak = peak_prefetched = 0
    async with running_worker(app, concurrency=4, prefetch=3, **FAST) as worker:
        state = worker.state
        assert state is not None
        while state.counters.succeeded < 600:
            peak = max(peak, unfinished(state))
            prefetched = sum(1 for h in state.held.values() if h.phase is Phase.PREFETCHED)
            peak_prefetched = max(peak_prefetched, prefetched)
            assert state.running <= 4
            await asyncio.sleep(0.0005)
    assert peak <= 4 + 3
    assert peak_prefetched > 0  # short jobs were in fact claimed ahead of free slots
    assert statuses(conn) == {"succeeded": 600}


async def _worker_with_prefetched_jobs(
    app: pgqueue.App, release: asyncio.Event, started: list[int]
) -> None:
    """Fast jobs first (so the worker learns to prefetch), then one that blocks its only slot,
    then jobs that wait behind it in the buffer."""

    @app.task
    async def fast(n: int) -> None:
        started.append(n)

    @app.task
    async def blocker(n: int) -> None:
        started.append(n)
        await release.wait()

    app.enqueue_many([("fast", {"n": n}) for n in range(300)])
    app.enqueue("blocker", {"n": 300})
    app.enqueue_many([("fast", {"n": n}) for n in range(301, 305)])


async def _prefetched(worker: Any, started: list[int], at_least: int = 1) -> list[int]:
    """The jobs waiting in the buffer behind the blocker, once it holds the only slot and
    ``at_least`` of them wait."""
    state = worker.state

    def waiting() -> list[int]:
        return [h.job.id for h in state.held.values() if h.phase is Phase.PREFETCHED]

    await wait_until_async(lambda: 300 in started and len(waiting()) >= at_least, timeout=30)
    return waiting()


@pytest.mark.usefixtures("prefetch_learned_over_a_second")
async def test_prefetched_jobs_are_heartbeated_while_they_wait(
    app: pgqueue.App, conn: Conn
) -> None:
    release = asyncio.Event()
    started: list[int] = []
    await _worker_with_prefetched_jobs(app, release, started)
    async with running_worker(app, concurrency=1, prefetch=4, **FAST) as worker:
        waiting = await _prefetched(worker, started)

        def expiry() -> dict[int, float]:
            # A job's lease is its worker's (pgqueue_workers.lease_expires_at).
            rows = conn.execute(
                "SELECT j.id, extract(epoch FROM w.lease_expires_at) FROM pgqueue_jobs j"
                " JOIN pgqueue_workers w ON w.id = j.worker_id"
                " WHERE j.id = ANY(%s) AND j.status = 'running' AND j.lease_expires_at IS NULL",
                (waiting,),
            ).fetchall()
            return {int(i): float(e) for i, e in rows}

        first = expiry()
        assert set(first) == set(waiting)
        await asyncio.sleep(2.5)  # two and a half leases: only heartbeats keep them
        later = expiry()
        assert set(later) == set(waiting)
        assert all(later[i] > first[i] for i in waiting)
        assert worker.state is not None
        assert worker.state.counters.stale_writes == 0
        release.set()
        await wait_until_async(lambda: statuses(conn) == {"succeeded": 305}, timeout=15)
    attempts = conn.execute("SELECT max(attempts), count(last_error) FROM pgqueue_jobs").fetchone()
    assert attempts == (1, 0)


@pytest.mark.usefixtures("prefetch_learned_over_a_second")
async def test_prefetched_jobs_are_released_on_shutdown(app: pgqueue.App, conn: Conn) -> None:
    release = asyncio.Event()
    started: list[int] = []
    await _worker_with_prefetched_jobs(app, release, started)
    async with running_worker(app, concurrency=1, prefetch=4, grace_period=0.2, **FAST) as worker:
        waiting = await _prefetched(worker, started)
        assert waiting
    rows = conn.execute(
        "SELECT status::text, attempts, lease_token, worker_id FROM pgqueue_jobs"
        " WHERE id = ANY(%s)",
        (waiting,),
    ).fetchall()
    assert rows and all(row == ("queued", 0, None, None) for row in rows)
    # The blocked handler was cancelled after the grace period and given back as well.
    assert statuses(conn).get("running", 0) == 0
    assert not set(waiting) & {n + 1 for n in started}  # ids are 1-based; none of them ran


@pytest.mark.usefixtures("prefetch_learned_over_a_second")
async def test_a_job_locked_for_a_moment_at_shutdown_is_released_too(
    app: pgqueue.App, conn: Conn
) -> None:
    """Found by the fault suite under load: another worker's claim can hold a row lock on a job
    this worker has just claimed (a claim that began before ours committed locks the row's
    newest version, finds it running and leaves it, locked until its transaction ends), and the
    release at shutdown skipped it. The worker then deregistered with that job still running
    under its lease, for a reaper to take back as an expired attempt. The release now tries
    again for the rows still its own."""
    release = asyncio.Event()
    started: list[int] = []
    await _worker_with_prefetched_jobs(app, release, started)
    with psycopg.connect(conn.info.dsn, autocommit=True) as locker:
        async with running_worker(app, concurrency=1, prefetch=4, grace_period=0.2, **FAST) as w:
            # One row locked, the others released by the first try.
            waiting = await _prefetched(w, started, at_least=2)
            locked = min(waiting)
            locker.execute("BEGIN")
            locker.execute("SELECT FROM pgqueue_jobs WHERE id = %s FOR UPDATE", (locked,))
            state = w.state
            assert state is not None

            async def unlock_after_the_first_release() -> None:
                # The lock outlives the worker's first release (which gives back the others)
                # and ends a moment later, as a claim's does.
                await wait_until_async(lambda: state.counters.released > 0, timeout=30)
                await asyncio.to_thread(locker.execute, "COMMIT")

            unlocking = asyncio.create_task(unlock_after_the_first_release())
        await unlocking
    rows = conn.execute(
        "SELECT id, status::text, attempts FROM pgqueue_jobs WHERE id = ANY(%s) ORDER BY id",
        (waiting,),
    ).fetchall()
    assert rows == [(i, "queued", 0) for i in sorted(waiting)]


async def test_pruning_keeps_up_with_a_busy_queue(dsn: str, conn: Conn) -> None:
    total = PRUNE_BATCH * 2 + 500
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, status, finished_at)"
        " SELECT 'default', 'old', 'succeeded', now() - interval '2 hours'"
        " FROM generate_series(1, %s)",
        (total,),
    )
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, status, finished_at)"
        " VALUES ('default', 'recent', 'succeeded', now())"
    )
    pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] = AsyncConnectionPool(
        dsn, min_size=1, max_size=1, open=False, kwargs={"autocommit": True}
    )
    await pool.open()
    try:
        app = pgqueue.App(dsn)
        reaper = Reaper(
            pool, app.q, WorkerState(concurrency=1), backoff=app.backoff,
            interval=1.0, lease=30.0, retention=3600.0,
        )  # fmt: skip
        started = time.monotonic()
        assert await reaper.prune() == total
        assert time.monotonic() - started < 60
        assert reaper.prune_every() == 60
    finally:
        await pool.close()
    assert conn.execute("SELECT task FROM pgqueue_jobs").fetchall() == [("recent",)]


def test_prefetch_must_be_a_non_negative_integer(app: pgqueue.App) -> None:
    for bad in (-1, 1.5, True):
        with pytest.raises(pgqueue.ConfigurationError, match="prefetch"):
            app.worker(prefetch=bad)
    # The default: the concurrency, but never so few that short jobs are claimed in dribs.
    assert app.worker(concurrency=7).prefetch == 1024
    assert app.worker(concurrency=3000).prefetch == 3000
    assert app.worker(concurrency=7, prefetch=0).prefetch == 0
