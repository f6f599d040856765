"""The job record as callers see it, and its statuses."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID


class Status(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    RETRYING = "retrying"
    SUCCEEDED = "succeeded"
    DEAD = "dead"
    CANCELLED = "cancelled"


#: The longest delay anything may put between now and a job's run_at (enqueue, Retry, backoff):
#: a hundred years. Beyond it lie dates that PostgreSQL stores but Python cannot read back.
MAX_DELAY_SECONDS = 100 * 365.25 * 86400.0

READY = (Status.QUEUED, Status.RETRYING)
FINISHED = (Status.SUCCEEDED, Status.DEAD, Status.CANCELLED)


@dataclass(frozen=True, slots=True)
class Job:
    id: int
    queue: str
    task: str
    args: dict[str, Any]
    priority: int
    run_at: datetime
    status: Status
    attempts: int
    max_attempts: int
    lease_token: UUID | None
    lease_expires_at: datetime | None
    worker_id: UUID | None
    last_error: str | None
    result: Any
    created_at: datetime
    claimed_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> Job:
        values = list(row)
        values[6] = Status(values[6])
        return cls(*values)
