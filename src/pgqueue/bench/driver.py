"""The adapter side of ``pgqueue bench``: one process per role, JSON lines on stdout.

Every system under test (pgqueue and each peer) is driven by the same code: this module runs the
producers, the timed producer loops and the worker life cycle, and an *adapter* supplies only the
library calls (install, enqueue one, enqueue many, run a worker). That way the methodology cannot
differ between systems. It uses the standard library only, because it also runs inside the peers'
separate virtual environment (the runner copies it there as ``pgqueue_bench_driver``).

Roles (``python adapter.py ROLE --dsn DSN [options]``):

- ``info``: the adapter's name, version and its "jobs not finished yet" SQL.
- ``install``: create the system's tables in an empty database.
- ``enqueue``: ``--jobs N --producers P --batch B``; B = 1 is one job per transaction.
- ``fill-finished``: ``--jobs N`` rows that look finished (for the depth workload).
- ``produce``: ``--count N --interval-ms T`` (one job per transaction every T ms, reporting each
  commit time) or ``--rate R --duration D`` (batches every 10 ms, reporting counts). With
  ``--stamp`` each job's ``seq`` carries the time its enqueue call began (``stamp``), so a worker
  can tell its pickup latency without a table of commit times.
- ``work``: prints ``ready``, waits for ``go`` on stdin, runs a worker until ``stop``. With
  ``--pickups`` it reports, per second of enqueue, a histogram of stamped jobs' pickup latencies
  (``pickup_bin``), small whatever the number of jobs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import Callable
from typing import Any, Protocol


class Adapter(Protocol):
    name: str
    version: str
    #: One row, one integer: jobs that are not finished yet (queued, waiting or running).
    remaining_sql: str

    async def open(self, dsn: str) -> None: ...

    async def close(self) -> None: ...

    async def install(self) -> None: ...

    async def enqueue_one(self, seq: int) -> None:
        """One job with argument ``seq``, in its own transaction."""

    async def enqueue_many(self, seqs: range) -> None:
        """Many jobs in the library's bulk path (one call)."""

    async def fill_finished(self, count: int) -> None:
        """``count`` rows that look like finished jobs, the way this system keeps them."""

    async def work(self, options: WorkOptions, on_start: Callable[[int], None]) -> None:
        """Run a worker until ``options.stop`` is set, then stop it gracefully."""


class WorkOptions:
    def __init__(self, args: argparse.Namespace) -> None:
        self.concurrency: int = args.concurrency
        self.sleep: float = args.sleep_ms / 1000
        self.listen: bool = not args.no_listen
        self.poll: float = args.poll
        self.config: dict[str, Any] = json.loads(args.config)
        self.stop = asyncio.Event()


#: Stamped seqs: milliseconds since STAMP_EPOCH (seconds) times STAMP_SPAN, plus the job's place
#: in its enqueue call (fewer than STAMP_SPAN per call). Below 2**53, exact as JSON numbers anywhere.
STAMP_EPOCH = 1_700_000_000
STAMP_SPAN = 10_000
#: Pickup histogram bins grow by this factor (5 %: percentiles to within that).
PICKUP_STEP = 1.05


def stamp(at: float) -> int:
    """The first seq of an enqueue call made at ``at`` (time.time())."""
    return int((at - STAMP_EPOCH) * 1000) * STAMP_SPAN


def stamped_at(seq: int) -> float:
    """When the enqueue call of a stamped ``seq`` began (time.time())."""
    return (seq // STAMP_SPAN) / 1000 + STAMP_EPOCH


def pickup_bin(seconds: float) -> int:
    """The histogram bin of a pickup latency: 0 up to a millisecond, then 5 % steps."""
    return 0 if seconds <= 0.001 else 1 + int(math.log(seconds * 1000, PICKUP_STEP))


def bin_seconds(index: int) -> float:
    """The upper edge of a bin, in seconds (what a percentile falling in it reports)."""
    return 0.001 * PICKUP_STEP**index


def emit(**fields: Any) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


async def _stdin_line() -> str:
    return await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


async def _enqueue(adapter: Adapter, args: argparse.Namespace) -> None:
    """Jobs/s; with one job per call also each call's latency (from the call to its commit
    returned), as p50 and p99 in ms."""
    per_producer = args.jobs // args.producers
    calls: list[float] = []

    async def producer(index: int) -> None:
        first = index * per_producer
        if args.batch == 1:
            clock = time.perf_counter
            for seq in range(first, first + per_producer):
                began = clock()
                await adapter.enqueue_one(seq)
                calls.append(clock() - began)
            return
        for start in range(first, first + per_producer, args.batch):
            await adapter.enqueue_many(range(start, min(start + args.batch, first + per_producer)))

    started = time.perf_counter()
    await asyncio.gather(*(producer(i) for i in range(args.producers)))
    seconds = time.perf_counter() - started
    if not calls:
        emit(seconds=seconds, jobs=per_producer * args.producers)
        return
    calls.sort()
    emit(
        seconds=seconds,
        jobs=per_producer * args.producers,
        p50_ms=calls[len(calls) // 2] * 1000,
        p99_ms=calls[min(int(len(calls) * 0.99), len(calls) - 1)] * 1000,
    )


async def _produce(adapter: Adapter, args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    if args.count:
        commits: dict[int, float] = {}
        next_at = loop.time()
        for seq in range(args.count):
            await asyncio.sleep(max(next_at - loop.time(), 0))
            await adapter.enqueue_one(seq)
            commits[seq] = time.time()
            next_at += args.interval_ms / 1000
        emit(commits=commits)
        return
    per_tick = max(round(args.rate / 100), 1)
    produced = 0
    started = loop.time()
    next_report = started + 0.5
    while loop.time() - started < args.duration:
        target = int((loop.time() - started) * args.rate) + per_tick
        while target > produced:
            count = min(target - produced, STAMP_SPAN - 1)
            first = stamp(time.time()) if args.stamp else produced
            await adapter.enqueue_many(range(first, first + count))
            produced += count
        if loop.time() >= next_report:
            emit(produced=produced, t=time.time())
            next_report += 0.5
        await asyncio.sleep(0.01)
    emit(produced=produced, t=time.time(), done=True)


async def _work(adapter: Adapter, args: argparse.Namespace) -> None:
    options = WorkOptions(args)
    starts: dict[int, float] = {}
    pickups: dict[int, dict[int, int]] = {}  # second of enqueue -> bin -> jobs
    handled = 0

    def on_start(seq: int) -> None:
        nonlocal handled
        handled += 1
        if args.record_starts:
            starts[seq] = time.time()
        if args.pickups:
            at = stamped_at(seq)
            bins = pickups.setdefault(int(at), {})
            index = pickup_bin(time.time() - at)
            bins[index] = bins.get(index, 0) + 1

    emit(ready=True)
    if (await _stdin_line()).strip() != "go":
        return
    worker = asyncio.create_task(adapter.work(options, on_start))
    stopper = asyncio.create_task(_stdin_line())
    await asyncio.wait({worker, stopper}, return_when=asyncio.FIRST_COMPLETED)
    options.stop.set()
    await worker
    emit(handled=handled, starts=starts, pickups=pickups)


async def _main(adapter: Adapter, args: argparse.Namespace) -> None:
    if args.role == "info":
        emit(name=adapter.name, version=adapter.version, remaining_sql=adapter.remaining_sql)
        return
    await adapter.open(args.dsn)
    try:
        if args.role == "install":
            await adapter.install()
            emit(installed=True)
        elif args.role == "enqueue":
            await _enqueue(adapter, args)
        elif args.role == "fill-finished":
            await adapter.fill_finished(args.jobs)
            emit(filled=args.jobs)
        elif args.role == "produce":
            await _produce(adapter, args)
        elif args.role == "work":
            await _work(adapter, args)
    finally:
        await adapter.close()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument(
        "role", choices=["info", "install", "enqueue", "fill-finished", "produce", "work"]
    )
    p.add_argument("--dsn", default="")
    p.add_argument("--jobs", type=int, default=0)
    p.add_argument("--producers", type=int, default=1)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--count", type=int, default=0)
    p.add_argument("--interval-ms", type=float, default=20.0)
    p.add_argument("--rate", type=float, default=0.0)
    p.add_argument("--duration", type=float, default=0.0)
    p.add_argument("--concurrency", type=int, default=10)
    p.add_argument("--sleep-ms", type=float, default=0.0)
    p.add_argument("--no-listen", action="store_true")
    p.add_argument("--poll", type=float, default=1.0)
    p.add_argument("--record-starts", action="store_true")
    p.add_argument("--stamp", action="store_true", help="seqs carry their enqueue time")
    p.add_argument("--pickups", action="store_true", help="report stamped jobs' pickups")
    p.add_argument("--config", default="{}", help="adapter-specific settings as JSON")
    return p


def main(adapter: Adapter, run: Callable[[Any], Any] = asyncio.run) -> None:
    """Entry point of an adapter script; ``run`` lets a peer use its recommended event loop."""
    run(_main(adapter, parser().parse_args()))
