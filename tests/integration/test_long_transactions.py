"""Claims while a long transaction holds back vacuum (docs/concepts/claiming.md).

A snapshot held open elsewhere keeps every claimed job's entry in the ready index, so a worker
whose claims from the start turn slow claims from where its last claim ended
(``claim_jobs_after``), and a sweep beside those claims takes the jobs that became ready behind
that point (``claim_jobs_before``) at least every ``BOUND_RESET`` seconds. These
tests force that mode (every walk from the start counts as slow) under a real held snapshot
and check correctness, not speed: every job runs once, whatever made it ready (a backlog, a
higher priority, a delay, a retry, a requeue, a reap, a past run_at, a resumed queue), and the
worker names the transaction in its log, once, and says when claims are fast again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import logging
import math
import uuid
from collections.abc import AsyncIterator, Iterator
from functools import partial
from typing import Any

import psycopg
import pytest

import pgqueue
from pgqueue.sql import queries
from pgqueue.worker import fetcher, horizon
from tests.helpers import register_worker, running_worker, wait_until_async
from tests.plans import buffers, claim_selection, explain, nodes

Conn = psycopg.Connection[tuple[Any, ...]]
FAST = {"lease": 2.0, "heartbeat_interval": 0.25, "poll_interval": 0.2, "reaper_interval": 0.3}
BACKLOG = 3000


@pytest.fixture
def claims_after_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every walk from the start of the index counts as slow: the worker claims from where its
    last claim ended, and sweeps behind that point every half second."""
    monkeypatch.setattr(fetcher, "SLOW_CLAIM", 0.0)
    # Never the dry bound (test_dry_claims.py): with every claim slow, a batch committed just
    # after an empty claim looks like a skipped backlog, and the mode's 2 ms threshold would
    # then end it at the first fast sweep.
    monkeypatch.setattr(fetcher, "DRY_CLAIM", math.inf)
    monkeypatch.setattr(fetcher, "BOUND_RESET", 0.5)
    monkeypatch.setattr(fetcher, "BOUND_RESET_RATIO", 1.0)


@pytest.fixture
def snapshot(dsn: str) -> Iterator[Conn]:
    """A session holding a snapshot, idle in its transaction, as a report left open would."""
    with psycopg.connect(dsn, autocommit=True, application_name="nightly-report") as holder:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM pg_class")
        yield holder
        holder.execute("COMMIT")


@pytest.mark.parametrize("queues", [None, ["a"]])
def test_a_claim_after_the_bound_steps_over_the_jobs_claimed_under_a_held_snapshot(
    conn: Conn, dsn: str, queues: list[str] | None
) -> None:
    """20,000 jobs claimed and finished while a snapshot is held: their entries stay in the ready
    index and cannot even be marked dead. A claim from the start visits the row of each; one
    from where the last claim ended reads about its batch (on the plan a worker runs: generic
    for all queues, custom for a list)."""
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task) SELECT 'a', 't' FROM generate_series(1, 30000)"
    )
    conn.execute("VACUUM ANALYZE pgqueue_jobs")
    worker = uuid.uuid4()
    register_worker(conn, worker)
    q = queries("public")
    params: dict[str, Any] = {"worker_id": worker, "limit": 200, "token": uuid.uuid4(),
                              "tasks": None, "queues": queues}  # fmt: skip
    with psycopg.connect(dsn, autocommit=True) as holder:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM pg_class")
        conn.execute(
            "UPDATE pgqueue_jobs SET status = 'succeeded', attempts = 1, finished_at = now()"
            " WHERE id IN (SELECT id FROM pgqueue_jobs ORDER BY id LIMIT 20000)"
        )
        row = conn.execute(
            "SELECT priority, run_at::text, id FROM pgqueue_jobs WHERE status = 'succeeded'"
            " ORDER BY id DESC LIMIT 1"
        ).fetchone()
        assert row is not None
        bound = {"after_priority": row[0], "after_run_at": row[1], "after_id": row[2]}
        plain = q.claim_jobs if queues is None else q.claim_jobs_in_queues
        after = q.claim_jobs_after if queues is None else q.claim_jobs_after_in_queues
        generic = queues is None
        from_start = claim_selection(explain(conn, plain, params, generic=generic))
        plan = explain(conn, after, {**params, **bound}, generic=generic)
        holder.execute("COMMIT")
    assert plan["Actual Rows"] == 200
    selection = claim_selection(plan)
    # From the start: the index and heap pages of the 20,000 claimed jobs (~800 buffers here),
    # then the batch's. After the bound: the batch's pages and its 200 row locks (~210).
    assert buffers(from_start) > 600, buffers(from_start)
    assert buffers(selection) < 350, buffers(selection)
    (scan,) = [
        n for n in nodes(selection)
        if n.get("Relation Name") == "pgqueue_jobs" and n["Actual Rows"] > 0
    ]  # fmt: skip
    assert scan["Node Type"] == "Index Scan" and "ROW(run_at, id) >" in scan["Index Cond"], scan


def succeeded(conn: Conn, count: int) -> bool:
    return statuses(conn) == {"succeeded": count}


def statuses(conn: Conn) -> dict[str, int]:
    rows = conn.execute("SELECT status::text, count(*) FROM pgqueue_jobs GROUP BY 1").fetchall()
    return {str(status): int(count) for status, count in rows}


async def test_every_job_runs_once_while_claims_start_where_the_last_ended(
    app: pgqueue.App, conn: Conn, dsn: str, claims_after_bound: None, snapshot: Conn
) -> None:
    runs: collections.Counter[int] = collections.Counter()
    order: list[int] = []
    failed_once: set[int] = set()

    @app.task
    async def work(ctx: pgqueue.JobContext, n: int) -> None:
        runs[ctx.job_id] += 1
        order.append(ctx.job_id)
        await asyncio.sleep(0.002)

    @app.task
    async def flaky(ctx: pgqueue.JobContext) -> None:
        runs[ctx.job_id] += 1
        if ctx.attempt == 1:
            raise pgqueue.Retry(after=0.2)

    @app.task(max_attempts=1)
    async def doomed(ctx: pgqueue.JobContext) -> None:
        runs[ctx.job_id] += 1
        if ctx.job_id not in failed_once:
            failed_once.add(ctx.job_id)
            raise RuntimeError("first time")

    app.pause_queue("side")
    side = [app.enqueue("work", {"n": -n}, queue="side").id for n in range(20)]
    app.enqueue_many([("work", {"n": n}) for n in range(BACKLOG)])
    dead = app.enqueue("doomed", {}).id
    async with running_worker(app, concurrency=10, **FAST) as worker:
        await wait_until_async(lambda: len(order) >= 300, timeout=60)
        # Another worker claims a job (the first in line) and vanishes: its lease runs out, the
        # reaper puts it back.
        ghost = uuid.uuid4()
        register_worker(conn, ghost, lease=60)
        params = {"worker_id": ghost, "limit": 1, "token": uuid.uuid4(), "tasks": None}
        (reaped,) = [r[0] for r in conn.execute(queries("public").claim_jobs, params)]
        conn.execute(
            "UPDATE pgqueue_workers SET lease_expires_at = now() - interval '1 second'"
            " WHERE id = %s",
            (ghost,),
        )
        # Jobs that become ready behind the last claim, or ahead of it in claim order.
        started = len(order)
        urgent = app.enqueue("work", {"n": -1000}, priority=10).id
        past = app.enqueue(
            "work", {"n": -1001},
            run_at=datetime.datetime.now(datetime.UTC) - datetime.timedelta(hours=1),
        ).id  # fmt: skip
        delayed = app.enqueue("work", {"n": -1002}, delay=0.5).id
        retried = app.enqueue("flaky", {}).id
        app.resume_queue("side")
        await wait_until_async(lambda: dead in failed_once, timeout=60)
        await wait_until_async(lambda: statuses(conn).get("dead") == 1, timeout=60)
        assert app.requeue(dead)
        total = BACKLOG + len(side) + 5  # + urgent, past, delayed, retried, dead
        await wait_until_async(lambda: statuses(conn) == {"succeeded": total}, timeout=180)
        assert worker.fetcher.claims_after > 0  # the bound was in use

    once = {job for job in runs if job not in (retried, dead)}
    assert len(once) == total - 2
    assert all(runs[job] == 1 for job in once), [j for j in once if runs[j] != 1]
    assert runs[retried] == 2 and runs[dead] == 2
    assert {urgent, past, delayed, reaped, *side} <= set(runs)
    # Priority stays strict: the urgent job is in the next claim, behind only the jobs the
    # worker held when it was enqueued (concurrency + prefetch, 20) and that claim's batch.
    assert order.index(urgent) - started < 200, (order.index(urgent), started)


async def test_a_slow_claim_names_the_transaction_holding_back_vacuum_once(
    app: pgqueue.App,
    conn: Conn,
    claims_after_bound: None,
    snapshot: Conn,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(horizon, "OLDER_THAN", 0.0)
    holder = snapshot.info.backend_pid

    @app.task
    async def noop(n: int) -> None:
        pass

    caplog.set_level(logging.INFO, logger="pgqueue.worker.fetcher")

    def lines(start: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith(start)]

    async with running_worker(app, concurrency=4, **FAST) as worker:
        claims = worker.fetcher
        app.enqueue_many([("noop", {"n": n}) for n in range(50)])
        await wait_until_async(lambda: lines("claims slowed"), timeout=30)
        # More walks from the start (sweeps), each as slow as the first: no second warning.
        swept = claims.sweeps_run
        for done in (100, 150):
            app.enqueue_many([("noop", {"n": n}) for n in range(50)])
            await wait_until_async(partial(succeeded, conn, done))
        await wait_until_async(lambda: claims.sweeps_run >= swept + 3)
        (warning,) = lines("claims slowed")
        assert f"pid {holder} " in warning and "'nightly-report'" in warning, warning
        assert "idle in transaction" in warning
        assert not lines("claims are fast again")
        # The transaction ends and claims from the start are fast again: one line says so.
        snapshot.execute("COMMIT")
        snapshot.execute("BEGIN")  # the fixture's COMMIT ends this one
        monkeypatch.setattr(fetcher, "SLOW_CLAIM", float("inf"))
        app.enqueue("noop", {"n": 0})
        await wait_until_async(lambda: lines("claims are fast again"), timeout=30)
        await wait_until_async(lambda: statuses(conn) == {"succeeded": 151})
        assert worker.fetcher.horizon.named is None
    assert len(lines("claims slowed")) == 1
    assert lines("claims are fast again") == [
        f"claims are fast again: vacuum is no longer held back (pid {holder} was named)"
    ]


class HeldSweeps:
    """The sweep's connections, held up at the door until the test opens it."""

    def __init__(self, lane: Any) -> None:
        self.lane = lane
        self.entered = asyncio.Event()
        self.opened = asyncio.Event()

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[Any]:
        self.entered.set()
        await self.opened.wait()
        async with self.lane.connection() as conn:
            yield conn


async def test_a_job_ready_behind_the_bound_is_swept_while_the_claims_go_on(
    app: pgqueue.App, conn: Conn, claims_after_bound: None, snapshot: Conn
) -> None:
    """The walk from the start of the index, slow while vacuum is held back, is the sweep's: the
    claims never wait for it (jobs enqueued while it is held up still start), and the job that
    became ready behind the claims' bound (a past run_at, as a reaped or released job has) is
    claimed by it."""
    started: list[int] = []  # the n of each job, as it starts

    @app.task
    async def work(n: int) -> None:
        started.append(n)
        await asyncio.sleep(0.001)

    app.enqueue_many([("work", {"n": n}) for n in range(300)])
    async with running_worker(app, concurrency=4, **FAST) as worker:
        claims = worker.fetcher
        await wait_until_async(lambda: claims.claims_after > 0 and len(started) >= 50)
        held = HeldSweeps(claims.sweeps)
        claims.sweeps = held
        try:
            await asyncio.wait_for(held.entered.wait(), 30)
            app.enqueue(
                "work", {"n": -1},
                run_at=datetime.datetime.now(datetime.UTC) - datetime.timedelta(hours=1),
            )  # fmt: skip
            app.enqueue_many([("work", {"n": n}) for n in range(1000, 1050)])
            await wait_until_async(lambda: set(range(1000, 1050)) <= set(started), timeout=60)
            # The premise: no claim but the sweep reads behind the bound, and it is held up.
            assert -1 not in started
        finally:
            held.opened.set()
        await wait_until_async(lambda: -1 in started, timeout=60)
    assert statuses(conn) == {"succeeded": 351}
