"""The app that chaos runs start as `pgqueue worker --app tests.chaos.app:app` processes.

``effect`` is the workload: it records its start in ``history_runs`` (its own transaction, so
even a killed attempt leaves a trace) and writes its effect through transactional completion,
so ``chaos_effects`` holds a row exactly for each attempt whose success was recorded. Its result
is the lease token, so a stale result would show as a token that is not the last claim's.

The poison tasks model handlers that take the process or its memory down, or never return.

``PGQUEUE_TEST_CLOCK_OFFSET`` skews this process's wall clock (time.time and datetime.now) by
that many seconds, as on a badly synced host; ``PGQUEUE_TEST_MEMORY_LIMIT`` (bytes above the
process's size at start) caps its address space, so an unbounded allocation fails inside the
process instead of taking the machine down.
"""

from __future__ import annotations

import asyncio
import os
import resource
from typing import Any

import psycopg

import pgqueue
from tests import (
    clock_skew,  # noqa: F401  (skews the clock when asked)
    history,
)

_LIMIT = int(os.environ.get("PGQUEUE_TEST_MEMORY_LIMIT", "0"))
if _LIMIT:
    with open("/proc/self/statm") as statm:
        _size = int(statm.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (_size + _LIMIT, resource.RLIM_INFINITY))

app = pgqueue.App(backoff=pgqueue.Backoff(base=0.05, cap=0.5))

INSTALL = """
CREATE TABLE IF NOT EXISTS chaos_effects (
    job_id      bigint NOT NULL,
    attempt     integer NOT NULL,
    lease_token uuid NOT NULL,
    at          timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""


@app.task(max_attempts=8)
async def effect(
    ctx: pgqueue.JobContext,
    conn: psycopg.AsyncConnection[Any],
    seconds: float = 0.0,
    key: str | None = None,
) -> str:
    """``key``: set on the unique jobs among them (enqueued with that unique_key)."""
    await history.record(app.dsn, ctx, "start")
    await asyncio.sleep(seconds)
    await conn.execute(
        "INSERT INTO chaos_effects (job_id, attempt, lease_token) VALUES (%s, %s, %s)",
        (ctx.job_id, ctx.attempt, ctx.lease_token),
    )
    return str(ctx.lease_token)


@app.task(max_attempts=3)
async def exit_process(ctx: pgqueue.JobContext) -> None:
    """Kills the worker process outright, as a segfault in a C extension would."""
    await history.record(app.dsn, ctx, "start")
    os._exit(1)


@app.task(max_attempts=3, timeout=1.0)
async def hang(ctx: pgqueue.JobContext) -> None:
    """Never returns on its own; only its timeout ends it."""
    await history.record(app.dsn, ctx, "start")
    await asyncio.Event().wait()


@app.task(max_attempts=3)
def hog(ctx: pgqueue.JobContext) -> None:
    """Allocates without bound; the process's memory limit turns that into a MemoryError."""
    hoard = []
    while True:
        hoard.append(bytearray(64 * 1024 * 1024))


@app.task(max_attempts=3)
def blob(data: str) -> int:
    """Takes a payload of any size (the bad-input scenario hand-inserts a 5 MiB one)."""
    return len(data)


@app.task(name="tâche ✓ عربى 🚀", max_attempts=3)
async def odd_name() -> None:
    """A task whose name is not ASCII, nor one script, nor free of symbols."""
