"""Many producers enqueueing single jobs, timed: what ``App(coalesce=True)`` changes (jobs/s and
each call's latency). Shared by the ``coalesce`` workload of ``pgqueue bench`` and
``benchmarks/coalesce.py``; pgqueue only (the peers have no such mode).
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import Callable

import psycopg

import pgqueue

ARGS = {"payload": "x" * 64}


def reset(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE pgqueue_jobs, pgqueue_attempts")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


class Result:
    """One timed run: jobs/s, call latency in ms, and jobs per statement (1 without coalescing)."""

    def __init__(self, jobs: int, seconds: float, latencies: list[float], batches: int) -> None:
        self.rate = jobs / seconds
        self.p50 = _percentile(latencies, 0.50) * 1000
        self.p99 = _percentile(latencies, 0.99) * 1000
        self.mean = statistics.fmean(latencies) * 1000
        self.max = max(latencies) * 1000
        self.per_batch = jobs / batches if batches else 1.0


def _batches(app: pgqueue.App) -> int:
    return app.coalesce_stats.batches if app.coalesce_stats else 0


Timing = tuple[float, list[float], int]


def run_async(app: pgqueue.App, producers: int, per_producer: int) -> Timing:
    """Seconds, each call's latency, and the batches written, of the timed part."""
    latencies: list[float] = []

    async def produce(p: int) -> None:
        for i in range(per_producer):
            start = time.perf_counter()
            await app.enqueue_async("bench", {"p": p, "i": i, **ARGS}, allow_unknown=True)
            latencies.append(time.perf_counter() - start)

    async def main() -> Timing:
        # Open the loop's pool outside the timing: as many connections as the run will use.
        await asyncio.gather(
            *(app.enqueue_async("warm", {}, allow_unknown=True) for _ in range(producers))
        )
        batches = _batches(app)
        start = time.perf_counter()
        await asyncio.gather(*(produce(p) for p in range(producers)))
        return time.perf_counter() - start, latencies, _batches(app) - batches

    return asyncio.run(main())


def run_threads(app: pgqueue.App, producers: int, per_producer: int) -> Timing:
    """``run_async`` with one thread per producer."""
    latencies: list[list[float]] = [[] for _ in range(producers)]
    barrier = threading.Barrier(producers + 1)

    def produce(p: int) -> None:
        app.enqueue("warm", {}, allow_unknown=True)
        barrier.wait()
        mine = latencies[p]
        for i in range(per_producer):
            start = time.perf_counter()
            app.enqueue("bench", {"p": p, "i": i, **ARGS}, allow_unknown=True)
            mine.append(time.perf_counter() - start)
        barrier.wait()

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    for t in threads:
        t.start()
    barrier.wait()
    batches = _batches(app)
    start = time.perf_counter()
    barrier.wait()
    seconds = time.perf_counter() - start
    for t in threads:
        t.join()
    return seconds, [x for mine in latencies for x in mine], _batches(app) - batches


Runner = Callable[[pgqueue.App, int, int], Timing]


def measure(dsn: str, coalesce: bool, run: Runner, producers: int, jobs: int) -> Result:
    """One run on an emptied table, with a fresh App (so a fresh pool) for it alone."""
    reset(dsn)
    app = pgqueue.App(dsn, coalesce=coalesce)
    try:
        per_producer = max(jobs // producers, 1)
        seconds, latencies, batches = run(app, producers, per_producer)
        return Result(per_producer * producers, seconds, latencies, batches)
    finally:
        app.close()
