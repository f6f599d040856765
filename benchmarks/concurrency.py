"""Draining no-op jobs at --concurrency 10, 20 and 100: the default prefetch (the concurrency,
at least 256) against a prefetch equal to the concurrency (the default before issue 23).

    .venv/bin/python -m benchmarks.concurrency [--dsn postgresql://...] [--jobs 20000] [--rounds 3]

One in-process worker (uvloop when installed, as ``pgqueue worker``) drains ``--jobs`` jobs
enqueued beforehand; the rate is jobs over the time from the worker's start to the last job's
start. The cases alternate within each round; medians of the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import psycopg

import pgqueue
from pgqueue.embedded import EmbeddedPostgres
from pgqueue.worker.runtime import PREFETCH_DEFAULT, loop_factory

CONCURRENCIES = (10, 20, 100)


def drain(dsn: str, jobs: int, concurrency: int, prefetch: int | None) -> float:
    app = pgqueue.App(dsn)
    started = 0
    done = asyncio.Event()

    @app.task
    async def noop(seq: int) -> None:
        nonlocal started
        started += 1
        if started >= jobs:
            done.set()

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE pgqueue_jobs")
    app.enqueue_many([("noop", {"seq": i}) for i in range(jobs)])

    async def main() -> float:
        worker = app.worker(
            concurrency=concurrency, prefetch=prefetch, install_signal_handlers=False
        )
        began = time.perf_counter()
        running = asyncio.create_task(worker.run())
        await done.wait()
        rate = jobs / (time.perf_counter() - began)
        worker.stop()
        await running
        await app.aclose()
        return rate

    try:
        with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:
            return runner.run(main())
    finally:
        app.close()


def bench(dsn: str, jobs: int, rounds: int) -> None:
    pgqueue.App(dsn).migrate()
    cases = [(c, p) for c in CONCURRENCIES for p in (None, c)]
    rates: dict[tuple[int, int | None], list[float]] = {case: [] for case in cases}
    for _ in range(rounds):
        for concurrency, prefetch in cases:
            rates[(concurrency, prefetch)].append(drain(dsn, jobs, concurrency, prefetch))
    print(f"{'concurrency':>11}  {'prefetch':<22}{'jobs/s':>9}   rounds")
    for (concurrency, prefetch), values in rates.items():
        label = (
            f"default ({max(concurrency, PREFETCH_DEFAULT)})" if prefetch is None else str(prefetch)
        )
        shown = ", ".join(f"{v:,.0f}" for v in values)
        print(f"{concurrency:>11}  {label:<22}{statistics.median(values):>9,.0f}   {shown}")
    for concurrency in CONCURRENCIES:
        gain = statistics.median(rates[(concurrency, None)]) / statistics.median(
            rates[(concurrency, concurrency)]
        )
        print(f"concurrency {concurrency}: default / prefetch = concurrency: {gain:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", help="a database where pgqueue may create its tables")
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    if options.dsn:
        bench(options.dsn, options.jobs, options.rounds)
        return
    with EmbeddedPostgres() as server:
        bench(server.dsn, options.jobs, options.rounds)


if __name__ == "__main__":
    main()
