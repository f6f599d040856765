"""One job, all of it: what /jobs/{id} shows and /api/jobs/{id} returns.

Four statements, each reaching rows by primary key or a bounded index range (queries.sql:
job_detail, job_family, job_attempts, job_why), in one read-only transaction so they agree. The
job row holds the latest attempt; the attempts that did not succeed are also in
pgqueue_attempts (migration 0016), so the page lists every attempt: those rows, then the row's
own attempt when it is running or succeeded (docs/dashboard.md says what is kept).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg

from . import queries, why

#: Parents and children listed per job (job_family counts them up to 1,001).
FAMILY_LIMIT = 50
#: The JSON API's argument preview, as before the detail page existed.
API_ARGS_PREVIEW = 8192
BIGINT_MAX = 2**63 - 1
#: Attempts listed per job, the latest ones (a job may allow thousands).
ATTEMPTS_LIMIT = 100


def parse_job_id(text: str) -> int | None:
    """A job id as typed or pasted (``123``, ``#123``, spaces around), or None if it is not one
    (ids are positive bigints)."""
    text = text.strip().removeprefix("#").strip()
    if not text.isascii() or not text.isdigit():
        return None
    value = int(text)
    return value if 0 < value <= BIGINT_MAX else None


@dataclass
class JsonValue:
    """A jsonb column for people: pretty text, or why it is not shown."""

    text: str | None
    size: int | None

    @classmethod
    def of(cls, raw: str | None, size: int | None) -> JsonValue:
        if raw is None:
            return cls(None, size)
        try:
            pretty = json.dumps(json.loads(raw), indent=2, ensure_ascii=False)
        except ValueError:  # not expected from jsonb; show it as stored
            pretty = raw
        return cls(pretty, size)

    @property
    def too_large(self) -> bool:
        return self.text is None and self.size is not None


@dataclass
class Attempt:
    """One attempt as the page lists it: from pgqueue_attempts, or the job row's own."""

    number: int
    worker: str | None
    claimed_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    outcome: str
    error: str | None

    @property
    def short_worker(self) -> str | None:
        return self.worker[:8] if self.worker else None

    def api(self) -> dict[str, Any]:
        return {
            "attempt": self.number, "worker": self.worker, "claimed_at": _iso(self.claimed_at),
            "started_at": _iso(self.started_at), "finished_at": _iso(self.finished_at),
            "outcome": self.outcome, "error": self.error,
        }  # fmt: skip


@dataclass
class JobPage:
    row: dict[str, Any]
    late_after: float = 15.0
    parents: list[dict[str, Any]] = field(default_factory=list)
    children: list[dict[str, Any]] = field(default_factory=list)
    parent_count: int = 0
    child_count: int = 0
    #: None for a job that is not waiting; a note instead when the role may not read limits.
    why: list[why.Reason] | None = None
    why_unavailable: str | None = None
    #: Oldest first; the job row's own attempt last when it is running or succeeded.
    attempts: list[Attempt] = field(default_factory=list)
    #: More attempts are recorded than ATTEMPTS_LIMIT: the earliest are not listed.
    attempts_cut: bool = False
    attempts_unavailable: str | None = None
    #: Read from pgqueue_jobs_archive: the job finished and a worker with archive=True moved it.
    archived: bool = False

    @property
    def now(self) -> datetime:
        now: datetime = self.row["now"]
        return now

    def value(self, name: str) -> JsonValue:
        return JsonValue.of(self.row[name], self.row[name + "_size"])

    @property
    def worker_state(self) -> str | None:
        """The holder of a running job's lease: ``alive`` (heartbeating, as on the Workers
        panel), ``late`` or ``gone`` (no row: deregistered or pruned). None without a worker:
        acks clear it, so a finished job's last worker is not kept."""
        r = self.row
        if r["worker"] is None:
            return None
        if r["worker_host"] is None:
            return "gone"
        late = r["worker_heartbeat_age"] > self.late_after or r["worker_lease_live"] is False
        return "late" if late else "alive"


DETAIL_COLUMNS = (
    "id", "task", "queue", "status", "attempts", "max_attempts", "priority", "args", "args_size",
    "last_error", "error_length", "created_at", "run_at", "claimed_at", "started_at",
    "finished_at", "worker", "meta", "meta_size", "progress", "result", "result_size",
    "cancel_requested_at", "lease_token", "lease_expires_at", "schedule_name", "schedule_tick",
    "schedule_cron", "unique_key", "limit_key", "worker_host", "worker_pid",
    "worker_heartbeat_age", "worker_lease_live", "now",
)  # fmt: skip


async def read(
    conn: psycopg.AsyncConnection[Any], schema: str, job_id: int, *, late_after: float = 15.0
) -> JobPage | None:
    q = queries.statements(schema)
    async with conn.transaction():
        await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        cur = await conn.execute(q["job_detail"], {"id": job_id})
        found = await cur.fetchone()
        archived = False
        if found is None:
            found = await _archived(conn, q["archived_job_detail"], job_id)
            if found is None:
                return None
            archived = True
        job = JobPage(dict(zip(DETAIL_COLUMNS, found, strict=True)), late_after)
        job.archived = archived
        cur = await conn.execute(q["job_family"], {"id": job_id, "limit": FAMILY_LIMIT})
        family = await cur.fetchone()
        assert family is not None
        job.parent_count, job.child_count = int(family[0]), int(family[1])
        job.parents, job.children = _members(family[2]), _members(family[3])
        try:
            # A savepoint: a role without SELECT on pgqueue_attempts loses only this part.
            async with conn.transaction():
                cur = await conn.execute(
                    q["archived_job_attempts" if archived else "job_attempts"],
                    {"id": job_id, "limit": ATTEMPTS_LIMIT + 1},
                )
                history = await cur.fetchall()
        except psycopg.errors.InsufficientPrivilege as exc:
            history = []
            job.attempts_unavailable = (
                f"The dashboard's role cannot read earlier attempts ({exc.diag.message_primary})"
                ": grant it SELECT on pgqueue_attempts as docs/dashboard.md shows."
            )
        job.attempts_cut = len(history) > ATTEMPTS_LIMIT
        job.attempts = [Attempt(*row) for row in reversed(history[:ATTEMPTS_LIMIT])]
        own = _own_attempt(job.row)
        if own is not None:
            job.attempts.append(own)
        if job.row["status"] in why.WAITING:
            try:
                # A savepoint: a role without SELECT on the limit tables loses only this part.
                async with conn.transaction():
                    cur = await conn.execute(q["job_why"], {"id": job_id, "late_after": late_after})
                    row = await cur.fetchone()
                job.why = why.reasons(row) if row is not None else None
            except psycopg.errors.InsufficientPrivilege as exc:
                job.why_unavailable = (
                    f"The dashboard's role cannot read what this needs ({exc.diag.message_primary})"
                    ": grant it SELECT as docs/dashboard.md shows."
                )
    return job


async def _archived(
    conn: psycopg.AsyncConnection[Any], statement: bytes, job_id: int
) -> tuple[Any, ...] | None:
    """The job's row in pgqueue_jobs_archive, if a worker archived it. In a savepoint: a role
    without SELECT on the archive (granted before migration 0018) sees such a job as gone."""
    try:
        async with conn.transaction():
            cur = await conn.execute(statement, {"id": job_id})
            return await cur.fetchone()
    except psycopg.errors.InsufficientPrivilege:
        return None


def _own_attempt(r: dict[str, Any]) -> Attempt | None:
    """The job row's attempt, when no pgqueue_attempts row holds it: a running one, or the one
    that succeeded (its worker is not kept: an ack clears it). A failed, cancelled or expired
    attempt is already in the history."""
    if r["status"] not in ("running", "succeeded") or not r["attempts"]:
        return None
    return Attempt(
        number=r["attempts"], worker=r["worker"], claimed_at=r["claimed_at"],
        started_at=r["started_at"], finished_at=r["finished_at"], outcome=r["status"],
        error=None,
    )  # fmt: skip


def _members(rows: list[list[Any]] | None) -> list[dict[str, Any]]:
    return [{"id": int(r[0]), "task": r[1], "status": r[2]} for r in rows or ()]


def api(job: JobPage) -> dict[str, Any]:
    """The JSON of /api/jobs/{id}: the fields it always had (``args`` still an 8 kB preview),
    then the rest of the page."""
    r = job.row
    args = r["args"][:API_ARGS_PREVIEW] if r["args"] is not None else f"… {r['args_size']} bytes"
    return {
        "id": r["id"], "task": r["task"], "queue": r["queue"], "status": r["status"],
        "attempts": r["attempts"], "max_attempts": r["max_attempts"], "priority": r["priority"],
        "args": args, "last_error": r["last_error"],
        "created_at": _iso(r["created_at"]), "run_at": _iso(r["run_at"]),
        "claimed_at": _iso(r["claimed_at"]), "finished_at": _iso(r["finished_at"]),
        "worker": r["worker"], "meta": _loads(r["meta"]), "progress": r["progress"],
        "cancel_requested_at": _iso(r["cancel_requested_at"]),
        "archived": job.archived,
        # Added with the detail page.
        "started_at": _iso(r["started_at"]), "error_length": r["error_length"],
        "result": _loads(r["result"]), "args_size": r["args_size"],
        "meta_size": r["meta_size"], "result_size": r["result_size"],
        "lease_token": r["lease_token"], "lease_expires_at": _iso(r["lease_expires_at"]),
        "worker_state": job.worker_state,
        "schedule": r["schedule_name"], "schedule_tick": _iso(r["schedule_tick"]),
        "unique_key": r["unique_key"], "limit_key": r["limit_key"],
        "parents": job.parents, "parent_count": job.parent_count,
        "children": job.children, "child_count": job.child_count,
        "why": None if job.why is None else [
            {"code": x.code, "text": x.text,
             "jobs": [{"id": i, "task": t, "status": s} for i, t, s in x.jobs]}
            for x in job.why
        ],
        # Every attempt, oldest first ("attempts" already was the count).
        "attempt_history": [a.api() for a in job.attempts],
    }  # fmt: skip


def _loads(raw: str | None) -> Any:
    return json.loads(raw) if raw is not None else None


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None
