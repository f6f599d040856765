"""Where a limited drain's time goes: one worker (concurrency 100) drains no-op jobs with its
queue limited to 100 and with ``limit=1`` per key over 1,000 keys, and the steps that bound each
cycle are timed in-process.

    .venv/bin/python -m benchmarks.limited_cycle [--dsn postgresql://...] [--jobs 30000]
        [--rounds 3]

Queue limit: every completer write (the acks, and the slots they hand to the queue's next jobs
in the same transaction), its jobs, and the pause from its end to the next write's start (the
handlers and the worker's own work). Per key: every limited claim (walk, then claim, two round
trips), its jobs, and the share of the drain the fetcher spent in them. Each run uses a fresh
database on the server of ``--dsn`` (without it, a throwaway server); the two limits alternate,
the drain without limits runs beside them for the ratio; medians of the middle half of each
run's steps, then of the rounds.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from typing import Any

import psycopg

from benchmarks.limited_backlog import CONCURRENCY, _app, _run, _work
from pgqueue.bench.adapter import KEYED_TASK
from pgqueue.bench.processes import Databases
from pgqueue.embedded import EmbeddedPostgres
from pgqueue.worker.completer import Completer
from pgqueue.worker.fetcher import Fetcher

FILL = 5_000
#: (start, seconds, jobs) of each timed step.
Step = tuple[float, float, int]


def _middle(steps: list[Step]) -> list[Step]:
    return steps[len(steps) // 4 : 3 * len(steps) // 4] or steps


def _drain(
    database: str, jobs: int, limit: str, prefetch: int | None = None
) -> tuple[float, list[Step]]:
    app = _app(database)
    steps: list[Step] = []
    write, claim = Completer._write_on, Fetcher.claim_limited

    async def timed_write(self: Completer, conn: Any, batch: list[Any], *a: Any) -> Any:
        began = time.perf_counter()
        try:
            return await write(self, conn, batch, *a)
        finally:
            steps.append((began, time.perf_counter() - began, len(batch)))

    async def timed_claim(self: Fetcher, want: int) -> Any:
        began = time.perf_counter()
        got = await claim(self, want)
        steps.append((began, time.perf_counter() - began, len(got)))
        return got

    try:
        app.migrate()
        task = KEYED_TASK if limit == "key" else "noop"
        for start in range(0, jobs, FILL):
            app.enqueue_many([(task, {"seq": n}) for n in range(start, min(jobs, start + FILL))])
        if limit == "queue":
            app.limit_queue(app.default_queue, limit=CONCURRENCY)
        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE pgqueue_jobs")
        if limit == "queue":
            Completer._write_on = timed_write  # type: ignore[method-assign,assignment]
        elif limit == "key":
            Fetcher.claim_limited = timed_claim  # type: ignore[method-assign,assignment]
        try:
            rate = _run(lambda: _work(app, database, jobs, prefetch, poll=0.05))
        finally:
            Completer._write_on = write  # type: ignore[method-assign]
            Fetcher.claim_limited = claim  # type: ignore[method-assign]
        return rate, steps
    finally:
        app.close()


def _figures(limit: str, rate: float, steps: list[Step]) -> dict[str, float]:
    figures = {"rate": rate}
    middle = _middle(steps)
    if not middle:
        return figures
    figures["ms"] = statistics.median(s[1] for s in middle) * 1e3
    figures["jobs"] = statistics.median(s[2] for s in middle)
    if limit == "queue" and len(middle) > 1:
        gaps = [b[0] - (a[0] + a[1]) for a, b in itertools.pairwise(middle)]
        figures["gap_ms"] = statistics.median(gaps) * 1e3
    if limit == "key":
        span = middle[-1][0] + middle[-1][1] - middle[0][0]
        figures["busy"] = sum(s[1] for s in middle) / span if span > 0 else 0.0
    return figures


def _line(limit: str, f: dict[str, float], plain: float | None) -> str:
    text = f"{limit:<6}{f['rate']:>9,.0f} jobs/s"
    if plain:
        text += f"  {f['rate'] / plain:.2f}x of no limit"
    if limit == "queue" and "ms" in f:
        text += (
            f"   write {f['ms']:.2f} ms for {f['jobs']:.0f} acks (+ as many handed off),"
            f" then {f.get('gap_ms', 0.0):.2f} ms to the next"
        )
    if limit == "key" and "ms" in f:
        text += (
            f"   limited claim {f['ms']:.2f} ms for {f['jobs']:.0f} jobs,"
            f" the fetcher in claims {f['busy']:.0%} of the time"
        )
    return text


def bench(dsn: str, jobs: int, rounds: int, prefetch: int | None = None) -> None:
    databases = Databases(dsn)
    results: dict[str, list[dict[str, float]]] = {"none": [], "queue": [], "key": []}
    order = ["none", "queue", "key"]
    for index in range(rounds):
        plain = None
        for limit in order[index % 3 :] + order[: index % 3]:
            with databases.fresh() as database:
                rate, steps = _drain(database, jobs, limit, prefetch)
            figures = _figures(limit, rate, steps)
            results[limit].append(figures)
            if limit == "none":
                plain = rate
            print(_line(limit, figures, plain if limit != "none" else None), flush=True)
    print("\nmedians of the rounds:")
    plain_rate = statistics.median(f["rate"] for f in results["none"])
    for limit in order:
        runs = results[limit]
        merged = {k: statistics.median(f[k] for f in runs if k in f) for k in runs[0]}
        print(_line(limit, merged, plain_rate if limit != "none" else None))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", help="a server where databases may be created")
    parser.add_argument("--jobs", type=int, default=30_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefetch", type=int, help="the worker's prefetch (default: its own)")
    options = parser.parse_args()
    if options.dsn:
        bench(options.dsn, options.jobs, options.rounds, options.prefetch)
        return
    with EmbeddedPostgres() as server:
        bench(server.dsn, options.jobs, options.rounds, options.prefetch)


if __name__ == "__main__":
    main()
