"""Waiting for a job's result: ``App.wait`` and ``App.wait_async``.

A waiter listens on the schema's done channel (``db.done_channel_for``) and holds advisory lock
3 of the job channel, shared, while it waits: workers announce finished jobs there
(``notify_finished``) only while some waiter holds it, so nobody pays for results nobody waits
for. The waiter looks at the job when it starts listening (so a job that finished before is
answered at once), at every announcement naming it, and every ``LOOK_EVERY`` seconds besides:
an announcement lost with a connection costs latency, never the answer. Its first look waits for
any write holding the job's row (``lock_awaited_job``): an ack that looked for waiters just
before this one announced itself sends nothing, and read before its commit the job would still
seem to run until the next look.

Waiting only reads, so a lost connection (a failover, a restart) is not the caller's problem
while the app's ``reconnect_timeout`` lasts: the waiter connects again with backoff, listens
again and looks at the job again. A connection refused for good (a wrong password, an unknown
database), or an outage longer than that, is ``DatabaseUnavailableError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import psycopg
from psycopg import sql

from . import db, pools
from .errors import (
    DatabaseUnavailableError,
    JobCancelledError,
    JobFailedError,
    JobNotFoundError,
    WaitTimeoutError,
)
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


def _left(deadline: float | None) -> float:
    return LOOK_EVERY if deadline is None else deadline - time.monotonic()


def _first_look(job_id: int, left: float) -> dict[str, Any]:
    return {"id": job_id, "lock_timeout": f"{max(1, int(min(left, LOOK_EVERY) * 1000))}ms"}


#: How the first look's wait for the row may end without the row: it gave up (a long lock, or
#: a role without UPDATE on the jobs table), or the write it waited for committed under a
#: stricter default isolation than READ COMMITTED (a serialization failure). The waiter reads
#: the job anyway, in a statement of its own, and looks again later, as always.
_UNSETTLED = (
    psycopg.errors.LockNotAvailable,
    psycopg.errors.InsufficientPrivilege,
    psycopg.errors.SerializationFailure,
)


def _timeout_error(job_id: int, timeout: float | None) -> WaitTimeoutError:
    return WaitTimeoutError(f"job {job_id} had not finished after {timeout:g} s (it goes on)")


class _Reconnect:
    """The retry budget of a waiter: spent while it cannot reach PostgreSQL, renewed every time
    it connects (a long wait may meet more than one outage)."""

    def __init__(self, dsn: str, retry_for: float, deadline: float | None) -> None:
        self.dsn = dsn
        self.retry_for = retry_for
        self.deadline = deadline
        self.retries = pools.Retries(retry_for)

    def connected(self) -> None:
        self.retries = pools.Retries(self.retry_for)

    def pause(self, exc: BaseException) -> float:
        """Seconds to wait before connecting again, or raise the error for the caller."""
        error = exc if isinstance(exc, DatabaseUnavailableError) else db.unavailable(self.dsn, exc)
        pause = None if pools.permanent(exc) else self.retries.pause()
        if pause is not None and self.deadline is not None:
            left = self.deadline - time.monotonic()
            pause = None if left <= 0 else min(pause, left)  # the wait's own timeout is up
        if pause is None:
            raise self.retries.gave_up(error) from None
        return pause


def wait(
    dsn: str, options: dict[str, Any], q: Queries, schema: str, job_id: int,
    timeout: float | None, retry_for: float = 0.0,
) -> Any:  # fmt: skip
    deadline = None if timeout is None else time.monotonic() + timeout
    reconnect = _Reconnect(dsn, retry_for, deadline)
    while True:
        try:
            return _wait(dsn, options, q, schema, job_id, timeout, deadline, reconnect)
        except (psycopg.OperationalError, DatabaseUnavailableError) as exc:
            time.sleep(reconnect.pause(exc))


def _wait(
    dsn: str, options: dict[str, Any], q: Queries, schema: str, job_id: int,
    timeout: float | None, deadline: float | None, reconnect: _Reconnect,
) -> Any:  # fmt: skip
    with psycopg.connect(dsn, autocommit=True, **options) as conn:
        reconnect.connected()
        conn.execute(_listen(db.done_channel_for(schema)))
        conn.execute(q.announce_result_wait)
        with contextlib.suppress(*_UNSETTLED):
            conn.execute(q.lock_awaited_job, _first_look(job_id, _left(deadline)))
        while True:
            done, result = settle(job_id, conn.execute(q.get_job, {"id": job_id}).fetchone())
            if done:
                return result
            left = _left(deadline)
            if left <= 0:
                raise _timeout_error(job_id, timeout)
            for notify in conn.notifies(timeout=min(left, LOOK_EVERY)):
                if _names(notify.payload, job_id):
                    break


async def wait_async(
    dsn: str, options: dict[str, Any], q: Queries, schema: str, job_id: int,
    timeout: float | None, retry_for: float = 0.0,
) -> Any:  # fmt: skip
    deadline = None if timeout is None else time.monotonic() + timeout
    reconnect = _Reconnect(dsn, retry_for, deadline)
    while True:
        try:
            return await _wait_async(dsn, options, q, schema, job_id, timeout, deadline, reconnect)
        except (psycopg.OperationalError, DatabaseUnavailableError) as exc:
            await asyncio.sleep(reconnect.pause(exc))


async def _wait_async(
    dsn: str, options: dict[str, Any], q: Queries, schema: str, job_id: int,
    timeout: float | None, deadline: float | None, reconnect: _Reconnect,
) -> Any:  # fmt: skip
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True, **options)
    async with conn:
        reconnect.connected()
        await conn.execute(_listen(db.done_channel_for(schema)))
        await conn.execute(q.announce_result_wait)
        with contextlib.suppress(*_UNSETTLED):
            await conn.execute(q.lock_awaited_job, _first_look(job_id, _left(deadline)))
        while True:
            cur = await conn.execute(q.get_job, {"id": job_id})
            done, result = settle(job_id, await cur.fetchone())
            if done:
                return result
            left = _left(deadline)
            if left <= 0:
                raise _timeout_error(job_id, timeout)
            async for notify in conn.notifies(timeout=min(left, LOOK_EVERY)):
                if _names(notify.payload, job_id):
                    break
