"""``pgqueue bench``: plans the runs, interleaves the systems, and reports medians and ratios.

Every run gets a fresh database on one server. Systems take turns inside each repetition
(pgqueue, then each peer, then pgqueue again...), so a noisy neighbour on the machine hits all of
them alike; the table shows the median of the repetitions and the ratio pgqueue / best peer.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..sql import queries
from . import workloads
from .adapter import LIMIT_KEYS
from .processes import (
    CpuMeter,
    Databases,
    System,
    cpu_steal_counters,
    find_postmaster,
    steal_percent,
)

HIGHER, LOWER = "higher", "lower"
#: Each run also records the CPU steal during it (percent of all CPU time; not a table row).
STEAL = "cpu_steal_pct"


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    unit: str
    better: str


@dataclass
class Workload:
    key: str
    title: str
    metrics: list[Metric]
    run: Callable[[workloads.Context, System], Awaitable[Any]]
    #: "all", "processing" (PgQueuer's batch-100 variant too), or "pgqueue" (pgqueue alone)
    systems: str = "all"


RATE = [Metric("rate", "jobs/s", "{:,.0f}", HIGHER)]
#: One job per call: the rate and each call's latency (call to commit returned).
SINGLE = [*RATE, *(Metric(p, f"call {p} ms", "{:.3f}", LOWER) for p in ("p50", "p99"))]
CPU = [
    Metric("worker_cpu_per_1k", "worker CPU s / 1k jobs", "{:.3f}", LOWER),
    Metric("pg_cpu_per_1k", "PostgreSQL CPU s / 1k jobs", "{:.3f}", LOWER),
]
DEPTH = [
    *RATE,
    Metric("empty_rate", "jobs/s, same jobs, empty table", "{:,.0f}", HIGHER),
    Metric("vs_empty", "share of the empty-table rate", "{:.0%}", HIGHER),
    *CPU,
]
DELAYED = [
    *RATE,
    Metric("empty_rate", "jobs/s, same jobs, no delayed jobs", "{:,.0f}", HIGHER),
    Metric("vs_empty", "share of that rate", "{:.0%}", HIGHER),
    Metric("claim_ms", "ms per claim of 100 (median)", "{:.2f}", LOWER),
    Metric("empty_claim_ms", "ms per claim, no delayed jobs", "{:.2f}", LOWER),
    Metric("claim_vs_empty", "claim time vs no delayed jobs", "{:.0%}", LOWER),
    *CPU,
]
LIMITS = [
    Metric("plain_rate", "jobs/s, no limit", "{:,.0f}", HIGHER),
    Metric("key_rate", f"jobs/s, limit=1 per key, {LIMIT_KEYS:,} keys", "{:,.0f}",
           HIGHER),
    Metric("key_vs_plain", "per-key limit / no limit (median)", "{:.2f}x", HIGHER),
    Metric("queue_rate", "jobs/s, queue limit = concurrency", "{:,.0f}", HIGHER),
    Metric("queue_vs_plain", "queue limit / no limit (median)", "{:.2f}x", HIGHER),
    *(Metric(f"{prefix}_{metric.key}", f"{metric.label}, {what}", metric.unit, metric.better)
      for prefix, what in (("plain", "no limit"), ("key", "per key"), ("queue", "queue limit"))
      for metric in CPU),
]  # fmt: skip
LATENCY = [Metric(p, f"{p} ms", "{:.2f}", LOWER) for p in ("p50", "p95", "p99")]
COALESCE = [
    Metric("rate", "jobs/s, coalescing on", "{:,.0f}", HIGHER),
    Metric("off_rate", "jobs/s, coalescing off", "{:,.0f}", HIGHER),
    Metric("speedup", "on / off (median of the pairs)", "{:.1f}x", HIGHER),
    Metric("p50", "call p50 ms, on", "{:.2f}", LOWER),
    Metric("off_p50", "call p50 ms, off", "{:.2f}", LOWER),
    Metric("p99", "call p99 ms, on", "{:.2f}", LOWER),
    Metric("off_p99", "call p99 ms, off", "{:.2f}", LOWER),
    Metric("per_batch", "jobs per INSERT, on", "{:.1f}", HIGHER),
]
STEADY = [
    Metric("first_third", "done/s, first third", "{:,.0f}", HIGHER),
    Metric("last_third", "done/s, last third", "{:,.0f}", HIGHER),
    # What the producer managed to enqueue: done/s below the offered rate with a small backlog
    # means the producer fell short (its commits slowed), not the worker.
    Metric("produced_last_third", "enqueued/s, last third", "{:,.0f}", HIGHER),
    Metric("max_backlog", "max backlog", "{:,.0f}", LOWER),
    Metric("size_end_mb", "database MB at end", "{:.0f}", LOWER),
]

LONG_TX = [
    *(Metric(f"{phase}_{key}", f"{label}, {title}", unit, better)
      for phase, title in (("clean", "before"), ("held", "snapshot held"),
                           ("recovery", "after"))
      for key, label, unit, better in (
          ("offered", "offered jobs/s", "{:,.0f}", HIGHER),
          ("done", "done jobs/s", "{:,.0f}", HIGHER),
          ("p50", "pickup p50 s", "{:.3f}", LOWER),
          ("p99", "pickup p99 s", "{:.3f}", LOWER))),
    Metric("held_backlog", "backlog when the snapshot ends", "{:,.0f}", LOWER),
    Metric("drain_s", "s from then to the usual backlog", "{:.1f}", LOWER),
    Metric("recovery_backlog", "backlog at the end", "{:,.0f}", LOWER),
]  # fmt: skip

#: Workloads that run only when --only names them.
ON_REQUEST = {"long_tx"}


@dataclass
class Plan:
    quick: bool
    reps: int
    steady_seconds: float
    steady_rate: float
    depth_waiting: int
    depth_finished: int
    delayed_ready: int
    delayed_jobs: int
    processing_jobs: int
    io_jobs: int
    single_jobs: int
    bulk_jobs: int
    latency_jobs: int
    poll_interval: float = 0.25
    ceiling_seconds: int = 10
    coalesce_jobs: int = 20_000
    #: long_tx: offered jobs/s, and seconds before, during and after the held snapshot. It runs
    #: only when asked for (--only long_tx): the full version takes 12 minutes per system.
    long_tx_rate: float = 2000.0
    long_tx_clean: float = 60.0
    long_tx_hold: float = 600.0
    long_tx_recovery: float = 60.0
    only: set[str] = field(default_factory=set)

    @classmethod
    def make(cls, quick: bool, reps: int | None) -> Plan:
        if quick:
            return cls(quick, reps or 3, steady_seconds=10, steady_rate=1000, depth_waiting=10_000,
                       depth_finished=100_000, delayed_ready=10_000, delayed_jobs=200_000,
                       processing_jobs=10_000, io_jobs=5_000, single_jobs=600, bulk_jobs=20_000,
                       latency_jobs=60, ceiling_seconds=5, coalesce_jobs=5_000,
                       long_tx_clean=30, long_tx_hold=90, long_tx_recovery=45)  # fmt: skip
        return cls(quick, reps or 3, steady_seconds=60, steady_rate=2000, depth_waiting=100_000,
                   depth_finished=1_000_000, delayed_ready=100_000, delayed_jobs=1_000_000,
                   processing_jobs=30_000, io_jobs=15_000, single_jobs=2_000, bulk_jobs=50_000,
                   latency_jobs=500)  # fmt: skip

    def workloads(self) -> list[Workload]:
        p = self
        w = workloads
        items = [
            Workload("enqueue_1", "enqueue, 1 job per transaction, 1 producer", SINGLE,
                     lambda c, s: w.enqueue(c, s, p.single_jobs, 1, 1)),
            Workload("enqueue_4", "enqueue, 1 job per transaction, 4 producers", SINGLE,
                     lambda c, s: w.enqueue(c, s, p.single_jobs, 4, 1)),
            Workload("enqueue_bulk", "enqueue, bulk (5,000 per call)", RATE,
                     lambda c, s: w.enqueue(c, s, p.bulk_jobs, 1, workloads.FILL_BATCH)),
            Workload("process_1", "processing no-op jobs, 1 worker process", RATE + CPU,
                     lambda c, s: w.process(c, s, p.processing_jobs, 1, 100, 0.0),
                     systems="processing"),
            Workload("process_c10", "processing no-op jobs, 1 worker, concurrency 10", RATE + CPU,
                     lambda c, s: w.process(c, s, p.processing_jobs, 1, 10, 0.0),
                     systems="processing"),
            Workload("process_c20", "processing no-op jobs, 1 worker, concurrency 20", RATE + CPU,
                     lambda c, s: w.process(c, s, p.processing_jobs, 1, 20, 0.0),
                     systems="processing"),
            Workload("process_2", "processing no-op jobs, 2 worker processes", RATE + CPU,
                     lambda c, s: w.process(c, s, p.processing_jobs, 2, 100, 0.0),
                     systems="processing"),
            Workload("process_2_c10", "processing no-op jobs, 2 workers, concurrency 10 each",
                     RATE + CPU, lambda c, s: w.process(c, s, p.processing_jobs, 2, 10, 0.0),
                     systems="processing"),
            Workload("process_2_c20", "processing no-op jobs, 2 workers, concurrency 20 each",
                     RATE + CPU, lambda c, s: w.process(c, s, p.processing_jobs, 2, 20, 0.0),
                     systems="processing"),
            Workload("process_io", "10 ms jobs, concurrency 50 (ideal 5,000/s)", RATE + CPU,
                     lambda c, s: w.process(c, s, p.io_jobs, 1, 50, 10.0),
                     systems="processing"),
            Workload("latency_notify", "pickup latency, idle worker, NOTIFY", LATENCY,
                     lambda c, s: w.latency(c, s, p.latency_jobs, 20, True, p.poll_interval)),
            Workload("latency_poll",
                     f"pickup latency, polling every {p.poll_interval:g} s (no LISTEN)", LATENCY,
                     lambda c, s: w.latency(c, s, p.latency_jobs, 20, False, p.poll_interval)),
            Workload("steady",
                     f"steady state, {p.steady_rate:,.0f} jobs/s offered for "
                     f"{p.steady_seconds:g} s", STEADY,
                     lambda c, s: w.steady(c, s, p.steady_rate, p.steady_seconds, 20)),
            Workload("depth",
                     f"processing with {p.depth_waiting:,} waiting and {p.depth_finished:,} "
                     "finished rows, 1 worker", DEPTH,
                     lambda c, s: w.depth(c, s, p.depth_waiting, p.depth_finished, 100),
                     systems="processing"),
            Workload("delayed",
                     f"processing {p.delayed_ready:,} jobs beside {p.delayed_jobs:,} delayed "
                     "jobs of higher priority, 1 worker", DELAYED,
                     lambda c, s: w.delayed(c, s, p.delayed_ready, p.delayed_jobs, 100),
                     systems="pgqueue"),
            Workload("limits",
                     f"processing {p.processing_jobs:,} no-op jobs under limits, 1 worker, "
                     "concurrency 100", LIMITS,
                     lambda c, s: w.limits(c, s, p.processing_jobs, 100), systems="pgqueue"),
            Workload("coalesce",
                     "100 coroutines enqueueing single jobs: App(coalesce=True) against without",
                     COALESCE, lambda c, s: w.coalesce(c, s, 100, p.coalesce_jobs),
                     systems="pgqueue"),
            Workload("long_tx",
                     f"{p.long_tx_rate:,.0f} jobs/s offered, a snapshot held "
                     f"{p.long_tx_hold:g} s ({p.long_tx_clean:g} s before, "
                     f"{p.long_tx_recovery:g} s after), 1 worker, concurrency 50", LONG_TX,
                     lambda c, s: w.long_tx(c, s, p.long_tx_rate, p.long_tx_clean,
                                            p.long_tx_hold, p.long_tx_recovery, 50)),
        ]  # fmt: skip
        if self.only:
            return [i for i in items if i.key in self.only]
        return [i for i in items if i.key not in ON_REQUEST]


def pgqueue_systems() -> list[System]:
    """pgqueue, a variant for long_tx whose claims always start at the beginning of the index
    (as before issue 22: what starting where the last claim ended is worth), and three variants
    for the enqueue workloads, never compared with the peers:
    with a worker waiting for work (so every commit notifies, what NOTIFY costs concurrent
    producers), with the NOTIFY trigger off, and with every job unique (``unique=True``, every
    key new: what the unique path costs). In the plain run no worker waits, as when every
    worker is busy, and producers skip NOTIFY."""
    argv = [sys.executable, "-m", "pgqueue.bench.adapter"]
    return [
        System(key="pgqueue", label="pgqueue", family="pgqueue", argv=argv),
        System(
            key="pgqueue-waiting",
            label="pgqueue, a worker waiting",
            family="pgqueue",
            argv=argv,
            session=[queries("public").announce_waiting.decode()],
            workloads={"enqueue_1", "enqueue_4"},
        ),
        System(
            key="pgqueue-no-notify",
            label="pgqueue, NOTIFY trigger off",
            family="pgqueue",
            argv=argv,
            after_install=["ALTER TABLE pgqueue_jobs DISABLE TRIGGER pgqueue_jobs_notify_ready"],
            workloads={"enqueue_1", "enqueue_4"},
        ),
        System(
            key="pgqueue-from-start",
            label="pgqueue, claims from the start",
            family="pgqueue",
            argv=argv,
            env={"PGQUEUE_BENCH_FROM_START": "1"},
            workloads={"long_tx"},
        ),
        System(
            key="pgqueue-unique",
            label="pgqueue, unique jobs",
            family="pgqueue",
            argv=argv,
            env={"PGQUEUE_BENCH_UNIQUE": "1"},
            workloads={"enqueue_1", "enqueue_4", "enqueue_bulk"},
        ),
    ]


def peer_systems(peers_dir: Path, venv: Path) -> list[System]:
    python = str(venv / "bin" / "python")
    return [
        System("pgqueuer-b10", "PgQueuer (batch 10)", "pgqueuer",
               [python, str(peers_dir / "pgqueuer_adapter.py")], work_config={"batch_size": 10}),
        System("pgqueuer-b100", "PgQueuer (batch 100)", "pgqueuer",
               [python, str(peers_dir / "pgqueuer_adapter.py")], work_config={"batch_size": 100}),
        # Its README's setup: one asyncpg connection, which its driver serialises with a lock.
        # Faster than the pool for a lone producer; producers then take turns on it.
        System("pgqueuer-conn", "PgQueuer (one connection)", "pgqueuer",
               [python, str(peers_dir / "pgqueuer_adapter.py")],
               env={"PGQUEUER_BENCH_ONE_CONNECTION": "1"},
               workloads={"enqueue_1", "enqueue_4", "enqueue_bulk"}),
        System("procrastinate", "Procrastinate", "procrastinate",
               [python, str(peers_dir / "procrastinate_adapter.py")], scale=0.05),
    ]  # fmt: skip


def ensure_peer_venv(peers_dir: Path, venv: Path, console: Console) -> None:
    """Create (or refresh) the peers' own environment from ``requirements.txt`` and put our
    stdlib-only driver in it. The peers never share pgqueue's environment."""
    requirements = peers_dir / "requirements.txt"
    digest = hashlib.sha256(requirements.read_bytes()).hexdigest()
    stamp = venv / ".pgqueue-bench-requirements"
    if not stamp.exists() or stamp.read_text() != digest:
        console.print(f"installing the peers from PyPI into {venv} ...")
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run(
            [str(venv / "bin" / "pip"), "install", "--quiet", "-r", str(requirements)], check=True
        )
        stamp.write_text(digest)
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    shutil.copy(
        Path(__file__).with_name("driver.py"), Path(out.stdout.strip()) / "pgqueue_bench_driver.py"
    )


def describe_machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


@dataclass
class Results:
    plan: Plan
    systems: list[System]
    runs: dict[str, dict[str, list[dict[str, float | None]]]] = field(default_factory=dict)
    ceiling: dict[str, float] | None = None
    settings: dict[str, str] = field(default_factory=dict)
    started: str = ""

    def add(self, workload: str, system: str, value: dict[str, float | None]) -> None:
        self.runs.setdefault(workload, {}).setdefault(system, []).append(value)

    def median(self, workload: str, system: str, metric: str) -> float | None:
        values = [
            v for run in self.runs.get(workload, {}).get(system, [])
            if (v := run.get(metric)) is not None
        ]  # fmt: skip
        return workloads.median(values) if values else None

    def steal_note(self) -> str | None:
        """CPU steal over the runs: on a shared virtual machine it, not the code, moves rates
        by tens of percent between repetitions."""
        values = sorted(
            v for by_system in self.runs.values() for runs in by_system.values()
            for run in runs if (v := run.get(STEAL)) is not None
        )  # fmt: skip
        if not values:
            return None
        return (
            f"CPU steal (time the hypervisor gave this machine's cores to others) during the "
            f"runs: median {workloads.median(values):.1f} %, highest {values[-1]:.1f} %."
        )

    def as_json(self) -> dict[str, Any]:
        medians = {
            workload: {
                system: {metric: self.median(workload, system, metric) for metric in runs[0]}
                for system, runs in by_system.items()
            }
            for workload, by_system in self.runs.items()
        }
        return {
            "started": self.started,
            "quick": self.plan.quick,
            "repetitions": self.plan.reps,
            "machine": describe_machine(),
            "postgresql": self.settings,
            "systems": {s.key: {"label": s.label, "version": s.version} for s in self.systems},
            "medians": medians,
            "runs": self.runs,
            "ceiling": self.ceiling,
            "long_tx": {name: getattr(self.plan, f"long_tx_{name}")
                        for name in ("rate", "clean", "hold", "recovery")},
        }  # fmt: skip


def _applies(workload: Workload, system: System) -> bool:
    if system.workloads:
        return workload.key in system.workloads
    if workload.systems == "pgqueue":
        return system.key == "pgqueue"
    if workload.systems == "processing":
        return True
    return system.key != "pgqueuer-b100"  # batch size only matters when processing


async def _info(system: System, logdir: Path) -> None:
    from .processes import run_role

    info = await run_role(system, "info", "", [], logdir)
    system.version = str(info["version"])
    system.remaining_sql = str(info["remaining_sql"])


async def run(
    admin_dsn: str, plan: Plan, systems: list[System], console: Console, logdir: Path | None
) -> Results:
    """Every planned run. Adapter logs go to ``logdir``; without one, to a temporary directory
    that is kept (and named) only when the run fails, since only then is there a log to read."""
    if logdir is not None:
        results = await _run_all(admin_dsn, plan, systems, console, logdir)
        console.print(f"[dim]adapter logs: {logdir}[/dim]")
        return results
    scratch = Path(tempfile.mkdtemp(prefix="pgqueue-bench-"))
    try:
        results = await _run_all(admin_dsn, plan, systems, console, scratch)
    except Exception:
        console.print(f"adapter logs kept in {scratch}")
        raise
    except BaseException:  # interrupted (Ctrl-C): no failure to read about
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    shutil.rmtree(scratch, ignore_errors=True)
    return results


async def _run_all(
    admin_dsn: str, plan: Plan, systems: list[System], console: Console, logdir: Path
) -> Results:
    databases = Databases(admin_dsn)
    ctx = workloads.Context(databases, CpuMeter(find_postmaster(admin_dsn)), logdir)
    results = Results(plan, systems, settings=databases.settings())
    results.started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    for system in systems:
        await _info(system, logdir)
    steps = []
    for workload in plan.workloads():
        for rep in range(plan.reps):
            for system in systems:
                if _applies(workload, system):
                    steps.append((workload, rep, system))
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True,
    ) as progress:  # fmt: skip
        bar = progress.add_task("benchmark", total=len(steps) + 1)
        for workload, rep, system in steps:
            progress.update(bar, description=f"{workload.key} · {system.label} · rep {rep + 1}")
            began, stolen = time.monotonic(), cpu_steal_counters()
            value = await workload.run(ctx, system)
            value[STEAL] = steal_percent(stolen, cpu_steal_counters())
            results.add(workload.key, system.key, value)
            console.log(f"{workload.key} {system.label}: {_brief(value)} "
                        f"({time.monotonic() - began:.0f} s)")  # fmt: skip
            progress.advance(bar)
        if not plan.only or "ceiling" in plan.only:
            progress.update(bar, description="database ceiling (pgbench)")
            results.ceiling = await asyncio.to_thread(
                workloads.ceiling, ctx, 4, plan.ceiling_seconds, 100
            )
        progress.advance(bar)
    return results


def _brief(value: dict[str, float | None]) -> str:
    return ", ".join(f"{k}={v:,.3g}" if v is not None else f"{k}=—" for k, v in value.items())


def _fmt(metric: Metric, value: float | None) -> str:
    return "—" if value is None else metric.unit.format(value)


def render(results: Results, console: Console) -> None:
    systems = results.systems
    peers = [s for s in systems if s.family != "pgqueue"]
    shown = [s for s in systems if any(s.key in by for by in results.runs.values())]
    table = Table(title="pgqueue bench: medians" + (" (quick)" if results.plan.quick else ""))
    table.add_column("workload")
    table.add_column("metric")
    for s in shown:
        table.add_column(s.label, justify="right")
    if peers:
        table.add_column("pgqueue / best peer", justify="right")
    for workload in results.plan.workloads():
        if workload.key not in results.runs:
            continue
        for index, metric in enumerate(workload.metrics):
            values = {s.key: results.median(workload.key, s.key, metric.key) for s in shown}
            row = [workload.title if index == 0 else "", metric.label]
            row += [_fmt(metric, values[s.key]) for s in shown]
            if peers:
                row.append(_ratio(metric, values, peers))
            table.add_row(*row, end_section=index == len(workload.metrics) - 1)
    console.print(table)
    if results.ceiling is None and (not results.plan.only or "ceiling" in results.plan.only):
        console.print("database ceiling: not measured (pgbench not found)")
    if results.ceiling:
        c = results.ceiling
        console.print(
            f"database ceiling (pgbench, {c['clients']:.0f} clients, batches of {c['batch']:.0f}: "
            f"insert, claim with SKIP LOCKED, ack; 3 durable commits per batch): "
            f"[bold]{c['rate']:,.0f} jobs/s[/bold]"
        )
        if (line := _drain_share(results)) is not None:
            console.print(line)
    steal = results.steal_note()
    if steal:
        console.print(f"[dim]{steal}[/dim]")
    pg = results.settings
    console.print(
        f"[dim]PostgreSQL {pg.get('server_version')}, fsync={pg.get('fsync')}, "
        f"synchronous_commit={pg.get('synchronous_commit')}; "
        f"{results.plan.reps} repetitions, interleaved; {results.started}[/dim]"
    )


def markdown(results: Results) -> str:
    """The same table as ``render``, as Markdown (for docs/performance.md)."""
    systems = [s for s in results.systems if any(s.key in by for by in results.runs.values())]
    peers = [s for s in systems if s.family != "pgqueue"]
    head = ["workload", "metric", *(s.label for s in systems)]
    if peers:
        head.append("pgqueue / best peer")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    for workload in results.plan.workloads():
        if workload.key not in results.runs:
            continue
        for index, metric in enumerate(workload.metrics):
            values = {s.key: results.median(workload.key, s.key, metric.key) for s in systems}
            row = [workload.title.strip() if index == 0 else "", metric.label]
            row += [_fmt(metric, values[s.key]) for s in systems]
            if peers:
                row.append(_ratio(metric, values, peers))
            lines.append("| " + " | ".join(row) + " |")
    if results.ceiling:
        lines.append("")
        if (line := _drain_share(results)) is not None:
            lines.append(line.replace("[bold]", "**").replace("[/bold]", "**"))
            lines.append("")
        lines.append(
            f"Database ceiling (pgbench, {results.ceiling['clients']:.0f} clients, batches of "
            f"{results.ceiling['batch']:.0f}): **{results.ceiling['rate']:,.0f} jobs/s**."
        )
    steal = results.steal_note()
    if steal:
        lines += ["", steal]
    return "\n".join(lines)


def load(path: Path, systems: list[System]) -> Results:
    """A saved ``--save`` report, for rendering again without running."""
    data = json.loads(path.read_text())
    plan = Plan.make(bool(data["quick"]), int(data["repetitions"]))
    plan.only = set(data["runs"])  # on-request workloads too, when the report has them
    for name, value in data.get("long_tx", {}).items():
        setattr(plan, f"long_tx_{name}", value)
    known = {s.key: s for s in systems}
    chosen = [known[key] for key in data["systems"] if key in known]
    for system in chosen:
        system.version = data["systems"][system.key]["version"]
    results = Results(plan, chosen, runs=data["runs"], ceiling=data["ceiling"],
                      settings=data["postgresql"], started=data["started"])  # fmt: skip
    return results


def _drain_share(results: Results) -> str | None:
    """The drain-only ceiling, and the share of it pgqueue's two workers reached (issue 23's
    target: at least 75 %)."""
    drain = (results.ceiling or {}).get("drain_rate")
    if not drain:
        return None
    line = (
        f"drain-only ceiling (pgbench: claim a batch of pre-filled rows with SKIP LOCKED, ack it; "
        f"2 durable commits per batch): [bold]{drain:,.0f} jobs/s[/bold]"
    )
    two = results.median("process_2", "pgqueue", "rate") if "process_2" in results.runs else None
    if two:
        line += f"; pgqueue's 2 workers reach [bold]{two / drain:.0%}[/bold] of it"
    return line


def _ratio(metric: Metric, values: dict[str, float | None], peers: list[System]) -> str:
    ours = values.get("pgqueue")
    theirs = [v for p in peers if (v := values.get(p.key)) is not None and v > 0]
    if ours is None or not theirs:
        return "—"
    best = max(theirs) if metric.better == HIGHER else min(theirs)
    return f"{ours / best:.2f}x"


def dump(results: Results) -> str:
    return json.dumps(results.as_json(), indent=2)
