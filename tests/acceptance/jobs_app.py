"""The app that the worker acceptance tests run as `pgqueue worker --app ...` subprocesses.

Each attempt records its start, and its end (``done`` or ``cancelled``), in ``history_runs``
(see tests/history.py) on a pool of its own, so the tests can compare the history with
``pgqueue_jobs`` in SQL. Backoff is short so that retries after a reap come quickly.
"""

from __future__ import annotations

import asyncio

import pgqueue
from tests import history

app = pgqueue.App(backoff=pgqueue.Backoff(base=0.1, cap=0.5))


async def _record(ctx: pgqueue.JobContext, event: str) -> None:
    await history.record(app.dsn, ctx, event)


@app.task(max_attempts=10)
async def work(
    ctx: pgqueue.JobContext, seconds: float = 0.0, first_attempt_seconds: float | None = None
) -> int:
    """Sleeps (longer on the first attempt if asked) and returns the attempt number, so the
    stored result tells which attempt's write won."""
    pause = first_attempt_seconds if ctx.attempt == 1 and first_attempt_seconds else seconds
    try:
        # Inside the try: a test that saw the "start" row may stop the worker while this call
        # is still returning, and the cancellation that follows lands here, not in the sleep.
        await _record(ctx, "start")
        await asyncio.sleep(pause)
    except asyncio.CancelledError:
        await _record(ctx, "cancelled")
        raise
    await _record(ctx, "done")
    return ctx.attempt


@app.task(max_attempts=10, limit=2)
async def limited(
    ctx: pgqueue.JobContext, seconds: float = 0.0, first_attempt_seconds: float | None = None
) -> int:
    """``work`` under a limit of 2 running jobs across every worker."""
    return await work.func(ctx, seconds, first_attempt_seconds)


@app.task(max_attempts=10, limit=1, limit_key=lambda args: args["tenant"])
async def per_tenant(ctx: pgqueue.JobContext, tenant: str, seconds: float = 0.0) -> int:
    """``work`` under a limit of 1 running job per tenant across every worker."""
    return await work.func(ctx, seconds)
