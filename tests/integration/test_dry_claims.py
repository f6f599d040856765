"""Claims that come back short after reading past jobs they cannot take.

A paused or limited queue's backlog, or the jobs of limited tasks, stay in the ready index in
claim order: a claim from the start reads each of them (a heap visit) to find nothing, and a
worker busy with limited jobs, or woken by every insert into the paused queue, claimed from the
start again and again (200,000 paused jobs: 35 ms of the database per claim). A claim that took
DRY_CLAIM and came back short while the first waiting job is due leaves the next ones after
everything that was waiting then (claim_dry_position, claim_jobs_after), and the sweep behind
that bound takes what becomes claimable there (a queue resumed): the costly walk runs at most
once a sweep period, beside the claims.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

import pgqueue
from pgqueue.sql import queries
from pgqueue.worker import fetcher
from tests.helpers import register_worker, running_worker, wait_until_async
from tests.plans import buffers, claim_selection, explain

Conn = psycopg.Connection[tuple[Any, ...]]
FAST = {"lease": 2.0, "heartbeat_interval": 0.25, "poll_interval": 0.2, "reaper_interval": 0.3}


def test_a_claim_after_the_dry_bound_does_not_read_a_paused_backlog_again(
    conn: Conn,
) -> None:
    """20,000 jobs of a paused queue: a claim from the start reads them all to find the new job
    of another queue; from the bound claim_dry_position gives, it reads about that job."""
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task) SELECT 'held', 't' FROM generate_series(1, 20000)"
    )
    conn.execute("INSERT INTO pgqueue_queues (name, paused) VALUES ('held', true)")
    conn.execute("VACUUM ANALYZE pgqueue_jobs")
    worker = uuid.uuid4()
    register_worker(conn, worker)
    q = queries("public")
    position = conn.execute(q.claim_dry_position, {"lookback": 0.05, "queues": None}).fetchone()
    assert position is not None
    bound = {"after_priority": position[0], "after_run_at": position[1],
             "after_id": fetcher.LAST_ID}  # fmt: skip
    conn.execute("INSERT INTO pgqueue_jobs (queue, task) VALUES ('live', 't')")
    params: dict[str, Any] = {"worker_id": worker, "limit": 100, "token": uuid.uuid4(),
                              "tasks": None, "queues": None}  # fmt: skip
    from_start = explain(conn, q.claim_jobs, params, generic=True)
    after = explain(conn, q.claim_jobs_after, {**params, **bound}, generic=True)
    assert from_start["Actual Rows"] == after["Actual Rows"] == 1
    assert buffers(claim_selection(from_start)) > 250, buffers(claim_selection(from_start))
    assert buffers(claim_selection(after)) < 50, buffers(claim_selection(after))


def test_no_dry_bound_unless_the_first_waiting_job_is_due(conn: Conn) -> None:
    """A claim that was only slow (a loaded machine) and found the queue empty, or only jobs
    not due yet, skipped nothing: claim_dry_position gives no bound then (with one, the worker
    claimed after it and the look at next_ready_at was skipped: a delayed job waited for the
    poll)."""
    q = queries("public")
    look = {"lookback": 0.05, "queues": None}
    assert conn.execute(q.claim_dry_position, look).fetchone() is None
    conn.execute("INSERT INTO pgqueue_jobs (queue, task, run_at) VALUES "
                 "('live', 't', now() + interval '1 hour')")  # fmt: skip
    assert conn.execute(q.claim_dry_position, look).fetchone() is None
    conn.execute("INSERT INTO pgqueue_jobs (queue, task, priority) VALUES ('live', 't', -1)")
    # A due job waits behind the delayed one of a higher priority: not the first in claim order.
    assert conn.execute(q.claim_dry_position, look).fetchone() is None
    conn.execute("INSERT INTO pgqueue_jobs (queue, task, priority) VALUES ('held', 't', 5)")
    position = conn.execute(q.claim_dry_position, look).fetchone()
    assert position is not None and position[0] == 5


def test_the_dry_bound_is_before_every_open_transaction(dsn: str, conn: Conn) -> None:
    """A job enqueued in a transaction that is still open has that transaction's start as its
    run_at: the bound lies before it, so the claims after the bound take the job once it
    commits, not the sweep a period later."""
    q = queries("public")
    conn.execute("INSERT INTO pgqueue_jobs (queue, task) VALUES ('held', 't')")
    with psycopg.connect(dsn) as other:
        other.execute("SELECT 1")  # its transaction starts now
        started = other.execute("SELECT now()::text").fetchone()
        look = {"lookback": 0.05, "queues": None}
        # Well past the lookback: a bound from the lookback alone would lie after that start.
        conn.execute("SELECT pg_sleep(0.25)")
        position = conn.execute(q.claim_dry_position, look).fetchone()
        assert position is not None and started is not None
        before = conn.execute(
            "SELECT %s::timestamptz < %s::timestamptz", (position[1], started[0])
        ).fetchone()
        assert before == (True,)
        other.rollback()
    position = conn.execute(q.claim_dry_position, look).fetchone()
    assert position is not None
    late = conn.execute(
        "SELECT %s::timestamptz > now() - interval '1 second'", (position[1],)
    ).fetchone()
    assert late == (True,)  # none open: just before the claim was sent


@pytest.fixture
def every_claim_slow(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every claim from the start counts as slow; sweeps every half second."""
    monkeypatch.setattr(fetcher, "SLOW_CLAIM", 0.0)
    monkeypatch.setattr(fetcher, "DRY_CLAIM", 0.0)
    monkeypatch.setattr(fetcher, "BOUND_RESET", 0.5)
    monkeypatch.setattr(fetcher, "BOUND_RESET_RATIO", 1.0)


@pytest.fixture
def ran(app: pgqueue.App) -> list[str]:
    """The queues of the jobs task ``work`` ran, in order."""
    ran: list[str] = []

    @app.task
    async def work(queue: str) -> None:
        ran.append(queue)

    return ran


def pause_with_backlog(app: pgqueue.App, jobs: int) -> None:
    """Queue ``held`` paused with that many jobs of ``work`` waiting."""
    app.pause_queue("held")
    app.enqueue_many([{"task": "work", "args": {"queue": "held"}, "queue": "held"}] * jobs)


async def behind_a_dry_bound(claims: fetcher.Fetcher) -> None:
    """Wait until the worker's claims start after a short claim's bound."""
    await wait_until_async(lambda: claims.bound is not None and claims.bound[2] == fetcher.LAST_ID)


@pytest.mark.parametrize("queues", [None, ["held", "live"]])
async def test_after_a_slow_dry_claim_new_jobs_start_and_a_resumed_backlog_is_swept(
    app: pgqueue.App, ran: list[str], conn: Conn, every_claim_slow: None, queues: list[str] | None
) -> None:
    """The worker finds only a paused backlog: its claim from the start comes back empty and it
    claims after the bound from then on, so the next jobs (another queue's) are claimed without
    that walk; once the queue is resumed, its backlog (behind the bound) is swept and runs."""
    pause_with_backlog(app, 500)
    async with running_worker(app, concurrency=4, queues=queues, **FAST) as worker:
        claims = worker.fetcher
        await behind_a_dry_bound(claims)
        assert ran == []
        after = claims.claims_after
        app.enqueue_many([{"task": "work", "args": {"queue": "live"}, "queue": "live"}] * 20)
        await wait_until_async(lambda: ran.count("live") == 20)
        assert claims.claims_after > after  # they were claimed after the bound
        app.resume_queue("held")
        await wait_until_async(lambda: ran.count("held") == 500, timeout=60)
    rows = conn.execute("SELECT status::text, count(*) FROM pgqueue_jobs GROUP BY 1").fetchall()
    assert rows == [("succeeded", 520)]


IDLE = {**FAST, "poll_interval": 60.0}  # only a wake-up or the worker's own look finds a job


async def test_a_slow_claim_that_skipped_nothing_keeps_delayed_jobs_on_time(
    app: pgqueue.App, ran: list[str], every_claim_slow: None
) -> None:
    """Every claim counts as slow, as on a loaded machine, but the queue holds only a job not
    due yet: no bound, and the job starts when due (the poll is a minute away)."""
    async with running_worker(app, concurrency=4, **IDLE) as worker:
        app.enqueue("work", {"queue": "live"}, queue="live", delay=1.0)
        await wait_until_async(lambda: ran == ["live"], timeout=15)
        bound = worker.fetcher.bound  # a claim that took jobs may leave where it ended
        assert bound is None or bound[2] != fetcher.LAST_ID


@pytest.mark.parametrize("queues", [None, ["held", "live"]])
async def test_behind_a_dry_bound_delayed_jobs_still_start_when_due(
    app: pgqueue.App, ran: list[str], every_claim_slow: None, queues: list[str] | None
) -> None:
    """A paused backlog puts the worker behind a dry bound; a job enqueued to run a second later
    in another queue starts then, found by the look at next_ready_at after the short claim
    (skipped behind the bound before: the job waited for the poll)."""
    pause_with_backlog(app, 50)
    async with running_worker(app, concurrency=4, queues=queues, **IDLE) as worker:
        claims = worker.fetcher
        await behind_a_dry_bound(claims)
        app.enqueue("work", {"queue": "live"}, queue="live", delay=1.0)
        await wait_until_async(lambda: ran == ["live"], timeout=15)


async def test_a_job_enqueued_in_a_transaction_open_before_the_bound_starts_at_commit(
    app: pgqueue.App,
    ran: list[str],
    dsn: str,
    every_claim_slow: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The transaction began (and enqueued) before the worker entered the dry bound: its job's
    run_at is that start. It commits later; the claims after the bound take it at once, with
    the sweep a minute away."""
    monkeypatch.setattr(fetcher, "BOUND_RESET", 60.0)
    pause_with_backlog(app, 50)
    with psycopg.connect(dsn) as other:
        app.enqueue("work", {"queue": "live"}, queue="live", connection=other)
        other.execute("SELECT pg_sleep(0.25)")  # the transaction goes on with other work
        async with running_worker(app, concurrency=4, **IDLE) as worker:
            claims = worker.fetcher
            await behind_a_dry_bound(claims)
            assert claims.bound is not None and claims.bound[2] == fetcher.LAST_ID
            other.commit()
            await wait_until_async(lambda: ran == ["live"], timeout=15)


async def test_a_notification_that_finds_nothing_after_the_bound_owes_a_sweep(
    app: pgqueue.App, ran: list[str], every_claim_slow: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job enqueued behind the bound (its run_at set in the past) wakes the worker, whose
    claim after the bound finds nothing; the sweep then runs at the end of its period although
    the worker waits (the poll is a minute away)."""
    monkeypatch.setattr(fetcher, "BOUND_RESET", 3.0)
    pause_with_backlog(app, 50)
    async with running_worker(app, concurrency=1, **IDLE) as worker:
        claims = worker.fetcher
        await behind_a_dry_bound(claims)
        past = datetime.now(UTC) - timedelta(hours=1)
        app.enqueue("work", {"queue": "live"}, queue="live", run_at=past)
        await wait_until_async(lambda: ran == ["live"], timeout=20)
        assert claims.sweeps_run >= 1


async def test_a_worker_busy_with_a_limited_queue_stops_rereading_its_backlog(
    app: pgqueue.App, conn: Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Default thresholds: a task limited to 2 with 15,000 jobs waiting keeps the worker busy,
    and every plain claim read that backlog (a few ms each, every DRY_FOR). The plain claims
    start after it, and stay there past the sweeps that read it again (with the horizon's
    20 ms threshold a walk of a few ms ended the mode at the first sweep); another queue's
    jobs still run at once. Sweeps every second whatever their walk takes: on a loaded machine
    a walk of 0.5 s would otherwise space them 10 s apart. (A task's limit, not a queue's: the
    acks of a limited queue's jobs hand their slots to its next jobs themselves, and the
    fetcher then has no claims to make.)"""
    monkeypatch.setattr(fetcher, "BOUND_RESET_RATIO", 1.0)
    ran: list[str] = []

    @app.task
    async def work(queue: str) -> None:
        ran.append(queue)
        await asyncio.sleep(0.005)

    @app.task(limit=2)
    async def capped(queue: str) -> None:
        ran.append(queue)
        await asyncio.sleep(0.005)

    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, args, limit_key) SELECT 'lim', 'capped', "
        "'{\"queue\": \"lim\"}', '' FROM generate_series(1, 15000)"
    )
    conn.execute("VACUUM ANALYZE pgqueue_jobs")
    async with running_worker(app, concurrency=4, **IDLE) as worker:
        claims = worker.fetcher
        await behind_a_dry_bound(claims)
        await wait_until_async(lambda: claims.sweeps_run >= 2, timeout=60)
        after = claims.claims_after
        await wait_until_async(lambda: claims.claims_after > after + 5, timeout=60)
        app.enqueue_many([{"task": "work", "args": {"queue": "live"}, "queue": "live"}] * 10)
        await wait_until_async(lambda: ran.count("live") == 10)
