"""After a chaos run: SQL over the jobs, the history and the effects decides pass or fail.

Every figure comes from the database; the harness only adds what it did (which workers it
killed, when each fault began) so that duplicates and recoveries can be attributed.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from uuid import UUID

import psycopg

from tests import history

Conn = psycopg.Connection[tuple[Any, ...]]


@dataclass
class Fault:
    kind: str
    at: datetime  # database clock
    worker: UUID | None = None


@dataclass
class Result:
    scenario: str
    seed: int
    jobs: int
    faults: int
    lost: int
    duplicate_effects: int
    duplicate_executions: int
    unexplained_duplicates: int
    stale_rejected: int
    stale_accepted: int
    zombie_attempts: int
    attempts_exceeded: int
    duplicate_unique: int
    recovery: list[float]
    recovery_bound: float
    checks: dict[str, bool] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(self.checks.values())

    @property
    def failures(self) -> list[str]:
        return [name for name, ok in self.checks.items() if not ok]

    def recovery_summary(self) -> str:
        if not self.recovery:
            return "-"
        values = sorted(self.recovery)
        p95 = values[min(len(values) - 1, round(0.95 * (len(values) - 1)))]
        return f"{statistics.median(values):.1f} / {p95:.1f} / {values[-1]:.1f} s"


def _one(conn: Conn, query: str, params: Any = None) -> int:
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return int(row[0] or 0)


def lost_jobs(conn: Conn) -> int:
    """Jobs that are neither succeeded nor dead (a cancelled job was cancelled on purpose)."""
    return _one(conn, "SELECT count(*) FROM pgqueue_jobs WHERE status NOT IN ('succeeded', 'dead')")


def recovery_times(conn: Conn, faults: list[Fault]) -> list[float]:
    """For each lease reaped from a faulted worker: seconds from the first fault to hit that
    worker after the claim to the reap, when the job is claimable again. (Its re-run then waits
    its turn: a retry is queued by its new run_at, behind jobs that were due before it.)"""
    by_worker: dict[UUID, list[datetime]] = {}
    for fault in faults:
        if fault.worker is not None:
            by_worker.setdefault(fault.worker, []).append(fault.at)
    rows = conn.execute(
        "SELECT c.new_worker, c.at, r.at FROM history_reaps r"
        " JOIN history_transitions c ON c.job_id = r.job_id AND c.new_token = r.old_token"
        " AND c.new_status = 'running'"
    ).fetchall()
    times = []
    for worker, claimed_at, reaped_at in rows:
        hits = [at for at in by_worker.get(worker, []) if claimed_at <= at <= reaped_at]
        if hits:
            times.append((reaped_at - min(hits)).total_seconds())
    return times


def check(
    conn: Conn,
    *,
    scenario: str,
    seed: int,
    faults: list[Fault],
    killed: set[UUID],
    recovery_bound: float,
    failures_explain: bool,
) -> Result:
    jobs = _one(conn, "SELECT count(*) FROM pgqueue_jobs")
    duplicate_effects = _one(
        conn,
        "SELECT coalesce(sum(n - 1), 0) FROM"
        " (SELECT count(*) AS n FROM chaos_effects GROUP BY job_id) per_job",
    ) + _one(
        conn,
        "SELECT count(*) FROM chaos_effects e JOIN pgqueue_jobs j ON j.id = e.job_id"
        " WHERE j.status <> 'succeeded'",
    )
    missing_effects = _one(
        conn,
        "SELECT count(*) FROM pgqueue_jobs j WHERE j.task = 'effect' AND j.status = 'succeeded'"
        " AND NOT EXISTS (SELECT 1 FROM chaos_effects e WHERE e.job_id = j.id)",
    )
    # A stale write that got in would leave an effect, or a result, of an attempt that was not
    # the job's last claim. (A finished row keeps the token of the attempt that finished it.)
    stale_accepted = _one(
        conn,
        """
        WITH last_claim AS (
            SELECT DISTINCT ON (job_id) job_id, new_token AS token FROM history_transitions
            WHERE new_status = 'running' ORDER BY job_id, seq DESC
        )
        SELECT (SELECT count(*) FROM chaos_effects e JOIN last_claim l USING (job_id)
                WHERE e.lease_token <> l.token)
             + (SELECT count(*) FROM pgqueue_jobs j JOIN last_claim l ON l.job_id = j.id
                WHERE j.task = 'effect' AND j.status = 'succeeded'
                  AND (j.result #>> '{}') IS DISTINCT FROM l.token::text)
        """,
    )
    zombie_attempts = _one(
        conn,
        "SELECT count(*) FROM history_reaps r"
        " JOIN history_transitions c ON c.job_id = r.job_id AND c.new_token = r.old_token"
        " AND c.new_status = 'running'"
        " WHERE NOT (c.new_worker = ANY(%s))",
        (list(killed),),
    )
    unexplained = history.unexplained_duplicates(conn, failures_explain=failures_explain)
    recovery = recovery_times(conn, faults)
    result = Result(
        scenario=scenario,
        seed=seed,
        jobs=jobs,
        faults=len(faults),
        lost=lost_jobs(conn),
        duplicate_effects=duplicate_effects,
        duplicate_executions=history.duplicate_executions(conn),
        unexplained_duplicates=len(unexplained),
        stale_rejected=_one(conn, "SELECT coalesce(sum(lost), 0) FROM pgqueue_stats"),
        stale_accepted=stale_accepted,
        zombie_attempts=zombie_attempts,
        attempts_exceeded=_one(
            conn, "SELECT count(*) FROM pgqueue_jobs WHERE attempts > max_attempts"
        ),
        duplicate_unique=history.duplicate_unique_jobs(conn),
        recovery=recovery,
        recovery_bound=recovery_bound,
    )
    result.checks = {
        "no job lost": result.lost == 0,
        "no duplicate effect": result.duplicate_effects == 0,
        "every success has its effect": missing_effects == 0,
        "no stale write accepted": result.stale_accepted == 0,
        "attempts within max_attempts": result.attempts_exceeded == 0,
        "no two jobs held one unique key at once": result.duplicate_unique == 0,
        "every duplicate explained by a lost lease": result.unexplained_duplicates == 0,
        "recovery within lease + reaper interval": all(t <= recovery_bound for t in recovery),
    }
    if unexplained:
        result.notes.append(f"unexplained re-claims (job, token): {unexplained[:5]}")
    return result
