"""Enqueue throughput: one job per transaction (one and several producer threads) against
``enqueue_many`` (one COPY), and the cost of the NOTIFY trigger with concurrent producers.

    .venv/bin/python -m benchmarks.enqueue --dsn postgresql://...   # or no --dsn: a throwaway server

Each figure is the median of three runs on a freshly truncated table.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psycopg

import pgqueue
from pgqueue.embedded import EmbeddedPostgres

RUNS = 3


def _reset(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE pgqueue_jobs")


def _median_rate(dsn: str, jobs: int, run: Callable[[], None]) -> float:
    rates = []
    for _ in range(RUNS):
        _reset(dsn)
        start = time.perf_counter()
        run()
        rates.append(jobs / (time.perf_counter() - start))
    return statistics.median(rates)


def one_by_one(app: pgqueue.App, jobs: int, threads: int) -> Callable[[], None]:
    """Each job is its own INSERT and its own (autocommit) transaction."""
    per_thread = jobs // threads

    def produce() -> None:
        for i in range(per_thread):
            app.enqueue("bench", {"i": i, "payload": "x" * 64}, allow_unknown=True)

    def run() -> None:
        workers = [threading.Thread(target=produce) for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    return run


def bulk(app: pgqueue.App, jobs: int) -> Callable[[], None]:
    specs = [("bench", {"i": i, "payload": "x" * 64}) for i in range(jobs)]

    def run() -> None:
        app.enqueue_many(specs, allow_unknown=True)

    return run


@contextmanager
def notify_trigger(dsn: str, enabled: bool) -> Iterator[None]:
    action = "ENABLE" if enabled else "DISABLE"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"ALTER TABLE pgqueue_jobs {action} TRIGGER pgqueue_jobs_notify_ready")
    try:
        yield
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("ALTER TABLE pgqueue_jobs ENABLE TRIGGER pgqueue_jobs_notify_ready")


def bench(dsn: str, single_jobs: int, bulk_jobs: int, threads: int) -> None:
    app = pgqueue.App(dsn)
    try:
        app.migrate()
        app.enqueue("bench", {}, allow_unknown=True)  # open the pool outside the timings
        single = _median_rate(dsn, single_jobs, one_by_one(app, single_jobs, 1))
        concurrent = _median_rate(
            dsn, single_jobs, one_by_one(app, single_jobs - single_jobs % threads, threads)
        )
        copied = _median_rate(dsn, bulk_jobs, bulk(app, bulk_jobs))
        print(f"one by one, 1 producer         {single:>12,.0f} jobs/s")
        print(f"one by one, {threads} producers        {concurrent:>12,.0f} jobs/s")
        print(f"enqueue_many (COPY)            {copied:>12,.0f} jobs/s")
        print(f"COPY / one-by-one (1 producer) {copied / single:>12.1f} x")
        print(f"COPY / one-by-one ({threads} producers){copied / concurrent:>12.1f} x")
        four = single_jobs - single_jobs % 4
        rates = {}
        for enabled in (True, False):
            with notify_trigger(dsn, enabled):
                rates[enabled] = _median_rate(dsn, four, one_by_one(app, four, 4))
        print(f"4 producers, NOTIFY trigger on {rates[True]:>12,.0f} jobs/s")
        print(f"4 producers, NOTIFY trigger off{rates[False]:>12,.0f} jobs/s")
        print(f"trigger cost                   {1 - rates[True] / rates[False]:>12.1%}")
    finally:
        _reset(dsn)
        app.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", help="a database where pgqueue may create its tables")
    parser.add_argument("--jobs", type=int, default=5_000, help="jobs per one-by-one run")
    parser.add_argument("--bulk-jobs", type=int, default=100_000, help="jobs per COPY run")
    parser.add_argument("--threads", type=int, default=4, help="concurrent producers")
    options = parser.parse_args()
    if options.dsn:
        bench(options.dsn, options.jobs, options.bulk_jobs, options.threads)
        return
    with EmbeddedPostgres() as server:
        bench(server.dsn, options.jobs, options.bulk_jobs, options.threads)


if __name__ == "__main__":
    main()
