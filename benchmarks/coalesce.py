"""The coalescing producer: jobs/s and call latency of many concurrent producers enqueueing single
jobs, with ``App(coalesce=True)`` and without, side by side in one run.

    .venv/bin/python -m benchmarks.coalesce --dsn postgresql://...   # or no --dsn: a throwaway server

Each repetition runs every case once, coalescing off then on (interleaved, so a noisy neighbour
hits both alike), on a freshly truncated table; the table shows the median of the repetitions,
and the speed-up is the median of each repetition's on / off ratio (paired: the two runs of a
repetition shared the machine's load), with the lowest and highest.
Cases: ``--producers`` coroutines on one event loop (``enqueue_async``), the same number of
threads (``enqueue``), and one producer alone (what coalescing costs a lone call: its latency).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics

import pgqueue
from pgqueue.bench.producers import Result, Runner, measure, reset, run_async, run_threads
from pgqueue.embedded import EmbeddedPostgres


def bench(dsn: str, producers: int, jobs: int, reps: int) -> None:
    with pgqueue.App(dsn) as app:
        app.migrate()
    cases: list[tuple[str, Runner, int, int]] = [
        (f"{producers} coroutines, enqueue_async", run_async, producers, jobs),
        (f"{producers} threads, enqueue", run_threads, producers, jobs),
        ("1 producer alone, enqueue", run_threads, 1, max(jobs // 10, 200)),
    ]
    results: dict[tuple[str, bool], list[Result]] = {}
    for rep in range(reps):
        for name, run, count, total in cases:
            for coalesce in (False, True):
                result = measure(dsn, coalesce, run, count, total)
                results.setdefault((name, coalesce), []).append(result)
                print(
                    f"  rep {rep + 1}/{reps} {name:<34} coalesce={'on ' if coalesce else 'off'}"
                    f" {result.rate:>9,.0f} jobs/s  p50 {result.p50:6.2f} ms"
                    f"  p99 {result.p99:7.2f} ms  mean {result.mean:7.2f} ms  max {result.max:7.1f} ms"
                    f"  {result.per_batch:6.1f} jobs/batch",
                    flush=True,
                )
    print()
    print(f"medians of {reps} interleaved repetitions ({platform.node()}, {os.cpu_count()} CPUs)")
    header = (
        f"{'case':<34} {'coalesce':>8} {'jobs/s':>10} {'p50 ms':>8} {'p99 ms':>8}"
        f" {'mean ms':>8} {'max ms':>8}"
    )
    print(header + f" {'jobs/batch':>10} {'speed-up (lowest-highest)':>26}")
    for name, *_ in cases:
        pairs = zip(results[(name, False)], results[(name, True)], strict=True)
        ratios = [on.rate / off.rate for off, on in pairs]
        for coalesce in (False, True):
            rs = results[(name, coalesce)]
            speedup = (
                f"{statistics.median(ratios):.1f}x ({min(ratios):.1f}-{max(ratios):.1f})"
                if coalesce
                else ""
            )
            print(
                f"{name:<34} {'on' if coalesce else 'off':>8}"
                f" {statistics.median(r.rate for r in rs):>10,.0f}"
                f" {statistics.median(r.p50 for r in rs):>8.2f}"
                f" {statistics.median(r.p99 for r in rs):>8.2f}"
                f" {statistics.median(r.mean for r in rs):>8.2f}"
                f" {statistics.median(r.max for r in rs):>8.1f}"
                f" {statistics.median(r.per_batch for r in rs):>10.1f} {speedup:>26}"
            )
    reset(dsn)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--dsn", help="a database where pgqueue may create its tables")
    parser.add_argument("--producers", type=int, default=100, help="concurrent producers")
    parser.add_argument("--jobs", type=int, default=20_000, help="jobs per run")
    parser.add_argument("--reps", type=int, default=3, help="repetitions (the median is shown)")
    options = parser.parse_args()
    if options.dsn:
        bench(options.dsn, options.producers, options.jobs, options.reps)
        return
    with EmbeddedPostgres() as server:
        bench(server.dsn, options.producers, options.jobs, options.reps)


if __name__ == "__main__":
    main()
