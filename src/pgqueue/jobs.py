"""The job record as callers see it, and its statuses."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

#: The longest wait pgqueue accepts anywhere a wait is given in seconds: ``delay=``,
#: ``Retry(after=)``, ``Backoff(cap=)`` and the worker's durations. 100 years: longer than any
#: real schedule, so a bigger value is a unit mistake (milliseconds, a timestamp), and short
#: enough that ``now() + delay`` stays a valid timestamp and every thread wait a valid timeout.
MAX_DELAY_SECONDS = 100 * 365.25 * 86400.0

#: The range of a job's ``run_at``. Every ``run_at`` read back must be a Python ``datetime``
#: in any session TimeZone (offsets up to ±16 h), which PostgreSQL's far wider ``timestamptz``
#: does not promise: these bounds keep it far inside years 1 to 9999, and refuse run_at values
#: that can only be mistakes (a zero timestamp, a year typed wrong).
EARLIEST_RUN_AT = datetime(1970, 1, 1, tzinfo=UTC)
LATEST_RUN_AT = datetime(3000, 1, 1, tzinfo=UTC)


class Status(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    RETRYING = "retrying"
    SUCCEEDED = "succeeded"
    DEAD = "dead"
    CANCELLED = "cancelled"
    #: Enqueued with ``after=``: waits until its parents finish (concepts/workflows.md).
    BLOCKED = "blocked"


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
    #: The key a unique job was enqueued with (``task:key``); None for other jobs, and once a
    #: later enqueue with the same key found it no longer held.
    unique_key: str | None = None
    #: The caller's own data, set at enqueue (``configure(meta=...)``).
    meta: dict[str, Any] | None = None
    #: The last progress its running attempt reported (``ctx.progress``): ``current``, and
    #: ``total`` and ``note`` if given.
    progress: dict[str, Any] | None = None

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> Job:
        values = list(row)
        values[6] = Status(values[6])
        return cls(*values)


@dataclass(frozen=True, slots=True)
class Attempt:
    """One attempt of a job, as ``App.job_attempts`` lists them.

    ``outcome`` is what the job became after it: ``retrying``, ``dead`` or ``cancelled`` (its
    handler failed or it was cancelled), ``lease expired`` (a reaper took it back), or, for the
    job's latest attempt only, ``running`` or ``succeeded``. ``worker_id`` is None for a
    succeeded attempt (the ack clears it)."""

    number: int
    outcome: str
    worker_id: UUID | None
    claimed_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    error: str | None


class CancelResult(enum.StrEnum):
    """What ``App.cancel`` did. True in a boolean context unless the job had already finished."""

    #: The job was waiting (queued or retrying): it is cancelled now and will never run.
    CANCELLED = "cancelled"
    #: The job was running: its worker stops the attempt (an async handler is cancelled, a sync
    #: one abandoned) and the job ends cancelled, never retried; a success that its handler
    #: wrote first still stands.
    REQUESTED = "cancel requested"
    #: The job had already succeeded, died or been cancelled: nothing changed.
    FINISHED = "already finished"

    def __bool__(self) -> bool:
        return self is not CancelResult.FINISHED


class Enqueued(int):
    """What ``enqueue`` returns: a job id (an ``int``, usable wherever the id was), and what
    happened. ``duplicate``: a job with the same unique key already held it, and this is that
    job's id (nothing new was written). ``replaced``: that job took the new arguments (and, for
    ``on_conflict="debounce"``, the later run_at), as it was still waiting. ``queue``: the queue
    the enqueue asked for, which names the job's cluster on an app with routes (None for an id
    made by hand)."""

    duplicate: bool
    replaced: bool
    queue: str | None = None

    def __new__(cls, job_id: int, duplicate: bool = False, replaced: bool = False) -> Enqueued:
        self = super().__new__(cls, job_id)
        self.duplicate = duplicate
        self.replaced = replaced
        return self

    @property
    def id(self) -> int:
        return int(self)
