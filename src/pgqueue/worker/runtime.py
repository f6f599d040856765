"""Wires the worker's services together and owns its life cycle: start, signals, shutdown.

Data flows one way: notifier wakes the fetcher, the fetcher claims into the buffer, slot tasks
take jobs from it and the executor runs each one, the completer writes; the heartbeat keeps every
held lease alive and the reaper recovers other workers' expired ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import psycopg

from .. import db, limits, producer, stats
from ..errors import ConfigurationError, InvalidJobError, PgQueueError
from ..jobs import MAX_DELAY_SECONDS
from ..logcontext import job_fields
from ..sql import Queries
from .completer import Completer
from .connections import DEFAULT_CONNECTIONS, WorkerPool, budget, too_many_connections
from .executor import Executor, Outcome
from .fetcher import Fetcher
from .health import HealthServer, Liveness
from .heartbeat import Heartbeat
from .notifier import Notifier
from .outage import PoolNoise
from .reaper import Reaper
from .scheduler import Scheduler
from .slots import JobRun, Slots
from .state import TRANSIENT, ClaimedJob, Held, Phase, WorkerState, key_of
from .statistics import StatsWriter
from .transactions import Transactions

if TYPE_CHECKING:
    from ..app import App

log = logging.getLogger("pgqueue.worker")

EVENT_LOOPS = ("auto", "uvloop", "asyncio")


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop for ``choice`` (see ``Worker``); None is asyncio's default."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ConfigurationError(
                "event_loop 'uvloop' needs the uvloop package: pip install uvloop"
            ) from None
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


_STATS_KIND = {"succeeded": "succeeded", "retrying": "retried", "dead": "dead"}
#: Job ids per NOTIFY of finished jobs (a payload stays well under PostgreSQL's 8,000 bytes).
ANNOUNCE_CHUNK = 400
#: Seconds a stopping worker gives its background rounds (wakes, announcements) to end before
#: it cancels them, and what it waits at most for cancelled tasks to end (see _end_tasks).
BACKGROUND_WAIT = 1.0
CANCEL_WAIT = 2.0
#: How long a stopping worker keeps trying to give back jobs whose rows someone else had locked
#: (release_leases skips those), and its first pause between tries (doubled each time). Such a
#: lock is usually another worker's claim, which locks a just-claimed row it then leaves alone
#: until its transaction ends, milliseconds later; a row still locked after this is left to
#: the reapers as an expired lease.
RELEASE_RETRY = 2.0
RELEASE_PAUSE = 0.01

#: The default prefetch's floor. The buffer is the last 50 ms of completions at most, so this
#: only matters for short jobs: with the concurrency as the only cap, no-op jobs drained at
#: concurrency 10 at a sixth of the rate at 250 or more, in claims too small to pay for
#: themselves; at 256 a worker still drained 12-30 % slower than at 1,024 (docs/performance.md,
#: "Concurrency-independent processing").
PREFETCH_DEFAULT = 1024


class Worker:
    """A worker process's runtime. Options:

    - ``queues``: queue names to serve (default: every queue);
    - ``concurrency``: jobs run at once (async handlers on the loop, sync ones in threads);
    - ``prefetch``: most jobs claimed ahead of a free slot (default: the concurrency, at least
      ``PREFETCH_DEFAULT``); the buffer only fills as far as recent completions show it will
      drain within ~50 ms, so slow jobs are not prefetched (see ``fetcher``), while fast ones
      are claimed in batches big enough that throughput does not depend on the concurrency;
    - ``lease``: seconds a claim is held without a heartbeat (default 30);
    - ``heartbeat_interval``: default ``lease / 3``, so two heartbeats can fail before a lease
      runs out;
    - ``poll_interval``: the fallback claim interval when no NOTIFY arrives (default 1 s);
    - ``listen``: use LISTEN/NOTIFY (default True; False leaves polling only);
    - ``grace_period``: seconds running jobs get to finish on SIGTERM (default 30);
    - ``reaper_interval``: how often expired leases are looked for (default the heartbeat
      interval); ``retention``: seconds succeeded/cancelled jobs are kept (default one day,
      None keeps them); ``dead_retention``: seconds dead jobs are kept (default None: until
      requeued or deleted);
    - ``archive``: move finished jobs past their retention to ``pgqueue_jobs_archive`` instead
      of deleting them (default False), where they stay ``archive_retention`` seconds (default
      None: until dropped by hand), in daily partitions dropped whole;
    - ``connections``: the most connections the worker holds for its own work (default 5: one
      each for claims, acks, heartbeats and maintenance, and one for LISTEN; at least 1, which then does
      everything and the worker polls). A fleet that would not fit the server's
      ``max_connections`` gets less per worker (see ``pgqueue.worker.connections`` and the
      "Fleet of workers" page);
    - ``tx_pool_size``: connections for handlers that take a ``connection`` (transactional
      completion), opened only when such a handler runs, closed when idle (default:
      ``concurrency``); a handler beyond it waits for one;
    - ``event_loop``: the loop ``run_sync`` starts: ``"auto"`` (uvloop when it is installed, as
      it is by default on Linux and macOS: the loop's cost is paid per job), ``"uvloop"`` or
      ``"asyncio"``. ``await worker.run()`` runs on whatever loop the caller has;
    - ``health_port``: serve liveness over HTTP on this port (``GET /healthz``: 200 while the
      heartbeat is recent, 503 once it stalled or the worker is stopping; see
      ``pgqueue.worker.health``), on ``health_host`` (default all interfaces, as a probe
      comes from outside a container); ``health_file``: a file touched on every heartbeat and
      removed at stop, for an exec probe.
    """

    def __init__(
        self,
        app: App,
        *,
        queues: list[str] | tuple[str, ...] | None = None,
        concurrency: int = 10,
        prefetch: int | None = None,
        lease: float = 30.0,
        heartbeat_interval: float | None = None,
        poll_interval: float = 1.0,
        listen: bool = True,
        grace_period: float = 30.0,
        reaper_interval: float | None = None,
        retention: float | None = 86400.0,
        dead_retention: float | None = None,
        archive: bool = False,
        archive_retention: float | None = None,
        install_signal_handlers: bool = True,
        flush_interval: float = 0.002,
        event_loop: str = "auto",
        health_port: int | None = None,
        health_host: str = "0.0.0.0",
        health_file: str | os.PathLike[str] | None = None,
        connections: int = DEFAULT_CONNECTIONS,
        tx_pool_size: int | None = None,
    ) -> None:
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ConfigurationError("concurrency must be a positive integer")
        prefetch = max(concurrency, PREFETCH_DEFAULT) if prefetch is None else prefetch
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ConfigurationError("prefetch must be a non-negative integer")
        if isinstance(connections, bool) or not isinstance(connections, int) or connections < 1:
            raise ConfigurationError("connections must be a positive integer")
        tx_pool_size = concurrency if tx_pool_size is None else tx_pool_size
        if isinstance(tx_pool_size, bool) or not isinstance(tx_pool_size, int) or tx_pool_size < 1:
            raise ConfigurationError("tx_pool_size must be a positive integer")

        def seconds(name: str, value: object, *, zero: bool = False) -> float:
            """A duration from 0 (or above it) up to MAX_DELAY_SECONDS: an infinite or huge
            one would overflow a timestamp in SQL or a timeout in Python."""
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigurationError(f"{name} must be a number of seconds")
            above_low = value >= 0 if zero else value > 0
            if not (above_low and value <= MAX_DELAY_SECONDS):  # NaN fails both
                low = "at least 0" if zero else "above 0"
                raise ConfigurationError(
                    f"{name} must be {low} and at most {MAX_DELAY_SECONDS:,.0f} seconds "
                    f"(100 years), got {value!r}"
                )
            return float(value)

        lease = seconds("lease", lease)
        heartbeat_interval = heartbeat_interval if heartbeat_interval is not None else lease / 3
        if not seconds("heartbeat_interval", heartbeat_interval) < lease:
            raise ConfigurationError(
                "heartbeat_interval must be positive and shorter than the lease"
            )
        seconds("poll_interval", poll_interval)
        seconds("grace_period", grace_period, zero=True)
        seconds("flush_interval", flush_interval, zero=True)
        if reaper_interval is not None:
            seconds("reaper_interval", reaper_interval)
        if retention is not None:
            seconds("retention", retention, zero=True)
        if dead_retention is not None:
            seconds("dead_retention", dead_retention, zero=True)
        if not isinstance(archive, bool):
            raise ConfigurationError("archive must be True or False")
        if archive_retention is not None:
            seconds("archive_retention", archive_retention)
            if not archive:
                raise ConfigurationError("archive_retention applies only with archive=True")
            if any(r is not None and r >= archive_retention for r in (retention, dead_retention)):
                raise ConfigurationError(
                    "archive_retention must be longer than retention and dead_retention "
                    "(jobs are archived once those end)"
                )
        if archive and retention is None and dead_retention is None:
            raise ConfigurationError(
                "archive=True moves jobs past retention or dead_retention: set one of them"
            )
        if health_port is not None and (
            isinstance(health_port, bool) or not isinstance(health_port, int)
            or not 0 <= health_port <= 65535
        ):  # fmt: skip
            raise ConfigurationError("health_port must be a port number (0 picks a free one)")
        if event_loop not in EVENT_LOOPS:
            raise ConfigurationError(f"event_loop must be one of {', '.join(EVENT_LOOPS)}")
        if queues is not None:
            if isinstance(queues, str):
                raise ConfigurationError("queues must be a list of queue names, not one string")
            try:
                queues = [
                    producer.check_name("queue", q, producer.MAX_QUEUE_LENGTH) for q in queues
                ]
            except InvalidJobError as exc:
                raise ConfigurationError(f"queues: {exc}") from None
            if not queues:
                raise ConfigurationError("queues must name at least one queue (or be None for all)")
        #: The app of the one cluster this worker serves (pgqueue.routing): its queues' own.
        self.app = app._serving(queues)
        self.queues = list(queues) if queues is not None else None
        self.lease = float(lease)
        self.heartbeat_interval = float(heartbeat_interval)
        self.poll_interval = float(poll_interval)
        self.listen = listen
        self.grace_period = float(grace_period)
        self.reaper_interval = float(reaper_interval or heartbeat_interval)
        self.retention = retention
        self.dead_retention = dead_retention
        self.archive = archive
        self.archive_retention = archive_retention
        self.install_signal_handlers = install_signal_handlers
        self.flush_interval = flush_interval
        self.id = uuid.uuid4()
        self.concurrency = concurrency
        self.prefetch = prefetch
        #: Live workers at the last count (the heartbeat's), this one included.
        self.fleet = 1
        self.connections = connections
        self.tx_pool_size = tx_pool_size
        self.event_loop = event_loop
        self.health_port = health_port
        self.health_host = health_host
        self.liveness = Liveness(self.heartbeat_interval, health_file)
        #: The liveness endpoint while the worker runs (``health.port``: the bound port).
        self.health: HealthServer | None = None
        self.state: WorkerState | None = None
        self.started = threading.Event()
        self.stopped = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signals = 0
        #: Why the worker stopped on its own, if it did (the process then exits non-zero).
        self.failure: str | None = None
        #: Background wake-ups of waiting workers (see ``wake``), kept until they finish.
        self._wakes: set[asyncio.Task[None]] = set()
        #: Called with each attempt's job and outcome once the database took the outcome (not
        #: for a refused, stale one): how pgqueue.testing.run_until_idle records what ran.
        self.on_outcome: Callable[[ClaimedJob, Outcome], None] | None = None

    # --- public ---------------------------------------------------------------------------

    def run_sync(self) -> None:
        with asyncio.Runner(loop_factory=loop_factory(self.event_loop)) as runner:
            runner.run(self.run())

    def stop(self) -> None:
        """Ask for a graceful stop; safe from any thread."""
        loop = self._loop
        if loop is not None and self.state is not None:
            loop.call_soon_threadsafe(self._begin_stop)

    async def run(self) -> None:
        dsn = self.app.dsn
        self._loop = asyncio.get_running_loop()
        self.state = state = WorkerState(concurrency=self.concurrency, prefetch=self.prefetch)
        self.slots = Slots(state, self._execute)
        q = self.app.q
        # The worker's id in every session's name: a reaper ends the sessions a worker whose
        # lease ran out left waiting inside a transaction (end_lapsed_sessions).
        name = f"pgqueue-worker:{os.getpid()}:{self.id.hex[:16]}"
        pool_noise = PoolNoise(state.outage, name)
        logging.getLogger("psycopg.pool").addFilter(pool_noise)
        try:
            await self._run(dsn, state, q, name)
        finally:
            logging.getLogger("psycopg.pool").removeFilter(pool_noise)

    async def _run(self, dsn: str, state: WorkerState, q: Queries, name: str) -> None:

        def connect_kwargs(role: str) -> dict[str, Any]:
            return {
                "autocommit": True,
                "application_name": f"{name}:{role}",
                **db.KEEPALIVES,
                **self.app.connect_options,
            }

        # Every connection of the worker's own work, under one budget (see connections.py).
        self.pool = pool = WorkerPool(dsn, connect_kwargs("pool"), size=self.connections)
        pool.listen_wanted = self.listen
        try:
            await self._check_database(pool)
        except BaseException:
            await pool.close()
            raise
        # Twice the slots: a sync handler abandoned at its timeout keeps its thread until it
        # returns, and the headroom keeps such threads from starving the next handlers
        # (threads are only started when needed).
        threads = ThreadPoolExecutor(2 * self.concurrency, thread_name_prefix="pgqueue-task")
        self.transactions = Transactions(
            dsn, q, self.tx_pool_size, connect_kwargs("handler"), lock_timeout=self.lease
        )
        self.executor = Executor(self.app, self.id, threads, self.transactions)

        async def results_of(job_id: int) -> list[Any]:
            async with pool.connection() as conn:
                cur = await conn.execute(self.app.q.parent_results, {"id": job_id})
                return [row[0] for row in await cur.fetchall()]

        self.executor.results_of = results_of
        self.completer = Completer(
            pool.lane("acks"),
            q,
            self._on_written,
            on_refused=self._on_refused,
            on_given_up=self._on_given_up,
            flush_interval=self.flush_interval,
            outage=state.outage,
        )
        self.completer.idle = lambda: state.running == 0 and not state.buffer

        def wakes(batch: list[Outcome]) -> list[str]:
            if not self.fetcher.limited:  # none held (any left over: _on_written wakes them)
                return []
            queues: set[str] = set()
            for outcome in batch:
                held = state.held.get(key_of(outcome.job_id, outcome.lease_token))
                if held is not None and held.job.limited:
                    queues.add(outcome.queue)
            return sorted(queues)

        self.completer.wakes = wakes

        def hand_off(batch: list[Outcome]) -> dict[str, Any] | None:
            # Acks of limited jobs of a limited queue, while this worker goes on claiming.
            limited = self.fetcher.limited_queues
            if not limited or state.stopping.is_set():
                return None
            ids: list[int] = []
            tokens: list[uuid.UUID] = []
            for outcome in batch:
                if outcome.queue in limited:
                    held = state.held.get(key_of(outcome.job_id, outcome.lease_token))
                    if held is not None and held.job.limited:
                        ids.append(outcome.job_id)
                        tokens.append(outcome.lease_token)
            return self.fetcher.hand_off_params(ids, tokens) if ids else None

        self.completer.hand_off = hand_off
        self.completer.on_handed_off = lambda rows, token: self.fetcher.handed_off(rows, token)
        self.fetcher = Fetcher(
            pool.lane("claims"),
            q,
            state,
            worker_id=self.id,
            queues=self.queues,
            tasks=self.app.tasks,
            poll_interval=self.poll_interval,
            declared={n: t.limits for n, t in self.app.tasks.items() if t.limits is not None},
            start=self._start,
            wake=self.wake,
            schema=self.app.schema,
            sweeps=pool.lane("maintenance"),
        )
        self.heartbeat = Heartbeat(
            pool.lane("heartbeat"),
            q,
            state,
            worker_id=self.id,
            queues=self.queues,
            lease=self.lease,
            interval=self.heartbeat_interval,
            on_lost=self._on_lost,
            on_cancel=self._on_cancel,
            on_beat=self.liveness.beat,
            on_fleet=self._on_fleet,
        )
        self.reaper = Reaper(
            pool.lane("maintenance"),
            q,
            state,
            backoff=self.app.backoff,
            interval=self.reaper_interval,
            lease=self.lease,
            retention=self.retention,
            dead_retention=self.dead_retention,
            archive=self.archive,
            archive_retention=self.archive_retention,
            wake=self._wake_reaped,
            fleet=self._fleet_size,
            worker_id=self.id,
        )
        self.notifier = Notifier(
            dsn,
            q,
            db.channel_for(self.app.schema),
            frozenset(self.queues) if self.queues is not None else None,
            self.fetcher.notify,
            connect_kwargs("listen"),
            poll_interval=self.poll_interval,
            on_cancel=self._on_cancel_notice,
            outage=state.outage,
            budget=pool,
        )
        if self.listen:
            self.fetcher.on_waiting = self.notifier.set_waiting
        self.completer.own_pid = self.notifier.own_pids.add
        self.scheduler = Scheduler(
            self.app, interval=min(self.poll_interval, 1.0), outage=state.outage
        )
        self.recorder = stats.StatsRecorder(self.app.schema, self.id)
        stats_writer = StatsWriter(
            pool.lane("maintenance"),
            self.recorder,
            self.app.schema,
            outage=state.outage,
            fleet=self._fleet_size,
        )
        services_stop = asyncio.Event()
        heartbeat_stop = asyncio.Event()
        # Signals first: once registered the worker counts as started, and a SIGTERM from then on
        # must stop it gracefully (exit 0), not kill it with the default action.
        self._install_signals()
        try:
            if self.health_port is not None:
                self.health = HealthServer(self.liveness, self.health_host, self.health_port)
                self.health.start()
            await self._register(pool)
        except BaseException:
            await self._close_health()
            self._remove_signals()
            await self.heartbeat.close()
            await pool.close()
            threads.shutdown(wait=False)
            raise
        # The heartbeat runs until the worker has given back what it holds and deregistered:
        # its lease must not lapse while the last results are written.
        heartbeat = asyncio.create_task(self.heartbeat.run(heartbeat_stop), name="heartbeat")
        services = [
            asyncio.create_task(self.reaper.run(services_stop), name="reaper"),
            asyncio.create_task(self.completer.run(services_stop), name="completer"),
            asyncio.create_task(
                self.scheduler.run(pool.lane("maintenance"), services_stop, self._fleet_size),
                name="scheduler",
            ),
            asyncio.create_task(stats_writer.run(services_stop), name="stats"),
        ]
        if self.listen:
            services.append(asyncio.create_task(self.notifier.run(services_stop), name="notifier"))
        for service in [heartbeat, *services]:
            service.add_done_callback(self._service_ended)
        fetcher = asyncio.create_task(self.fetcher.run(state.stopping), name="fetcher")
        log.info(
            "worker %s started: queues=%s concurrency=%d lease=%gs",
            self.id,
            ",".join(self.queues) if self.queues else "*",
            self.concurrency,
            self.lease,
        )
        self.started.set()
        try:
            await state.stopping.wait()
            await fetcher
            await self._drain_handlers()
            self.completer.stop()
            services_stop.set()
            await asyncio.gather(*services, return_exceptions=True)
            unwritten = await self.completer.drain(timeout=10)
            if unwritten:
                self._unwritten(unwritten)
            await stats_writer.final_flush()
            await self._release_unfinished(pool)
            # The heartbeat would re-create the row that deregistering deletes.
            heartbeat_stop.set()
            await asyncio.gather(heartbeat, return_exceptions=True)
            await self._deregister(pool)
        finally:
            await self._end_tasks([fetcher, heartbeat, *services, *self.slots.tasks])
            await self.heartbeat.close()
            await self.transactions.close()
            await pool.close()
            threads.shutdown(wait=False, cancel_futures=True)
            await self._close_health()
            self._remove_signals()
            self.stopped.set()
            log.info("worker %s stopped", self.id)
        if self.failure is not None:
            raise PgQueueError(f"worker stopped: {self.failure}")

    async def _end_tasks(self, tasks: list[asyncio.Task[Any]]) -> None:
        """Before the pool closes: what still runs is cancelled (none does after a clean stop),
        background rounds (wakes, announcements) first get ``BACKGROUND_WAIT`` to finish, and
        everything cancelled is waited for (at most ``CANCEL_WAIT``), so that no task of the
        worker outlives ``run()``. A task left cancelling used a connection of a closed pool,
        and whoever closed the event loop cancelled it again in the middle of psycopg's own
        cancellation of its query ("query cancellation interrupted")."""
        running = [task for task in tasks if not task.done()]
        for task in running:
            task.cancel()
        if self._wakes:
            await asyncio.wait(set(self._wakes), timeout=BACKGROUND_WAIT)
        background = [task for task in self._wakes if not task.done()]
        for task in background:
            task.cancel()
        if running or background:
            await asyncio.wait({*running, *background}, timeout=CANCEL_WAIT)

    # --- life cycle -----------------------------------------------------------------------

    async def _check_database(self, pool: WorkerPool) -> None:
        """Fail at once when the tables are missing; wait, with one line said, while the server
        has no connection slot left (53300): a worker of a full fleet starts once one frees."""
        delay, said = 0.5, False
        while True:
            try:
                async with pool.connection() as conn:
                    await conn.execute(
                        self.app.q.status_counts.replace(b"GROUP BY", b"WHERE false GROUP BY")
                    )
                    break
            except psycopg.errors.UndefinedTable:
                raise ConfigurationError(
                    f"pgqueue's tables are missing in schema {self.app.schema!r}: run "
                    "`pgqueue migrate` (or app.migrate()) first"
                ) from None
            except psycopg.OperationalError as exc:
                if not too_many_connections(exc):
                    raise db.unavailable(self.app.dsn, exc) from None
                if not said:
                    said = True
                    log.warning(
                        "PostgreSQL has no connection slot left (too many connections, 53300): "
                        "waiting for one before starting"
                    )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        if said:
            log.info("got a connection slot: starting")

    async def _register(self, pool: WorkerPool) -> None:
        # Limits first: once a worker shows as registered, its tasks' limits are in force (a
        # job enqueued by name from then on gets its group from the database).
        await self._declare_limits(pool)
        sent_at = time.monotonic()
        async with pool.connection() as conn:
            await conn.execute(
                self.app.q.register_worker,
                {
                    "worker_id": self.id,
                    "host": socket.gethostname(),
                    "pid": os.getpid(),
                    "queues": self.queues,
                    "concurrency": self.concurrency,
                    "lease": self.lease,
                    "tasks": sorted(self.app.tasks),
                },
            )
            await self.heartbeat.look_at_fleet(conn)
        self.heartbeat.extended(sent_at)

    async def _declare_limits(self, pool: WorkerPool) -> None:
        """Write the limits this app's tasks declare, and give the waiting jobs of a task
        limited for the first time their group (they were enqueued before the limit)."""
        declared = self.fetcher.declared
        if not declared:
            return
        async with pool.connection() as conn:
            names = await limits.declare(conn, self.app.q, declared)
            if not names:
                return
            horizon = await limits.snapshot_horizon(conn, self.app.q)
            for name in names:
                stamped, _ = await limits.stamp_waiting(conn, self.app.q, name, declared.get(name))
                if stamped:
                    log.info("task %r: %d waiting jobs now count against its limit", name, stamped)
        # A job enqueued by a statement that read pgqueue_tasks before the declaration committed
        # has no group, and if its transaction commits after the pass above, nothing gave it one:
        # it would run unlimited. Once every transaction open at the declaration has ended (the
        # snapshot horizon), a second pass finds such jobs.
        task = asyncio.get_running_loop().create_task(
            self._stamp_after(pool, horizon, {n: declared.get(n) for n in names}), name="restamp"
        )
        self._wakes.add(task)
        task.add_done_callback(self._wakes.discard)

    async def _stamp_after(
        self,
        pool: WorkerPool,
        horizon: str,
        tasks: dict[str, limits.TaskLimits | None],
    ) -> None:
        """The second pass, once the horizon has passed. Jobs it finds locked (see
        stamp_limit_keys) are tried again for up to STAMP_RETRY: their lock may have been
        taken after the horizon, so no later pass would look for them."""
        delay = 0.05
        skipped: dict[str, limits.Groups] = {}
        try:
            while True:
                async with pool.connection() as conn:
                    if await limits.horizon_passed(conn, self.app.q, horizon):
                        for name, declared in tasks.items():
                            stamped, skipped[name] = await limits.stamp_waiting(
                                conn, self.app.q, name, declared
                            )
                            if stamped:
                                log.info(
                                    "task %r: %d jobs enqueued during its declaration now count"
                                    " against its limit", name, stamped,
                                )  # fmt: skip
                        break
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.poll_interval)
            deadline = time.monotonic() + limits.STAMP_RETRY
            await limits.stamp_skipped(pool.connection, self.app.q, skipped, deadline)
        except Exception as exc:  # a lost connection: claims give such jobs their group
            log.warning(
                "could not give late jobs their limit group (a claim by a worker that declares "
                "the limit will): %s",
                exc,
            )

    async def _deregister(self, pool: WorkerPool) -> None:
        try:
            async with pool.connection() as conn:
                await conn.execute(self.app.q.deregister_worker, {"worker_id": self.id})
        except (psycopg.Error, OSError) as exc:
            log.warning("could not deregister (%s); the row will be pruned", exc)

    def _on_fleet(self, workers: int, max_connections: int, reserved: int, in_use: int) -> None:
        """The heartbeat counted the live workers: the connection budget follows the fleet,
        and so do the intervals of the fleet-wide chores (see ``spread``)."""
        self.fleet = max(workers, 1)
        self.pool.set_cap(budget(max_connections, reserved, self.fleet, in_use, self.pool.held))

    def _fleet_size(self) -> int:
        return self.fleet

    async def _close_health(self) -> None:
        self.liveness.stop()
        if self.health is not None:
            await asyncio.to_thread(self.health.close)  # waits for its loop's next poll

    def _begin_stop(self) -> None:
        assert self.state is not None
        self.liveness.stopping = True
        if not self.state.stopping.is_set():
            log.info("stopping: no new claims; running jobs get %gs to finish", self.grace_period)
            self.state.stopping.set()
            self.state.wakeup.set()

    def _service_ended(self, task: asyncio.Task[Any]) -> None:
        """Services retry every failed round and end only when told to. One that ended anyway
        leaves the worker unable to do its part (without heartbeats its leases would lapse
        while its handlers run on), so the worker stops and exits non-zero for its
        supervisor to restart it."""
        assert self.state is not None
        if task.cancelled() or self.state.stopping.is_set():
            return
        self.failure = f"its {task.get_name()} service ended unexpectedly: {task.exception()!r}"
        log.critical("%s; stopping", self.failure)
        self._begin_stop()

    def _install_signals(self) -> None:
        if (
            not self.install_signal_handlers
            or threading.current_thread() is not threading.main_thread()
        ):
            return
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal)

    def _remove_signals(self) -> None:
        if (
            not self.install_signal_handlers
            or threading.current_thread() is not threading.main_thread()
        ):
            return
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)

    def _on_signal(self) -> None:
        self._signals += 1
        if self._signals > 1:
            log.warning("second signal: exiting now; unfinished leases will expire and be reaped")
            os._exit(1)
        self._begin_stop()

    async def _drain_handlers(self) -> None:
        assert self.state is not None
        if await self.slots.wait(self.grace_period):
            return
        running = [h.handler for h in self.state.held.values() if h.handler is not None]
        log.warning("cancelling %d jobs still running after the grace period", len(running))
        for run in running:
            run.cancel()
        await self.slots.wait(5)

    def _unwritten(self, outcomes: list[Outcome]) -> None:
        """Results the database never took by the end of the shutdown: not silent."""
        ids = ", ".join(str(o.job_id) for o in outcomes[:20])
        more = f" and {len(outcomes) - 20} more" if len(outcomes) > 20 else ""
        self.failure = f"{len(outcomes)} results could not be written ({ids}{more})"
        log.error(
            "%s; those jobs run again once their lease has run out", self.failure.capitalize()
        )

    async def _release_unfinished(self, pool: WorkerPool) -> None:
        """Give back the jobs this worker will not finish. Rows someone else locks right now
        are skipped by release_leases (it never waits on a row lock), so those still ours are
        tried again for up to RELEASE_RETRY: deregistered with a job still running under its
        lease, the worker would leave it to a reaper, its attempt counted."""
        assert self.state is not None
        unfinished = sorted(
            (h for h in self.state.held.values() if h.phase in (Phase.RUNNING, Phase.PREFETCHED)),
            key=lambda h: h.job.id,
        )
        if not unfinished:
            return
        left = [(h.job.id, h.job.lease_token) for h in unfinished]
        deadline = time.monotonic() + RELEASE_RETRY
        pause = RELEASE_PAUSE
        try:
            async with pool.connection() as conn:
                while left:
                    ids, tokens = [i for i, _ in left], [t for _, t in left]
                    cur = await conn.execute(
                        self.app.q.release_leases, {"ids": ids, "tokens": tokens}
                    )
                    released = await cur.fetchall()
                    if released:
                        await self._wake_now(conn, [str(row[1]) for row in released])
                        self.state.counters.released += len(released)
                        log.info("released %d unfinished jobs for other workers", len(released))
                    gone = {int(row[0]) for row in released}
                    left = [(i, t) for i, t in left if i not in gone]
                    if not left:
                        break
                    # Those still ours and running were locked by someone else: again shortly.
                    cur = await conn.execute(
                        self.app.q.applied_completions,
                        {"ids": [i for i, _ in left], "tokens": [t for _, t in left]},
                    )
                    ours = {int(row[0]) for row in await cur.fetchall() if row[1]}
                    left = [(i, t) for i, t in left if i in ours]
                    if not left or time.monotonic() + pause > deadline:
                        break
                    await asyncio.sleep(pause)
                    pause *= 2
            if left:
                log.warning(
                    "could not release %d jobs locked by someone else; they will expire", len(left)
                )
        except TRANSIENT as exc:
            log.warning("could not release %d leases (%s); they will expire", len(left), exc)

    # --- waking other workers -------------------------------------------------------------

    def wake(self, queues: list[str]) -> None:
        """Jobs in ``queues`` became ready, or will soon, through an UPDATE of ours (a retry, a
        hand-back, a reap): tell waiting workers (``wake_waiting_workers``), off the caller's
        path. A failure costs only latency: the poll finds the jobs."""
        if not queues:
            return
        task = asyncio.get_running_loop().create_task(self._wake(queues), name="wake")
        self._wakes.add(task)
        task.add_done_callback(self._wakes.discard)

    def _background(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._wakes.add(task)
        task.add_done_callback(self._wakes.discard)

    async def _announce(self, job_ids: list[int]) -> None:
        """Tell waiters for results (App.wait) that these jobs finished; they also look on
        their own every few seconds, so a failure here costs them latency only."""
        try:
            async with self.pool.connection() as conn:
                for start in range(0, len(job_ids), ANNOUNCE_CHUNK):
                    ids = ",".join(map(str, job_ids[start : start + ANNOUNCE_CHUNK]))
                    await conn.execute(self.app.q.notify_finished, {"ids": ids})
        except Exception as exc:
            log.debug("could not announce finished jobs (%s); waiters will look", exc)

    def _wake_reaped(self, queues: list[str]) -> None:
        """Reaped jobs are work for this worker too: its own notification is ignored (see the
        notifier's own_pids), so it is told here."""
        self.fetcher.notify()
        self.wake(queues)

    async def _wake(self, queues: list[str]) -> None:
        try:
            async with self.pool.connection() as conn:
                await self._wake_now(conn, queues)
        except Exception as exc:
            log.debug("could not wake waiting workers (%s); the poll will find the jobs", exc)

    async def _wake_now(self, conn: psycopg.AsyncConnection[Any], queues: list[str]) -> None:
        self.notifier.own_pids.add(conn.info.backend_pid)
        await conn.execute(self.app.q.wake_waiting_workers, {"queues": sorted(set(queues))})

    # --- per job --------------------------------------------------------------------------

    def _start(self, job: ClaimedJob) -> None:
        assert self.state is not None
        state = self.state
        state.counters.claimed += 1
        held = Held(job)
        state.held[job.key] = held
        if state.stopping.is_set():
            return  # claimed as we stopped: released with the other unfinished jobs
        state.buffer.append(held)
        self.slots.buffered()

    def _lease_deadline(self) -> float:
        assert self.state is not None
        return self.state.lease_deadline

    async def _execute(self, held: Held) -> None:
        """Run one job on the calling slot (see ``slots``) and hand its outcome on."""
        assert self.state is not None
        state = self.state
        held.phase = Phase.RUNNING
        state.running += 1
        held.started = time.monotonic()
        held.handler = run = JobRun(
            self.executor.run(held.job, held.started, self._lease_deadline, held.acking),
            self.slots,
        )
        try:
            outcome: Outcome = await run
        except asyncio.CancelledError as exc:
            slot = asyncio.current_task()
            if held.job.cancel_asked and not held.lost and not state.stopping.is_set():
                # Someone asked to cancel the job (App.cancel): the attempt ends 'cancelled'.
                outcome = self.executor.cancelled(held.job, held.started)
            elif run.cancel_requested or (slot is not None and slot.cancelling()):
                # The worker's own cancellation: a lost lease, or the end of the grace period
                # (then the job is handed back at shutdown).
                if held.lost:
                    state.held.pop(held.job.key, None)
                return
            else:
                # The handler's own: it awaited something that someone else cancelled.
                outcome = self.executor.failure(held.job, held.started, exc)
        finally:
            held.handler = None
            state.running -= 1
            state.finished += 1
            state.wakeup.set()
        if outcome.written is not None:  # the handler's transaction wrote it already
            self._on_written([outcome], {outcome.job_id} if outcome.written else set())
            return
        held.phase = Phase.ACKING
        self.completer.submit(outcome)

    def _on_cancel(self, held: Held) -> None:
        """Someone asked to cancel a job this worker holds (its heartbeat or a NOTIFY said so):
        stop its handler (a sync one is abandoned: Python cannot interrupt a thread) and write
        'cancelled', fenced like any ack. A job still in the buffer is cancelled unstarted."""
        assert self.state is not None
        job = held.job
        if job.cancel_asked or held.phase not in (Phase.PREFETCHED, Phase.RUNNING):
            return
        job.cancel_asked = True
        log.info("job %d: cancel requested; stopping it", job.id, extra=job_fields(job))
        if held.phase is Phase.PREFETCHED:
            with contextlib.suppress(ValueError):
                self.state.buffer.remove(held)
                held.phase = Phase.ACKING
                self.completer.submit(self.executor.cancelled(job, time.monotonic()))
        elif held.handler is not None:
            held.handler.cancel()

    def _on_cancel_notice(self, payload: str) -> None:
        """A NOTIFY asked to cancel job ``payload`` (an id): if this worker holds it."""
        assert self.state is not None
        try:
            job_id = int(payload)
        except ValueError:
            return
        for held in list(self.state.held.values()):
            if held.job.id == job_id:
                self._on_cancel(held)

    def _on_lost(self, held: Held) -> None:
        assert self.state is not None
        if not held.lost:
            held.lost = True
            self._count_stale()
            self.recorder.record(held.job.queue, "lost", None, None)
        held.phase = Phase.ABANDONED
        if held.handler is not None:
            held.handler.cancel()
        else:
            self.state.held.pop(held.job.key, None)

    def _count_stale(self) -> None:
        assert self.state is not None
        self.state.counters.stale_writes += 1
        self.state.counters.stale_unreported += 1

    def _on_refused(self, outcome: Outcome, reason: str) -> Outcome | None:
        """The database refused to store ``outcome``: the plain failed attempt to write instead
        (None: the attempt is no longer ours to write)."""
        assert self.state is not None
        held = self.state.held.get(key_of(outcome.job_id, outcome.lease_token))
        if held is None:
            return None
        self.state.counters.unstorable += 1
        return self.executor.unstorable(held.job, outcome, reason)

    def _on_given_up(self, outcome: Outcome, reason: str) -> None:
        """Not even a plain failure could be written: end the attempt's lease, so that the
        reaper records it (the heartbeat would find it untracked and do the same, later)."""
        assert self.state is not None
        held = self.state.held.pop(key_of(outcome.job_id, outcome.lease_token), None)
        if held is not None:
            held.phase = Phase.ABANDONED
        self.state.counters.given_up += 1
        task = asyncio.get_running_loop().create_task(self._expire([outcome]), name="give-up")
        self._wakes.add(task)
        task.add_done_callback(self._wakes.discard)

    async def _expire(self, outcomes: list[Outcome]) -> None:
        try:
            async with self.pool.connection() as conn:
                await conn.execute(
                    self.app.q.expire_leases,
                    {
                        "ids": [o.job_id for o in outcomes],
                        "tokens": [o.lease_token for o in outcomes],
                    },
                )
        except Exception as exc:
            log.warning("could not expire given-up leases (%s); the heartbeat will retry", exc)

    def _on_written(self, batch: list[Outcome], accepted: set[int]) -> None:
        assert self.state is not None
        counters = self.state.counters
        retried: list[str] = []
        freed: list[str] = []
        final: list[int] = []
        # Written by the handler's own transaction: announced whether or not anyone waits
        # (notify_finished checks); else only when the completer's write said someone does.
        announce = self.completer.awaited or any(o.written is not None for o in batch)
        for outcome in batch:
            held = self.state.held.pop(key_of(outcome.job_id, outcome.lease_token), None)
            if held is not None and held.job.limited and outcome.job_id in accepted:
                freed.append(outcome.queue)  # a slot of its group: others may wait for it
            if outcome.job_id not in accepted:
                log.warning(
                    "job %d: result refused, the lease was no longer ours (fenced stale write)",
                    outcome.job_id,
                    extra=None if held is None else job_fields(held.job),
                )
                if held is None or not held.lost:
                    # Once per attempt: a heartbeat that already found this lease gone counted
                    # it (an ack can still be on its way when that happens).
                    self._count_stale()
                    self.recorder.record(outcome.queue, "lost", None, None)
                continue
            if self.on_outcome is not None and held is not None:
                self.on_outcome(held.job, outcome)
            kind = _STATS_KIND.get(outcome.status.value)
            if kind is not None:  # a cancelled attempt is none of the dashboard's outcomes
                self.recorder.record(
                    outcome.queue, kind, outcome.pickup_seconds, outcome.run_seconds
                )
            if announce and outcome.status.value != "retrying":
                final.append(outcome.job_id)
            if outcome.status.value == "succeeded":
                counters.succeeded += 1
            elif outcome.status.value == "retrying":
                counters.retried += 1
                retried.append(outcome.queue)
                self.fetcher.ready_in(outcome.delay or 0.0)
            elif outcome.status.value == "cancelled":
                counters.cancelled += 1
            else:
                counters.dead += 1
        # Written results free lease budget: the fetcher may claim again.
        self.state.wakeup.set()
        handed = self.completer.handed.copy()
        if handed:  # slots the acks' own transaction gave the queue's next jobs
            left = []
            for queue in freed:
                if handed[queue] > 0:
                    handed[queue] -= 1
                else:
                    left.append(queue)
            freed = left
        if freed:
            self.fetcher.slot_freed()
        woke = self.completer.woke
        self.wake(retried + [queue for queue in freed if queue not in woke])
        if final:
            self._background(self._announce(final), "announce")
