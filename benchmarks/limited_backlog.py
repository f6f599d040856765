"""A large limited backlog drained by one worker: the limited claim as shipped (its transaction
reads pgqueue_jobs by plain index scans only, see ``limit_claim_settings`` in queries.sql)
against the same claim with the planner left to choose (bitmap scans allowed), interleaved.

    .venv/bin/python -m benchmarks.limited_backlog [--dsn postgresql://...] [--jobs 300000]
        [--rounds 2] [--limit queue,key]

Two limits: the queue limited to the worker's concurrency (100), and ``limit=1`` per key over
1,000 keys. Each run drains ``--jobs`` no-op jobs in a fresh database (created on the server of
``--dsn``; without it, a throwaway server). Printed per run: jobs/s and the limited claim's
median time in each tenth of the drain (a claim that reads the finished jobs again grows as
the drain goes on); then medians and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import time
from collections.abc import Callable, Coroutine
from typing import Any

import psycopg

import pgqueue
from pgqueue.bench.adapter import KEYED_TASK, PgqueueAdapter, declare_keyed
from pgqueue.bench.processes import Databases
from pgqueue.embedded import EmbeddedPostgres
from pgqueue.sql import render
from pgqueue.worker.fetcher import Fetcher
from pgqueue.worker.runtime import loop_factory
from pgqueue.worker.state import ClaimedJob

CONCURRENCY = 100
FILL = 5_000
#: The variant with the planner's own choice: the claim's settings without the scan settings.
PLANNERS_CHOICE = "SELECT set_config('idle_in_transaction_session_timeout', %(idle)s, true)"


async def _noop(seq: int) -> None: ...


def _app(dsn: str) -> pgqueue.App:
    """The benchmark's tasks: ``noop`` for the queue limit, and ``pgqueue bench``'s keyed task
    (``limit=1`` per key over its 1,000 keys)."""
    app = pgqueue.App(dsn)
    app.task(name="noop")(_noop)
    declare_keyed(app, _noop)
    return app


def _drain(database: str, jobs: int, limit: str, shipped: bool) -> tuple[float, list[float]]:
    app = _app(database)
    try:
        app.migrate()
        task = KEYED_TASK if limit == "key" else "noop"
        for start in range(0, jobs, FILL):
            app.enqueue_many([(task, {"seq": n}) for n in range(start, min(jobs, start + FILL))])
        if limit == "queue":
            app.limit_queue(app.default_queue, limit=CONCURRENCY)
        if not shipped:
            app.q = dataclasses.replace(
                app.q, limit_claim_settings=render(PLANNERS_CHOICE, app.schema)
            )
        claims: list[float] = []
        original = Fetcher.claim_limited

        async def timed(self: Fetcher, want: int) -> list[ClaimedJob]:
            began = time.perf_counter()
            try:
                return await original(self, want)
            finally:
                claims.append(time.perf_counter() - began)

        Fetcher.claim_limited = timed  # type: ignore[assignment]
        try:
            rate = _run(lambda: _work(app, database, jobs))
        finally:
            Fetcher.claim_limited = original  # type: ignore[method-assign]
        return rate, claims
    finally:
        app.close()


def _run(main: Callable[[], Coroutine[Any, Any, float]]) -> float:
    with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:
        return runner.run(main())


async def _work(
    app: pgqueue.App, database: str, jobs: int, prefetch: int | None = None, poll: float = 0.2
) -> float:
    """Jobs per second of one worker draining ``jobs`` (its prefetch: its own by default),
    looked at every ``poll`` seconds."""
    worker = app.worker(concurrency=CONCURRENCY, prefetch=prefetch, install_signal_handlers=False)
    began = time.perf_counter()
    running = asyncio.create_task(worker.run())
    async with await psycopg.AsyncConnection.connect(database, autocommit=True) as conn:
        while True:
            await asyncio.sleep(poll)
            row = await (await conn.execute(PgqueueAdapter.remaining_sql)).fetchone()
            if row is not None and row[0] == 0:
                break
    took = time.perf_counter() - began
    worker.stop()
    await running
    return jobs / took


def _tenths(claims: list[float]) -> str:
    size = max(len(claims) // 10, 1)
    parts = [statistics.median(claims[i : i + size]) * 1e3 for i in range(0, len(claims), size)]
    return " ".join(f"{ms:.1f}" for ms in parts[:10])


def bench(dsn: str, jobs: int, rounds: int, limits: list[str]) -> None:
    variants = {True: "index scans (shipped)", False: "planner's choice"}
    databases = Databases(dsn)
    rates: dict[tuple[str, bool], list[float]] = {}
    for index in range(rounds):
        for limit in limits:
            order = (True, False) if index % 2 == 0 else (False, True)
            for shipped in order:
                with databases.fresh() as database:
                    rate, claims = _drain(database, jobs, limit, shipped)
                rates.setdefault((limit, shipped), []).append(rate)
                print(
                    f"{limit:<6}{variants[shipped]:<24}{rate:>9,.0f} jobs/s"
                    f"   claim ms by tenth of the drain: {_tenths(claims)}",
                    flush=True,
                )
    print()
    for limit in limits:
        as_shipped = statistics.median(rates[(limit, True)])
        chosen = statistics.median(rates[(limit, False)])
        print(
            f"{limit:<6}medians: {as_shipped:,.0f} jobs/s shipped, {chosen:,.0f} with the"
            f" planner's choice: {as_shipped / chosen:.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", help="a server where databases may be created")
    parser.add_argument("--jobs", type=int, default=300_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--limit", default="queue,key", help="queue, key, or both")
    options = parser.parse_args()
    limits = [name for name in options.limit.split(",") if name]
    if not limits or set(limits) - {"queue", "key"}:
        parser.error("--limit takes queue, key or both, comma-separated")
    if options.dsn:
        bench(options.dsn, options.jobs, options.rounds, limits)
        return
    with EmbeddedPostgres() as server:
        bench(server.dsn, options.jobs, options.rounds, limits)


if __name__ == "__main__":
    main()
