"""What a single durable enqueue costs the server alone: pgbench, one client, no Python.

    .venv/bin/python -m benchmarks.enqueue_floor [--dsn postgresql://...] [--rounds 3]
        [--seconds 5]

One client runs one-row inserts back to back, each its own transaction with a durable commit
(prepared statements, as psycopg sends them), into a fresh database (on the server of
``--dsn``; without it, a throwaway server). The variants alternate, ``--rounds`` times, and
each round's average latency is reported, then the medians:

- a table of two columns (the floor: a round trip and a commit);
- ``insert_job``'s statement as pgqueue ships it, into a copy of pgqueue_jobs with only its
  primary key, then with the two ready indexes a waiting job has entries in, then with every
  index (no trigger), and into pgqueue_jobs itself (its NOTIFY trigger too);
- the same job enqueued from Python by ``App.enqueue`` and ``App.enqueue_async`` (one call at
  a time, as one producer does), on the same server in the same minutes: what the client side
  adds to the statement's own time.

Issue 23's single-enqueue target (1.3x PgQueuer with one producer) asks for ~0.29 ms a call
from Python on this machine; this says what the server needs for the same row
(docs/performance.md, "Issue 23's targets").
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg

import pgqueue
from pgqueue.bench.processes import Databases
from pgqueue.bench.workloads import find_pgbench
from pgqueue.embedded import EmbeddedPostgres
from pgqueue.sql import queries

#: insert_job's parameters as one plain enqueue sends them (no delay, no limit, no meta).
VALUES = {
    "queue": "'default'", "task": "'noop'", "args": "'{\"n\": 1}'", "priority": "0",
    "run_at": "NULL", "delay": "0", "max_attempts": "25", "limit_key": "NULL::text",
    "meta": "NULL",
}  # fmt: skip

TABLES = """
CREATE TABLE floor_two (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, v int);
CREATE TABLE floor_pkey (LIKE pgqueue_jobs INCLUDING DEFAULTS INCLUDING CONSTRAINTS
                         INCLUDING IDENTITY);
ALTER TABLE floor_pkey ADD PRIMARY KEY (id);
CREATE TABLE floor_ready (LIKE floor_pkey INCLUDING ALL);
CREATE INDEX ON floor_ready (priority DESC, run_at, id) WHERE status IN ('queued', 'retrying');
CREATE INDEX ON floor_ready (queue, priority DESC, run_at, id)
    WHERE status IN ('queued', 'retrying');
CREATE TABLE floor_indexes (LIKE pgqueue_jobs INCLUDING ALL);
"""


def _insert_job(table: str) -> str:
    text = queries("public").insert_job.decode()
    for name, value in VALUES.items():
        text = text.replace(f"%({name})s", value)
    return text.replace('"public".pgqueue_jobs\n', f'"public".{table}\n') + ";\n"


VARIANTS = {
    "two columns": "INSERT INTO floor_two (v) VALUES (1);\n",
    "insert_job, primary key only": _insert_job("floor_pkey"),
    "insert_job, + the ready indexes": _insert_job("floor_ready"),
    "insert_job, every index": _insert_job("floor_indexes"),
    "insert_job into pgqueue_jobs": _insert_job("pgqueue_jobs"),
}


def _latency(pgbench: str, script: Path, dsn: str, seconds: int) -> float:
    out = subprocess.run(
        [pgbench, "-n", "-c", "1", "-T", str(seconds), "-M", "prepared", "-f", str(script), dsn],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    line = next(x for x in out.stdout.splitlines() if x.startswith("latency average"))
    return float(line.split("=")[1].split()[0])


def _python(database: str, seconds: float, mode: str) -> float:
    """ms per call of one producer enqueueing ``{"n": 1}`` jobs of ``noop`` for ``seconds``."""
    app = pgqueue.App(database)

    @app.task(name="noop")
    async def noop(n: int) -> None: ...

    async def calls_async() -> int:
        count, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            await app.enqueue_async("noop", {"n": 1})
            count += 1
        return count

    try:
        app.enqueue("noop", {"n": 1})  # the pool and the prepared statement, before timing
        began = time.perf_counter()
        if mode == "sync":
            count, end = 0, began + seconds
            while time.perf_counter() < end:
                app.enqueue("noop", {"n": 1})
                count += 1
        else:
            count = asyncio.run(calls_async())
        return (time.perf_counter() - began) / count * 1e3
    finally:
        app.close()


PYTHON = {"App.enqueue (Python)": "sync", "App.enqueue_async (Python)": "async"}


def bench(dsn: str, rounds: int, seconds: int) -> None:
    pgbench = find_pgbench()
    if pgbench is None:
        sys.exit("pgbench not found (it comes with PostgreSQL's server or client package)")
    latencies: dict[str, list[float]] = {name: [] for name in [*VARIANTS, *PYTHON]}
    with Databases(dsn).fresh() as database, tempfile.TemporaryDirectory() as tmp:
        pgqueue.App(database).migrate()
        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute(TABLES.encode())
        scripts = {}
        for index, (name, text) in enumerate(VARIANTS.items()):
            scripts[name] = Path(tmp) / f"variant-{index}.sql"
            scripts[name].write_text(text)
        for round_ in range(rounds):
            for name in [*VARIANTS, *PYTHON]:
                if name in PYTHON:
                    ms = _python(database, seconds, PYTHON[name])
                else:
                    ms = _latency(pgbench, scripts[name], database, seconds)
                latencies[name].append(ms)
                print(f"round {round_ + 1}  {name:<34}{ms:.3f} ms", flush=True)
    print("\nmedians of the rounds (ms per enqueue, one client, durable commits):")
    for name, values in latencies.items():
        print(f"{name:<34}{statistics.median(values):.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", help="a server where databases may be created")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=5, help="per variant and round")
    options = parser.parse_args()
    if options.dsn:
        bench(options.dsn, options.rounds, options.seconds)
        return
    with EmbeddedPostgres() as server:
        bench(server.dsn, options.rounds, options.seconds)


if __name__ == "__main__":
    main()
