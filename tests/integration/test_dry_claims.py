"""Claims that come back short after reading past jobs they cannot take.

A paused or limited queue's backlog, or the jobs of limited tasks, stay in the ready index in
claim order: a claim from the start reads each of them (a heap visit) to find nothing, and a
worker busy with limited jobs, or woken by every insert into the paused queue, claimed from the
start again and again (200,000 paused jobs: 35 ms of the database per claim). A claim that was
slow and short leaves the next ones after everything that was waiting then (claim_dry_position,
claim_jobs_after), and the sweep behind that bound takes what becomes claimable there (a queue
resumed): the costly walk runs at most once a sweep period, beside the claims.
"""

from __future__ import annotations

import uuid
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
    position = conn.execute(q.claim_dry_position).fetchone()
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


@pytest.fixture
def every_claim_slow(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every claim from the start counts as slow; sweeps every half second."""
    monkeypatch.setattr(fetcher, "SLOW_CLAIM", 0.0)
    monkeypatch.setattr(fetcher, "BOUND_RESET", 0.5)
    monkeypatch.setattr(fetcher, "BOUND_RESET_RATIO", 1.0)


@pytest.mark.parametrize("queues", [None, ["held", "live"]])
async def test_after_a_slow_dry_claim_new_jobs_start_and_a_resumed_backlog_is_swept(
    app: pgqueue.App, conn: Conn, every_claim_slow: None, queues: list[str] | None
) -> None:
    """The worker finds only a paused backlog: its claim from the start comes back empty and it
    claims after the bound from then on, so the next jobs (another queue's) are claimed without
    that walk; once the queue is resumed, its backlog (behind the bound) is swept and runs."""
    ran: list[str] = []

    @app.task
    async def work(queue: str) -> None:
        ran.append(queue)

    app.pause_queue("held")
    app.enqueue_many([{"task": "work", "args": {"queue": "held"}, "queue": "held"}] * 500)
    async with running_worker(app, concurrency=4, queues=queues, **FAST) as worker:
        claims = worker.fetcher
        await wait_until_async(lambda: claims.claims >= 1 and claims.bound is not None)
        assert claims.bound is not None and claims.bound[2] == fetcher.LAST_ID
        assert ran == []
        after = claims.claims_after
        app.enqueue_many([{"task": "work", "args": {"queue": "live"}, "queue": "live"}] * 20)
        await wait_until_async(lambda: ran.count("live") == 20)
        assert claims.claims_after > after  # they were claimed after the bound
        app.resume_queue("held")
        await wait_until_async(lambda: ran.count("held") == 500, timeout=60)
    rows = conn.execute("SELECT status::text, count(*) FROM pgqueue_jobs GROUP BY 1").fetchall()
    assert rows == [("succeeded", 520)]
