"""Middleware around every attempt and hooks on every enqueue, with real workers."""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import psycopg
import pytest

import pgqueue
from pgqueue import hooks
from tests.helpers import running_worker, wait_until_async

Conn = psycopg.Connection[tuple[Any, ...]]
FAST = {"lease": 5.0, "heartbeat_interval": 1.0, "poll_interval": 0.2, "reaper_interval": 1.0}
tenant: contextvars.ContextVar[str] = contextvars.ContextVar("tenant", default="none")


def statuses(conn: Conn) -> list[tuple[str, str]]:
    return [
        (str(t), str(s))
        for t, s in conn.execute("SELECT task, status::text FROM pgqueue_jobs ORDER BY id")
    ]


async def test_middleware_wraps_async_and_sync_handlers_in_order_with_their_context(
    app: pgqueue.App, conn: Conn
) -> None:
    calls: list[str] = []
    seen: dict[str, str] = {}

    @app.middleware
    async def outer(ctx: pgqueue.JobContext, call_next: Callable[[], Awaitable[Any]]) -> Any:
        calls.append(f"outer>{ctx.task}")
        token = tenant.set((ctx.meta or {}).get("tenant", "?"))
        try:
            return await call_next()
        finally:
            tenant.reset(token)
            calls.append(f"outer<{ctx.task}")

    @app.middleware
    async def inner(ctx: pgqueue.JobContext, call_next: Callable[[], Awaitable[Any]]) -> Any:
        calls.append(f"inner>{ctx.task}")
        result = await call_next()
        calls.append(f"inner<{ctx.task}")
        return result

    @app.task
    async def in_loop(ctx: pgqueue.JobContext) -> str:
        seen["in_loop"] = tenant.get()
        assert ctx.meta == {"tenant": "acme"}
        return "a"

    @app.task
    def in_thread() -> str:
        seen["in_thread"] = tenant.get()
        return "b"

    in_loop.configure(meta={"tenant": "acme"}).enqueue()
    async with running_worker(app, concurrency=1, **FAST):
        await wait_until_async(lambda: "in_loop" in seen, timeout=30)
        in_thread.configure(meta={"tenant": "globex"}).enqueue()
        await wait_until_async(lambda: len(calls) == 8, timeout=30)
    assert seen == {"in_loop": "acme", "in_thread": "globex"}
    assert calls == [
        "outer>in_loop", "inner>in_loop", "inner<in_loop", "outer<in_loop",
        "outer>in_thread", "inner>in_thread", "inner<in_thread", "outer<in_thread",
    ]  # fmt: skip
    assert statuses(conn) == [("in_loop", "succeeded"), ("in_thread", "succeeded")]


async def test_a_middleware_that_fails_never_loses_a_job(
    app: pgqueue.App, conn: Conn, caplog: pytest.LogCaptureFixture
) -> None:
    """After the handler ran: logged, and the result stands. Before: logged, and the attempt
    fails and is retried, so the job still runs once the middleware works."""
    broken = {"before": 1}

    @app.middleware
    async def flaky(ctx: pgqueue.JobContext, call_next: Callable[[], Awaitable[Any]]) -> Any:
        if ctx.task == "setup" and broken["before"]:
            broken["before"] -= 1
            raise RuntimeError("tenant database unreachable")
        result = await call_next()
        if ctx.task == "metrics":
            raise RuntimeError("statsd is down")
        return result

    @app.task
    async def metrics() -> int:
        return 42

    @app.task(backoff=pgqueue.Backoff(base=0.01, cap=0.01))
    async def setup() -> int:
        return 7

    caplog.set_level(logging.ERROR, logger="pgqueue.hooks")
    first = metrics.enqueue()
    second = setup.enqueue()
    async with running_worker(app, **FAST):
        assert await app.wait_async(first, timeout=30) == 42
        assert await app.wait_async(second, timeout=30) == 7
    job = app.get_job(second)
    assert job is not None and job.attempts == 2 and "tenant database" in (job.last_error or "")
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "after job" in messages and "statsd is down" in messages
    assert "before job" in messages


async def test_enqueue_hooks_add_meta_on_every_path_and_a_failing_hook_loses_nothing(
    app: pgqueue.App, conn: Conn, caplog: pytest.LogCaptureFixture
) -> None:
    @app.on_enqueue
    def trace(task: str, args: Any, meta: dict[str, Any]) -> None:
        meta["traceparent"] = f"00-{task}"

    @app.on_enqueue
    def broken(task: str, args: Any, meta: dict[str, Any]) -> None:
        if args.get("n") == 3:
            raise ValueError("no span")

    @app.task
    def job(n: int) -> None: ...

    job.enqueue(n=1)
    await job.configure(meta={"mine": True}).enqueue_async(n=2)
    caplog.set_level(logging.ERROR, logger="pgqueue.hooks")
    app.enqueue_many([("job", {"n": 3}), {"task": "job", "args": {"n": 4}}])
    metas = [r[0] for r in conn.execute("SELECT meta FROM pgqueue_jobs ORDER BY id")]
    assert metas == [
        {"traceparent": "00-job"},
        {"mine": True, "traceparent": "00-job"},
        {"traceparent": "00-job"},  # the second hook raised: logged, the job written
        {"traceparent": "00-job"},
    ]
    assert "no span" in caplog.text


def test_hooks_of_the_wrong_kind_are_refused_where_they_are_declared() -> None:
    def sync_mw(ctx: Any, call_next: Any) -> Any: ...

    async def async_hook(task: str, args: Any, meta: Any) -> None: ...

    with pytest.raises(pgqueue.ConfigurationError, match="must be an async function"):
        pgqueue.App("postgresql://x/y", middleware=[sync_mw])
    app = pgqueue.App("postgresql://x/y")
    with pytest.raises(pgqueue.ConfigurationError, match="must be a plain function"):
        app.on_enqueue(async_hook)  # type: ignore[arg-type]


async def test_around_enqueue_hooks_see_each_call_whole_and_a_failing_one_loses_nothing(
    app: pgqueue.App, conn: Conn, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[tuple[str, dict[tuple[str, str], int], list[int] | None, int | None]] = []

    @app.around_enqueue
    @contextlib.contextmanager
    def record(publish: hooks.Publish) -> Iterator[None]:
        yield
        seen.append((publish.operation, dict(publish.counts), publish.ids, publish.written))

    @app.around_enqueue
    @contextlib.contextmanager
    def broken(publish: hooks.Publish) -> Iterator[None]:
        yield
        raise RuntimeError("exporter down")  # after the write: must not fail the call

    @app.task(queue="q")
    def job(n: int) -> None: ...

    caplog.set_level(logging.ERROR, logger="pgqueue.hooks")
    first = job.enqueue(n=1)
    second = await job.enqueue_async(n=2)
    assert app.enqueue_many([("job", {"n": 3}), ("job", {"n": 4})]) == 2
    steps = app.chain(job.s(n=5), job.s(n=6))
    assert seen == [
        ("enqueue", {("job", "q"): 1}, [first], 1),
        ("enqueue", {("job", "q"): 1}, [second], 1),
        ("enqueue_many", {("job", "q"): 2}, None, 2),
        ("chain", {("job", "q"): 2}, [int(s) for s in steps], 2),
    ]
    assert conn.execute("SELECT count(*) FROM pgqueue_jobs").fetchone() == (6,)
    assert sum("raised on exit" in r.getMessage() for r in caplog.records) == 4
