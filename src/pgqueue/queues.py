"""Pausing a queue: operator state kept in ``pgqueue_queues``, read by every claim.

No worker claims a paused queue's jobs (claim_jobs says how the claim skips them); jobs already
running finish and are acked as usual, and enqueues and schedules go on filling the queue. The
state lives in the database, so it holds across worker restarts and applies to every worker at
its next claim. Resuming wakes the workers waiting for work at once, as a new job would.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import psycopg

from . import producer
from .sql import Queries


def check_queue(name: object) -> str:
    """The same rule as at enqueue: a name no job could have is refused (InvalidJobError)."""
    return producer.check_name("queue", name, producer.MAX_QUEUE_LENGTH)


def pause(conn: psycopg.Connection[Any], q: Queries, name: str) -> bool:
    """True if the queue was not paused before."""
    return conn.execute(q.pause_queue, {"name": name}).fetchone() is not None


def resume(conn: psycopg.Connection[Any], q: Queries, name: str) -> bool:
    """True if the queue was paused. ``conn`` is in autocommit mode: the resume commits before
    the wake-up looks for waiting workers (see resume_queue)."""
    if conn.execute(q.resume_queue, {"name": name}).fetchone() is None:
        return False
    conn.execute(q.wake_waiting_workers, {"queues": [name]})
    return True


async def pause_async(conn: psycopg.AsyncConnection[Any], q: Queries, name: str) -> bool:
    cur = await conn.execute(q.pause_queue, {"name": name})
    return await cur.fetchone() is not None


async def resume_async(conn: psycopg.AsyncConnection[Any], q: Queries, name: str) -> bool:
    cur = await conn.execute(q.resume_queue, {"name": name})
    if await cur.fetchone() is None:
        return False
    await conn.execute(q.wake_waiting_workers, {"queues": [name]})
    return True


def paused(conn: psycopg.Connection[Any], q: Queries) -> list[tuple[str, datetime]]:
    """Paused queues by name, with when each was paused."""
    return [(str(name), at) for name, at in conn.execute(q.paused_queues).fetchall()]
