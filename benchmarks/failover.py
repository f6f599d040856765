"""Acknowledged enqueues lost in a failover, against the replication lag at the crash.

    .venv/bin/python -m benchmarks.failover --delays 0 0.01 0.05 --reps 3

Each run starts a primary and a streaming standby from the local PostgreSQL binaries
(tests/replication.py), the standby reaching the primary through a relay that delays every
byte by ``delay`` seconds each way (network latency on the replication link). Producer threads
enqueue single jobs through the multi-host DSN (``host=a,b target_session_attrs=read-write``)
for ``--seconds``; then the replication lag is read (WAL bytes the standby has not flushed, and
its last reported ``flush_lag``), the primary is killed (``pg_ctl -m immediate stop``) and the
standby promoted. ``lost`` counts the enqueues that returned an id but whose job is not on the
new primary; ``in lag`` counts the enqueues acknowledged within ``flush_lag`` of the crash, what
the lag predicts. Synchronous replication (``--modes sync``) loses none, at the price of a round
trip to the standby in every commit (its enqueue latency shows it).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import threading
import time
from dataclasses import dataclass

import psycopg

import pgqueue
from pgqueue.migrate import migrate
from tests.replication import replicated


@dataclass
class Run:
    mode: str
    delay: float
    rate: float
    p50_ms: float
    lag_bytes: int
    lag_s: float
    acked: int
    lost: int
    in_lag: int


def run_once(mode: str, delay: float, producers: int, seconds: float) -> Run:
    with replicated(delay) as pair:
        with psycopg.connect(pair.primary.dsn, autocommit=True) as conn:
            migrate(conn, "public")
        if mode == "sync":
            pair.synchronous()
        pair.wait_replayed()
        app = pgqueue.App(pair.dsn, reconnect_timeout=60)
        stop = threading.Event()
        acked: list[tuple[float, str]] = []
        latencies: list[float] = []

        def produce(name: str) -> None:
            i = 0
            while not stop.is_set():
                token = f"{name}-{i}"
                started = time.monotonic()
                try:
                    app.enqueue("t", {"token": token}, allow_unknown=True)
                except pgqueue.DatabaseUnavailableError:
                    pass  # an answer lost in the crash: not acknowledged
                else:
                    done = time.monotonic()
                    acked.append((done, token))
                    latencies.append(done - started)
                i += 1

        threads = [threading.Thread(target=produce, args=(str(n),)) for n in range(producers)]
        for thread in threads:
            thread.start()
        time.sleep(seconds)
        lag_bytes, lag_s = pair.lag()
        crash = time.monotonic()
        before = [token for at, token in acked if at <= crash]
        p50 = statistics.median(latencies[: len(before)]) * 1000 if before else 0.0
        pair.fail_over()
        stop.set()
        for thread in threads:
            thread.join(120)
        app.close()
        with psycopg.connect(pair.standby.dsn, autocommit=True) as conn:
            present = {row[0] for row in conn.execute("SELECT args->>'token' FROM pgqueue_jobs")}
        lost = len({token for _, token in acked} - present)
        in_lag = sum(1 for at, _ in acked if crash - lag_s < at <= crash)
        return Run(mode, delay, len(before) / seconds, p50, lag_bytes, lag_s, len(acked), lost,
                   in_lag)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=["async", "sync"], choices=["async", "sync"])
    parser.add_argument("--delays", nargs="+", type=float, default=[0.0, 0.01, 0.05])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--producers", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=3.0)
    options = parser.parse_args()
    print(f"{platform.node()}, {os.cpu_count()} CPUs, {options.producers} producer threads")
    header = (
        f"{'mode':<5} {'delay':>6} {'jobs/s':>7} {'p50 ms':>7} {'lag bytes':>10}"
        f" {'lag ms':>7} {'acked':>6} {'lost':>5} {'in lag':>6}"
    )
    print(header)
    for _ in range(options.reps):
        for mode in options.modes:
            for delay in options.delays:
                r = run_once(mode, delay, options.producers, options.seconds)
                print(
                    f"{r.mode:<5} {r.delay * 1000:>4.0f}ms {r.rate:>7,.0f} {r.p50_ms:>7.2f}"
                    f" {r.lag_bytes:>10,} {r.lag_s * 1000:>7.1f} {r.acked:>6} {r.lost:>5}"
                    f" {r.in_lag:>6}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
