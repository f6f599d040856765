"""App: the task registry, configuration, and the entry points for producers and workers."""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import threading
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar, overload

import psycopg

from . import coalesce as coalescing
from . import (
    connections,
    db,
    hooks,
    limits,
    operations,
    pools,
    producer,
    queues,
    results,
    routing,
    schedules,
    wire,
    workflows,
)  # fmt: skip
from . import unique as uniqueness
from .backoff import Backoff
from .errors import ConfigurationError, InvalidJobError, JobNotFoundError, UnknownTaskError
from .jobs import Attempt, CancelResult, Enqueued, Job
from .limits import LimitKey, RateSpec, TaskLimits
from .migrate import migrate as apply_migrations
from .schedules import DEFAULT_MAX_CATCHUP, Schedule, declare
from .sql import Queries, queries
from .tasks import Task, TaskOptions
from .unique import OnConflict, UniqueBy, UniqueWhile

if TYPE_CHECKING:
    from .worker.runtime import Worker

P = ParamSpec("P")
R = TypeVar("R")

JobSpec = Mapping[str, Any] | tuple[str, Mapping[str, Any]]


def _published(
    operation: str,
) -> Callable[[Callable[Concatenate[App, P], R]], Callable[Concatenate[App, P], R]]:
    """Runs the method inside the app's around-enqueue hooks, if it has any (pgqueue.hooks)."""

    def decorate(method: Callable[Concatenate[App, P], R]) -> Callable[Concatenate[App, P], R]:
        @functools.wraps(method)
        def call(self: App, /, *args: P.args, **kwargs: P.kwargs) -> R:
            if not self.around_enqueue_hooks:
                return method(self, *args, **kwargs)
            with hooks.publishing(self.around_enqueue_hooks, operation) as publish:
                result = method(self, *args, **kwargs)
                publish.finish(result)
                return result

        return call

    return decorate


def _published_async(
    operation: str,
) -> Callable[
    [Callable[Concatenate[App, P], Coroutine[Any, Any, R]]],
    Callable[Concatenate[App, P], Coroutine[Any, Any, R]],
]:
    """``_published`` for async methods."""

    def decorate(
        method: Callable[Concatenate[App, P], Coroutine[Any, Any, R]],
    ) -> Callable[Concatenate[App, P], Coroutine[Any, Any, R]]:
        @functools.wraps(method)
        async def call(self: App, /, *args: P.args, **kwargs: P.kwargs) -> R:
            if not self.around_enqueue_hooks:
                return await method(self, *args, **kwargs)
            with hooks.publishing(self.around_enqueue_hooks, operation) as publish:
                result = await method(self, *args, **kwargs)
                publish.finish(result)
                return result

        return call

    return decorate


class App:
    """One pgqueue application: tasks, a database and a schema.

    The DSN is the argument, else ``$PGQUEUE_DSN``, else ``$DATABASE_URL``; it is resolved on
    first use, so an ``App()`` can be declared at import time and configured later.
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        name: str = schedules.DEFAULT_APP_NAME,
        schema: str = "public",
        default_queue: str = "default",
        max_payload_bytes: int = producer.DEFAULT_MAX_PAYLOAD,
        backoff: Backoff | None = None,
        prepared_statements: bool | None = None,
        middleware: Iterable[hooks.Middleware] = (),
        coalesce: bool = False,
        coalesce_window: float = coalescing.DEFAULT_WINDOW,
        coalesce_max: int = coalescing.DEFAULT_MAX,
        reconnect_timeout: float = pools.RETRY_FOR,
        pool_size: int = pools.MAX_SIZE,
        routes: Mapping[str, str] | None = None,
    ) -> None:
        """``reconnect_timeout``: seconds a producer call (enqueue, cancel, ...) keeps retrying,
        with backoff, while PostgreSQL cannot take it and nothing of it was written: the server
        down or restarting, a standby being promoted (docs/failover.md); then it raises
        ``DatabaseUnavailableError``. 0 raises at once.

        ``coalesce``: ``enqueue`` and ``enqueue_async`` calls made at the same time outside a
        caller's transaction share one INSERT and one commit, for more jobs/s under load; a
        call waits for the batch being written (``coalesce_window`` seconds at most before
        another starts) and a batch holds ``coalesce_max`` jobs at most. Off by default; see
        docs/concepts/coalescing.md for what it changes. ``pool_size``: producer connections at
        most for sync callers, and for each event loop's async callers (a worker's handlers
        that enqueue use these: see docs/fleet.md).

        ``routes``: ``{queue: dsn}``, queues that live on other PostgreSQL clusters (each a
        complete pgqueue); every other queue is on ``dsn``. Enqueues go to their queue's
        cluster, workers serve one cluster each (that of their ``queues``); see
        pgqueue.routing and docs/operating-at-scale.md for what spans clusters and what not."""
        self._dsn = dsn
        self._routes = routing.check_routes(routes)
        #: The app whose routes this member serves (None: the app itself); see ``cluster``.
        self._root: App | None = None
        self._members: dict[str, App] = {}
        self._coalesce_options = (coalesce, coalesce_window, coalesce_max)
        #: Wraps every attempt, outermost first (``@app.middleware``; see pgqueue.hooks).
        self.middleware_stack: list[hooks.Middleware] = [
            hooks.check_middleware(m) for m in middleware
        ]
        #: Sees every job before it is written (``@app.on_enqueue``).
        self.enqueue_hooks: list[hooks.EnqueueHook] = []
        #: Wrap every call that writes jobs (``app.around_enqueue``).
        self.around_enqueue_hooks: list[hooks.AroundEnqueue] = []
        #: False for PgBouncer's transaction pooling before 1.21 (see the PgBouncer guide): psycopg
        #: then never prepares statements server-side on pgqueue's connections. Default: on,
        #: unless ``$PGQUEUE_PREPARED_STATEMENTS`` is off, so CLI commands can turn it off too.
        if prepared_statements is None:
            setting = os.environ.get("PGQUEUE_PREPARED_STATEMENTS")
            prepared_statements = db.parse_flag("PGQUEUE_PREPARED_STATEMENTS", setting, True)
        self.prepared_statements = prepared_statements
        #: Owns the schedules this app declares; see docs/concepts/schedules.md.
        self.name = schedules.check_app_name(name)
        self.schema = db.validate_schema(schema)
        self.default_queue = _declared(
            producer.check_name, "queue", default_queue, producer.MAX_QUEUE_LENGTH
        )
        if max_payload_bytes <= 0:
            raise ConfigurationError("max_payload_bytes must be positive")
        self.max_payload_bytes = max_payload_bytes
        self.backoff = backoff or Backoff()
        if (
            isinstance(reconnect_timeout, bool)
            or not isinstance(reconnect_timeout, int | float)
            or not 0 <= reconnect_timeout <= 86400
        ):
            raise ConfigurationError(
                f"reconnect_timeout must be seconds from 0 to 86400, got {reconnect_timeout!r}"
            )
        self.reconnect_timeout = float(reconnect_timeout)
        self.tasks: dict[str, Task[Any, Any]] = {}
        self.q: Queries = queries(self.schema)
        self._pool: pools.Pool | None = None
        self._pool_lock = threading.Lock()
        if isinstance(pool_size, bool) or not isinstance(pool_size, int) or pool_size < 1:
            raise ConfigurationError("pool_size must be a positive integer")
        self.pool_size = pool_size
        self._loop_pools = pools.LoopPools(self._connection_settings, pool_size)
        settings = coalescing.Settings.of(coalesce_window, coalesce_max)
        if not isinstance(coalesce, bool):
            raise ConfigurationError(f"coalesce must be True or False, got {coalesce!r}")
        #: The coalescing producer, with ``coalesce=True`` (pgqueue.coalesce).
        self._coalescer = (
            coalescing.Coalescer(settings, self.q, self._sync_pool, self._async_pool)
            if coalesce
            else None
        )
        self.periodic_schedules: dict[str, Schedule] = {}
        self.retired_schedules: set[str] = set()

    # --- configuration --------------------------------------------------------------------

    @property
    def dsn(self) -> str:
        return db.resolve_dsn(self._dsn)

    @dsn.setter
    def dsn(self, value: str) -> None:
        if self._pool is not None or self._loop_pools:
            raise ConfigurationError("set the DSN before the app first talks to the database")
        self._dsn = db.resolve_dsn(value)

    @property
    def routes(self) -> dict[str, str]:
        """The queues routed to other clusters, and their DSNs (a copy)."""
        return dict((self._root or self)._routes)

    def cluster(self, queue: str) -> App:
        """The app of the cluster ``queue`` lives on: this app for an unrouted queue, else a
        member app on its route's DSN sharing this app's tasks, hooks and schedules. For what
        does not name a queue (bulk actions without ``queue=``, counts, ``migrate``, a
        worker serving every queue) on a routed cluster: ``app.cluster("reports").find_jobs()``."""
        root = self._root or self
        dsn = root._routes.get(queues.check_queue(queue))
        # A route to the app's own DSN, spelled the same, is the app's own cluster.
        return root if dsn is None or dsn == root._dsn else root._member(dsn)

    def _member(self, dsn: str) -> App:
        with self._pool_lock:
            member = self._members.get(dsn)
            if member is None:
                member = self._members[dsn] = routing.member(self, dsn)
        return member

    def _job_cluster(self, job_id: int, queue: str | None) -> App:
        """Where a call given a job id looks: see pgqueue.routing."""
        if queue is not None:
            return self.cluster(queue)
        if isinstance(job_id, Enqueued) and job_id.queue is not None:
            return self.cluster(job_id.queue)
        if self._root is not None or not self._routes:
            return self  # one cluster: the app's own, or the member it was asked on
        raise routing.unknown_cluster(job_id)

    def _queue_cluster(self, queue: str | None) -> App:
        """The cluster of a filter's queue; without one, this app's own."""
        return self if queue is None else self.cluster(queue)

    def _cluster_schedules(self) -> dict[str, Schedule]:
        """The declared schedules this app's cluster fires: those of its queues (a schedule
        enqueues on the cluster of its queue, fired there by that cluster's workers)."""
        return {n: s for n, s in self.periodic_schedules.items() if self.cluster(s.queue) is self}

    def _serving(self, worker_queues: list[str] | None) -> App:
        """The cluster a worker of ``worker_queues`` serves (None: this app's, every queue)."""
        if worker_queues is None or not (self._root or self)._routes:
            return self
        try:
            return routing.one_cluster(self.cluster, worker_queues, "a worker's queues")
        except InvalidJobError as exc:
            raise ConfigurationError(f"{exc}: run one worker per cluster") from None

    # --- hooks ----------------------------------------------------------------------------

    def middleware(self, func: hooks.Middleware) -> hooks.Middleware:
        """Register ``async def middleware(ctx, call_next)`` around every attempt, after (inside)
        those registered before it. See pgqueue.hooks for what its exceptions do."""
        self.middleware_stack.append(hooks.check_middleware(func))
        return func

    def on_enqueue(self, func: hooks.EnqueueHook) -> hooks.EnqueueHook:
        """Register ``def hook(task, args, meta)``, called for every job this app enqueues,
        before it is written; it may add to ``meta`` (a trace context, a tenant)."""
        self.enqueue_hooks.append(hooks.check_enqueue_hook(func))
        return func

    def around_enqueue(self, func: hooks.AroundEnqueue) -> hooks.AroundEnqueue:
        """Register ``def hook(publish) -> context manager``, entered around every call that
        writes jobs (a producer span; see pgqueue.hooks), inside those registered before it."""
        self.around_enqueue_hooks.append(hooks.check_around_enqueue(func))
        return func

    # --- tasks ----------------------------------------------------------------------------

    @overload
    def task(self, func: Callable[P, R], /) -> Task[P, R]: ...

    @overload
    def task(
        self,
        *,
        name: str | None = None,
        queue: str | None = None,
        priority: int = 0,
        max_attempts: int = 5,
        timeout: float | None = None,
        backoff: Backoff | None = None,
        unique: UniqueBy | None = None,
        unique_while: UniqueWhile | None = None,
        unique_for: float | timedelta | None = None,
        on_conflict: OnConflict | None = None,
        limit: int | None = None,
        limit_key: LimitKey | None = None,
        rate: RateSpec | None = None,
    ) -> Callable[[Callable[P, R]], Task[P, R]]: ...

    def task(  # type: ignore[misc]
        self,
        func: Callable[P, R] | None = None,
        /,
        *,
        name: str | None = None,
        queue: str | None = None,
        priority: int = 0,
        max_attempts: int = 5,
        timeout: float | None = None,
        backoff: Backoff | None = None,
        unique: UniqueBy | None = None,
        unique_while: UniqueWhile | None = None,
        unique_for: float | timedelta | None = None,
        on_conflict: OnConflict | None = None,
        limit: int | None = None,
        limit_key: LimitKey | None = None,
        rate: RateSpec | None = None,
    ) -> Task[P, R] | Callable[[Callable[P, R]], Task[P, R]]:
        """Register a handler. Async functions run on the worker's event loop, plain ones in
        its thread pool. The task name defaults to the function's name. ``unique`` makes its
        jobs unique (concepts/uniqueness.md): True keys on every argument, a list of names on
        those arguments, a function of the arguments on the string it returns. ``limit`` caps
        how many of its jobs run at once across every worker, ``rate`` how many start per period
        (``"100/m"``); with ``limit_key`` (a function of the arguments) both apply per key
        (concepts/limits.md)."""

        def register(fn: Callable[P, R]) -> Task[P, R]:
            task_name = _declared(
                producer.check_name, "task", name or fn.__name__, producer.MAX_TASK_LENGTH
            )
            existing = self.tasks.get(task_name)
            if existing is not None and existing.func is not fn:
                raise ConfigurationError(
                    f"task name {task_name!r} is already registered by {existing.func!r}; "
                    "pass name=... to tell them apart"
                )
            if timeout is not None and not timeout > 0:
                raise ConfigurationError("timeout must be a positive number of seconds")
            options = TaskOptions(
                queue=_declared(
                    producer.check_name,
                    "queue",
                    queue if queue is not None else self.default_queue,
                    producer.MAX_QUEUE_LENGTH,
                ),
                priority=_declared(producer.check_int, "priority", priority, -(2**31 - 1)),
                max_attempts=_declared(producer.check_int, "max_attempts", max_attempts, 1),
                unique=_declared(
                    lambda: uniqueness.combine(
                        None,
                        unique=unique,
                        unique_while=unique_while,
                        unique_for=unique_for,
                        on_conflict=on_conflict,
                    )[0]
                ),
            )
            task = Task(self, fn, name=task_name, options=options, timeout=timeout, backoff=backoff,
                        limits=_declared(TaskLimits.declared, limit, rate, limit_key))  # fmt: skip
            self.tasks[task_name] = task
            return task

        return register(func) if func is not None else register

    # --- periodic schedules ---------------------------------------------------------------

    def periodic(
        self,
        *,
        cron: str,
        name: str | None = None,
        queue: str | None = None,
        args: Mapping[str, Any] | None = None,
        priority: int | None = None,
        max_attempts: int | None = None,
        missed: str = "latest",
        max_catchup: int = DEFAULT_MAX_CATCHUP,
    ) -> Callable[[Task[P, R]], Task[P, R]]:
        """Enqueue the task on a cron schedule (UTC). Goes above ``@app.task``; the schedule
        name defaults to the task name. See docs/concepts/schedules.md for ``missed``."""

        def register(task: Task[P, R]) -> Task[P, R]:
            if not isinstance(task, Task) or self.tasks.get(task.name) is not task:
                raise ConfigurationError(
                    "@app.periodic must be applied on top of @app.task of the same app"
                )
            declare(self, task, cron=cron, name=name, queue=queue, args=args, priority=priority,
                    max_attempts=max_attempts, missed=missed, max_catchup=max_catchup)  # fmt: skip
            return task

        return register

    def schedule(
        self,
        name: str,
        cron: str,
        *,
        task: str,
        queue: str | None = None,
        args: Mapping[str, Any] | None = None,
        priority: int | None = None,
        max_attempts: int | None = None,
        missed: str = "latest",
        max_catchup: int = DEFAULT_MAX_CATCHUP,
    ) -> Schedule:
        """Declare a cron schedule (UTC) for a registered task, given by name."""
        registered = self.tasks.get(task) if isinstance(task, str) else None
        if registered is None:
            known = ", ".join(sorted(self.tasks)) or "none"
            raise ConfigurationError(
                f"schedule {name!r}: unknown task {task!r} (registered: {known})"
            )
        return declare(self, registered, cron=cron, name=name, queue=queue, args=args,
                       priority=priority, max_attempts=max_attempts, missed=missed,
                       max_catchup=max_catchup)  # fmt: skip

    def retire_schedule(self, name: str) -> None:
        """Stop this app's schedule ``name`` for good when the next worker starts (its row and
        history stay). Schedules are never stopped just because the code stops declaring them."""
        schedules.retire(self, name)

    def prune_schedules(self, *, dry_run: bool = False) -> list[str]:
        """Retire this app's schedules that its code no longer declares; returns their names
        (with ``dry_run``, only returns them). Run it once no worker of an older version that
        still declares them is left."""
        with self.connection() as conn:
            return schedules.prune(conn, self, dry_run=dry_run)

    # --- connections ----------------------------------------------------------------------

    @property
    def coalesce_stats(self) -> coalescing.CoalesceStats | None:
        """Jobs and statements written by the coalescing producer so far (None without
        ``coalesce``): jobs / batches is the average batch."""
        return None if self._coalescer is None else self._coalescer.stats

    @property
    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for every connection pgqueue opens for this app."""
        return {} if self.prepared_statements else {"prepare_threshold": None}

    def _connection_settings(self) -> tuple[str, dict[str, Any], float]:
        dsn = self.dsn
        return dsn, pools.connect_kwargs(dsn, self.connect_options), self.reconnect_timeout

    def _sync_pool(self) -> pools.Pool:
        pool = self._pool
        if pool is None:
            with self._pool_lock:
                if self._pool is None:
                    self._pool = pools.Pool(*self._connection_settings(), self.pool_size)
                pool = self._pool
        return pool

    async def _async_pool(self) -> pools.AsyncPool:
        """This event loop's pool (see ``pgqueue.pools`` for why one per loop, and how it is
        closed when the loop ends)."""
        return await self._loop_pools.get()

    def close(self) -> None:
        """Close every producer connection of this app, sync and async (those in use as they
        are given back). The app stays usable: the next call connects again. With ``coalesce``,
        calls still waiting for their batch fail (nothing of theirs was written); batches
        being written end as usual."""
        if self._coalescer is not None:
            self._coalescer.close()
        with self._pool_lock:
            pool, self._pool = self._pool, None
            members = list(self._members.values())
        if pool is not None:
            pool.close()
        self._loop_pools.close()
        for member in members:
            member.close()

    async def aclose(self) -> None:
        """``close()`` for async code (closing never waits on the network)."""
        self.close()

    # An app used as a context manager is checked when the block starts (a missing or invalid
    # DSN fails at startup, not at the first request) and its connections closed when it ends:
    # ``async with App(...) as app`` fits an ASGI lifespan. No connection is made up front, so a
    # database that is down does not stop the process from starting.

    def __enter__(self) -> App:
        self._sync_pool()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> App:
        await self._async_pool()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @contextlib.contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A pooled sync connection (autocommit), as a context manager. Getting one raises
        DatabaseUnavailableError when PostgreSQL cannot be reached; errors of your statements
        on it are psycopg's own."""
        pool = self._sync_pool()
        conn = pool.take()
        try:
            yield conn
        finally:
            pool.give_back(conn)

    # --- producing ------------------------------------------------------------------------

    def _row(
        self,
        task: str,
        args: Mapping[str, Any] | None,
        *,
        queue: str | None,
        priority: int | None,
        max_attempts: int | None,
        delay: float | timedelta | None,
        run_at: datetime | None,
        allow_unknown: bool,
        unique: Any = None,
        unique_key: str | None = None,
        unique_while: UniqueWhile | None = None,
        unique_for: float | timedelta | None = None,
        on_conflict: str | None = None,
        grouped: bool = True,
        meta: Mapping[str, Any] | None = None,
    ) -> producer.JobRow:
        """``grouped``: compute the job's limit group (False for a bulk template, whose jobs
        each compute their own)."""
        registered = self.tasks.get(task) if isinstance(task, str) else None
        if registered is None and not allow_unknown:
            known = ", ".join(sorted(self.tasks)) or "none"
            raise UnknownTaskError(f"unknown task {task!r} (registered: {known})")
        defaults = registered.options if registered else TaskOptions(queue=self.default_queue)
        rule, key = uniqueness.combine(
            defaults.unique,
            unique=unique,
            unique_key=unique_key if unique_key is not None else defaults.unique_key,
            unique_while=unique_while,
            unique_for=unique_for,
            on_conflict=on_conflict,
        )
        limits = registered.limits if registered and grouped else None
        if self.enqueue_hooks and grouped:
            meta = hooks.run_enqueue_hooks(self.enqueue_hooks, task, args, meta)
        row = producer.build_row(
            limit_key=None if limits is None else limits.group(task, args),
            task=task,
            args=args,
            queue=queue if queue is not None else defaults.queue,
            priority=priority if priority is not None else defaults.priority,
            max_attempts=max_attempts if max_attempts is not None else defaults.max_attempts,
            delay=delay,
            run_at=run_at,
            max_payload=self.max_payload_bytes,
            unique=None if rule is None else (rule, key),
            meta=meta,
        )
        if self.around_enqueue_hooks and grouped:
            publish = hooks.current_publish.get()
            if publish is not None:
                publish.add(row.task, row.queue)
        return row

    @_published("enqueue")
    def enqueue(
        self,
        task: str,
        args: Mapping[str, Any] | None = None,
        *,
        queue: str | None = None,
        priority: int | None = None,
        max_attempts: int | None = None,
        delay: float | timedelta | None = None,
        run_at: datetime | None = None,
        connection: connections.SyncConnection | None = None,
        allow_unknown: bool = False,
        unique: UniqueBy | None = None,
        unique_key: str | None = None,
        unique_while: UniqueWhile | None = None,
        unique_for: float | timedelta | None = None,
        on_conflict: OnConflict | None = None,
        meta: Mapping[str, Any] | None = None,
        after: Iterable[int] | None = None,
        after_failure: str = "cancel",
    ) -> Enqueued:
        """Queue one job and return its id. With ``connection`` (a psycopg connection, or a
        SQLAlchemy session on the psycopg driver), the job exists only if that transaction
        commits. For a unique job (the task's ``unique``, or
        ``unique_key``/``unique=`` here) the id may be an existing job's: ``.duplicate`` says so.
        With ``App(coalesce=True)`` and no ``connection``, the job may share one INSERT and
        commit with other calls made at the same time; it returns once that commit is done.

        Raises InvalidJobError (nothing written) for a bad job, and DatabaseUnavailableError
        when PostgreSQL cannot be reached or the connection is lost during the INSERT (the
        message then says the job may or may not have been written; it is never sent twice).
        """
        row = self._row(
            task,
            args,
            queue=queue,
            priority=priority,
            max_attempts=max_attempts,
            delay=delay,
            run_at=run_at,
            allow_unknown=allow_unknown,
            unique=unique,
            unique_key=unique_key,
            unique_while=unique_while,
            unique_for=unique_for,
            on_conflict=on_conflict,
            meta=meta,
        )
        target = self
        if after is not None or (self._root or self)._routes:
            target, row = self._placed_row(row, after, after_failure)
        if connection is not None:
            routing.refuse_connection(target, self, row.queue)
            job = producer.insert(connections.sync_connection(connection), self.q, row)
        elif target._coalescer is not None and coalescing.batchable(row):
            job = target._coalescer.enqueue(row)
        else:
            job = target._sync_pool().run(lambda conn: wire.pooled_insert(conn, self.q, row))
        return routing.placed(job, row.queue)

    @_published_async("enqueue")
    async def enqueue_async(
        self,
        task: str,
        args: Mapping[str, Any] | None = None,
        *,
        queue: str | None = None,
        priority: int | None = None,
        max_attempts: int | None = None,
        delay: float | timedelta | None = None,
        run_at: datetime | None = None,
        connection: connections.AsyncConnection | None = None,
        allow_unknown: bool = False,
        unique: UniqueBy | None = None,
        unique_key: str | None = None,
        unique_while: UniqueWhile | None = None,
        unique_for: float | timedelta | None = None,
        on_conflict: OnConflict | None = None,
        meta: Mapping[str, Any] | None = None,
        after: Iterable[int] | None = None,
        after_failure: str = "cancel",
    ) -> Enqueued:
        """``enqueue`` for async code, on this event loop's connections."""
        row = self._row(
            task,
            args,
            queue=queue,
            priority=priority,
            max_attempts=max_attempts,
            delay=delay,
            run_at=run_at,
            allow_unknown=allow_unknown,
            unique=unique,
            unique_key=unique_key,
            unique_while=unique_while,
            unique_for=unique_for,
            on_conflict=on_conflict,
            meta=meta,
        )
        target = self
        if after is not None or (self._root or self)._routes:
            target, row = self._placed_row(row, after, after_failure)
        if connection is not None:
            routing.refuse_connection(target, self, row.queue)
            conn = await connections.async_connection(connection)
            job = await producer.insert_async(conn, self.q, row)
        elif target._coalescer is not None and coalescing.batchable(row):
            job = await target._coalescer.enqueue_async(row)
        else:
            pool = await target._async_pool()
            job = await pool.run(lambda conn: wire.pooled_insert_async(conn, self.q, row))
        return routing.placed(job, row.queue)

    def _placed_row(
        self, row: producer.JobRow, after: Iterable[int] | None, after_failure: str
    ) -> tuple[App, producer.JobRow]:
        """The cluster of the job's queue, and the job with its parents (on that cluster)."""
        target = self.cluster(row.queue)
        parents = None if after is None else workflows.check_parents(after)
        routing.check_parents(self.cluster, target, row.queue, parents)
        return target, workflows.with_parents(row, parents, after_failure)

    def _row_chunks(
        self, jobs: Iterable[JobSpec], allow_unknown: bool
    ) -> Iterator[list[producer.JobRow]]:
        """The jobs checked and serialised, ``COPY_CHUNK`` at a time (lazily: see
        ``producer.copy_rows``)."""
        rows: list[producer.JobRow] = []
        # (task, args) pairs, the common bulk form, share their task's checked defaults: per job
        # only the arguments are checked and serialised.
        # Per task: the template row, its unique rule (when the task's jobs are unique) and its
        # limits, looked up once.
        templates: dict[
            str,
            tuple[producer.JobRow, uniqueness.UniqueRule | None, TaskLimits | None],
        ] = {}
        for index, spec in enumerate(jobs):
            if (
                type(spec) is tuple and len(spec) == 2 and type(spec[0]) is str
                and not self.enqueue_hooks  # hooks see each job: the general path below
                and not self.around_enqueue_hooks
            ):  # fmt: skip
                known = templates.get(spec[0])
                try:
                    if known is None:
                        template = self._row(
                            spec[0], None, queue=None, priority=None, max_attempts=None,
                            delay=None, run_at=None, allow_unknown=allow_unknown, grouped=False,
                        )  # fmt: skip
                        registered = self.tasks.get(spec[0])
                        rule = None
                        if template.unique_key is not None:  # the task's own rule: key per job
                            assert registered is not None
                            rule = registered.options.unique
                        limits = registered.limits if registered is not None else None
                        known = templates[spec[0]] = (template, rule, limits)
                    template, rule, limits = known
                    args = producer.serialize_args(spec[1], self.max_payload_bytes)
                    key = (
                        None if rule is None
                        else uniqueness.key_for(spec[0], rule, spec[1] or {}, None, args)
                    )  # fmt: skip
                    group = None if limits is None else limits.group(spec[0], spec[1])
                except (InvalidJobError, UnknownTaskError) as exc:
                    raise type(exc)(f"job #{index}: {exc}") from None
                rows.append(template.with_args(args, key, group))
                if len(rows) == producer.COPY_CHUNK:
                    yield rows
                    rows = []
                continue
            if isinstance(spec, tuple):
                if len(spec) != 2:
                    raise InvalidJobError(f"job #{index}: expected (task, args)")
                spec = {"task": spec[0], "args": spec[1]}
            if not isinstance(spec, Mapping) or "task" not in spec:
                raise InvalidJobError(f"job #{index}: expected a mapping with a 'task' key")
            unknown = set(spec) - {
                "task",
                "args",
                "queue",
                "priority",
                "max_attempts",
                "delay",
                "run_at",
                "unique",
                "unique_key",
                "unique_while",
                "unique_for",
                "on_conflict",
                "meta",
            }
            if unknown:
                raise InvalidJobError(f"job #{index}: unknown keys {sorted(unknown)}")
            try:
                rows.append(
                    self._row(
                        spec["task"],
                        spec.get("args"),
                        queue=spec.get("queue"),
                        priority=spec.get("priority"),
                        max_attempts=spec.get("max_attempts"),
                        delay=spec.get("delay"),
                        run_at=spec.get("run_at"),
                        allow_unknown=allow_unknown,
                        unique=spec.get("unique"),
                        unique_key=spec.get("unique_key"),
                        unique_while=spec.get("unique_while"),
                        unique_for=spec.get("unique_for"),
                        on_conflict=spec.get("on_conflict"),
                        meta=spec.get("meta"),
                    )
                )
            except (InvalidJobError, UnknownTaskError) as exc:
                raise type(exc)(f"job #{index}: {exc}") from None
            if len(rows) == producer.COPY_CHUNK:
                yield rows
                rows = []
        if rows:
            yield rows

    def _checked_chunks(
        self, jobs: Iterable[JobSpec], allow_unknown: bool
    ) -> Iterator[list[producer.JobRow]] | None:
        """None for no jobs. The first chunk is checked before any connection is taken, so a
        small batch with a bad job fails without touching the database."""
        chunks = self._row_chunks(jobs, allow_unknown)
        first = next(chunks, None)
        return None if first is None else itertools.chain([first], chunks)

    @_published("enqueue_many")
    def enqueue_many(
        self,
        jobs: Iterable[JobSpec],
        *,
        connection: connections.SyncConnection | None = None,
        allow_unknown: bool = False,
    ) -> int:
        """Queue many jobs with one COPY and return how many were written as new (duplicates of
        unique jobs, answered by the job holding their key, are not counted; chunks holding
        unique jobs are written with INSERT ... ON CONFLICT instead of COPY). One bad job refuses
        the whole batch and nothing of it is written; with ``connection``, the rest of that connection's
        transaction is kept. Jobs are checked while the COPY runs (a chunk at a time), so
        PostgreSQL does not wait for Python to check the whole batch first. With ``routes``,
        every job is checked first, then each cluster's jobs are one COPY in a transaction of
        their own there: a cluster that fails after another committed leaves the other's part."""
        chunks = self._checked_chunks(jobs, allow_unknown)
        if chunks is None:
            return 0
        if (self._root or self)._routes:
            written = 0
            for target, rows in routing.by_cluster(self, chunks, connection is not None):
                if connection is not None:
                    conn = connections.sync_connection(connection)
                    written += producer.copy_rows(conn, self.q, rows)
                else:
                    copy = functools.partial(producer.copy_rows, q=self.q, chunks=rows, own=True)
                    written += target._sync_pool().run(copy)
            return written
        if connection is not None:
            return producer.copy_rows(connections.sync_connection(connection), self.q, chunks)
        # Not replayable: the chunks are checked as the COPY consumes them.
        return self._sync_pool().run(
            lambda conn: producer.copy_rows(conn, self.q, chunks, own=True), replayable=False
        )

    @_published_async("enqueue_many")
    async def enqueue_many_async(
        self,
        jobs: Iterable[JobSpec],
        *,
        connection: connections.AsyncConnection | None = None,
        allow_unknown: bool = False,
    ) -> int:
        chunks = self._checked_chunks(jobs, allow_unknown)
        if chunks is None:
            return 0
        if (self._root or self)._routes:
            written = 0
            for target, rows in routing.by_cluster(self, chunks, connection is not None):
                if connection is not None:
                    conn = await connections.async_connection(connection)
                    written += await producer.copy_rows_async(conn, self.q, rows)
                else:
                    pool = await target._async_pool()
                    copy = functools.partial(
                        producer.copy_rows_async, q=self.q, chunks=rows, own=True
                    )
                    written += await pool.run(copy)
            return written
        if connection is not None:
            conn = await connections.async_connection(connection)
            return await producer.copy_rows_async(conn, self.q, chunks)
        pool = await self._async_pool()
        return await pool.run(
            lambda conn: producer.copy_rows_async(conn, self.q, chunks, own=True), replayable=False
        )

    # --- inspecting and steering jobs -----------------------------------------------------

    # A call given a job id looks on the cluster of ``queue=`` (the job's queue), else of the
    # queue an ``Enqueued`` remembers; on an app with routes a plain id alone is refused, as ids
    # repeat across clusters (pgqueue.routing).

    def get_job(self, job_id: int, *, queue: str | None = None) -> Job | None:
        pool = self._job_cluster(job_id, queue)._sync_pool()
        row = pool.run(
            lambda conn: conn.execute(self.q.get_job, {"id": job_id}).fetchone(), read_only=True
        )
        return Job.from_row(row) if row else None

    def job_attempts(
        self, job_id: int, *, limit: int = 1000, queue: str | None = None
    ) -> list[Attempt]:
        """Every attempt of job ``job_id``, oldest first: the failed, cancelled and expired ones
        from the attempt history (the latest ``limit`` of them), then the running or succeeded
        one. Empty for a job that never ran, and for an id with no job or history. A requeue
        starts the numbering again at 1; attempts that ended before schema version 16 were not
        recorded."""
        cluster = self._job_cluster(job_id, queue)
        job_id = _job_id(job_id)
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ConfigurationError(f"limit must be a positive whole number, got {limit!r}")
        rows = cluster._sync_pool().run(
            lambda conn: conn.execute(
                self.q.job_attempts, {"id": job_id, "limit": limit}
            ).fetchall(),
            read_only=True,
        )
        ordered = sorted(rows, key=lambda r: (r[7], r[5] is None, r[5]))
        return [Attempt(*row[:7]) for row in ordered]

    def wait(self, job_id: int, timeout: float | None = None, *, queue: str | None = None) -> Any:
        """Block until job ``job_id`` finishes and return its result (the handler's return
        value, as stored JSON). Raises ``JobFailedError`` if it ends dead (with its last error),
        ``JobCancelledError`` if cancelled, ``WaitTimeoutError`` after ``timeout`` seconds (the
        job goes on), ``JobNotFoundError`` for an unknown id. Woken by the worker's announcement
        of the job's end, not by polling (concepts/results.md)."""
        cluster = self._job_cluster(job_id, queue)
        return results.wait(
            cluster.dsn, cluster.connect_options, self.q, self.schema, _job_id(job_id),
            _timeout(timeout), cluster.reconnect_timeout,
        )  # fmt: skip

    async def wait_async(
        self, job_id: int, timeout: float | None = None, *, queue: str | None = None
    ) -> Any:
        """``wait`` for async code."""
        cluster = self._job_cluster(job_id, queue)
        return await results.wait_async(
            cluster.dsn, cluster.connect_options, self.q, self.schema, _job_id(job_id),
            _timeout(timeout), cluster.reconnect_timeout,
        )  # fmt: skip

    def requeue(self, job_id: int, *, queue: str | None = None) -> bool:
        """Run a dead or cancelled job again, with a fresh set of attempts."""
        pool = self._job_cluster(job_id, queue)._sync_pool()
        return pool.run(
            lambda conn: conn.execute(self.q.requeue_job, {"id": job_id}).fetchone() is not None
        )

    def cancel(self, job_id: int, *, queue: str | None = None) -> CancelResult:
        """Cancel a job: a waiting one at once (``"cancelled"``), a running one by asking its
        worker to stop it (``"cancel requested"``; it ends cancelled, never retried), a finished
        one not at all (``"already finished"``, false in a boolean context). Raises
        ``JobNotFoundError`` for an unknown id (concepts/cancellation.md)."""
        cluster = self._job_cluster(job_id, queue)
        job = _job_id(job_id)
        row = cluster._sync_pool().run(
            lambda conn: conn.execute(self.q.cancel_job, {"id": job}).fetchone()
        )
        return _cancel_result(job, row)

    async def cancel_async(self, job_id: int, *, queue: str | None = None) -> CancelResult:
        """``cancel`` for async code."""
        cluster = self._job_cluster(job_id, queue)
        job = _job_id(job_id)
        pool = await cluster._async_pool()

        async def run(conn: psycopg.AsyncConnection[Any]) -> Any:
            cur = await conn.execute(self.q.cancel_job, {"id": job})
            return await cur.fetchone()

        return _cancel_result(job, await pool.run(run))

    # --- workflows (pgqueue.workflows) --------------------------------------------------------

    @_published("chain")
    def chain(
        self, *steps: workflows.Signature, after_failure: str = "cancel",
        connection: connections.SyncConnection | None = None,
    ) -> list[Enqueued]:  # fmt: skip
        """Enqueue ``steps`` (``task.s(...)``) so that each runs after the one before it
        succeeded; all written in one transaction. Returns their ids in order."""
        if not steps:
            raise InvalidJobError("chain() needs at least one step")
        rows = [step.row(self, callback=i > 0) for i, step in enumerate(steps)]
        for i, row in enumerate(rows[1:], start=2):
            workflows.refuse_unique(row, f"step {i} of the chain")
        failure = workflows.check_after_failure(after_failure)
        target = self._workflow_cluster(rows, "a chain", connection is not None)

        def write(conn: psycopg.Connection[Any], own: bool = False) -> list[Enqueued]:
            with conn.transaction():
                if own:
                    producer.bound_client_waits(conn, self.q)
                ids = workflows.chain(conn, self.q, rows, failure)
            return [routing.placed(job, row.queue) for job, row in zip(ids, rows, strict=True)]

        if connection is not None:
            return write(connections.sync_connection(connection))
        return target._sync_pool().run(lambda conn: write(conn, own=True))

    @_published("group")
    def group(
        self, members: Iterable[workflows.Signature], *, then: workflows.Signature | None = None,
        after_failure: str = "cancel", connection: connections.SyncConnection | None = None,
    ) -> workflows.Group:  # fmt: skip
        """Enqueue ``members`` (any number) and, with ``then``, a callback that runs once every
        member finished: it gets their results in order as its ``results`` argument. A member
        that ends dead or cancelled cancels the callback unless ``after_failure="run"``."""
        rows = [m.row(self) for m in members]
        if not rows:
            raise InvalidJobError("group() needs at least one member")
        callback = None if then is None else then.row(self, callback=True)
        for i, row in enumerate(rows, start=1):
            workflows.refuse_unique(row, f"member {i} of the group", member=True)
        if callback is not None:
            workflows.refuse_unique(callback, "the group's callback")
        failure = workflows.check_after_failure(after_failure)
        every = rows if callback is None else [*rows, callback]
        target = self._workflow_cluster(every, "a group", connection is not None)

        def write(conn: psycopg.Connection[Any], own: bool = False) -> workflows.Group:
            with conn.transaction():
                done = workflows.group(conn, self.q, rows, callback, failure, own=own)
            # Members come back in order (workflows.group), so each takes its own queue.
            members = [routing.placed(j, r.queue) for j, r in zip(done.members, rows, strict=True)]
            last = done.callback
            return workflows.Group(
                members, None if last is None or callback is None
                else routing.placed(last, callback.queue),
            )  # fmt: skip

        if connection is not None:
            return write(connections.sync_connection(connection))
        return target._sync_pool().run(lambda conn: write(conn, own=True))

    def _workflow_cluster(self, rows: list[producer.JobRow], what: str, on_connection: bool) -> App:
        """The one cluster a workflow's jobs are on: one cluster's trigger releases children."""
        if not (self._root or self)._routes:
            return self
        target = routing.one_cluster(self.cluster, (r.queue for r in rows), what)
        if on_connection:
            routing.refuse_connection(target, self, rows[0].queue)
        return target

    # --- operators' bulk actions (pgqueue.operations) ---------------------------------------

    def requeue_jobs(
        self, *, task: str | None = None, queue: str | None = None,
        status: str | Iterable[str] | None = None, since: object = None,
        older_than: object = None, dry_run: bool = False,
    ) -> int:  # fmt: skip
        """Run again every dead (or ``status="cancelled"``) job that matches, with a fresh set of
        attempts; returns how many (a dry run only counts). ``since``/``older_than``: "1h",
        "7d", seconds or a timedelta, against when the job finished. Batched and audited."""
        f = operations.JobFilter.of(
            task=task, queue=queue, status=status, since=since, older_than=older_than
        )
        pool = self._queue_cluster(queue)._sync_pool()
        return pool.run(
            lambda conn: operations.bulk(conn, self.q, "requeue", f, dry_run=dry_run),
            replayable=False,  # batches commit one by one
        )

    def cancel_jobs(
        self, *, task: str | None = None, queue: str | None = None,
        status: str | Iterable[str] | None = None, since: object = None,
        older_than: object = None, dry_run: bool = False,
    ) -> int:  # fmt: skip
        """``cancel`` for every matching job: waiting ones (the default) are cancelled, running
        ones (``status="running"``) asked to stop. Batched and audited."""
        f = operations.JobFilter.of(
            task=task, queue=queue, status=status, since=since, older_than=older_than
        )
        pool = self._queue_cluster(queue)._sync_pool()
        return pool.run(
            lambda conn: operations.bulk(conn, self.q, "cancel", f, dry_run=dry_run),
            replayable=False,  # batches commit one by one
        )

    def purge_jobs(
        self, *, older_than: object, task: str | None = None, queue: str | None = None,
        status: str | Iterable[str] | None = None, dry_run: bool = False,
    ) -> int:  # fmt: skip
        """Delete finished jobs (succeeded by default; dead or cancelled if named) that finished
        more than ``older_than`` ago. Batched (never a long lock) and audited."""
        f = operations.JobFilter.of(task=task, queue=queue, status=status, older_than=older_than)
        pool = self._queue_cluster(queue)._sync_pool()
        return pool.run(
            lambda conn: operations.bulk(conn, self.q, "purge", f, dry_run=dry_run),
            replayable=False,  # batches commit one by one
        )

    def find_jobs(
        self, *, task: str | None = None, queue: str | None = None,
        status: str | Iterable[str] | None = None, since: object = None,
        older_than: object = None, limit: int = 20,
    ) -> list[operations.JobSummary]:  # fmt: skip
        """The newest jobs that match, newest first."""
        f = operations.JobFilter.of(
            task=task, queue=queue, status=status, since=since, older_than=older_than
        )
        pool = self._queue_cluster(queue)._sync_pool()
        return pool.run(lambda conn: operations.find(conn, self.q, f, limit), read_only=True)

    def retry_now(self, job_id: int, *, queue: str | None = None) -> bool:
        """Run a retrying (or delayed) job now instead of at its run_at; False if it is not
        waiting. Raises JobNotFoundError for an unknown id."""
        cluster = self._job_cluster(job_id, queue)
        job = _job_id(job_id)
        was = cluster._sync_pool().run(lambda conn: operations.retry_now(conn, self.q, job))
        return was in ("queued", "retrying")

    def audit_log(self, limit: int = 20) -> list[operations.AuditEntry]:
        """The newest bulk actions (requeue, cancel, purge by filter), newest first."""
        return self._sync_pool().run(
            lambda conn: operations.audit_log(conn, self.q, limit), read_only=True
        )

    def status_counts(self) -> list[tuple[str, str, int]]:
        rows = self._sync_pool().run(
            lambda conn: conn.execute(self.q.status_counts).fetchall(), read_only=True
        )
        return [(str(r[0]), str(r[1]), int(r[2])) for r in rows]

    # --- pausing queues -------------------------------------------------------------------

    def pause_queue(self, name: str) -> bool:
        """Stop every worker from claiming jobs of queue ``name`` until ``resume_queue``;
        returns False if it was paused already. Running jobs finish and are acked as usual;
        enqueues are still accepted. The pause is kept in the database: restarts keep it."""
        queue = queues.check_queue(name)
        return self.cluster(queue)._sync_pool().run(lambda conn: queues.pause(conn, self.q, queue))

    def resume_queue(self, name: str) -> bool:
        """Let workers claim queue ``name`` again, and wake the idle ones at once; returns False
        if it was not paused."""
        queue = queues.check_queue(name)
        return self.cluster(queue)._sync_pool().run(lambda conn: queues.resume(conn, self.q, queue))

    async def pause_queue_async(self, name: str) -> bool:
        """``pause_queue`` for async code."""
        queue = queues.check_queue(name)
        pool = await self.cluster(queue)._async_pool()
        return await pool.run(lambda conn: queues.pause_async(conn, self.q, queue))

    async def resume_queue_async(self, name: str) -> bool:
        """``resume_queue`` for async code."""
        queue = queues.check_queue(name)
        pool = await self.cluster(queue)._async_pool()
        return await pool.run(lambda conn: queues.resume_async(conn, self.q, queue))

    def paused_queues(self) -> list[str]:
        """The names of the paused queues, sorted."""
        rows = self._sync_pool().run(lambda conn: queues.paused(conn, self.q), read_only=True)
        return [name for name, _ in rows]

    def limit_queue(
        self,
        name: str,
        *,
        limit: int | limits.Unset | None = limits.UNSET,
        rate: RateSpec | limits.Rate | limits.Unset | None = limits.UNSET,
    ) -> None:
        """Cap queue ``name`` across every worker: at most ``limit`` of its jobs running at once
        and/or ``rate`` started per period (``"100/m"``); None removes one, an omitted one stays.
        Workers obey from their next claim; nothing restarts (concepts/limits.md)."""
        queue = queues.check_queue(name)
        settings = limits.check_settings(limit, rate)
        self.cluster(queue)._sync_pool().run(
            lambda conn: limits.set_queue(conn, self.q, queue, settings)
        )

    def limit_task(
        self,
        name: str,
        *,
        limit: int | limits.Unset | None = limits.UNSET,
        rate: RateSpec | limits.Rate | limits.Unset | None = limits.UNSET,
    ) -> None:
        """An operator's limit and/or rate for task ``name`` (per key if the task declares
        ``limit_key``), kept over what the code declares until ``reset_task_limits``."""
        task = _declared(producer.check_name, "task", name, producer.MAX_TASK_LENGTH)
        settings = limits.check_settings(limit, rate)
        self._sync_pool().run(lambda conn: limits.set_task(conn, self.q, task, settings))

    async def limit_queue_async(
        self,
        name: str,
        *,
        limit: int | limits.Unset | None = limits.UNSET,
        rate: RateSpec | limits.Rate | limits.Unset | None = limits.UNSET,
    ) -> None:
        """``limit_queue`` for async code."""
        queue = queues.check_queue(name)
        settings = limits.check_settings(limit, rate)
        pool = await self.cluster(queue)._async_pool()
        await pool.run(lambda conn: limits.set_queue_async(conn, self.q, queue, settings))

    async def limit_task_async(
        self,
        name: str,
        *,
        limit: int | limits.Unset | None = limits.UNSET,
        rate: RateSpec | limits.Rate | limits.Unset | None = limits.UNSET,
    ) -> None:
        """``limit_task`` for async code."""
        task = _declared(producer.check_name, "task", name, producer.MAX_TASK_LENGTH)
        settings = limits.check_settings(limit, rate)
        pool = await self._async_pool()
        await pool.run(lambda conn: limits.set_task_async(conn, self.q, task, settings))

    def reset_task_limits(self, name: str) -> bool:
        """Drop an operator's values for task ``name``: the code's apply again from the next
        worker start. False if none were set."""
        return self._sync_pool().run(lambda conn: limits.reset_task(conn, self.q, name))

    def queue_limits(self) -> list[limits.QueueSettings]:
        """Every queue with operator state (paused, limit, rate), by name."""
        return self._sync_pool().run(
            lambda conn: limits.queue_settings(conn, self.q), read_only=True
        )

    def task_limits(self) -> list[limits.TaskSettings]:
        """Every task with a limit or a rate in the database, by name."""
        return self._sync_pool().run(
            lambda conn: limits.task_settings(conn, self.q), read_only=True
        )

    def migrate(
        self, *, lock_timeout: float | None = None, timeout: float | None = None
    ) -> list[int]:
        """Apply pending schema migrations, each in its own transaction, without stalling a live
        queue; returns the versions applied. ``lock_timeout`` (default 1 s) bounds each wait for
        a lock before the step backs off and retries; after ``timeout`` (default 600 s) a step
        that still cannot take its locks raises ``MigrationError`` naming who holds them. See
        ``pgqueue.migrate.migrate``. With ``routes``, every cluster is migrated, this app's first
        (then the versions are those applied on any of them); a member (``app.cluster(q)``)
        migrates its own cluster only."""
        applied: set[int] = set()
        routed = {self.cluster(queue) for queue in self._routes} - {self}
        for cluster in [self, *sorted(routed, key=lambda member: member.dsn)]:
            with db.connect(cluster.dsn, **cluster.connect_options) as conn:
                applied.update(
                    apply_migrations(conn, self.schema, lock_timeout=lock_timeout, timeout=timeout)
                )
        return sorted(applied)

    # --- workers --------------------------------------------------------------------------

    def worker(self, **options: Any) -> Worker:
        """A worker on one cluster: that of its ``queues`` (all on one cluster), or this app's
        own serving every queue there when ``queues`` is not given (see ``Worker``)."""
        from .worker.runtime import Worker

        return Worker(self, **options)

    def run_worker(self, **options: Any) -> None:
        """Run a worker in this thread until SIGTERM/SIGINT (see ``Worker`` for options)."""
        self.worker(**options).run_sync()


def _cancel_result(job_id: int, row: Any) -> CancelResult:
    if row is None:
        raise JobNotFoundError.of(job_id)
    was = str(row[0])
    if was == "running":
        return CancelResult.REQUESTED
    waiting = ("queued", "retrying", "blocked")
    return CancelResult.CANCELLED if was in waiting else CancelResult.FINISHED


def _job_id(job_id: object) -> int:
    if isinstance(job_id, bool) or not isinstance(job_id, int) or job_id < 1:
        raise InvalidJobError(f"a job id is a positive integer, got {job_id!r}")
    return int(job_id)


def _timeout(timeout: object) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout >= 0:
        raise ConfigurationError(f"timeout must be a number of seconds from 0, got {timeout!r}")
    return float(timeout)


def _declared(check: Callable[..., R], *args: Any) -> R:
    """A declaration's check: the same rule as at enqueue, refused as a ConfigurationError."""
    try:
        return check(*args)
    except InvalidJobError as exc:
        raise ConfigurationError(str(exc)) from None
