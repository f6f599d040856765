"""PostgreSQL CPU of a fleet of worker processes, idle and per job, at 1, 10 and 50 workers.

    python benchmarks/fleet_cpu.py [--workers 1,10,50] [--jobs 5000] [--idle 20]
                                   [--max-connections 100]

Starts its own PostgreSQL (``max_connections`` as given: 100 is PostgreSQL's default), and for
each fleet size a fresh database, that many ``pgqueue worker --concurrency 2`` processes of
tests/acceptance/fleet_app.py, then measures the CPU of the postmaster and all its children
(from /proc, sampled every 0.2 s and kept per process, so a backend that exits keeps what it
used until its last sample):

- idle: CPU seconds per second with no job at all (heartbeats, polls, reaper, scheduler,
  statistics: the fleet's standing cost);
- per 1,000 jobs: from a COPY of ``--jobs`` no-op jobs until the last succeeded.

Run it with ``PYTHONPATH=<another checkout>/src`` to measure another version side by side.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg import conninfo, sql

import pgqueue
from pgqueue.bench.processes import children_of, cpu_seconds
from pgqueue.embedded import EmbeddedPostgres
from pgqueue.migrate import migrate

ROOT = Path(__file__).resolve().parent.parent


class Meter(threading.Thread):
    """PostgreSQL's CPU so far: the highest reading of every process seen under the postmaster."""

    def __init__(self, postmaster: int) -> None:
        super().__init__(daemon=True)
        self.postmaster = postmaster
        self.seen: dict[int, float] = {}
        self.done = threading.Event()

    def sample(self) -> float:
        for pid in [self.postmaster, *children_of(self.postmaster)]:
            self.seen[pid] = max(self.seen.get(pid, 0.0), cpu_seconds(pid))
        return sum(self.seen.values())

    def run(self) -> None:
        while not self.done.wait(0.2):
            self.sample()


def scalar(conn: psycopg.Connection[tuple[Any, ...]], query: str) -> int:
    row = conn.execute(query).fetchone()
    assert row is not None
    return int(row[0])


def wait_for(predicate: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        time.sleep(0.1)


def measure(cluster: EmbeddedPostgres, meter: Meter, workers: int, jobs: int, idle: float) -> str:
    name = f"fleet_{workers}"
    with psycopg.connect(cluster.dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsn = conninfo.make_conninfo(cluster.dsn, dbname=name)
    conn = psycopg.connect(dsn, autocommit=True)
    migrate(conn, "public")
    env = {**os.environ, "PGQUEUE_DSN": dsn}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(ROOT)]))
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pgqueue.cli",
                "worker",
                "--app",
                "tests.acceptance.fleet_app:app",
                "--concurrency",
                "2",
                "--log-level",
                "WARNING",
            ],
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(workers)
    ]
    try:
        wait_for(lambda: scalar(conn, "SELECT count(*) FROM pgqueue_workers") == workers, 300)
        time.sleep(15)  # start-up settles (first reaper rounds, schedules synced)
        before = meter.sample()
        time.sleep(idle)
        idle_cpu = (meter.sample() - before) / idle
        app = pgqueue.App(dsn)
        before, started = meter.sample(), time.monotonic()
        app.enqueue_many([("nap", {}) for _ in range(jobs)], connection=conn, allow_unknown=True)
        wait_for(
            lambda: (
                scalar(conn, "SELECT count(*) FROM pgqueue_jobs WHERE status = 'succeeded'") == jobs
            ),
            600,
        )
        elapsed = time.monotonic() - started
        busy_cpu = meter.sample() - before
        backends = scalar(
            conn, "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'"
        )
        app.close()
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(60)
        conn.close()
    return (
        f"| {workers} | {idle_cpu * 100:.1f} % | {busy_cpu / jobs * 1000:.3f} | "
        f"{jobs / elapsed:,.0f} | {backends} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--workers", default="1,10,50")
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--idle", type=float, default=20.0)
    parser.add_argument("--max-connections", type=int, default=100)
    args = parser.parse_args()
    print(f"pgqueue from {Path(pgqueue.__file__).parent}; max_connections={args.max_connections}")
    print("| workers | PostgreSQL CPU idle | PostgreSQL CPU s / 1k jobs | jobs/s | connections |")
    print("|---|---|---|---|---|")
    with EmbeddedPostgres(settings={"max_connections": str(args.max_connections)}) as cluster:
        with psycopg.connect(cluster.dsn) as c:
            row = c.execute("SELECT pg_backend_pid()").fetchone()
            assert row is not None
            postmaster = int(Path(f"/proc/{row[0]}/stat").read_text().rsplit(")", 1)[1].split()[1])
        meter = Meter(postmaster)
        meter.start()
        for workers in (int(n) for n in args.workers.split(",")):
            print(measure(cluster, meter, workers, args.jobs, args.idle), flush=True)
        meter.done.set()


if __name__ == "__main__":
    main()
