"""Reads every panel's figures in one read-only transaction (the SQL is in queries.sql)."""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any

import psycopg

from .. import stats
from ..db import validate_schema
from ..sql import named
from . import figures

LIST_LIMIT = 50
FEED_LIMIT = 30
#: Past DEAD_ALWAYS_COUNTED, dead jobs are counted in full (per queue) at most this often: the
#: count reads every dead row (there is no index by queue). In between, the jobs that died
#: since are added; jobs requeued or pruned since leave the figures at the next full count.
DEAD_RECOUNT_SECONDS = 30.0
#: Up to this many dead jobs, counting them costs well under a millisecond: every refresh
#: counts them exactly (per queue when the total moved).
DEAD_ALWAYS_COUNTED = 2000


@dataclasses.dataclass
class DeadCounts:
    """Dead jobs per queue as last counted, kept by the refresh loop between reads."""

    total: int
    at: float
    by_queue: dict[str, int]


@dataclasses.dataclass
class QueueSetting:
    paused: bool
    limit: int | None
    rate: int | None
    period: float | None
    #: [starts in the current period, seconds until there is room again] while rated.
    used: list[Any] | None = None


@dataclasses.dataclass
class Reading:
    """One refresh's raw figures, before the refresh loop adds what it remembers."""

    now: float
    second: int
    depth: dict[str, dict[str, int]]
    throughput: dict[str, Any]
    latency: dict[str, float | None]
    depth_samples: list[tuple[Any, ...]]
    workers: list[dict[str, Any]]
    running: list[dict[str, Any]]
    problems: list[dict[str, Any]]
    problem_counts: dict[str, int]
    feed: list[dict[str, Any]]
    schedules: list[dict[str, Any]]
    paused: list[str]
    inserts_total: int | None
    settings: dict[str, QueueSetting] = dataclasses.field(default_factory=dict)
    queue_finished: dict[str, int] = dataclasses.field(default_factory=dict)
    queue_pickup: dict[str, dict[int, int]] = dataclasses.field(default_factory=dict)
    #: now - the earliest run_at of each queue's waiting jobs (negative: none due yet).
    heads: dict[str, float] = dataclasses.field(default_factory=dict)
    #: The tasks of each queue's due heads (the first job of each priority).
    head_tasks: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    #: The last full count of dead jobs, kept by the refresh loop between reads.
    dead: DeadCounts | None = None
    #: Dead jobs per queue as shown: the last full count plus the jobs that died since.
    dead_by_queue: dict[str, int] = dataclasses.field(default_factory=dict)
    #: (pid, application_name, state, xact age, query age, query, xmin age) of the oldest
    #: transaction holding back vacuum past the threshold, if any.
    oldest_transaction: tuple[Any, ...] | None = None
    hidden_sessions: int = 0
    #: (live, dead, seconds since the last vacuum) of pgqueue_jobs, from the statistics.
    tuples: tuple[int, int, float | None] | None = None
    #: None on a primary; on a hot standby {"lag": seconds behind or None, "streaming": bool}.
    replica: dict[str, Any] | None = None


async def _dead_counts(
    conn: psycopg.AsyncConnection[Any],
    q: dict[str, bytes],
    now: float,
    seen: int,
    last: DeadCounts | None,
) -> tuple[DeadCounts | None, DeadCounts]:
    """(the full count to keep, the figures to show). ``seen`` is the dead total counted up to
    DEAD_ALWAYS_COUNTED + 1: below it exact, past it a full count at most every
    DEAD_RECOUNT_SECONDS, with the deaths since added in between, so a refresh never reads
    100,000 dead rows."""
    if seen <= DEAD_ALWAYS_COUNTED:
        if last is None or last.total != seen or last.total > DEAD_ALWAYS_COUNTED:
            by_queue = {str(r[0]): int(r[1]) for r in await _all(conn, q["dead_by_queue"])}
            last = DeadCounts(seen, now, by_queue)
        return last, last
    if last is None or last.total <= DEAD_ALWAYS_COUNTED or now - last.at >= DEAD_RECOUNT_SECONDS:
        by_queue = {str(r[0]): int(r[1]) for r in await _all(conn, q["dead_by_queue"])}
        last = DeadCounts(sum(by_queue.values()), now, by_queue)
        return last, last
    since = {str(r[0]): int(r[1]) for r in await _all(conn, q["dead_since"], {"since": last.at})}
    if not since:
        return last, last
    by_queue = dict(last.by_queue)
    for queue, n in since.items():
        by_queue[queue] = by_queue.get(queue, 0) + n
    return last, DeadCounts(last.total + sum(since.values()), now, by_queue)


def statements(schema: str) -> dict[str, bytes]:
    return named("pgqueue.dashboard", "queries.sql", validate_schema(schema))


async def _all(
    conn: psycopg.AsyncConnection[Any], query: bytes, params: dict[str, Any] | None = None
) -> list[tuple[Any, ...]]:
    cur = await conn.execute(query, params)
    return list(await cur.fetchall())


async def read(
    conn: psycopg.AsyncConnection[Any],
    schema: str,
    *,
    late_after: float = 15.0,
    long_transaction: float = 300.0,
    dead: DeadCounts | None = None,
) -> Reading:
    """Every panel, inside the caller's REPEATABLE READ READ ONLY transaction
    (``Database.read``): one instant for all figures. ``dead`` is the last count of dead jobs
    per queue, recounted only when stale; ``long_transaction`` is the health strip's threshold
    (seconds)."""
    q = statements(schema)
    clock = (await _all(conn, q["clock"]))[0]
    now, second = float(clock[0]), int(clock[1])
    sampled = await _all(conn, q["depth_sampled"], {"rows_per_second": stats.DEPTH_ROWS_PER_SECOND})
    depth_rows = sampled or await _all(conn, q["depth_count"])
    depth = figures.with_running(
        figures.depth_counts(depth_rows), await _all(conn, q["running_by_queue"])
    )
    tput = figures.throughput(await _all(conn, q["throughput"]), second)
    hist_rows = await _all(conn, q["latency_histograms"])
    latency = figures.latency(figures.histograms((r[0], r[2], r[3]) for r in hist_rows))
    queue_pickup: dict[str, dict[int, int]] = {}
    for kind, queue, index, count in hist_rows:
        if kind == "pickup":
            stats.merge(queue_pickup.setdefault(str(queue), {}), {int(index): int(count)})
    queue_finished = {str(r[0]): int(r[1]) for r in await _all(conn, q["queue_throughput"])}
    head_rows = await _all(conn, q["queue_heads"])
    heads = {str(r[0]): float(r[1]) for r in head_rows}
    head_tasks = {str(r[0]): list(r[2]) for r in head_rows if r[2]}
    samples = await _all(conn, q["depth_history"])
    workers = [figures.worker_row(r, late_after) for r in await _all(conn, q["workers"])]
    running = [
        {"id": r[0], "task": r[1], "queue": r[2], "worker": r[3], "attempt": r[4],
         "max_attempts": r[5], "running_for": r[6], "lease_left": r[7], "args": r[8],
         "progress": r[9], "parents": r[10], "children": r[11]}
        for r in await _all(conn, q["running_jobs"], {"limit": LIST_LIMIT})
    ]  # fmt: skip
    problems = [
        {"id": r[0], "task": r[1], "queue": r[2], "status": r[3], "attempts": r[4],
         "max_attempts": r[5], "error": r[6], "error_length": r[7], "when": r[8],
         "args": r[9], "parents": r[10], "children": r[11]}
        for r in await _all(conn, q["problems"], {"limit": LIST_LIMIT})
    ]  # fmt: skip
    dead_seen, retrying = (await _all(conn, q["problem_counts"], {"cap": DEAD_ALWAYS_COUNTED}))[0]
    feed = [
        {"id": r[0], "task": r[1], "queue": r[2], "event": r[3], "at": r[4], "attempt": r[5]}
        for r in await _all(conn, q["feed"], {"limit": FEED_LIMIT})
    ]
    schedules = [
        {"name": r[0], "cron": r[1], "task": r[2], "queue": r[3], "next_run": r[4],
         "last_run": r[5], "enabled": r[6], "paused": r[7]}
        for r in await _all(conn, q["schedules"])
    ]  # fmt: skip
    rows = await _all(conn, q["queue_settings"], {"schema": schema})
    settings = {str(r[0]): QueueSetting(bool(r[1]), r[2], r[3], r[4]) for r in rows}
    if rows and rows[0][5] and any(s.rate is not None for s in settings.values()):
        for name, used, room_in in await _all(conn, q["queue_rates"]):
            if (setting := settings.get(str(name))) is not None:  # past the first 1,000: none
                setting.used = [used, room_in]
    paused = [name for name, s in settings.items() if s.paused]
    dead, shown = await _dead_counts(conn, q, now, int(dead_seen), dead)
    activity = (await _all(conn, q["oldest_transaction"], {"older_than": long_transaction}))[0]
    in_recovery, lag, streaming = (await _all(conn, q["replica"]))[0]
    replica = {"lag": lag, "streaming": bool(streaming)} if in_recovery else None
    # A standby's table statistics count its own activity, not the primary's inserts: no rate.
    counter = [] if in_recovery else await _all(conn, q["insert_counter"], {"schema": schema})
    return Reading(
        now=now,
        second=second,
        depth=depth,
        throughput=tput,
        latency=latency,
        depth_samples=samples,
        workers=workers,
        running=running,
        problems=problems,
        problem_counts={"dead": shown.total, "retrying": int(retrying)},
        feed=feed,
        schedules=schedules,
        paused=paused,
        inserts_total=int(counter[0][0]) if counter else None,
        settings=settings,
        queue_finished=queue_finished,
        queue_pickup=queue_pickup,
        heads=heads,
        head_tasks=head_tasks,
        dead=dead,
        dead_by_queue=shown.by_queue,
        oldest_transaction=tuple(activity[1]) if activity[1] is not None else None,
        hidden_sessions=int(activity[0]),
        tuples=(int(counter[0][1]), int(counter[0][2]), counter[0][3]) if counter else None,
        replica=replica,
    )


async def finished_since(
    conn: psycopg.AsyncConnection[Any], schema: str, after: datetime | None
) -> tuple[datetime, list[tuple[Any, ...]]]:
    """Settled per-queue counts and histograms since ``after`` (None: since the beginning of
    the retention window), and the new watermark; inside the caller's read-only transaction."""
    q = statements(schema)
    until = (await _all(conn, q["settled_until"]))[0][0]
    rows = await _all(conn, q["finished_since"], {"after": after or datetime.min})
    return until, rows
