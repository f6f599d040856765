"""The app that chaos runs start as `pgqueue worker --app tests.chaos.app:app` processes.

``effect`` is the workload: it records its start in ``history_runs`` (its own transaction, so
even a killed attempt leaves a trace) and writes its effect through transactional completion,
so ``chaos_effects`` holds a row exactly for each attempt whose success was recorded. Its result
is the lease token, so a stale result would show as a token that is not the last claim's.

The limited tasks (``LIMITED``) do the same under a concurrency limit, a limit per key, a rate,
or a limit and a rate per key; the feeder also puts jobs in ``CAPPED_QUEUE``, which the harness
limits as an operator would. The checker holds every run to these values (and to the operator's
changes the harness makes during the feed), counting from the trigger log of each lease's start
and end (tests/history.py), not from anything the workers say.

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
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


async def _work(ctx: pgqueue.JobContext, conn: psycopg.AsyncConnection[Any], seconds: float) -> str:
    await history.record(app.dsn, ctx, "start")
    await asyncio.sleep(seconds)
    await conn.execute(
        "INSERT INTO chaos_effects (job_id, attempt, lease_token) VALUES (%s, %s, %s)",
        (ctx.job_id, ctx.attempt, ctx.lease_token),
    )
    return str(ctx.lease_token)


@app.task(max_attempts=8)
async def effect(
    ctx: pgqueue.JobContext,
    conn: psycopg.AsyncConnection[Any],
    seconds: float = 0.0,
    key: str | None = None,
) -> str:
    """``key``: set on the unique jobs among them (enqueued with that unique_key)."""
    return await _work(ctx, conn, seconds)


@app.task(max_attempts=8)
async def acked(ctx: pgqueue.JobContext, seconds: float = 0.0) -> str:
    """The handoff scenario's job: no transactional completion, so the worker's completer acks
    it (and may hand its slot off in that transaction); its result is its lease token, which
    shows a stale ack that got in."""
    await history.record(app.dsn, ctx, "start")
    await asyncio.sleep(seconds)
    return str(ctx.lease_token)


@dataclass(frozen=True)
class Limits:
    """A group's limit (jobs holding a lease at once) and rate (starts, period in seconds);
    ``key``: the argument whose value is the group, for a limit per key."""

    limit: int | None = None
    rate: tuple[int, float] | None = None
    key: str | None = None


#: The limited tasks, as declared below. ``limited``'s limit is changed during the feed by the
#: harness (LIMIT_CHANGES), as an operator would with `pgqueue tasks limit limited N`.
LIMITED: dict[str, Limits] = {
    "limited": Limits(limit=2),
    "keyed": Limits(limit=1, key="tenant"),
    "rated": Limits(rate=(5, 1.0)),
    "pushed": Limits(limit=2, rate=(3, 1.0), key="account"),
    "spread": Limits(limit=1, key="tenant"),
}
#: A queue the harness limits at the start of each run (`pgqueue queues limit|rate`): it holds
#: jobs of ``effect`` (no limit of their own) and some of ``keyed`` (limited twice).
CAPPED_QUEUE = "capped"
CAPPED = Limits(limit=4, rate=(3, 0.2))
#: The operator's changes of ``limited``'s limit during the feed: (fraction of the feed, limit).
#: The second one lowers it below what is running then.
LIMIT_CHANGES = [(0.4, 4), (0.7, 2)]
#: The handoff scenario: ``CAPPED_QUEUE`` with a limit alone and no other limited work, so the
#: acks of its jobs hand their slots to its next ones (hand_off_queue_slots); the operator
#: lowers the limit below what runs, then raises it again: (fraction of the feed, limit).
HANDOFF_CAPPED = Limits(limit=4)
HANDOFF_CHANGES = [(0.4, 2), (0.7, 4)]
#: Jobs that write an effect (chaos_effects) and return their lease token.
EFFECT_TASKS = ["effect", *LIMITED]


async def limited_work(
    ctx: pgqueue.JobContext,
    conn: psycopg.AsyncConnection[Any],
    seconds: float = 0.0,
    tenant: str | None = None,
    account: str | None = None,
) -> str:
    """The handler of every limited task: ``effect``'s, under its task's limits."""
    return await _work(ctx, conn, seconds)


def _key_of(name: str) -> Callable[[Mapping[str, Any]], object]:
    return lambda args: args[name]


def declare_limited(target: pgqueue.App) -> None:
    """Declares the limited tasks on ``target``: this worker app, and the harness's producer,
    which must know a task's key function to give each job its group at enqueue."""
    for name, limits in LIMITED.items():
        target.task(
            name=name,
            max_attempts=8,
            limit=limits.limit,
            rate=limits.rate,
            limit_key=None if limits.key is None else _key_of(limits.key),
        )(limited_work)


declare_limited(app)


async def member_work(n: int) -> int:
    """A group member (``control`` scenario): cheap, so a group can have 100,000 of them."""
    return n


async def summarise_work(
    ctx: pgqueue.JobContext,
    conn: psycopg.AsyncConnection[Any],
    results: list[Any],
    seconds: float = 0.0,
) -> dict[str, Any]:
    """The group's callback: one effect, through transactional completion, so a second run of
    it (or a run before every member finished) shows in the checks. It lasts ``seconds``, so
    that the harness can kill its worker while it runs."""
    await history.record(app.dsn, ctx, "start")
    await asyncio.sleep(seconds)
    await conn.execute(
        "INSERT INTO chaos_effects (job_id, attempt, lease_token) VALUES (%s, %s, %s)",
        (ctx.job_id, ctx.attempt, ctx.lease_token),
    )
    return {"count": len(results), "in_order": results == list(range(len(results)))}


def declare_workflow(target: pgqueue.App) -> None:
    """The tasks of the ``control`` scenario's group and chains, on the worker app and the
    producer's."""
    if target is not app:
        target.task(name="effect", max_attempts=8)(effect.func)
    target.task(name="member", max_attempts=8)(member_work)
    target.task(name="summarise", max_attempts=8)(summarise_work)


declare_workflow(app)


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
