"""A history of every attempt and every state change, kept in the test database, so that after a
run of real worker processes plain SQL can decide what happened.

- ``history_runs``: written by handlers through ``record`` (start, done, cancelled), with the
  attempt, the lease token of the claim, the pid and the database clock.
- ``history_transitions``: written by a trigger on every status change of a job, with the old
  and new lease token, the old lease expiry (the job's own, else its worker's) and the new
  error, so a re-run can be matched to the reap of the lease before it.
- ``history_leases``: written by a trigger on every change into and out of ``running`` (a lease
  starts, a lease ends), with the job's task, limit group and queue, the claim's ``claimed_at``
  and the database clock, so a sweep can count what held a lease in each limit group at any
  moment, and the starts in any window of a rate's period (``lease_events``).

A lease token is per claim statement, shared by the jobs of that claim: match attempts on
(job, token), never on the token alone.

Test-only: pgqueue itself never installs these.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

import psycopg
from psycopg_pool import AsyncConnectionPool

from pgqueue import JobContext
from pgqueue.worker.transactions import _connection_async

Conn = psycopg.Connection[tuple[Any, ...]]

_pool: AsyncConnectionPool[psycopg.AsyncConnection[tuple[Any, ...]]] | None = None


async def record(dsn: str, ctx: JobContext, event: str) -> None:
    """Called by handlers in worker processes: one history row, on a pool of this process's
    own (never the worker's), committed at once. It takes the connection as the worker's
    handler pools do (transactions._connection_async: asking again every few seconds rather
    than failing after psycopg_pool's 30 s): in `make chaos` (handoff, seed 10011788) a
    worker SIGSTOPped twice had every handler of its next claim fail in this call with
    PoolTimeout after 30 s, a failure of the harness that the checks counted against pgqueue
    (duplicate executions without a lost lease)."""
    global _pool
    if _pool is None:
        _pool = AsyncConnectionPool(
            dsn, min_size=1, max_size=4, open=False, kwargs={"autocommit": True}
        )
        await _pool.open()
    async with _connection_async(_pool) as conn:
        await conn.execute(
            "INSERT INTO history_runs (job_id, attempt, lease_token, pid, event)"
            " VALUES (%s, %s, %s, %s, %s)",
            (ctx.job_id, ctx.attempt, ctx.lease_token, os.getpid(), event),
        )


INSTALL = """
CREATE TABLE IF NOT EXISTS history_runs (
    seq         bigserial PRIMARY KEY,
    job_id      bigint NOT NULL,
    attempt     integer NOT NULL,
    lease_token uuid NOT NULL,
    pid         integer NOT NULL,
    event       text NOT NULL,
    at          timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS history_transitions (
    seq         bigserial PRIMARY KEY,
    job_id      bigint NOT NULL,
    old_status  text NOT NULL,
    new_status  text NOT NULL,
    old_token   uuid,
    new_token   uuid,
    old_expires timestamptz,
    new_error   text,
    new_worker  uuid,
    old_attempts integer,
    new_attempts integer,
    at          timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE OR REPLACE FUNCTION history_log_transition() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO history_transitions
        (job_id, old_status, new_status, old_token, new_token, old_expires, new_error,
         new_worker, old_attempts, new_attempts)
    VALUES (NEW.id, OLD.status::text, NEW.status::text, OLD.lease_token, NEW.lease_token,
            -- The lease the attempt held: its own, else its worker's (a worker that is gone
            -- holds none).
            COALESCE(OLD.lease_expires_at,
                     (SELECT w.lease_expires_at FROM pgqueue_workers w
                      WHERE w.id = OLD.worker_id),
                     '-infinity'),
            left(NEW.last_error, 200), NEW.worker_id, OLD.attempts, NEW.attempts);
    RETURN NULL;
END;
$$;
-- A reap: the reaper clears the token, keeps the attempt count and writes a fresh LeaseExpired
-- error. (An ack keeps the token; a release lowers the count; a later ack can keep an old
-- LeaseExpired text, which is why the error alone says nothing.)
CREATE OR REPLACE VIEW history_reaps AS
    SELECT * FROM history_transitions
    WHERE old_status = 'running' AND new_status IN ('retrying', 'dead') AND new_token IS NULL
      AND new_attempts = old_attempts AND new_error LIKE 'LeaseExpired:%';
-- A worker lease that ran out and was renewed later (a stalled worker's first heartbeat after
-- the stall): a reaper that read the lapsed lease may reap after the renewal, when the jobs'
-- transition logs the renewed expiry as old_expires. The lapse is what explains that reap.
CREATE TABLE IF NOT EXISTS history_lapses (
    worker_id  uuid NOT NULL,
    expired_at timestamptz NOT NULL,
    renewed_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE OR REPLACE FUNCTION history_log_lapse() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO history_lapses (worker_id, expired_at) VALUES (OLD.id, OLD.lease_expires_at);
    RETURN NULL;
END;
$$;
DROP TRIGGER IF EXISTS history_lapses ON pgqueue_workers;
CREATE TRIGGER history_lapses AFTER UPDATE ON pgqueue_workers
    FOR EACH ROW WHEN (OLD.lease_expires_at < now() AND NEW.lease_expires_at >= now())
    EXECUTE FUNCTION history_log_lapse();
-- Every unique job as inserted, with its key (a later enqueue may clear the key on the row)
-- and the clock as the insert ran: after the check that let it in.
CREATE TABLE IF NOT EXISTS history_unique (
    job_id     bigint NOT NULL,
    unique_key text NOT NULL,
    at         timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE OR REPLACE FUNCTION history_log_unique() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO history_unique (job_id, unique_key)
    SELECT id, unique_key FROM new_rows WHERE unique_key IS NOT NULL;
    RETURN NULL;
END;
$$;
DROP TRIGGER IF EXISTS history_unique ON pgqueue_jobs;
CREATE TRIGGER history_unique AFTER INSERT ON pgqueue_jobs
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION history_log_unique();
DROP TRIGGER IF EXISTS history_transitions ON pgqueue_jobs;
CREATE TRIGGER history_transitions AFTER UPDATE ON pgqueue_jobs
    FOR EACH ROW WHEN (OLD.status IS DISTINCT FROM NEW.status)
    EXECUTE FUNCTION history_log_transition();
-- Every lease's start (a row entering 'running': a claim) and end (leaving it, or deleted while
-- in it: an ack, a reap, a release), the slots of a limit. 'at' is the clock when the row
-- changed: after the statement's snapshot, and before its commit. So a start that a claim
-- could only make after seeing an end committed is logged after that end, and a sweep in 'at'
-- order never shows two leases at once that never were. 'stmt_at' (the statement's start,
-- before its snapshot) places the start against changes of a limit made meanwhile;
-- 'claimed_at' is the claim's now(), which the rate log counts.
CREATE TABLE IF NOT EXISTS history_leases (
    seq         bigserial PRIMARY KEY,
    job_id      bigint NOT NULL,
    task        text NOT NULL,
    limit_key   text,
    queue       text NOT NULL,
    event       text NOT NULL CHECK (event IN ('start', 'end')),
    lease_token uuid,
    worker_id   uuid,
    claimed_at  timestamptz,
    stmt_at     timestamptz NOT NULL DEFAULT statement_timestamp(),
    at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    xact        bigint NOT NULL DEFAULT txid_current()
);
CREATE OR REPLACE FUNCTION history_log_lease() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'UPDATE' AND NEW.status = 'running' THEN
        INSERT INTO history_leases
            (job_id, task, limit_key, queue, event, lease_token, worker_id, claimed_at)
        VALUES (NEW.id, NEW.task, NEW.limit_key, NEW.queue, 'start', NEW.lease_token,
                NEW.worker_id, NEW.claimed_at);
    ELSE
        INSERT INTO history_leases
            (job_id, task, limit_key, queue, event, lease_token, worker_id)
        VALUES (OLD.id, OLD.task, OLD.limit_key, OLD.queue, 'end', OLD.lease_token,
                OLD.worker_id);
    END IF;
    RETURN NULL;
END;
$$;
DROP TRIGGER IF EXISTS history_leases ON pgqueue_jobs;
CREATE TRIGGER history_leases AFTER UPDATE ON pgqueue_jobs
    FOR EACH ROW WHEN ((OLD.status = 'running') IS DISTINCT FROM (NEW.status = 'running'))
    EXECUTE FUNCTION history_log_lease();
DROP TRIGGER IF EXISTS history_leases_deleted ON pgqueue_jobs;
CREATE TRIGGER history_leases_deleted AFTER DELETE ON pgqueue_jobs
    FOR EACH ROW WHEN (OLD.status = 'running')
    EXECUTE FUNCTION history_log_lease();
"""


def install(conn: Conn) -> None:
    conn.execute(INSTALL)


def duplicate_unique_jobs(conn: Conn) -> int:
    """Pairs of jobs with one key (rule 'active', no unique_for) where the second was inserted
    before the first had left queued/retrying/running: both held the key at once. The first
    leaves at its transition to succeeded, dead or cancelled, as logged by its own statement
    (so before its commit, which the second's insert had to see)."""
    row = conn.execute(
        """
        WITH left_at AS (
            SELECT u.job_id, u.unique_key, u.at AS inserted,
                   (SELECT min(t.at) FROM history_transitions t
                    WHERE t.job_id = u.job_id
                      AND t.new_status IN ('succeeded', 'dead', 'cancelled')) AS finished
            FROM history_unique u
        )
        SELECT count(*) FROM left_at a JOIN left_at b
            ON a.unique_key = b.unique_key AND a.job_id < b.job_id
        WHERE b.inserted < coalesce(a.finished, 'infinity')
        """
    ).fetchone()
    assert row is not None
    return int(row[0])


@dataclass(frozen=True)
class LeaseEvent:
    """A lease's start or end, from ``history_leases``."""

    job_id: int
    task: str
    limit_key: str | None
    queue: str
    event: str  # 'start' | 'end'
    lease_token: UUID | None
    claimed_at: datetime | None  # a start's claim now(), what rates count
    stmt_at: datetime
    at: datetime


def lease_events(conn: Conn) -> list[LeaseEvent]:
    """Every lease start and end, in the order of the clock when each row changed (an end
    before a start logged at the same microsecond: a claim that saw the end could only have
    been logged after it)."""
    return [
        LeaseEvent(*row)
        for row in conn.execute(
            "SELECT job_id, task, limit_key, queue, event, lease_token, claimed_at, stmt_at, at"
            " FROM history_leases ORDER BY at, event = 'start', seq"
        ).fetchall()
    ]


def running_without_lease(conn: Conn, queues: list[str]) -> list[tuple[int, str, str | None]]:
    """(job, task, limit group) of each job of a limit group, or of one of ``queues``, that is
    still 'running' although nobody holds its lease: neither the job's own lease
    (lease_expires_at, set when its worker gave it up) nor its worker's is live. Each holds a
    slot that only a reaper can free."""
    return [
        (int(job_id), str(task), limit_key)
        for job_id, task, limit_key in conn.execute(
            "SELECT j.id, j.task, j.limit_key FROM pgqueue_jobs j"
            " WHERE j.status = 'running' AND (j.limit_key IS NOT NULL OR j.queue = ANY(%s))"
            "   AND NOT coalesce(j.lease_expires_at >= clock_timestamp(), EXISTS ("
            "       SELECT FROM pgqueue_workers w"
            "       WHERE w.id = j.worker_id AND w.lease_expires_at >= clock_timestamp()))"
            " ORDER BY j.id",
            (queues,),
        ).fetchall()
    ]


@dataclass(frozen=True)
class Run:
    job_id: int
    attempt: int
    lease_token: UUID
    pid: int
    at: datetime


def starts(conn: Conn) -> dict[int, list[Run]]:
    """Every started attempt, by job, in attempt order."""
    runs: dict[int, list[Run]] = {}
    for job_id, attempt, token, pid, at in conn.execute(
        "SELECT job_id, attempt, lease_token, pid, at FROM history_runs"
        " WHERE event = 'start' ORDER BY job_id, attempt, seq"
    ).fetchall():
        runs.setdefault(job_id, []).append(Run(job_id, attempt, token, pid, at))
    return runs


def ended_by(conn: Conn, job_id: int, token: UUID) -> str | None:
    """How the attempt holding lease ``token`` ended: ``reaped`` (its lease had expired and a
    reaper took the job back: at the reap the lease had run out, or it had lapsed since the
    claim and been renewed too late, see history_lapses), ``released`` (handed back at
    shutdown, the attempt not counted), ``failed`` (its own failure ack), or None if none of
    these."""
    row = conn.execute(
        "SELECT t.seq IN (SELECT seq FROM history_reaps) AND (t.at >= t.old_expires OR EXISTS ("
        "   SELECT FROM history_transitions c JOIN history_lapses l ON l.worker_id = c.new_worker"
        "   WHERE c.job_id = t.job_id AND c.new_token = t.old_token AND c.new_status = 'running'"
        "     AND l.expired_at > c.at AND l.expired_at <= t.at)),"
        " t.new_token IS NULL AND t.new_attempts = t.old_attempts - 1,"
        " t.new_token IS NOT NULL"
        " FROM history_transitions t WHERE t.job_id = %s AND t.old_token = %s"
        " AND t.old_status = 'running' AND t.new_status IN ('queued', 'retrying', 'dead')",
        (job_id, token),
    ).fetchone()
    if row is None:
        return None
    reaped, released, failed = row
    return "reaped" if reaped else "released" if released else "failed" if failed else None


def claims(conn: Conn) -> dict[int, list[UUID]]:
    """The lease token of every claim, by job, in order (from the transitions to running)."""
    found: dict[int, list[UUID]] = {}
    for job_id, token in conn.execute(
        "SELECT job_id, new_token FROM history_transitions WHERE new_status = 'running'"
        " ORDER BY job_id, seq"
    ).fetchall():
        found.setdefault(job_id, []).append(token)
    return found


def unexplained_duplicates(conn: Conn, *, failures_explain: bool = False) -> list[tuple[int, UUID]]:
    """(job, lease token) of every claim that was followed by another claim of the same job
    although its lease was neither reaped after expiring nor released at shutdown (nor, with
    ``failures_explain``, did its attempt fail). Empty means every repeated execution is
    explained by a lost lease."""
    allowed = {"reaped", "released", "failed"} if failures_explain else {"reaped", "released"}
    return [
        (job_id, token)
        for job_id, tokens in claims(conn).items()
        for token in tokens[:-1]
        if ended_by(conn, job_id, token) not in allowed
    ]


def describe_jobs(conn: Conn, job_ids: list[int]) -> list[str]:
    """Each job's recorded transitions and handler runs, one line each, and the worker lease
    lapses: what a failure note needs to say why a re-claim was not explained."""
    lines = []
    for job_id in job_ids:
        for task, queue, key in conn.execute(
            "SELECT task, queue, limit_key FROM pgqueue_jobs WHERE id = %s", (job_id,)
        ).fetchall():
            lines.append(f"job {job_id}: task {task}, queue {queue}, limit group {key!r}")
        for at, old, new, old_token, new_token, worker, attempts, expires, error in conn.execute(
            "SELECT at, old_status, new_status, old_token, new_token, new_worker,"
            " old_attempts || '->' || new_attempts, old_expires::text, left(new_error, 160)"
            " FROM history_transitions WHERE job_id = %s ORDER BY seq",
            (job_id,),
        ).fetchall():
            lines.append(
                f"job {job_id} {at:%H:%M:%S.%f} {old}->{new} token {old_token}->{new_token}"
                f" worker {worker} attempts {attempts} lease until {expires} error {error!r}"
            )
        for at, event, token, pid in conn.execute(
            "SELECT at, event, lease_token, pid FROM history_runs WHERE job_id = %s ORDER BY seq",
            (job_id,),
        ).fetchall():
            lines.append(f"job {job_id} {at:%H:%M:%S.%f} handler {event} token {token} pid {pid}")
    for worker, expired, renewed in conn.execute(
        "SELECT worker_id, expired_at, renewed_at FROM history_lapses ORDER BY renewed_at"
    ).fetchall():
        lines.append(f"lapse: worker {worker} lease ran out {expired}, renewed {renewed}")
    return lines


def duplicate_executions(conn: Conn) -> int:
    """Handler starts beyond the first, over all jobs."""
    row = conn.execute(
        "SELECT count(*) - count(DISTINCT job_id) FROM history_runs WHERE event = 'start'"
    ).fetchone()
    assert row is not None
    return int(row[0])


def hand_offs(conn: Conn, queue: str) -> int:
    """Lease starts in ``queue`` made in the transaction that ended another of its leases: the
    slots that acks handed straight to the queue's next jobs (hand_off_queue_slots)."""
    row = conn.execute(
        "SELECT count(*) FROM history_leases s WHERE s.event = 'start' AND s.queue = %s"
        " AND EXISTS (SELECT FROM history_leases e WHERE e.event = 'end' AND e.queue = s.queue"
        "             AND e.xact = s.xact AND e.job_id <> s.job_id)",
        (queue,),
    ).fetchone()
    assert row is not None
    return int(row[0])
