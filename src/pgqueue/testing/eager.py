"""Eager mode: ``enqueue`` runs the handler at once, in the caller, with no database.

For unit tests of handlers and of the code that enqueues them. It is deliberately small: one
attempt per job, in the caller's thread (an async handler on a loop of its own, or on the
caller's loop for ``enqueue_async``), through the app's middleware and enqueue hooks, with the
arguments and the result round-tripped through JSON as a worker would see them. Nothing else of
the runtime happens: no leases, no retries (a failed attempt is recorded ``retrying`` or ``dead``
as its first attempt would be, and not run again), no timeouts, no uniqueness, no limits;
``delay``/``run_at`` are ignored and ``connection=`` does not tie the job to that transaction.
``run_until_idle`` runs the real worker when those matter.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import json
import math
import uuid
from collections.abc import Coroutine, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from .. import hooks
from ..context import JobContext
from ..errors import ConfigurationError, Fail, JobFailedError, JobNotFoundError, Retry
from ..jobs import Enqueued, Status
from ..worker.executor import encode_result, format_error, storable_text
from .runs import Run, Runs

if TYPE_CHECKING:
    from ..app import App, JobSpec
    from ..producer import JobRow
    from ..tasks import Task

#: The options of ``App.enqueue`` that shape the job's row (the rest are handled here).
_ROW_OPTIONS = (
    "queue", "priority", "max_attempts", "delay", "run_at", "unique", "unique_key",
    "unique_while", "unique_for", "on_conflict", "meta",
)  # fmt: skip
#: The App methods eager mode replaces on the app object for the duration of the block.
_PATCHED = (
    "enqueue", "enqueue_async", "enqueue_many", "enqueue_many_async", "wait", "wait_async",
    "chain", "group",
)  # fmt: skip


@contextlib.contextmanager
def eager(app: App, *, propagate: bool = True) -> Iterator[Runs]:
    """Within the block, every enqueue of ``app`` (``task.enqueue``, ``app.enqueue``,
    ``enqueue_many`` and their async twins) runs the handler at once and records a ``Run`` in
    the ``Runs`` the block gets; ``app.wait(job_id)`` returns its result. Job ids count from 1
    and exist nowhere else. With ``propagate`` (the default) a handler's exception is raised
    from the enqueue call after it was recorded; with False it is only recorded.

    ``after=``, ``app.chain`` and ``app.group`` (ordering between jobs), and handlers that take
    a psycopg connection (transactional completion) need the database: they raise
    ConfigurationError here. See the module's docstring for what else is skipped."""
    if any(name in vars(app) for name in _PATCHED):
        raise ConfigurationError("eager mode is already on for this app")
    runner = _Eager(app, propagate)
    for name in _PATCHED:
        setattr(app, name, getattr(runner, name))
    try:
        yield runner.runs
    finally:
        for name in _PATCHED:
            vars(app).pop(name, None)


class _Eager:
    def __init__(self, app: App, propagate: bool) -> None:
        self.app = app
        self.propagate = propagate
        self.runs = Runs()
        self.ids = itertools.count(1)
        self.worker_id = uuid.uuid4()

    # --- the App methods it stands in for ---------------------------------------------------

    def enqueue(self, task: str, args: Any = None, **options: Any) -> Enqueued:
        return _sync(self._start(self._row(task, args, options)))

    async def enqueue_async(self, task: str, args: Any = None, **options: Any) -> Enqueued:
        return await self._start(self._row(task, args, options))

    def enqueue_many(self, jobs: Iterable[JobSpec], **options: Any) -> int:
        return sum(1 for row in self._rows(jobs, options) if _sync(self._start(row)))

    async def enqueue_many_async(self, jobs: Iterable[JobSpec], **options: Any) -> int:
        return sum([1 for row in self._rows(jobs, options) if await self._start(row)])

    def wait(self, job_id: int, timeout: float | None = None, *, queue: str | None = None) -> Any:
        # queue= picks a cluster with routes (pgqueue.routing); eager ids are one sequence.
        run = self._find(job_id)
        if run.status is not Status.SUCCEEDED:
            first_line = (run.error or "").splitlines()[0] if run.error else ""
            raise JobFailedError(
                f"job {job_id} ({run.task}) ended {run.status} in eager mode, which runs one "
                f"attempt and no retries: {first_line}",
                run,
            )
        return run.result

    async def wait_async(
        self, job_id: int, timeout: float | None = None, *, queue: str | None = None
    ) -> Any:
        return self.wait(job_id, timeout)

    def chain(self, *steps: Any, **options: Any) -> Any:
        raise ConfigurationError(_needs_database("app.chain()"))

    def group(self, members: Any, **options: Any) -> Any:
        raise ConfigurationError(_needs_database("app.group()"))

    # --- running one job --------------------------------------------------------------------

    def _row(self, task: str, args: Any, options: dict[str, Any]) -> JobRow:
        unknown = set(options) - {*_ROW_OPTIONS, "connection", "after", "after_failure"}
        unknown.discard("allow_unknown")
        if unknown:
            raise TypeError(f"enqueue() got unexpected keyword arguments {sorted(unknown)}")
        if options.get("after") is not None:
            raise ConfigurationError(_needs_database("after="))
        values: dict[str, Any] = {name: options.get(name) for name in _ROW_OPTIONS}
        return self.app._row(task, args, allow_unknown=False, **values)

    def _rows(self, jobs: Iterable[JobSpec], options: dict[str, Any]) -> Iterator[JobRow]:
        if set(options) - {"connection", "allow_unknown"}:
            raise TypeError(f"enqueue_many() got unexpected keyword arguments {sorted(options)}")
        for chunk in self.app._row_chunks(jobs, allow_unknown=False):
            yield from chunk

    async def _start(self, row: JobRow) -> Enqueued:
        task = self.app.tasks[row.task]  # _row refused unknown tasks
        if task.connection_param:
            raise ConfigurationError(
                _needs_database(f"task {task.name!r}, which takes a psycopg connection,")
            )
        args = json.loads(row.args_json)
        task.check_args(dict(args))
        job_id = next(self.ids)
        ctx = JobContext(
            job_id=job_id,
            task=task.name,
            queue=row.queue,
            attempt=1,
            max_attempts=row.max_attempts,
            lease_token=uuid.uuid4(),
            worker_id=self.worker_id,
            _lease_deadline=lambda: math.inf,  # no lease: it never runs out
            meta=None if row.meta_json is None else json.loads(row.meta_json),
        )
        kwargs = dict(args)
        if task.context_param:
            kwargs[task.context_param] = ctx
        failure: Exception | None = None
        try:
            text = encode_result(await self._call(task, kwargs, ctx))
            run = Run(job_id, task.name, args, 1, Status.SUCCEEDED, _decoded(text), None)
        except Exception as exc:
            failure = exc
            status, error = _failed(exc, row.max_attempts)
            run = Run(job_id, task.name, args, 1, status, None, error)
        self.runs.append(run)
        if failure is not None and self.propagate:
            raise failure
        return Enqueued(job_id)

    async def _call(self, task: Task[Any, Any], kwargs: dict[str, Any], ctx: JobContext) -> Any:
        async def call() -> tuple[Any, None]:
            result = task.func(**kwargs)
            if task.is_async:
                result = await result
            return result, None

        if not self.app.middleware_stack:
            return (await call())[0]
        result, _ = await hooks.call_through(self.app.middleware_stack, ctx, call)
        return result

    def _find(self, job_id: int) -> Run:
        for run in reversed(self.runs):
            if run.job_id == job_id:
                return run
        raise JobNotFoundError(f"no job {job_id} ran in this eager block")


def _sync(step: Coroutine[Any, Any, Enqueued]) -> Enqueued:
    """Run ``step`` from sync code: on a loop of its own, or in a thread if this thread
    already runs one (sync code called from async code)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(step)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, step).result()


def _decoded(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _failed(exc: Exception, max_attempts: int) -> tuple[Status, str]:
    """What a worker's first attempt would have written for ``exc`` (see the executor)."""
    if isinstance(exc, Fail):
        return Status.DEAD, storable_text(f"Fail: {exc.reason}")
    error = format_error(exc, with_traceback=not isinstance(exc, Retry))
    return (Status.RETRYING if max_attempts > 1 else Status.DEAD), error


def _needs_database(what: str) -> str:
    return f"{what} needs the database: eager mode cannot run it (use run_until_idle)"
