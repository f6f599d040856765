"""Jobs that run after other jobs: ``after=[...]``, chains and groups (concepts/workflows.md).

A child is enqueued 'blocked' with a count of its unfinished parents; each parent's final write
(its ack, its reap, its cancel) releases it in the same transaction (the trigger of migration
0015), so a child never runs before its parents succeeded and is never left waiting. A group of
any size is one bulk insert and its callback one counter: each member's end is one decrement.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import psycopg

from . import producer
from .errors import InvalidJobError
from .jobs import Enqueued
from .sql import Queries

if TYPE_CHECKING:
    from .app import App
    from .tasks import Task

#: Parents one job may name with after= (a group's callback may have any number).
MAX_PARENTS = 1000
#: Group members inserted per statement.
GROUP_CHUNK = 1000
AFTER_FAILURE = ("cancel", "run")


def check_parents(after: Iterable[int], limit: int = MAX_PARENTS) -> tuple[int, ...]:
    if isinstance(after, int | str | bytes):
        raise InvalidJobError("after must be a list of job ids")
    parents = tuple(after)
    if not parents:
        raise InvalidJobError("after=[] names no parent job")
    for job_id in parents:
        if isinstance(job_id, bool) or not isinstance(job_id, int) or not 1 <= job_id < 2**63:
            raise InvalidJobError(f"after: {job_id!r} is not a job id")
    if len(parents) > limit:
        raise InvalidJobError(
            f"after names {len(parents):,} jobs; at most {limit:,} (use a group for more)"
        )
    # An Enqueued is kept as it is: its queue names its cluster (pgqueue.routing).
    return tuple(p if isinstance(p, Enqueued) else int(p) for p in parents)


def check_after_failure(value: object) -> str:
    if value not in AFTER_FAILURE:
        raise InvalidJobError(f"after_failure must be 'cancel' or 'run', got {value!r}")
    return str(value)


def refuse_unique(row: producer.JobRow, which: str, member: bool = False) -> None:
    """A job that runs after others (``after=``, a chain's later step, a group's callback)
    cannot be unique; nor can a group's member, whose bulk insert takes no key.
    Refused, rather than written without the key its task declares."""
    if row.unique_key is None:
        return
    if member:
        raise InvalidJobError(
            f"{which} (task {row.task!r}) is a unique job, and a group's members cannot be: "
            "enqueue it with enqueue() and give its id to the callback's after="
        )
    raise InvalidJobError(
        f"{which} (task {row.task!r}) is a unique job, and a unique job cannot also run after "
        "other jobs"
    )


def with_parents(
    row: producer.JobRow, after: Iterable[int] | None, after_failure: str
) -> producer.JobRow:
    if after is None:
        return row
    refuse_unique(row, "a job with after=")
    parents = tuple(int(p) for p in check_parents(after))  # one type: psycopg dumps a list of one
    return row._replace(after=parents, after_failure=check_after_failure(after_failure))


@dataclass(frozen=True, slots=True)
class Signature:
    """A task with its arguments and options, not enqueued yet: ``task.s(**kwargs)``."""

    task: Task[Any, Any]
    args: Mapping[str, Any] = field(default_factory=dict)
    queue: str | None = None
    priority: int | None = None
    max_attempts: int | None = None
    delay: float | timedelta | None = None
    run_at: datetime | None = None
    meta: Mapping[str, Any] | None = None

    def row(self, app: App, *, callback: bool = False) -> producer.JobRow:
        self.task.check_args(dict(self.args), callback=callback)
        return app._row(
            self.task.name, self.args, queue=self.queue, priority=self.priority,
            max_attempts=self.max_attempts, delay=self.delay, run_at=self.run_at,
            allow_unknown=False, meta=self.meta,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Group:
    """What ``App.group`` wrote: the members' ids in order, and the callback's id (if any)."""

    members: list[Enqueued]
    callback: Enqueued | None


def chain(
    conn: psycopg.Connection[Any], q: Queries, rows: Sequence[producer.JobRow], after_failure: str
) -> list[Enqueued]:
    """Each job after the one before it, all in ``conn``'s transaction."""
    ids: list[Enqueued] = []
    for row in rows:
        if ids:
            row = row._replace(after=(int(ids[-1]),), after_failure=after_failure)
        ids.append(producer.insert(conn, q, row))
    return ids


def group(
    conn: psycopg.Connection[Any], q: Queries, members: Sequence[producer.JobRow],
    callback: producer.JobRow | None, after_failure: str, *, own: bool = False,
) -> Group:  # fmt: skip
    """The members in chunks (ids back, in order), then the callback after all of them.
    ``own``: the transaction is pgqueue's (producer.bound_client_waits)."""
    ids: list[Enqueued] = []
    db_now = (
        producer.bound_client_waits(conn, q) if own else conn.execute(q.database_now).fetchone()
    )
    assert db_now is not None
    for start in range(0, len(members), GROUP_CHUNK):
        chunk = members[start : start + GROUP_CHUNK]
        rows = conn.execute(
            q.insert_group_members,
            {
                "has_children": callback is not None,
                "queues": [r.queue for r in chunk],
                "tasks": [r.task for r in chunk],
                "args": [r.args_json for r in chunk],
                "priorities": [r.priority for r in chunk],
                "run_ats": [r.db_run_at(db_now[0]) for r in chunk],
                "max_attempts": [r.max_attempts for r in chunk],
                "limit_keys": [r.limit_key for r in chunk],
                "metas": [r.meta_json for r in chunk],
            },
        ).fetchall()
        ids += [Enqueued(job_id) for job_id in sorted(r[0] for r in rows)]
    done = None
    if callback is not None:
        row = callback._replace(after=tuple(int(i) for i in ids), after_failure=after_failure)
        done = producer.insert(conn, q, row)
    return Group(ids, done)
