"""Waiting for a job's result: ``App.wait`` and ``App.wait_async``.

A waiter listens on the schema's done channel (``db.done_channel_for``) and holds advisory lock
3 of the job channel, shared, while it waits: workers announce finished jobs there
(``notify_finished``) only while some waiter holds it, so nobody pays for results nobody waits
for. The waiter looks at the job when it starts listening (so a job that finished before is
answered at once), at every announcement naming it, and every ``LOOK_EVERY`` seconds besides:
an announcement lost with a connection costs latency, never the answer.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg
from psycopg import sql

from . import db
from .errors import JobCancelledError, JobFailedError, JobNotFoundError, WaitTimeoutError
from .jobs import Job, Status
from .sql import Queries

#: Seconds between a waiter's own looks at the job, between announcements.
LOOK_EVERY = 5.0


def settle(job_id: int, row: Any) -> tuple[bool, Any]:
    """(finished, result) for a job row; raises for a job that ended without a result."""
    if row is None:
        raise JobNotFoundError.of(job_id)
    job = Job.from_row(row)
    if job.status is Status.SUCCEEDED:
        return True, job.result
    if job.status is Status.DEAD:
        error = (job.last_error or "no error recorded").strip().splitlines()
        raise JobFailedError(
            f"job {job_id} ({job.task}) is dead after {job.attempts} attempts: "
            f"{error[0] if error else ''}",
            job,
        )
    if job.status is Status.CANCELLED:
        raise JobCancelledError(f"job {job_id} ({job.task}) was cancelled", job)
    return False, None


def _listen(channel: str) -> sql.Composed:
    return sql.SQL("LISTEN {}").format(sql.Identifier(channel))


def _names(payload: str, job_id: int) -> bool:
    return str(job_id) in payload.split(",")


def _timeout_error(job_id: int, timeout: float | None) -> WaitTimeoutError:
    return WaitTimeoutError(f"job {job_id} had not finished after {timeout:g} s (it goes on)")


def wait(
    dsn: str, options: dict[str, Any], q: Queries, schema: str, job_id: int,
    timeout: float | None,
) -> Any:  # fmt: skip
    deadline = None if timeout is None else time.monotonic() + timeout
    with db.connect(dsn, **options) as conn:
        try:
            conn.execute(_listen(db.done_channel_for(schema)))
            conn.execute(q.announce_result_wait)
            while True:
                done, result = settle(job_id, conn.execute(q.get_job, {"id": job_id}).fetchone())
                if done:
                    return result
                left = LOOK_EVERY if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    raise _timeout_error(job_id, timeout)
                for notify in conn.notifies(timeout=min(left, LOOK_EVERY)):
                    if _names(notify.payload, job_id):
                        break
        except psycopg.OperationalError as exc:
            raise db.unavailable(dsn, exc) from None


async def wait_async(
    dsn: str, options: dict[str, Any], q: Queries, schema: str, job_id: int,
    timeout: float | None,
) -> Any:  # fmt: skip
    deadline = None if timeout is None else time.monotonic() + timeout
    conn = await db.connect_async(dsn, **options)
    async with conn:
        try:
            await conn.execute(_listen(db.done_channel_for(schema)))
            await conn.execute(q.announce_result_wait)
            while True:
                cur = await conn.execute(q.get_job, {"id": job_id})
                done, result = settle(job_id, await cur.fetchone())
                if done:
                    return result
                left = LOOK_EVERY if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    raise _timeout_error(job_id, timeout)
                async for notify in conn.notifies(timeout=min(left, LOOK_EVERY)):
                    if _names(notify.payload, job_id):
                        break
        except psycopg.OperationalError as exc:
            raise db.unavailable(dsn, exc) from None
