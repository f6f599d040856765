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
    #: None on a primary; on a hot standby {"lag": seconds behind or None, "streaming": bool}.
    replica: dict[str, Any] | None = None


def statements(schema: str) -> dict[str, bytes]:
    return named("pgqueue.dashboard", "queries.sql", validate_schema(schema))


async def _all(
    conn: psycopg.AsyncConnection[Any], query: bytes, params: dict[str, Any] | None = None
) -> list[tuple[Any, ...]]:
    cur = await conn.execute(query, params)
    return list(await cur.fetchall())


async def read(
    conn: psycopg.AsyncConnection[Any], schema: str, *, late_after: float = 15.0
) -> Reading:
    """Every panel, inside the caller's REPEATABLE READ READ ONLY transaction
    (``Database.read``): one instant for all figures."""
    q = statements(schema)
    clock = (await _all(conn, q["clock"]))[0]
    now, second = float(clock[0]), int(clock[1])
    sampled = await _all(conn, q["depth_sampled"], {"rows_per_second": stats.DEPTH_ROWS_PER_SECOND})
    depth_rows = sampled or await _all(conn, q["depth_count"])
    depth = figures.with_running(
        figures.depth_counts(depth_rows), await _all(conn, q["running_by_queue"])
    )
    tput = figures.throughput(await _all(conn, q["throughput"]), second)
    latency = figures.latency(figures.histograms(await _all(conn, q["latency_histograms"])))
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
    dead, retrying = (await _all(conn, q["problem_counts"]))[0]
    feed = [
        {"id": r[0], "task": r[1], "queue": r[2], "event": r[3], "at": r[4], "attempt": r[5]}
        for r in await _all(conn, q["feed"], {"limit": FEED_LIMIT})
    ]
    schedules = [
        {"name": r[0], "cron": r[1], "task": r[2], "queue": r[3], "next_run": r[4],
         "last_run": r[5], "enabled": r[6], "paused": r[7]}
        for r in await _all(conn, q["schedules"])
    ]  # fmt: skip
    paused = [str(r[0]) for r in await _all(conn, q["paused_queues"])]
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
        problem_counts={"dead": int(dead), "retrying": int(retrying)},
        feed=feed,
        schedules=schedules,
        paused=paused,
        inserts_total=int(counter[0][0]) if counter else None,
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
