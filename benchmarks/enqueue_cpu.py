"""Client CPU of one single-job enqueue (one job per transaction, one producer): pgqueue's
direct libpq path against psycopg's general execute path, sync and async, interleaved in one
run, with psycopg itself (the same INSERT through ``conn.execute``, prepared) as the floor of
the general path.

    .venv/bin/python -m benchmarks.enqueue_cpu [--dsn postgresql://...] [--calls 3000] [--rounds 5]

CPU is ``time.process_time`` over the calls (the producer process's own CPU, whatever the
database and the machine's other load take); wall time is reported beside it. Medians of the
rounds; the modes alternate within each round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import psycopg

import pgqueue
from pgqueue import wire
from pgqueue.embedded import EmbeddedPostgres

ARGS: dict[str, Any] = {"user_id": 42, "email": "someone@example.com", "template": "welcome"}
INSERT = (
    b"INSERT INTO pgqueue_jobs (queue, task, args) VALUES (%(queue)s, %(task)s, %(args)s::jsonb)"
    b" RETURNING id"
)


def _timed(calls: int, run: Callable[[], None]) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    run()
    return (time.process_time() - cpu) / calls * 1e3, (time.perf_counter() - wall) / calls * 1e3


def bench(dsn: str, calls: int, rounds: int) -> None:
    app = pgqueue.App(dsn)
    app.migrate()

    @app.task
    def send_email(user_id: int, email: str, template: str) -> None: ...

    loop = asyncio.new_event_loop()
    raw = psycopg.connect(dsn, autocommit=True, prepare_threshold=0)
    raw_async = loop.run_until_complete(
        psycopg.AsyncConnection.connect(dsn, autocommit=True, prepare_threshold=0)
    )

    def sync_calls() -> None:
        for _ in range(calls):
            send_email.enqueue(**ARGS)

    def async_calls() -> None:
        async def run() -> None:
            for _ in range(calls):
                await send_email.enqueue_async(**ARGS)

        loop.run_until_complete(run())

    params = {"queue": "default", "task": "send_email"}

    def psycopg_sync() -> None:
        for _ in range(calls):
            raw.execute(INSERT, {**params, "args": json.dumps(ARGS)}).fetchone()

    def psycopg_async() -> None:
        async def run() -> None:
            for _ in range(calls):
                cur = await raw_async.execute(INSERT, {**params, "args": json.dumps(ARGS)})
                await cur.fetchone()

        loop.run_until_complete(run())

    modes: dict[str, tuple[bool | None, Callable[[], None]]] = {
        "sync, direct path": (True, sync_calls),
        "sync, general path": (False, sync_calls),
        "sync, psycopg alone": (None, psycopg_sync),
        "async, direct path": (True, async_calls),
        "async, general path": (False, async_calls),
        "async, psycopg alone": (None, psycopg_async),
    }
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in modes}
    try:
        for _ in range(1 + rounds):  # the first round warms up and is not counted
            for name, (direct, run) in modes.items():
                wire.ENABLED = bool(direct)
                figures[name].append(_timed(calls, run))
                with psycopg.connect(dsn, autocommit=True) as conn:
                    conn.execute("TRUNCATE pgqueue_jobs")
    finally:
        wire.ENABLED = True
        raw.close()
        loop.run_until_complete(raw_async.close())
        app.close()
        loop.close()
    print(f"{'one enqueue, one producer':<24}{'CPU ms/call':>13}{'wall ms/call':>14}")
    medians = {}
    for name, samples in figures.items():
        cpu = statistics.median(c for c, _ in samples[1:])
        wall = statistics.median(w for _, w in samples[1:])
        medians[name] = cpu
        print(f"{name:<24}{cpu:>13.3f}{wall:>14.3f}")
    for kind in ("sync", "async"):
        ratio = medians[f"{kind}, general path"] / medians[f"{kind}, direct path"]
        print(f"{kind}: the direct path takes {1 / ratio:.0%} of the general path's CPU")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", help="a database where pgqueue may create its tables")
    parser.add_argument("--calls", type=int, default=3000, help="enqueues per mode and round")
    parser.add_argument("--rounds", type=int, default=5)
    options = parser.parse_args()
    if options.dsn:
        bench(options.dsn, options.calls, options.rounds)
        return
    with EmbeddedPostgres() as server:
        bench(server.dsn, options.calls, options.rounds)


if __name__ == "__main__":
    main()
