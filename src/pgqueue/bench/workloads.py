"""The benchmark workloads: each runs one system once, in a fresh database, and measures it.

Throughput of a burn-down is taken over the middle 90 % of the jobs (from 95 % left to 5 % left,
read from the database), so process start-up and the last stragglers weigh the same for every
system; CPU is read at the same two samples. Between the two samples the count runs a handful of
times (closer together as the second one nears, every 50 ms at the end): it scans the jobs table,
and counting every 50 ms took a third of a core from the system under test.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import statistics
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from ..embedded import find_bindir
from ..sql import queries
from .processes import Adapter, CpuMeter, Databases, System, adapter, run_role

POLL = 0.05
FILL_BATCH = 5_000


@dataclass
class Context:
    databases: Databases
    cpu: CpuMeter
    logdir: Path
    #: Calls of the workloads that rotate the order of their drains (``limits``).
    turns: int = 0


def _scaled(system: System, jobs: int) -> int:
    return max(int(jobs * system.scale), 200)


async def _install(ctx: Context, system: System, dsn: str) -> None:
    await run_role(system, "install", dsn, [], ctx.logdir)
    if system.after_install:
        with psycopg.connect(dsn, autocommit=True) as conn:
            for statement in system.after_install:
                conn.execute(statement.encode())


async def _fill(ctx: Context, system: System, dsn: str, jobs: int) -> dict[str, Any]:
    return await run_role(
        system, "enqueue", dsn, ["--jobs", str(jobs), "--batch", str(FILL_BATCH)], ctx.logdir
    )


def _vacuum(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")


async def enqueue(
    ctx: Context, system: System, jobs: int, producers: int, batch: int
) -> dict[str, float]:
    """Jobs/s of ``producers`` concurrent producers, ``batch`` jobs per transaction; with one
    job per transaction also the calls' latency (p50 and p99, ms)."""
    jobs = _scaled(system, jobs) if batch == 1 else jobs
    with ctx.databases.fresh() as dsn:
        await _install(ctx, system, dsn)
        args = ["--jobs", str(jobs), "--producers", str(producers), "--batch", str(batch)]
        with psycopg.connect(dsn, autocommit=True) as session:
            for statement in system.session:
                session.execute(statement.encode())
            result = await run_role(system, "enqueue", dsn, args, ctx.logdir)
    figures = {"rate": float(result["jobs"]) / float(result["seconds"])}
    for key in ("p50", "p99"):
        if f"{key}_ms" in result:
            figures[key] = float(result[f"{key}_ms"])
    return figures


async def _start_workers(
    ctx: Context,
    system: System,
    dsn: str,
    count: int,
    args: list[str],
    stack: Any,
    **extra: Any,
) -> list[Adapter]:
    config = ["--config", json.dumps({**system.work_config, **extra})]
    workers = [
        await stack.enter_async_context(adapter(system, "work", dsn, [*args, *config], ctx.logdir))
        for _ in range(count)
    ]
    for worker in workers:
        await worker.next()  # ready
    return workers


async def _stop_workers(workers: list[Adapter]) -> list[dict[str, Any]]:
    for worker in workers:
        await worker.send("stop")
    return [await worker.finish() for worker in workers]


def _poll_delay(
    marks: list[tuple[float, int, float, float | None]], left: int, now: float, low: float
) -> float:
    """Seconds to the next count. Between the two marks the count runs rarely (at half the
    predicted time to the second mark, every ``POLL`` near it): it is a scan of the jobs, and
    every 50 ms over 100,000 rows it took a third of a core from the system being measured."""
    if len(marks) != 1:
        return POLL
    started, left_then = marks[0][0], marks[0][1]
    if left >= left_then or now <= started:
        return POLL
    rate = (left_then - left) / (now - started)
    return min(max((left - low) / rate / 2, POLL), 2.0)


async def drain(
    ctx: Context,
    system: System,
    dsn: str,
    jobs: int,
    processes: int,
    concurrency: int,
    sleep_ms: float = 0.0,
    remaining_sql: str | None = None,
    **work_config: Any,
) -> dict[str, float | None]:
    """Start workers on ``jobs`` waiting jobs and time them over the middle 90 %. The jobs left
    are counted by ``remaining_sql`` (default: the system's own count of unfinished jobs);
    ``work_config`` goes to the workers' ``--config``."""
    from contextlib import AsyncExitStack

    remaining = (remaining_sql or system.remaining_sql).encode()
    args = ["--concurrency", str(concurrency), "--sleep-ms", str(sleep_ms)]
    async with AsyncExitStack() as stack:
        workers = await _start_workers(ctx, system, dsn, processes, args, stack, **work_config)
        pids = [w.proc.pid for w in workers]
        with psycopg.connect(dsn, autocommit=True) as conn:
            poller = conn.info.backend_pid
            high, low = jobs * 0.95, jobs * 0.05
            marks: list[tuple[float, int, float, float | None]] = []
            for worker in workers:
                await worker.send("go")
            deadline = time.monotonic() + max(120.0, jobs / 50)
            while time.monotonic() < deadline:
                row = conn.execute(remaining).fetchone()
                left = int(row[0]) if row else 0
                now = time.perf_counter()
                if (not marks and left <= high) or (len(marks) == 1 and left <= low):
                    marks.append((now, left, ctx.cpu.processes(pids), ctx.cpu.postgres(poller)))
                if left == 0:
                    break
                await asyncio.sleep(_poll_delay(marks, left, now, low))
            else:
                raise RuntimeError(f"{system.label}: {left} of {jobs} jobs left at the deadline")
        await _stop_workers(workers)
    (t0, left0, w0, p0), (t1, left1, w1, p1) = marks
    done = left0 - left1
    return {
        "rate": done / (t1 - t0),
        "worker_cpu_per_1k": (w1 - w0) / done * 1000,
        "pg_cpu_per_1k": None if p0 is None or p1 is None else (p1 - p0) / done * 1000,
    }


async def process(
    ctx: Context, system: System, jobs: int, processes: int, concurrency: int, sleep_ms: float
) -> dict[str, float | None]:
    jobs = _scaled(system, jobs)
    with ctx.databases.fresh() as dsn:
        await _install(ctx, system, dsn)
        await _fill(ctx, system, dsn, jobs)
        _vacuum(dsn)
        return await drain(ctx, system, dsn, jobs, processes, concurrency, sleep_ms)


async def depth(
    ctx: Context, system: System, waiting: int, finished: int, concurrency: int
) -> dict[str, float | None]:
    """Processing with ``waiting`` jobs queued and ``finished`` old rows in the table, and the
    same burn-down on an empty table just before it: the ratio of the two is the figure the
    target speaks of, taken from one repetition rather than from two workloads minutes apart."""
    empty = await process(ctx, system, waiting, 1, concurrency, 0.0)
    waiting = _scaled(system, waiting)
    with ctx.databases.fresh() as dsn:
        await _install(ctx, system, dsn)
        await run_role(system, "fill-finished", dsn, ["--jobs", str(finished)], ctx.logdir)
        await _fill(ctx, system, dsn, waiting)
        _vacuum(dsn)
        result = await drain(ctx, system, dsn, waiting, 1, concurrency)
    assert result["rate"] is not None and empty["rate"] is not None
    return {**result, "empty_rate": empty["rate"], "vs_empty": result["rate"] / empty["rate"]}


def _coalesce_pair(dsn: str, producers: int, jobs: int) -> dict[str, float]:
    from . import producers as timed

    off = timed.measure(dsn, False, timed.run_async, producers, jobs)
    on = timed.measure(dsn, True, timed.run_async, producers, jobs)
    return {
        "rate": on.rate, "off_rate": off.rate, "speedup": on.rate / off.rate,
        "p50": on.p50, "off_p50": off.p50, "p99": on.p99, "off_p99": off.p99,
        "per_batch": on.per_batch,
    }  # fmt: skip


async def coalesce(ctx: Context, system: System, producers: int, jobs: int) -> dict[str, float]:
    """``producers`` coroutines enqueueing single jobs on one event loop, with
    ``App(coalesce=True)`` and without, one right after the other in one fresh database: the
    pair shares the machine's load, so its ratio is the figure to read (pgqueue only)."""
    with ctx.databases.fresh() as dsn:
        await _install(ctx, system, dsn)
        # In a thread: each run has an event loop of its own, as an application would.
        return await asyncio.to_thread(_coalesce_pair, dsn, producers, jobs)


#: Jobs due later, all of one priority above the jobs being drained (the default, 0), due an
#: hour or more from now, as ``enqueue_many(..., delay=...)`` would leave them. Written by one
#: INSERT: a million jobs through the producer would add ~15 s to every repetition.
FILL_DELAYED = """
INSERT INTO pgqueue_jobs (queue, task, args, priority, run_at)
SELECT 'default', 'noop', jsonb_build_object('seq', -g), 10,
       now() + interval '1 hour' + g * interval '1 ms'
FROM generate_series(1, %(count)s) AS g
"""
#: The drained jobs left (priority 0, none of them delayed) and running ones: each count reads
#: one partial index range, never the million delayed rows.
DUE_REMAINING = (
    "SELECT (SELECT count(*) FROM pgqueue_jobs"
    "        WHERE status IN ('queued', 'retrying') AND priority = 0)"
    " + (SELECT count(*) FROM pgqueue_jobs WHERE status = 'running')"
)
#: Claims timed, claims before them (psycopg prepares the statement after 5, and PostgreSQL tries
#: 5 custom plans before it settles on the cached generic one), jobs per claim.
CLAIM_SAMPLES, CLAIM_WARMUP, CLAIM_BATCH = 100, 15, 100


def claim_ms(dsn: str, by_priority: bool) -> float:
    """Median milliseconds of pgqueue's claim statement taking ``CLAIM_BATCH`` jobs, prepared and
    on its cached plan as in the worker: ``claim_jobs_by_priority`` as a worker claims while jobs
    wait for a later run_at, ``claim_jobs`` otherwise. Each batch is handed back (``release_leases``) in the
    claim's transaction, so the queue stays as it was for the drain, and the commit, a disk
    flush whose time has nothing to do with the claim, is not timed. (Rolling the claim back
    instead would leave it unprepared: psycopg forgets its prepared statements at a ROLLBACK.)"""
    q = queries("public")
    statement = q.claim_jobs_by_priority if by_priority else q.claim_jobs
    timings = []
    worker = uuid.uuid4()
    with psycopg.connect(dsn) as conn:
        # A claim takes jobs only for a worker whose lease is live.
        conn.execute(
            q.register_worker,
            {"worker_id": worker, "host": "bench", "pid": 0, "queues": None, "concurrency": 1,
             "lease": 3600.0, "tasks": None},
        )  # fmt: skip
        conn.commit()
        for n in range(CLAIM_WARMUP + CLAIM_SAMPLES):
            token = uuid.uuid4()
            params = {"worker_id": worker, "limit": CLAIM_BATCH, "token": token, "tasks": None}
            began = time.perf_counter()
            ids = [row[0] for row in conn.execute(statement, params)]
            elapsed = time.perf_counter() - began
            conn.execute(q.release_leases, {"ids": ids, "tokens": [token] * len(ids)})
            conn.commit()
            if len(ids) != CLAIM_BATCH:
                raise RuntimeError(f"a claim took {len(ids)} jobs, not {CLAIM_BATCH}")
            if n >= CLAIM_WARMUP:
                timings.append(elapsed * 1000)
    return statistics.median(timings)


async def _drain_beside_delayed(
    ctx: Context, system: System, ready: int, delayed: int, concurrency: int
) -> dict[str, float | None]:
    with ctx.databases.fresh() as dsn:
        await _install(ctx, system, dsn)
        if delayed:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(FILL_DELAYED, {"count": delayed})
        await _fill(ctx, system, dsn, ready)
        _vacuum(dsn)
        claim = claim_ms(dsn, by_priority=delayed > 0)
        result = await drain(ctx, system, dsn, ready, 1, concurrency, remaining_sql=DUE_REMAINING)
    return {**result, "claim_ms": claim}


async def delayed(
    ctx: Context, system: System, ready: int, delayed_jobs: int, concurrency: int
) -> dict[str, float | None]:
    """Claims and a burn-down of ``ready`` jobs with ``delayed_jobs`` jobs of a higher priority
    due later in the table, against the same on an empty table just before: delayed jobs must not
    slow the claims of due ones (pgqueue only: it times its own claim statement)."""
    if system.family != "pgqueue":
        raise ValueError(f"the delayed-jobs workload runs pgqueue only, not {system.label}")
    empty = await _drain_beside_delayed(ctx, system, ready, 0, concurrency)
    result = await _drain_beside_delayed(ctx, system, ready, delayed_jobs, concurrency)
    rate, empty_rate = result["rate"], empty["rate"]
    claim, empty_claim = result["claim_ms"], empty["claim_ms"]
    assert rate is not None and empty_rate is not None
    assert claim is not None and empty_claim is not None
    return {
        **result,
        "empty_rate": empty_rate,
        "vs_empty": rate / empty_rate,
        "empty_claim_ms": empty_claim,
        "claim_vs_empty": claim / empty_claim,
    }


def _fill_keyed(dsn: str, jobs: int) -> None:
    """``jobs`` jobs of the adapter's per-key task, in bulk calls as ``_fill`` makes them (from
    here: the adapter's enqueue role knows only the plain task)."""
    import pgqueue

    from .adapter import KEYED_TASK, declare_keyed

    async def never(seq: int) -> None:  # the runner only enqueues
        raise AssertionError

    app = pgqueue.App(dsn)
    declare_keyed(app, never)
    try:
        for start in range(0, jobs, FILL_BATCH):
            stop = min(start + FILL_BATCH, jobs)
            app.enqueue_many([(KEYED_TASK, {"seq": seq}) for seq in range(start, stop)])
    finally:
        app.close()


def _limit_queue(dsn: str, limit: int) -> None:
    import pgqueue

    app = pgqueue.App(dsn)
    try:
        app.limit_queue(app.default_queue, limit=limit)
    finally:
        app.close()


async def _drain_limited(
    ctx: Context, system: System, jobs: int, concurrency: int, limit: str
) -> dict[str, float | None]:
    """One burn-down of ``jobs`` no-op jobs by one worker, in a fresh database: without limits
    (``limit`` "none"), of the adapter's task limited to one job per key over
    ``adapter.LIMIT_KEYS`` keys ("key"), or with the queue limited to ``concurrency`` jobs at
    once ("queue", set through ``App.limit_queue`` after the fill, before the worker starts)."""
    with ctx.databases.fresh() as dsn:
        await _install(ctx, system, dsn)
        if limit == "key":
            await asyncio.to_thread(_fill_keyed, dsn, jobs)
        else:
            await _fill(ctx, system, dsn, jobs)
        if limit == "queue":
            await asyncio.to_thread(_limit_queue, dsn, concurrency)
        _vacuum(dsn)
        return await drain(ctx, system, dsn, jobs, 1, concurrency, limit_keys=limit == "key")


async def limits(
    ctx: Context, system: System, jobs: int, concurrency: int
) -> dict[str, float | None]:
    """The same burn-down three ways, each in a fresh database: no limit, ``limit=1`` per key
    over ``adapter.LIMIT_KEYS`` keys, and a queue limit equal to the worker's concurrency
    (issue 18: each within 15 % of the drain without limits). The order of the three rotates
    from one repetition to the next; the ratios are each repetition's own (pgqueue only)."""
    if system.family != "pgqueue":
        raise ValueError(f"the limits workload runs pgqueue only, not {system.label}")
    order = ["none", "key", "queue"]
    turn = ctx.turns % len(order)
    ctx.turns += 1
    runs: dict[str, dict[str, float | None]] = {}
    for limit in order[turn:] + order[:turn]:
        runs[limit] = await _drain_limited(ctx, system, jobs, concurrency, limit)
    plain = runs["none"]["rate"]
    assert plain is not None
    result: dict[str, float | None] = {}
    for limit, prefix in (("none", "plain"), ("key", "key"), ("queue", "queue")):
        for metric, value in runs[limit].items():
            result[f"{prefix}_{metric}"] = value
        if limit != "none":
            rate = runs[limit]["rate"]
            assert rate is not None
            result[f"{prefix}_vs_plain"] = rate / plain
    return result


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q * (len(ordered) - 1))))
    return ordered[rank]


async def latency(
    ctx: Context, system: System, count: int, interval_ms: float, listen: bool, poll: float
) -> dict[str, float]:
    """Idle worker, one job every ``interval_ms``: producer commit → handler start."""
    from contextlib import AsyncExitStack

    args = ["--concurrency", "10", "--record-starts", "--poll", str(poll)]
    if not listen:
        args.append("--no-listen")
    with ctx.databases.fresh() as dsn:
        await _install(ctx, system, dsn)
        async with AsyncExitStack() as stack:
            (worker,) = await _start_workers(ctx, system, dsn, 1, args, stack)
            await worker.send("go")
            await asyncio.sleep(1.0)  # connected, listening and idle
            produced = await run_role(
                system, "produce", dsn,
                ["--count", str(count), "--interval-ms", str(interval_ms)], ctx.logdir,
            )  # fmt: skip
            with psycopg.connect(dsn, autocommit=True) as conn:
                deadline = time.monotonic() + 30 + poll * 2
                while time.monotonic() < deadline:
                    row = conn.execute(system.remaining_sql.encode()).fetchone()
                    if row and int(row[0]) == 0:
                        break
                    await asyncio.sleep(0.05)
            (result,) = await _stop_workers([worker])
    commits = {int(k): float(v) for k, v in produced["commits"].items()}
    starts = {int(k): float(v) for k, v in result["starts"].items()}
    warm = 5  # the first jobs also pay for connections being opened
    values = [(starts[s] - commits[s]) * 1000 for s in commits if s in starts and s >= warm]
    if len(values) < (count - warm) * 0.99:
        raise RuntimeError(f"{system.label}: only {len(values)} of {count} jobs were timed")
    return {
        "p50": percentile(values, 0.50),
        "p95": percentile(values, 0.95),
        "p99": percentile(values, 0.99),
    }


async def steady(
    ctx: Context, system: System, rate: float, duration: float, concurrency: int
) -> dict[str, float]:
    """Producers and a worker together at a fixed offered rate: is it sustained, and does the
    database stay small?"""
    from contextlib import AsyncExitStack

    size_sql = b"SELECT pg_database_size(current_database())"
    args = ["--concurrency", str(concurrency)]
    with ctx.databases.fresh() as dsn:
        await _install(ctx, system, dsn)
        async with AsyncExitStack() as stack:
            (worker,) = await _start_workers(ctx, system, dsn, 1, args, stack, keep_small=True)
            await worker.send("go")
            await asyncio.sleep(1.0)
            producer = await stack.enter_async_context(
                adapter(system, "produce", dsn,
                        ["--rate", str(rate), "--duration", str(duration)], ctx.logdir)
            )  # fmt: skip
            samples: list[tuple[float, int, int, int]] = []  # (t, produced, left, size)
            with psycopg.connect(dsn, autocommit=True) as conn:
                while True:
                    line = await producer.next(timeout=duration + 60)
                    left_row = conn.execute(system.remaining_sql.encode()).fetchone()
                    size_row = conn.execute(size_sql).fetchone()
                    assert left_row is not None and size_row is not None
                    samples.append((line["t"], line["produced"], left_row[0], size_row[0]))
                    if line.get("done"):
                        break
            await producer.finish()
            await _stop_workers([worker])
    third = max(len(samples) // 3, 1)

    def completion_rate(part: list[tuple[float, int, int, int]]) -> float:
        (t0, p0, l0, _), (t1, p1, l1, _) = part[0], part[-1]
        return ((p1 - l1) - (p0 - l0)) / (t1 - t0) if t1 > t0 else 0.0

    def enqueue_rate(part: list[tuple[float, int, int, int]]) -> float:
        (t0, p0, _, _), (t1, p1, _, _) = part[0], part[-1]
        return (p1 - p0) / (t1 - t0) if t1 > t0 else 0.0

    return {
        "offered": rate,
        "first_third": completion_rate(samples[:third]),
        "last_third": completion_rate(samples[-third:]),
        "produced_last_third": enqueue_rate(samples[-third:]),
        "max_backlog": float(max(s[2] for s in samples)),
        "size_start_mb": samples[0][3] / 2**20,
        "size_end_mb": samples[-1][3] / 2**20,
    }


CEILING_SETUP = """
CREATE TABLE ceiling_jobs (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    args jsonb NOT NULL,
    status smallint NOT NULL DEFAULT 0,
    token bigint
) WITH (fillfactor = 80);
CREATE INDEX ceiling_ready ON ceiling_jobs (id) WHERE status = 0;
CREATE INDEX ceiling_running ON ceiling_jobs (token) WHERE status = 1;
"""

# One pgbench transaction = the lifecycle of BATCH jobs as three autocommit statements (three
# durable commits, like a queue that batches everything): insert a batch, claim a batch with
# SKIP LOCKED under a fresh token, ack that token's batch.
CEILING_SCRIPT = """
\\set token random(1, 9000000000000000000)
INSERT INTO ceiling_jobs (args) SELECT jsonb_build_object('seq', g) FROM generate_series(1, {batch}) g;
UPDATE ceiling_jobs SET status = 1, token = :token WHERE id IN (SELECT id FROM ceiling_jobs WHERE status = 0 ORDER BY id LIMIT {batch} FOR UPDATE SKIP LOCKED);
UPDATE ceiling_jobs SET status = 2 WHERE token = :token AND status = 1;
"""


# The drain alone (what the processing workloads do): claim a batch of pre-filled rows with SKIP
# LOCKED under a fresh token, then ack that token's batch; two durable commits per batch.
CEILING_DRAIN_SCRIPT = """
\\set token random(1, 9000000000000000000)
UPDATE ceiling_jobs SET status = 1, token = :token WHERE id IN (SELECT id FROM ceiling_jobs WHERE status = 0 ORDER BY id LIMIT {batch} FOR UPDATE SKIP LOCKED);
UPDATE ceiling_jobs SET status = 2 WHERE token = :token AND status = 1;
"""
#: Rows pre-filled per second of the drain ceiling's run: well above any rate it can reach here,
#: so the claims never find the table empty.
CEILING_DRAIN_FILL = 80_000


def find_pgbench() -> str | None:
    """pgbench of the server's own installation (beside initdb), else from PATH."""
    bindir = find_bindir()
    if bindir is not None and (bindir / "pgbench").exists():
        return str(bindir / "pgbench")
    return shutil.which("pgbench")


def ceiling(ctx: Context, clients: int, seconds: int, batch: int) -> dict[str, float] | None:
    """The database's own rate for the same row work, by pgbench (None if pgbench is missing):
    the whole life cycle (insert, claim, ack), and the drain alone of pre-filled rows, which is
    what the processing workloads are compared with."""
    pgbench = find_pgbench()
    if pgbench is None:
        return None
    rates = []
    for name, text, fill in (
        ("ceiling.sql", CEILING_SCRIPT, 0),
        ("ceiling-drain.sql", CEILING_DRAIN_SCRIPT, CEILING_DRAIN_FILL * seconds),
    ):
        with ctx.databases.fresh() as dsn:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(CEILING_SETUP.encode())
                if fill:
                    conn.execute(
                        "INSERT INTO ceiling_jobs (args)"
                        " SELECT jsonb_build_object('seq', g) FROM generate_series(1, %s) g",
                        (fill,),
                    )
                    conn.execute("VACUUM ANALYZE ceiling_jobs")
            script = ctx.logdir / name
            script.write_text(text.format(batch=batch))
            out = subprocess.run(
                [pgbench, "-n", "-c", str(clients), "-j", str(min(clients, 2)),
                 "-T", str(seconds), "-f", str(script), dsn],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
        tps = [
            float(line.split("=")[1].split()[0])
            for line in out.stdout.splitlines()
            if line.startswith("tps =")
        ]
        rates.append(tps[0] * batch)
    return {
        "rate": rates[0], "drain_rate": rates[1], "batch": float(batch), "clients": float(clients)
    }  # fmt: skip


def median(values: list[float]) -> float:
    return statistics.median(values)


#: The long transaction of ``long_tx``: a snapshot taken and kept (REPEATABLE READ: READ
#: COMMITTED drops its snapshot between statements), over a catalog so that it locks none of
#: the system's tables, then left idle, as a report or a forgotten session would.
HOLD_SNAPSHOT = (
    b"BEGIN ISOLATION LEVEL REPEATABLE READ",
    b"SELECT count(*) FROM pg_class",
)
#: The backlog is counted at each report of the producer (every 0.5 s), but no sooner than this
#: many times the last count took: while the snapshot is held, a count walks the same dead
#: entries as a claim does, and every 0.5 s it would take a core from the system under test.
COUNT_SHARE = 10.0


def _pickup_percentiles(
    histograms: list[dict[str, dict[str, int]]], start: float, end: float
) -> tuple[float | None, float | None]:
    """p50 and p99 pickup (seconds) of the jobs enqueued in [start, end), from the workers'
    histograms (driver.pickup_bin: 5 % bins, so to within 5 %)."""
    from .driver import bin_seconds

    counts: dict[int, int] = {}
    for histogram in histograms:
        for second, bins in histogram.items():
            if start <= int(second) < end:
                for key, n in bins.items():
                    counts[int(key)] = counts.get(int(key), 0) + n
    total = sum(counts.values())
    if not total:
        return None, None
    result = []
    for q in (0.50, 0.99):
        seen = 0
        for bin_index in sorted(counts):
            seen += counts[bin_index]
            if seen >= q * total:
                result.append(bin_seconds(bin_index))
                break
    return result[0], result[1]


async def long_tx(
    ctx: Context,
    system: System,
    rate: float,
    clean: float,
    hold: float,
    recovery: float,
    concurrency: int,
) -> dict[str, float | None]:
    """Producers at ``rate`` jobs/s and one worker for ``clean`` seconds, then for ``hold``
    seconds while another session holds a snapshot (vacuum can remove nothing newer), then
    ``recovery`` seconds after it ended. Per phase: jobs/s offered and completed, and pickup
    p50/p99 of the jobs enqueued in it (producer's call to handler start); the backlog when the
    transaction ends, and the seconds from then until the backlog is back to the clean phase's
    (None: not within the recovery phase)."""
    from contextlib import AsyncExitStack

    args = ["--concurrency", str(concurrency), "--pickups"]
    duration = clean + hold + recovery
    with ctx.databases.fresh() as dsn:
        await _install(ctx, system, dsn)
        async with AsyncExitStack() as stack:
            (worker,) = await _start_workers(ctx, system, dsn, 1, args, stack)
            await worker.send("go")
            await asyncio.sleep(1.0)
            producer = await stack.enter_async_context(
                adapter(system, "produce", dsn,
                        ["--rate", str(rate), "--duration", str(duration), "--stamp"], ctx.logdir)
            )  # fmt: skip
            began = time.time()
            held_from, held_to = began + clean, began + clean + hold
            samples: list[tuple[float, int, int]] = []  # (t, produced, left)
            holder = psycopg.connect(dsn, autocommit=True)
            stack.callback(holder.close)
            holding = released = False
            count_at = 0.0
            with psycopg.connect(dsn, autocommit=True) as conn:
                while True:
                    line = await producer.next(timeout=duration + 60)
                    now = time.time()
                    boundary = bool(line.get("done"))  # each phase's ends are counted
                    if not holding and now >= held_from:
                        for statement in HOLD_SNAPSHOT:
                            holder.execute(statement)
                        # Held for ``hold`` seconds from when it began, however late that was.
                        holding, held_from, boundary = True, now, True
                        held_to = now + hold
                    if holding and not released and now >= held_to:
                        holder.execute(b"COMMIT")
                        released, held_to, boundary = True, now, True
                    if boundary or now >= count_at:
                        took = time.perf_counter()
                        row = conn.execute(system.remaining_sql.encode()).fetchone()
                        took = time.perf_counter() - took
                        assert row is not None
                        samples.append((now, int(line["produced"]), int(row[0])))
                        count_at = now + COUNT_SHARE * took
                    if line.get("done"):
                        break
            await producer.finish()
            (result,) = await _stop_workers([worker])
    if not released:
        raise RuntimeError(f"{system.label}: the producer ended before the hold did")
    histograms = [result.get("pickups", {})]
    phases = {"clean": (began, held_from), "held": (held_from, held_to),
              "recovery": (held_to, samples[-1][0])}  # fmt: skip
    out: dict[str, float | None] = {"offered": rate, "hold_s": held_to - held_from}
    for name, (start, end) in phases.items():
        part = [s for s in samples if start <= s[0] <= end]
        if len(part) >= 2:
            (t0, p0, l0), (t1, p1, l1) = part[0], part[-1]
            out[f"{name}_offered"] = (p1 - p0) / (t1 - t0)
            out[f"{name}_done"] = ((p1 - l1) - (p0 - l0)) / (t1 - t0)
        else:
            out[f"{name}_offered"] = out[f"{name}_done"] = None
        p50, p99 = _pickup_percentiles(histograms, start, end)
        out[f"{name}_p50"], out[f"{name}_p99"] = p50, p99
    held = [s for s in samples if s[0] <= held_to]
    out["held_backlog"] = float(held[-1][2]) if held else None
    usual = max([s[2] for s in samples if s[0] < phases["clean"][1]] or [0])
    drained = next((s[0] for s in samples if s[0] > held_to and s[2] <= max(usual, 100)), None)
    out["drain_s"] = None if drained is None else drained - held_to
    out["recovery_backlog"] = float(samples[-1][2])
    return out
