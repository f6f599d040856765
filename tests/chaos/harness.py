"""The chaos harness: real `pgqueue worker` processes on a PostgreSQL cluster of its own, a
producer feeding jobs at a steady rate, and a scenario injecting faults from a seeded random
generator, so a failing run can be replayed with its seed. ``checker`` decides the outcome.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
from psycopg import conninfo, sql

import pgqueue
from pgqueue.embedded import EmbeddedPostgres
from pgqueue.migrate import migrate
from tests import history
from tests.chaos import app as chaos_app
from tests.chaos.checker import Fault, Group, LimitChange, LimitPlan, Result, check
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.chaos.app:app"
#: Keys of the unique jobs the feeder mixes in: few, so most of them meet a job holding theirs.
UNIQUE_KEYS = 12
#: The limited jobs the feeder mixes in, whatever the run's rate: per second offered, (min, max)
#: handler seconds, and the keys (tenants, accounts) drawn from. Each group is offered about 90 %
#: of what its limit or rate lets through (a limit of L over handlers of mean m: L / m a
#: second), so its jobs queue up behind full slots most of the time, faults or not, and the
#: backlog a fault leaves is run off within seconds of the feed's end.
LIMITED_FEED: list[tuple[str, float, tuple[float, float], dict[str, Any]]] = [
    ("limited", 6.0, (0.1, 0.5), {}),  # limit 2 (4 for a while): 6.7 a second
    ("keyed", 15.0, (0.1, 0.5), {"tenant": 5}),  # limit 1 per tenant: 3.3 a second each
    ("rated", 4.5, (0.05, 0.2), {}),  # 5 a second
    ("pushed", 5.4, (0.1, 0.5), {"account": 2}),  # limit 2 and 3 a second per account
    ("effect", 8.0, (0.05, 0.25), {}),  # into the capped queue (limit 4, 3 per 0.2 s)
]
#: The handoff scenario's limited jobs: the capped queue's alone, at about 75 % of what its
#: limit of 4 lets through (0.15 s handlers), so its slots are handed off most of the time.
HANDOFF_FEED: list[tuple[str, float, tuple[float, float], dict[str, Any]]] = [
    ("acked", 20.0, (0.05, 0.25), {}),
]
#: Bursts of ``spread`` (limit 1 per tenant over many tenants, short handlers, priority 1): every
#: SPREAD_EVERY-th batch brings SPREAD_BATCHES batches' worth of them (200 at `make chaos`'s
#: rate, 75 at the test suite's), the tenants interleaved, so that the first jobs waiting (ahead
#: of the other limited tasks' backlogs, by their priority) are of groups with room and the
#: limited claims take them from the head of the queue (concepts/limits.md) rather than by the
#: walk over the groups. In runs of at least SPREAD_RATE jobs a second: the test suite's small
#: runs too since a worker cut off mid-transaction no longer holds its rows past its lease
#: (docs/guarantees.md "Cut off mid-transaction"; with the bursts the small `blackhole` run had
#: failed its recovery bound 2 times in about 40 before that, and none in 24 beside a CPU hog
#: after).
SPREAD_EVERY = 30
SPREAD_BATCHES = 5
SPREAD_TENANTS = 100
SPREAD_RATE = 150.0
#: The share of ``keyed`` jobs that go to the capped queue, under its limits as well.
KEYED_IN_CAPPED = 1 / 3
Conn = psycopg.Connection[tuple[Any, ...]]


@dataclass
class Config:
    """One run's size. ``rate`` jobs per second are enqueued for ``duration`` seconds."""

    seed: int = 1
    workers: int = 3
    concurrency: int = 8
    lease: float = 2.0
    rate: float = 150.0
    duration: float = 8.0
    job_seconds: float = 0.05  # mean handler time; uniform in [0, 2 * mean]
    faults: int = 3
    drain_timeout: float = 120.0
    #: Members of the ``control`` scenario's group (its callback must run once, after all).
    group_size: int = 2_000

    @property
    def heartbeat(self) -> float:
        return self.lease / 3

    @property
    def recovery_bound(self) -> float:
        """A lease runs out at most ``lease`` after the fault (its last extension came before
        it), and the next reaper round comes within one interval; plus ε = 2 s for a loaded
        machine (CI runs two scenarios, their workers and PostgreSQL on 2 cores)."""
        return self.lease + self.heartbeat + 2.0


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """``wait_until``, failing with TimeoutError: scenarios catch it as a finding."""
    try:
        return wait_until(predicate, timeout, interval=0.05, what=what)
    except AssertionError as exc:
        raise TimeoutError(str(exc)) from None


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    id: UUID | None = None
    env: dict[str, str] = field(default_factory=dict)
    dsn: str = ""
    #: Set when the harness (or a poison job) ended it on purpose.
    expected_exit: bool = False


class Run:
    """One scenario on one fresh database of ``cluster``."""

    def __init__(self, cluster: EmbeddedPostgres, config: Config, scenario: str, logdir: Path):
        self.cluster = cluster
        self.config = config
        self.scenario = scenario
        self.rng = random.Random(f"{config.seed}:{scenario}")
        self.logdir = logdir
        name = f"chaos_{scenario}_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(cluster.dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        self.dsn = conninfo.make_conninfo(cluster.dsn, dbname=name)
        self.db: Conn = psycopg.connect(self.dsn, autocommit=True)
        migrate(self.db, "public")
        history.install(self.db)
        self.db.execute(chaos_app.INSTALL)
        self.app = pgqueue.App(self.dsn)
        # The producer knows the limited tasks (their key functions give each job its group).
        chaos_app.declare_limited(self.app)
        chaos_app.declare_workflow(self.app)
        # As an operator would, before any worker starts.
        #: The handoff scenario: the capped queue with a limit alone and the only limited work.
        self.handoff = scenario == "handoff"
        self.capped = chaos_app.HANDOFF_CAPPED if self.handoff else chaos_app.CAPPED
        capped = self.capped
        self.app.limit_queue(chaos_app.CAPPED_QUEUE, limit=capped.limit, rate=capped.rate)
        #: The operator's changes of limits during the feed, for the checker.
        self.limit_changes: list[LimitChange] = []
        self.workers: list[Worker] = []
        self.faults: list[Fault] = []
        self.killed: set[UUID] = set()
        self.restarts = 0
        self.failures_explain = False
        #: Jobs a scenario cancelled on purpose (and their cancelled children): not lost.
        self.cancelled_on_purpose: set[int] = set()
        #: What a scenario keeps for its own checks.
        self.extras: dict[str, Any] = {}
        self._feeding = threading.Event()
        self._feeder: threading.Thread | None = None
        self.acknowledged = 0

    # --- workers --------------------------------------------------------------------------

    def start_worker(self, env: dict[str, str] | None = None, dsn: str | None = None) -> Worker:
        c = self.config
        environment = {
            **os.environ,
            "PGQUEUE_DSN": dsn or self.dsn,
            "PYTHONPATH": str(ROOT),
            "MALLOC_ARENA_MAX": "2",
            **(env or {}),
        }
        log = (self.logdir / f"worker-{len(self.workers)}.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "pgqueue.cli", "worker", "--app", APP,
             "--log-level", "WARNING", "--concurrency", str(c.concurrency),
             "--lease", str(c.lease), "--poll-interval", "0.5", "--grace-period", "2"],
            cwd=ROOT, env=environment, stdout=subprocess.DEVNULL, stderr=log,
        )  # fmt: skip
        log.close()
        worker = Worker(proc, env=env or {}, dsn=dsn or self.dsn)
        self.workers.append(worker)
        worker.id = wait_for(lambda: self._worker_id(proc.pid), 30, f"worker {proc.pid}")
        return worker

    def _worker_id(self, pid: int) -> UUID | None:
        # The row first: a worker registers before it claims, so one that registered and was then
        # taken down by a job it claimed at once (poison's os._exit) did start.
        row = self.db.execute("SELECT id FROM pgqueue_workers WHERE pid = %s", (pid,)).fetchone()
        if row:
            return row[0]  # type: ignore[no-any-return]
        if self.workers and self.workers[-1].proc.poll() is not None:
            raise RuntimeError(f"worker {pid} exited at start:\n{self.logs()}")
        return None

    def alive(self) -> list[Worker]:
        return [w for w in self.workers if w.proc.poll() is None]

    def holding(self) -> list[Worker]:
        """Live workers that hold at least one running job right now."""
        rows = self.db.execute(
            "SELECT DISTINCT worker_id FROM pgqueue_jobs WHERE status = 'running'"
        ).fetchall()
        busy = {r[0] for r in rows}
        return [w for w in self.alive() if w.id in busy]

    def now(self) -> datetime:
        row = self.db.execute("SELECT clock_timestamp()").fetchone()
        assert row is not None
        return row[0]  # type: ignore[no-any-return]

    def fault(self, kind: str, worker: Worker | None = None) -> None:
        self.faults.append(Fault(kind, self.now(), worker.id if worker else None))

    def kill(self, worker: Worker) -> None:
        self.fault("SIGKILL", worker)
        worker.expected_exit = True
        assert worker.id is not None
        self.killed.add(worker.id)
        worker.proc.kill()
        worker.proc.wait(10)

    def supervise(self) -> None:
        """Like systemd with Restart=always: a worker that died on its own (a poison job) is
        recorded as killed and replaced. Restarts are counted, to show they are no hot loop."""
        for worker in list(self.workers):
            if worker.proc.poll() is not None and not worker.expected_exit:
                worker.expected_exit = True
                if worker.id is not None:
                    self.killed.add(worker.id)
                self.faults.append(Fault("worker died", self.now(), worker.id))
                self.restarts += 1
                self.start_worker(worker.env, worker.dsn)

    # --- jobs -----------------------------------------------------------------------------

    def feed(self) -> None:
        """Enqueue at the configured rate, in a thread, until done or ``stop``. A batch whose
        COPY failed (the server restarting) is retried; ``acknowledged`` counts the jobs whose
        commit the client saw, which must all exist at the end. Every third batch is unique
        jobs over a few keys (most of them duplicates, refused while a job with the key is
        queued, retrying or running): the checker counts any two that held one key at once.
        Every batch also brings limited jobs (LIMITED_FEED), every SPREAD_EVERY-th a burst of
        ``spread``, and at the points of LIMIT_CHANGES the feeder changes ``limited``'s limit as
        an operator would."""
        rng = random.Random(self.rng.random())
        period = 0.1
        per_batch = max(1, round(self.config.rate * period))
        total = round(self.config.rate * self.config.duration)
        mean = self.config.job_seconds
        changes = list(chaos_app.HANDOFF_CHANGES if self.handoff else chaos_app.LIMIT_CHANGES)

        def loop() -> None:
            sent = 0
            next_at = time.monotonic()
            while sent < total and not self._feeding.is_set():
                while changes and sent >= changes[0][0] * total:
                    if self.handoff:
                        self.change_limit(("queue", chaos_app.CAPPED_QUEUE, ""), changes.pop(0)[1])
                    else:
                        self.change_limit(("task", "limited", ""), changes.pop(0)[1])
                n = min(per_batch, total - sent)
                batch: list[Any] = [("effect", {"seconds": round(rng.uniform(0, 2 * mean), 4)})] * n
                if (sent // per_batch) % 3 == 2:
                    keys = [f"k{rng.randrange(UNIQUE_KEYS)}" for _ in range(n)]
                    # Longer than the others, so that a key's job is often still running
                    # when the next batch brings the key again.
                    batch = [
                        {"task": "effect", "unique_key": key,
                         "args": {"seconds": round(rng.uniform(0.2, 0.6), 4), "key": key}}
                        for key in keys
                    ]  # fmt: skip
                limited = limited_batch(rng, period, HANDOFF_FEED if self.handoff else LIMITED_FEED)
                if (
                    not self.handoff
                    and self.config.rate >= SPREAD_RATE
                    and (sent // per_batch) % SPREAD_EVERY == SPREAD_EVERY // 2
                ):
                    limited += spread_burst(rng, SPREAD_BATCHES * per_batch)
                try:
                    written = self.app.enqueue_many(batch + limited, allow_unknown=True)
                except (psycopg.OperationalError, pgqueue.DatabaseUnavailableError):
                    time.sleep(0.2)
                    continue
                sent += n
                self.acknowledged += written
                next_at += period
                time.sleep(max(0.0, next_at - time.monotonic()))

        self._feeder = threading.Thread(target=loop, name="chaos-feeder", daemon=True)
        self._feeder.start()

    def change_limit(self, group: Group, limit: int) -> None:
        """An operator's `pgqueue tasks limit TASK N` or `pgqueue queues limit NAME N`, retried
        until it goes through (the server may be restarting: the change may then have committed
        or not, and is made again). The checker gets when: between the database clock before
        the first try and after the last, which is where its commit is."""
        kind, name, _ = group
        before: datetime | None = None
        while before is None:
            before = self._clock()
        while True:
            try:
                if kind == "queue":
                    self.app.limit_queue(name, limit=limit)
                else:
                    self.app.limit_task(name, limit=limit)
                break
            except (psycopg.OperationalError, pgqueue.DatabaseUnavailableError):
                time.sleep(0.2)
        after: datetime | None = None
        while after is None:
            after = self._clock()
        self.limit_changes.append(LimitChange(group, limit, before, after))

    def _clock(self) -> datetime | None:
        """The database clock, on a connection of its own (None while the server is down)."""
        try:
            with psycopg.connect(self.dsn, autocommit=True, connect_timeout=5) as conn:
                row = conn.execute("SELECT clock_timestamp()").fetchone()
        except psycopg.OperationalError:
            time.sleep(0.2)
            return None
        assert row is not None
        return row[0]  # type: ignore[no-any-return]

    def reconnect(self) -> None:
        """After a server restart: a fresh connection for the harness's own queries."""
        self.db.close()
        self.db = wait_for(self._connect, 60, "PostgreSQL to accept connections again")

    def _connect(self) -> Conn | None:
        try:
            return psycopg.connect(self.dsn, autocommit=True)
        except psycopg.OperationalError:
            return None

    def during_feed(self, step: Callable[[], None], times: int) -> None:
        """Call ``step`` ``times`` times, spread at random over the feeding period."""
        span = self.config.duration
        moments = sorted(self.rng.uniform(0.15 * span, 0.8 * span) for _ in range(times))
        start = time.monotonic()
        for moment in moments:
            while time.monotonic() - start < moment:
                self.supervise()
                time.sleep(0.05)
            step()

    def drain(self, ignore: list[int] | None = None) -> None:
        """Wait until everything enqueued is finished (succeeded or dead), but the jobs in
        ``ignore``."""
        if self._feeder is not None:
            self._feeder.join()

        def done() -> bool:
            self.supervise()
            row = self.db.execute(
                "SELECT count(*) FROM pgqueue_jobs WHERE status NOT IN ('succeeded', 'dead',"
                " 'cancelled') AND id <> ALL(%s)",
                (ignore or [],),
            ).fetchone()
            return row == (0,)

        wait_for(done, self.config.drain_timeout, "every job to finish")

    def stop(self) -> None:
        self._feeding.set()
        for worker in self.workers:
            if worker.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.proc.pid, signal.SIGCONT)
                    worker.proc.send_signal(signal.SIGTERM)
        for worker in self.workers:
            try:
                worker.proc.wait(30)
            except subprocess.TimeoutExpired:
                worker.proc.kill()
                worker.proc.wait()

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}"
            for p in sorted(self.logdir.glob("worker-*.log"))
        )

    def result(self) -> Result:
        result = check(
            self.db,
            scenario=self.scenario,
            seed=self.config.seed,
            faults=self.faults,
            killed=self.killed,
            recovery_bound=self.config.recovery_bound,
            lease=self.config.lease,
            failures_explain=self.failures_explain,
            cancelled_on_purpose=self.cancelled_on_purpose,
            limits=LimitPlan(
                tasks=chaos_app.LIMITED,
                queues={chaos_app.CAPPED_QUEUE: self.capped},
                changes=self.limit_changes,
                effect_tasks=chaos_app.EFFECT_TASKS,
                acked_tasks=["acked"],
            ),
        )
        if self.restarts:
            result.notes.append(f"{self.restarts} worker restarts")
        return result

    def close(self) -> None:
        self.stop()
        self.app.close()
        self.db.close()


def limited_batch(
    rng: random.Random,
    period: float,
    feed: list[tuple[str, float, tuple[float, float], dict[str, Any]]],
) -> list[Any]:
    """The limited jobs of one batch: for each line of ``feed`` (LIMITED_FEED, or
    HANDOFF_FEED), a Poisson number of jobs with the mean its rate gives over ``period``."""
    jobs: list[Any] = []
    for task, per_second, (low, high), keys in feed:
        for _ in range(_poisson(rng, per_second * period)):
            args: dict[str, Any] = {"seconds": round(rng.uniform(low, high), 4)}
            for name, count in keys.items():
                args[name] = f"{name[0]}{rng.randrange(count)}"
            job: dict[str, Any] = {"task": task, "args": args}
            capped = task in ("effect", "acked")
            if capped or (task == "keyed" and rng.random() < KEYED_IN_CAPPED):
                job["queue"] = chaos_app.CAPPED_QUEUE
            jobs.append(job)
    return jobs


def spread_burst(rng: random.Random, jobs: int) -> list[Any]:
    """``jobs`` jobs of ``spread``, the tenants in turn (see SPREAD_EVERY)."""
    return [
        {"task": "spread", "priority": 1,
         "args": {"seconds": round(rng.uniform(0.01, 0.05), 4),
                  "tenant": f"s{n % SPREAD_TENANTS}"}}
        for n in range(jobs)
    ]  # fmt: skip


def _poisson(rng: random.Random, mean: float) -> int:
    """Knuth's: fine for the small means here."""
    limit, n, product = math.exp(-mean), 0, rng.random()
    while product > limit:
        n += 1
        product *= rng.random()
    return n


@contextlib.contextmanager
def cluster() -> Iterator[EmbeddedPostgres]:
    with EmbeddedPostgres() as pg:
        yield pg
