"""A caller's own data on a job (meta) and a running job's progress, on a real database."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import psycopg
import pytest

import pgqueue
from tests.helpers import running_worker, wait_until_async

Conn = psycopg.Connection[tuple[Any, ...]]
BEAT = {"lease": 3.0, "heartbeat_interval": 0.2, "poll_interval": 0.5, "reaper_interval": 1.0}


async def test_meta_travels_from_every_enqueue_path_to_the_handler_and_the_job(
    app: pgqueue.App, conn: Conn
) -> None:
    seen: dict[int, Any] = {}

    @app.task
    async def traced(ctx: pgqueue.JobContext, n: int) -> None:
        seen[n] = ctx.meta

    @app.task(unique=True)
    async def once(ctx: pgqueue.JobContext, n: int) -> None:
        seen[n] = ctx.meta

    trace = {"traceparent": "00-abc-def-01", "tenant": "acme", "x-request-id": 7}
    jobs = [
        traced.configure(meta=trace).enqueue(n=1),
        await traced.configure(meta={"k": [1, 2]}).enqueue_async(n=2),
        app.enqueue("traced", {"n": 3}, meta={"a": None}),
        traced.enqueue(n=4),
        once.configure(meta={"u": 1}).enqueue(n=5),
    ]
    app.enqueue_many(
        [{"task": "traced", "args": {"n": 6}, "meta": {"bulk": "yes\\tab"}}, ("traced", {"n": 7})]
    )
    app.enqueue_many([{"task": "once", "args": {"n": 8}, "meta": {"u": 8}}])
    async with running_worker(app, **BEAT):
        await wait_until_async(lambda: len(seen) == 8, timeout=30)
    assert seen == {
        1: trace, 2: {"k": [1, 2]}, 3: {"a": None}, 4: None, 5: {"u": 1},
        6: {"bulk": "yes\\tab"}, 7: None, 8: {"u": 8},
    }  # fmt: skip
    job = app.get_job(jobs[0])
    assert job is not None and job.meta == trace


def test_bad_meta_is_refused_before_anything_is_written(app: pgqueue.App, conn: Conn) -> None:
    @app.task
    def t() -> None: ...

    with pytest.raises(pgqueue.InvalidJobError, match="meta must be a mapping"):
        t.configure(meta=[1, 2])  # type: ignore[arg-type]
    with pytest.raises(pgqueue.InvalidJobError, match="meta keys must be strings"):
        app.enqueue("t", {}, meta={1: "x"})  # type: ignore[dict-item]
    with pytest.raises(pgqueue.InvalidJobError, match="meta"):
        app.enqueue("t", {}, meta={"x": float("nan")})
    with pytest.raises(pgqueue.InvalidJobError, match=r"job #0: .*meta\['x'\]"):
        app.enqueue_many([{"task": "t", "meta": {"x": object()}}])
    assert conn.execute("SELECT count(*) FROM pgqueue_jobs").fetchone() == (0,)


async def test_progress_is_written_by_the_heartbeat_and_shown_while_it_runs(
    app: pgqueue.App, conn: Conn
) -> None:
    step = asyncio.Event()
    done = asyncio.Event()

    @app.task(max_attempts=1)
    async def crunch(ctx: pgqueue.JobContext) -> None:
        for i in range(1000):  # many calls: only the last before each beat is written
            ctx.progress(i, total=1000)
        ctx.progress(500, 1000, "halfway")
        step.set()
        await done.wait()

    job = crunch.enqueue()
    async with running_worker(app, **BEAT):
        await asyncio.wait_for(step.wait(), 30)

        def progress() -> Any:
            row = app.get_job(job)
            return row.progress if row else None

        await wait_until_async(lambda: progress() is not None, timeout=10)
        assert progress() == {"current": 500, "total": 1000, "note": "halfway"}
        done.set()
        await wait_until_async(
            lambda: (
                conn.execute("SELECT status::text FROM pgqueue_jobs").fetchone() == ("succeeded",)
            ),
            timeout=30,
        )


async def test_a_sync_handler_reports_progress_too_and_a_retry_starts_without_it(
    app: pgqueue.App, conn: Conn
) -> None:
    written = threading.Event()
    release = threading.Event()

    @app.task(max_attempts=3, backoff=pgqueue.Backoff(base=60, cap=60))
    def slow(ctx: pgqueue.JobContext) -> None:
        ctx.progress(3, note="three")
        written.wait(30)
        release.wait(30)
        raise RuntimeError("try again")

    job = slow.enqueue()
    async with running_worker(app, **BEAT):

        def progress() -> Any:
            row = app.get_job(job)
            return row.progress if row else None

        await wait_until_async(lambda: progress() == {"current": 3, "note": "three"}, timeout=30)
        written.set()
        release.set()
        await wait_until_async(
            lambda: (
                conn.execute("SELECT status::text FROM pgqueue_jobs").fetchone() == ("retrying",)
            ),
            timeout=30,
        )
    assert progress() is None


def test_bad_progress_values_raise_in_the_handler() -> None:
    ctx = pgqueue.JobContext(
        1, "t", "q", 1, 1, __import__("uuid").uuid4(), __import__("uuid").uuid4()
    )
    with pytest.raises(TypeError):
        ctx.progress("3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="finite"):
        ctx.progress(float("inf"))
    with pytest.raises(TypeError):
        ctx.progress(1, note=3)  # type: ignore[arg-type]
    ctx.progress(1, 2, "x" * 5000)  # a long note is cut, not refused
