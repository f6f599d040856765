"""Operators' actions on many jobs at once (CLI and Python, never the dashboard).

Each bulk action (requeue, cancel, purge) runs in batches of ``BATCH`` jobs, each its own short
transaction (``bulk_batch``): rows being claimed or acked right now are skipped rather than
waited for, no lock outlives a batch, and an interrupted action leaves every finished batch done
and counted in its audit row (``pgqueue_audit``: who, when, the filter, how many). A dry run
counts what the action would change and is recorded as such.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import socket
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any

import psycopg

from .errors import InvalidJobError, JobNotFoundError
from .sql import Queries

BATCH = 1000

#: The statuses each action may touch, and the default when none is named.
ACTIONS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "requeue": (("dead", "cancelled"), ("dead",)),
    "cancel": (("queued", "retrying", "running", "blocked"), ("queued", "retrying", "blocked")),
    "purge": (("succeeded", "dead", "cancelled"), ("succeeded",)),
}
STATUSES = ("queued", "running", "retrying", "succeeded", "dead", "cancelled", "blocked")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)?\s*$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(value: object, what: str = "duration") -> float:
    """``"90s"``, ``"30m"``, ``"1h"``, ``"7d"``, ``"2w"``, a number of seconds or a timedelta."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION.match(value.lower())):
        seconds = float(m.group(1)) * _UNIT[m.group(2) or "s"]
    else:
        raise InvalidJobError(f"{what} {value!r}: write it as 90s, 30m, 1h, 7d or 2w")
    if not 0 <= seconds <= 100 * 366 * 86400:
        raise InvalidJobError(f"{what} {value!r} is out of range")
    return seconds


@dataclass(frozen=True, slots=True)
class JobFilter:
    """Which jobs: every given part must match. ``since``/``older_than`` (seconds) compare
    when the job finished, or was enqueued if it has not finished."""

    task: str | None = None
    queue: str | None = None
    statuses: tuple[str, ...] | None = None
    since: float | None = None
    older_than: float | None = None

    @classmethod
    def of(
        cls,
        *,
        task: str | None = None,
        queue: str | None = None,
        status: str | Iterable[str] | None = None,
        since: object = None,
        older_than: object = None,
    ) -> JobFilter:
        statuses = None
        if status is not None:
            statuses = (status,) if isinstance(status, str) else tuple(status)
            unknown = [s for s in statuses if s not in STATUSES]
            if unknown or not statuses:
                raise InvalidJobError(
                    f"unknown status {', '.join(map(repr, unknown)) or '(none)'}: one of "
                    + ", ".join(STATUSES)
                )
        return cls(
            task, queue, statuses,
            None if since is None else parse_duration(since, "since"),
            None if older_than is None else parse_duration(older_than, "older than"),
        )  # fmt: skip

    def for_action(self, action: str) -> JobFilter:
        allowed, default = ACTIONS[action]
        statuses = self.statuses or default
        refused = [s for s in statuses if s not in allowed]
        if refused:
            raise InvalidJobError(
                f"{action} takes jobs that are {', '.join(allowed)}; not {', '.join(refused)}"
            )
        return JobFilter(self.task, self.queue, statuses, self.since, self.older_than)

    def params(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "queue": self.queue,
            "statuses": list(self.statuses) if self.statuses else None,
            "since": self.since,
            "older_than": self.older_than,
        }

    def described(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()
                if v is not None}  # fmt: skip


def actor() -> str:
    """Who runs the action, as the audit log records it."""
    try:
        user = getpass.getuser()
    except Exception:
        user = "?"
    return f"{user}@{socket.gethostname()} (pid {os.getpid()})"


def bulk(
    conn: psycopg.Connection[Any], q: Queries, action: str, job_filter: JobFilter, *,
    dry_run: bool = False, batch: int = BATCH,
) -> int:  # fmt: skip
    """Apply ``action`` to every job ``job_filter`` matches (see the module docstring); the
    number changed (or, for a dry run, that would be). ``conn`` is in autocommit mode."""
    f = job_filter.for_action(action)
    params = f.params()
    audit = {"actor": actor(), "action": action, "filter": json.dumps(f.described())}
    if dry_run:
        row = conn.execute(q.count_jobs, params).fetchone()
        count = int(row[0]) if row else 0
        conn.execute(q.begin_audit, {**audit, "dry_run": True, "matched": count})
        return count
    row = conn.execute(q.begin_audit, {**audit, "dry_run": False, "matched": 0}).fetchone()
    assert row is not None
    audit_id, after, total = int(row[0]), 0, 0
    while True:
        with conn.transaction():
            result = conn.execute(
                q.bulk_batch,
                {**params, "action": action, "after": after, "batch": batch, "audit": audit_id},
            ).fetchone()
        assert result is not None
        last, changed, picked, queues = result[0], int(result[1]), int(result[2]), result[3]
        total += changed
        if queues:  # requeued jobs are work again
            conn.execute(q.wake_waiting_workers, {"queues": list(queues)})
        if last is None or picked < batch:
            break
        after = int(last)
    conn.execute(q.end_audit, {"id": audit_id})
    return total


@dataclass(frozen=True, slots=True)
class JobSummary:
    id: int
    task: str
    queue: str
    status: str
    attempts: int
    max_attempts: int
    created_at: datetime
    finished_at: datetime | None
    error: str | None


def find(
    conn: psycopg.Connection[Any], q: Queries, job_filter: JobFilter, limit: int
) -> list[JobSummary]:
    if not 1 <= limit <= 10_000:
        raise InvalidJobError(f"limit must be from 1 to 10,000, got {limit}")
    rows = conn.execute(q.find_jobs, {**job_filter.params(), "limit": limit}).fetchall()
    return [
        JobSummary(int(r[0]), str(r[1]), str(r[2]), str(r[3]), int(r[4]), int(r[5]), r[6], r[7],
                   r[8] or None)
        for r in rows
    ]  # fmt: skip


@dataclass(frozen=True, slots=True)
class AuditEntry:
    id: int
    at: datetime
    actor: str
    action: str
    filter: dict[str, Any]
    dry_run: bool
    matched: int
    finished_at: datetime | None


def audit_log(conn: psycopg.Connection[Any], q: Queries, limit: int) -> list[AuditEntry]:
    return [AuditEntry(*r) for r in conn.execute(q.audit_log, {"limit": limit}).fetchall()]


def retry_now(conn: psycopg.Connection[Any], q: Queries, job_id: int) -> str:
    """The job's status before; a waiting one is due now and its queue's workers are woken."""
    row = conn.execute(q.retry_now, {"id": job_id}).fetchone()
    if row is None:
        raise JobNotFoundError.of(job_id)
    if row[0] in ("queued", "retrying"):
        conn.execute(q.wake_waiting_workers, {"queues": [row[1]]})
    return str(row[0])
