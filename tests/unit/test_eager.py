"""Eager mode (pgqueue.testing.eager): enqueues run the handler at once, with no database."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest

import pgqueue
from pgqueue import Status
from pgqueue.testing import eager

#: Nothing answers here: a test that reached the database would fail to connect.
NOWHERE = "postgresql://nobody@db.invalid:1/none?connect_timeout=1"


@pytest.fixture
def app() -> pgqueue.App:
    return pgqueue.App(NOWHERE)


def test_enqueue_runs_the_handler_at_once_without_a_database(app: pgqueue.App) -> None:
    @app.task
    def pair(a: int, b: str) -> tuple[int, str]:
        return a, b

    with eager(app) as runs:
        job = pair.enqueue(a=1, b="x")
        assert app.wait(job) == [1, "x"]  # as stored: JSON, so the tuple is a list
    (run,) = runs
    assert (run.job_id, run.task, run.args, run.attempt) == (job, "pair", {"a": 1, "b": "x"}, 1)
    assert run.status is Status.SUCCEEDED and run.error is None


def test_the_app_is_itself_again_after_the_block(app: pgqueue.App) -> None:
    with eager(app):
        assert "enqueue" in vars(app)
    assert not {"enqueue", "wait", "enqueue_many"} & set(vars(app))


def test_a_handlers_exception_is_recorded_then_raised(app: pgqueue.App) -> None:
    @app.task(max_attempts=3)
    def broken() -> None:
        raise ValueError("boom")

    with eager(app) as runs, pytest.raises(ValueError, match="boom"):
        broken.enqueue()
    assert [r.status for r in runs] == [Status.RETRYING]  # its first attempt, not retried
    assert runs[0].error is not None and runs[0].error.startswith("ValueError: boom")


def test_without_propagate_failures_are_only_recorded(app: pgqueue.App) -> None:
    @app.task(max_attempts=1)
    def broken() -> None:
        raise ValueError("boom")

    @app.task
    def refuse() -> None:
        raise pgqueue.Fail("bad input")

    with eager(app, propagate=False) as runs:
        first = broken.enqueue()
        refuse.enqueue()
        with pytest.raises(pgqueue.JobFailedError, match="ended dead in eager mode"):
            app.wait(first)
    assert [(r.task, r.status) for r in runs] == [("broken", Status.DEAD), ("refuse", Status.DEAD)]
    assert runs.failed == runs and runs[1].error == "Fail: bad input"


def test_async_handlers_run_from_sync_and_async_code(app: pgqueue.App) -> None:
    @app.task
    async def double(x: int) -> int:
        await asyncio.sleep(0)
        return 2 * x

    async def from_async() -> Any:
        job = await double.enqueue_async(x=2)
        double.enqueue(x=3)  # sync code called from async code: runs in a thread of its own
        return await app.wait_async(job)

    with eager(app) as runs:
        double.enqueue(x=1)
        assert asyncio.run(from_async()) == 4
    assert runs.results == [2, 4, 6]


def test_the_handler_gets_a_context_and_the_middleware_runs(app: pgqueue.App) -> None:
    seen: list[str] = []

    @app.middleware
    async def around(ctx: pgqueue.JobContext, call_next: Callable[[], Awaitable[Any]]) -> Any:
        seen.append(f"before {ctx.task}")
        result = await call_next()
        seen.append("after")
        return result

    @app.task(queue="q", max_attempts=4)
    def whoami(ctx: pgqueue.JobContext) -> list[Any]:
        return [ctx.job_id, ctx.queue, ctx.attempt, ctx.max_attempts, ctx.meta]

    with eager(app) as runs:
        whoami.configure(meta={"tenant": "t1"}).enqueue()
        whoami.enqueue()
    assert runs.results == [[1, "q", 1, 4, {"tenant": "t1"}], [2, "q", 1, 4, None]]
    assert seen == ["before whoami", "after", "before whoami", "after"]


def test_enqueue_many_runs_each_job(app: pgqueue.App) -> None:
    @app.task
    def square(x: int) -> int:
        return x * x

    with eager(app) as runs:
        assert app.enqueue_many([("square", {"x": x}) for x in range(4)]) == 4
    assert runs.results == [0, 1, 4, 9]
    assert runs.of("square") == runs and runs.last(4).result == 9


def test_bad_jobs_are_refused_as_a_real_enqueue_would(app: pgqueue.App) -> None:
    @app.task
    def add(a: int) -> int:
        return a

    with eager(app) as runs:
        with pytest.raises(pgqueue.UnknownTaskError):
            app.enqueue("nope", {})
        with pytest.raises(pgqueue.InvalidJobError, match="arguments do not match"):
            add.enqueue(b=1)  # type: ignore[call-arg]
        with pytest.raises(pgqueue.InvalidJobError):
            add.enqueue(a=object())  # type: ignore[arg-type]  # not JSON
    assert runs == []


def test_what_needs_the_database_is_refused(app: pgqueue.App) -> None:
    @app.task
    def step() -> None: ...

    @app.task
    def write(conn: psycopg.Connection[Any]) -> None: ...

    with eager(app):
        for call in (
            lambda: step.configure(after=[1]).enqueue(),
            lambda: app.chain(step.s(), step.s()),
            lambda: app.group([step.s()]),
            lambda: write.enqueue(),
        ):
            with pytest.raises(pgqueue.ConfigurationError, match="needs the database"):
                call()


def test_eager_mode_cannot_be_nested(app: pgqueue.App) -> None:
    with eager(app), pytest.raises(pgqueue.ConfigurationError, match="already on"), eager(app):
        pass
