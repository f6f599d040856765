"""pgqueue.testing against a real PostgreSQL: run_until_idle runs the real worker and reports
what ran; bind points an app at a test's database."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg
import pytest

import pgqueue
from pgqueue import Status
from pgqueue.testing import NotIdleError, bind, run_until_idle, run_until_idle_async


def test_run_until_idle_runs_every_job_and_returns_what_ran(app: pgqueue.App) -> None:
    @app.task
    def add(a: int, b: int) -> int:
        return a + b

    jobs = [add.enqueue(a=i, b=1) for i in range(3)]
    runs = run_until_idle(app)
    assert [(r.job_id, r.task, r.status, r.result, r.attempt) for r in runs] == [
        (job, "add", Status.SUCCEEDED, i + 1, 1) for i, job in enumerate(jobs)
    ]
    assert runs.results == [1, 2, 3]
    assert runs[0].args == {"a": 0, "b": 1}
    assert all(app.get_job(job).status is Status.SUCCEEDED for job in jobs)  # type: ignore[union-attr]


def test_with_nothing_to_do_it_returns_at_once(app: pgqueue.App) -> None:
    started = time.monotonic()
    assert run_until_idle(app) == []
    assert time.monotonic() - started < 10


def test_a_failing_job_is_retried_at_once_until_dead(app: pgqueue.App) -> None:
    @app.task(max_attempts=3, backoff=pgqueue.Backoff(base=3600))
    def broken() -> None:
        raise ValueError("boom")

    job = broken.enqueue()
    runs = run_until_idle(app, timeout=60)
    assert [(r.attempt, r.status) for r in runs] == [
        (1, Status.RETRYING), (2, Status.RETRYING), (3, Status.DEAD),
    ]  # fmt: skip
    assert runs.failed == runs and runs.succeeded == []
    assert runs.last(job).error is not None and "ValueError: boom" in runs.last(job).error  # type: ignore[operator]
    assert app.get_job(job).status is Status.DEAD  # type: ignore[union-attr]


def test_a_flaky_job_ends_succeeded(app: pgqueue.App) -> None:
    calls: list[int] = []

    @app.task
    def flaky(ctx: pgqueue.JobContext) -> int:
        calls.append(ctx.attempt)
        if ctx.attempt < 2:
            raise pgqueue.Retry(after=600)
        return ctx.attempt

    job = flaky.enqueue()
    runs = run_until_idle(app)
    assert [r.status for r in runs] == [Status.RETRYING, Status.SUCCEEDED]
    assert runs.last(job).result == 2 and calls == [1, 2]


def test_without_retries_a_failed_job_is_left_retrying(app: pgqueue.App) -> None:
    @app.task(backoff=pgqueue.Backoff(base=600))
    def broken() -> None:
        raise ValueError("boom")

    job = broken.enqueue()
    runs = run_until_idle(app, retries=False)
    assert [r.status for r in runs] == [Status.RETRYING]
    assert app.get_job(job).status is Status.RETRYING  # type: ignore[union-attr]


def test_fail_ends_the_job_dead_in_one_attempt(app: pgqueue.App) -> None:
    @app.task
    def refuse() -> None:
        raise pgqueue.Fail("bad input")

    refuse.enqueue()
    (run,) = run_until_idle(app)
    assert run.status is Status.DEAD and run.error == "Fail: bad input"


def test_delayed_jobs_and_other_queues_are_left_waiting(app: pgqueue.App) -> None:
    @app.task(queue="mail")
    def send() -> str:
        return "sent"

    @app.task(queue="reports")
    def report() -> str:
        return "done"

    later = send.configure(delay=3600).enqueue()
    now = send.enqueue()
    other = report.enqueue()
    runs = run_until_idle(app, ["mail"])
    assert [r.job_id for r in runs] == [now]
    assert app.get_job(later).status is Status.QUEUED  # type: ignore[union-attr]
    assert app.get_job(other).status is Status.QUEUED  # type: ignore[union-attr]


def test_a_chain_runs_to_its_end_in_one_drain(app: pgqueue.App) -> None:
    @app.task
    def step(n: int) -> int:
        return n

    app.chain(step.s(n=1), step.s(n=2), step.s(n=3))
    assert run_until_idle(app).results == [1, 2, 3]


def test_a_transactional_handlers_result_is_read_back(app: pgqueue.App) -> None:
    @app.task
    def record(conn: psycopg.Connection[Any], value: str) -> dict[str, str]:
        conn.execute("CREATE TABLE IF NOT EXISTS seen (value text)")
        conn.execute("INSERT INTO seen VALUES (%s)", (value,))
        return {"stored": value}

    record.enqueue(value="x")
    (run,) = run_until_idle(app)
    assert run.status is Status.SUCCEEDED and run.result == {"stored": "x"}


def test_timeout_names_what_was_still_pending(app: pgqueue.App) -> None:
    @app.task
    async def sleepy() -> None:
        await asyncio.sleep(60)

    job = sleepy.enqueue()
    started = time.monotonic()
    with pytest.raises(NotIdleError) as caught:
        run_until_idle(app, timeout=1)
    assert time.monotonic() - started < 20  # the handler is cancelled, not waited for
    error = caught.value
    assert [(p.id, p.task, p.status) for p in error.pending] == [(job, "sleepy", Status.RUNNING)]
    assert f"#{job} sleepy" in str(error) and "not idle after 1 s" in str(error)
    assert error.runs == []
    # Handed back at the stop, for a later drain or worker.
    assert app.get_job(job).status is Status.QUEUED  # type: ignore[union-attr]


async def test_run_until_idle_async_runs_on_the_callers_loop(app: pgqueue.App) -> None:
    @app.task
    async def double(x: int) -> int:
        return 2 * x

    await double.enqueue_async(x=21)
    runs = await run_until_idle_async(app)
    assert runs.results == [42]


async def test_the_sync_form_refuses_a_running_loop(app: pgqueue.App) -> None:
    with pytest.raises(RuntimeError, match="run_until_idle_async"):
        run_until_idle(app)


def test_bind_points_an_app_at_a_database_and_gives_its_own_back(dsn: str) -> None:
    app = pgqueue.App("postgresql://nobody@db.invalid/app")

    @app.task
    def ping() -> str:
        return "pong"

    with bind(app, dsn):
        ping.enqueue()
        assert run_until_idle(app).results == ["pong"]
    assert app.dsn == "postgresql://nobody@db.invalid/app"
