"""Concurrency limits and rates across every worker (concepts/limits.md).

A limit counts running jobs (live leases) of a group; a rate counts the jobs started in the last
period. Groups are a queue (``pgqueue queues limit``), a task (``@app.task(limit=...)``) or a
key within a task (``limit_key=``). The values live in the database (``pgqueue_queues``,
``pgqueue_tasks``), so operators change them at run time and every worker's next claim obeys;
the grouping of a task's jobs is written on each job at enqueue (``limit_key``). The claim that
enforces them is ``claim_limited_jobs`` (queries.sql), run by the fetcher.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg

from .errors import ConfigurationError, InvalidJobError
from .sql import Queries

log = logging.getLogger("pgqueue.limits")

#: A group key computed from a job's arguments (``limit_key=lambda args: args["tenant"]``).
LimitKey = Callable[[Mapping[str, Any]], object]
#: ``"100/m"``, ``"5/s"``, ``"1000/h"``, ``"10/5m"``, or (count, seconds).
RateSpec = str | tuple[int, float | timedelta]

MAX_KEY_LENGTH = 1000
#: A pass that gives a newly limited task's waiting jobs their group skips rows locked at that
#: moment (stamp_limit_keys) and tries those that still wait again, STAMP_PAUSE apart at first
#: (doubling), for up to STAMP_RETRY seconds; one left without a group would run unlimited.
STAMP_RETRY = 30.0
STAMP_PAUSE = 0.01
#: The operator's change (set_task) waits this long at most for the transactions that were
#: enqueueing when it committed (snapshot_horizon) before it looks for their jobs.
SET_WAIT = 5.0
#: Job id -> the limit group to write on it.
Groups = dict[int, str]
_UNITS = {"s": 1.0, "sec": 1.0, "second": 1.0, "m": 60.0, "min": 60.0, "minute": 60.0,
          "h": 3600.0, "hour": 3600.0, "d": 86400.0, "day": 86400.0}  # fmt: skip
_RATE = re.compile(r"^\s*(\d+)\s*/\s*(\d+(?:\.\d+)?)?\s*([a-z]+)\s*$")


@dataclass(frozen=True, slots=True)
class Rate:
    """At most ``count`` jobs started in any window of ``period`` seconds."""

    count: int
    period: float

    def __str__(self) -> str:
        for unit, seconds in (("d", 86400.0), ("h", 3600.0), ("m", 60.0), ("s", 1.0)):
            if self.period == seconds:
                return f"{self.count}/{unit}"
            if self.period % seconds == 0:
                return f"{self.count}/{self.period / seconds:g}{unit}"
        return f"{self.count}/{self.period:g}s"


def parse_rate(spec: object) -> Rate:
    """A rate from ``"N/unit"`` (s, m, h, d, or a multiple such as ``"10/5m"``) or a
    ``(count, seconds)`` pair. Raises ConfigurationError with the accepted forms."""
    if isinstance(spec, Rate):
        return spec
    count: object
    period: object
    if isinstance(spec, tuple) and len(spec) == 2:
        count, period = spec
        if isinstance(period, timedelta):
            period = period.total_seconds()
    elif isinstance(spec, str) and (match := _RATE.match(spec.lower())):
        name = match.group(3)
        unit = _UNITS.get(name) or (_UNITS.get(name[:-1]) if name.endswith("s") else None)
        if unit is None:
            raise ConfigurationError(_rate_error(spec))
        count = int(match.group(1))
        period = float(match.group(2) or 1) * unit
    else:
        raise ConfigurationError(_rate_error(spec))
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 2**31 - 1:
        raise ConfigurationError(f"rate {spec!r}: the count must be a whole number from 1")
    if isinstance(period, bool) or not isinstance(period, int | float):
        raise ConfigurationError(_rate_error(spec))
    if not (math.isfinite(period) and 0.001 <= period <= 366 * 86400):
        raise ConfigurationError(f"rate {spec!r}: the period must be from 1 ms to a year")
    return Rate(count, float(period))


def _rate_error(spec: object) -> str:
    return (
        f"rate {spec!r} is not understood: write it as 'N/unit' (unit s, m, h or d, optionally "
        "with a multiple, e.g. '100/m', '5/s', '10/5m') or as a (count, seconds) pair"
    )


def group_name(task: str, key: str) -> str:
    """A task group's name in pgqueue_rates and its advisory lock (lock_limit_groups computes
    the same in SQL): unambiguous whatever the task and key hold."""
    return f"t:{len(task)}:{task}:{key}"


def check_limit(value: object, what: str = "limit") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 2**31 - 1:
        raise ConfigurationError(f"{what} must be a whole number of jobs from 0, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class TaskLimits:
    """What ``@app.task(limit=, rate=, limit_key=)`` declared."""

    limit: int | None
    rate: Rate | None
    key: LimitKey | None

    @classmethod
    def declared(
        cls, limit: int | None, rate: RateSpec | None, limit_key: LimitKey | None
    ) -> TaskLimits | None:
        if limit is None and rate is None:
            if limit_key is not None:
                raise ConfigurationError("limit_key needs a limit or a rate to apply per key")
            return None
        if limit_key is not None and not callable(limit_key):
            raise ConfigurationError(
                "limit_key must be a function of the job's arguments, e.g. "
                "limit_key=lambda args: args['tenant']"
            )
        return cls(
            None if limit is None else check_limit(limit),
            None if rate is None else parse_rate(rate),
            limit_key,
        )

    def group(self, task: str, args: Mapping[str, Any] | None) -> str:
        """The job's limit group: '' for the whole task, else the key of its arguments."""
        if self.key is None:
            return ""
        try:
            key = self.key(args or {})
        except Exception as exc:
            raise InvalidJobError(
                f"task {task!r}: limit_key failed on the job's arguments "
                f"({type(exc).__name__}: {exc})"
            ) from None
        if key is None:
            raise InvalidJobError(f"task {task!r}: limit_key returned None")
        text = key if isinstance(key, str) else json.dumps(key, sort_keys=True, default=str)
        if len(text.encode("utf-8", "surrogatepass")) > MAX_KEY_LENGTH or "\x00" in text:
            raise InvalidJobError(
                f"task {task!r}: limit_key gave a key longer than {MAX_KEY_LENGTH} bytes "
                "or with a NUL character"
            )
        return text

    def waiting_group(self, task: str, args: Mapping[str, Any] | None) -> str:
        """The group of a job written without one (stamped after a declaration, given back by
        a claim, fired by a schedule): ``group``, or '' when the key cannot be computed, so
        such a job is limited with the others it cannot be told from, never left unlimited."""
        try:
            return self.group(task, args)
        except InvalidJobError:
            return ""


# --- worker start: declarations ------------------------------------------------------------


async def declare(
    conn: psycopg.AsyncConnection[Any], q: Queries, declared: Mapping[str, TaskLimits]
) -> list[str]:
    """Write the declared limits; returns the tasks whose waiting jobs need a group."""
    if not declared:
        return []
    names = sorted(declared)
    cur = await conn.execute(
        q.declare_task_limits,
        {
            "names": names,
            "limits": [declared[n].limit for n in names],
            "rate_limits": [_count(declared[n].rate) for n in names],
            "rate_periods": [_period(declared[n].rate) for n in names],
            "per_keys": [declared[n].key is not None for n in names],
        },
    )
    return [str(name) for name, restamp in await cur.fetchall() if restamp]


async def snapshot_horizon(conn: psycopg.AsyncConnection[Any], q: Queries) -> str:
    """The first transaction id not yet started: once every transaction below it has ended,
    none can still commit a row it wrote before this moment (see horizon_passed)."""
    cur = await conn.execute(q.snapshot_horizon)
    row = await cur.fetchone()
    assert row is not None
    return str(row[0])


async def horizon_passed(conn: psycopg.AsyncConnection[Any], q: Queries, horizon: str) -> bool:
    """Whether every transaction that was running at ``horizon`` has ended."""
    cur = await conn.execute(q.horizon_passed, {"horizon": horizon})
    row = await cur.fetchone()
    return bool(row and row[0])


async def stamp_waiting(
    conn: psycopg.AsyncConnection[Any], q: Queries, task: str, limits: TaskLimits | None
) -> tuple[int, Groups]:
    """Give the task's waiting jobs without a group their group (a batch per round trip).
    Returns how many got one, and the jobs a lock kept from it that still wait (stamp_again)."""
    after, stamped, skipped = 0, 0, Groups()
    while True:
        cur = await conn.execute(q.unstamped_jobs, {"after": after, "task": task})
        rows = await cur.fetchall()
        if not rows:
            return stamped, skipped
        groups: Groups = {}
        for job_id, args in rows:
            groups[job_id] = "" if limits is None else limits.waiting_group(task, json.loads(args))
        done, left = await stamp_again(conn, q, groups)
        stamped += done
        skipped.update(left)
        after = rows[-1][0]


async def stamp_again(
    conn: psycopg.AsyncConnection[Any], q: Queries, groups: Groups
) -> tuple[int, Groups]:
    """One try at these jobs' groups: how many got theirs, and those still skipped."""
    cur = await conn.execute(q.stamp_limit_keys, _stamp_params(groups))
    done = {row[0] for row in await cur.fetchall()}
    if len(done) == len(groups):
        return len(done), {}
    cur = await conn.execute(q.unstamped_among, {"ids": [i for i in groups if i not in done]})
    return len(done), {row[0]: groups[row[0]] for row in await cur.fetchall()}


def _stamp_params(groups: Groups) -> dict[str, Any]:
    return {"ids": list(groups), "keys": list(groups.values())}


def _stamp_task(conn: psycopg.Connection[Any], q: Queries, name: str) -> Groups:
    """stamp_waiting and stamp_again for an operator's limit (the group '': the whole task),
    on a sync connection; returns the jobs still skipped."""
    after, skipped = 0, Groups()
    while rows := conn.execute(q.unstamped_jobs, {"after": after, "task": name}).fetchall():
        skipped.update(_stamp_again_sync(conn, q, dict.fromkeys((r[0] for r in rows), "")))
        after = rows[-1][0]
    return skipped


def _stamp_again_sync(conn: psycopg.Connection[Any], q: Queries, groups: Groups) -> Groups:
    done = {row[0] for row in conn.execute(q.stamp_limit_keys, _stamp_params(groups))}
    if len(done) == len(groups):
        return {}
    rows = conn.execute(q.unstamped_among, {"ids": [i for i in groups if i not in done]})
    return {row[0]: groups[row[0]] for row in rows}


async def stamp_skipped(
    connection: Callable[[], AbstractAsyncContextManager[psycopg.AsyncConnection[Any]]],
    q: Queries,
    skipped: dict[str, Groups],
    deadline: float,
    pause: float = STAMP_PAUSE,
) -> None:
    """Try the skipped jobs of each task again (stamp_again), ``pause`` apart at first, until
    none is left or the ``time.monotonic()`` deadline; warn of those still left."""
    while any(skipped.values()) and time.monotonic() < deadline:
        await asyncio.sleep(pause)
        pause = _next_pause(pause)
        async with connection() as conn:
            for name, groups in skipped.items():
                if groups:
                    _, skipped[name] = await stamp_again(conn, q, groups)
    for name, groups in skipped.items():
        if groups:
            _left_ungrouped(name, len(groups))


def _next_pause(pause: float) -> float:
    """The pause before the next try at skipped jobs: doubling, at most a second."""
    return min(pause * 2, 1.0)


def _left_ungrouped(task: str, jobs: int) -> None:
    log.warning(
        "task %r: %d waiting jobs stayed locked and have no limit group; the worker that "
        "claims one gives it back with its group, and it runs under the limit",
        task, jobs,
    )  # fmt: skip


def _count(rate: Rate | None) -> int | None:
    return None if rate is None else rate.count


def _period(rate: Rate | None) -> float | None:
    return None if rate is None else rate.period


# --- operators --------------------------------------------------------------------------------


class Unset:
    """Leave this setting as it is."""


UNSET = Unset()


def check_settings(
    limit: int | Unset | None, rate: RateSpec | Rate | Unset | None
) -> dict[str, Any]:
    """An operator's change as statement parameters (set_queue_limits, set_task_limits): each
    of ``limit`` and ``rate`` is set, removed (None) or left as it is (UNSET)."""
    if isinstance(limit, Unset) and isinstance(rate, Unset):
        raise ConfigurationError("give a limit, a rate, or both (None removes one)")
    parsed = None if isinstance(rate, Unset) or rate is None else parse_rate(rate)
    return {
        "set_limit": not isinstance(limit, Unset),
        "limit": None if isinstance(limit, Unset) or limit is None else check_limit(limit),
        "set_rate": not isinstance(rate, Unset),
        "rate_limit": _count(parsed),
        "rate_period": _period(parsed),
    }


def set_queue(
    conn: psycopg.Connection[Any], q: Queries, name: str, settings: dict[str, Any]
) -> None:
    """Set a queue's limit and/or rate (check_settings); wakes waiting workers after it
    commits. ``conn`` is in autocommit mode."""
    conn.execute(q.set_queue_limits, {"name": name, **settings})
    conn.execute(q.wake_waiting_workers, {"queues": [name]})


def set_task(
    conn: psycopg.Connection[Any], q: Queries, name: str, settings: dict[str, Any]
) -> None:
    """An operator's limit and/or rate for a task, kept over the code's until reset. A task
    limited here for the first time gets its waiting jobs grouped ('': the whole task): now,
    and again once the transactions that were enqueueing at the change have ended (a statement
    that read pgqueue_tasks before it wrote a job without a group)."""
    row = conn.execute(q.set_task_limits, {"name": name, **settings}).fetchone()
    if row is not None and row[1]:
        horizon = conn.execute(q.snapshot_horizon).fetchone()
        assert horizon is not None
        _stamp_task(conn, q, name)
        deadline, pause = time.monotonic() + SET_WAIT, STAMP_PAUSE
        while not _passed(conn, q, horizon[0]) and time.monotonic() < deadline:
            time.sleep(pause)
            pause = _next_pause(pause)
        skipped = _stamp_task(conn, q, name)
        while skipped and time.monotonic() < deadline:
            time.sleep(pause)
            pause = _next_pause(pause)
            skipped = _stamp_again_sync(conn, q, skipped)
        if skipped:
            _left_ungrouped(name, len(skipped))
    # The task's jobs may wait in any queue: wake every worker that waits (a worker that serves
    # every queue takes any queue's name as its own).
    queues = [str(row[0]) for row in conn.execute(q.served_queues).fetchall()]
    conn.execute(q.wake_waiting_workers, {"queues": queues})


def _passed(conn: psycopg.Connection[Any], q: Queries, horizon: object) -> bool:
    row = conn.execute(q.horizon_passed, {"horizon": horizon}).fetchone()
    return bool(row and row[0])


async def set_queue_async(
    conn: psycopg.AsyncConnection[Any], q: Queries, name: str, settings: dict[str, Any]
) -> None:
    await conn.execute(q.set_queue_limits, {"name": name, **settings})
    await conn.execute(q.wake_waiting_workers, {"queues": [name]})


async def set_task_async(
    conn: psycopg.AsyncConnection[Any], q: Queries, name: str, settings: dict[str, Any]
) -> None:
    cur = await conn.execute(q.set_task_limits, {"name": name, **settings})
    row = await cur.fetchone()
    if row is not None and row[1]:
        horizon = await snapshot_horizon(conn, q)
        await stamp_waiting(conn, q, name, None)
        deadline, pause = time.monotonic() + SET_WAIT, STAMP_PAUSE
        while not await horizon_passed(conn, q, horizon) and time.monotonic() < deadline:
            await asyncio.sleep(pause)
            pause = _next_pause(pause)
        _, skipped = await stamp_waiting(conn, q, name, None)
        await stamp_skipped(lambda: nullcontext(conn), q, {name: skipped}, deadline, pause)
    cur = await conn.execute(q.served_queues)
    queues = [str(r[0]) for r in await cur.fetchall()]
    await conn.execute(q.wake_waiting_workers, {"queues": queues})


def reset_task(conn: psycopg.Connection[Any], q: Queries, name: str) -> bool:
    return conn.execute(q.reset_task_limits, {"name": name}).fetchone() is not None


@dataclass(frozen=True, slots=True)
class QueueSettings:
    name: str
    paused: bool
    limit: int | None
    rate: Rate | None


@dataclass(frozen=True, slots=True)
class TaskSettings:
    name: str
    limit: int | None
    rate: Rate | None
    per_key: bool
    overridden: bool


def queue_settings(conn: psycopg.Connection[Any], q: Queries) -> list[QueueSettings]:
    return [
        QueueSettings(str(name), bool(paused), limit, _rate(count, period))
        for name, paused, _, limit, count, period in conn.execute(q.queue_settings).fetchall()
    ]


def task_settings(conn: psycopg.Connection[Any], q: Queries) -> list[TaskSettings]:
    return [
        TaskSettings(str(name), limit, _rate(count, period), bool(per_key), bool(overridden))
        for name, limit, count, period, per_key, overridden in conn.execute(
            q.task_limits
        ).fetchall()
    ]


def _rate(count: int | None, period: float | None) -> Rate | None:
    return None if count is None or period is None else Rate(int(count), float(period))
