"""Runs one job and decides its outcome: success, retry (with backoff or Retry-After) or dead.

Async handlers run on the event loop, plain functions in the worker's thread pool, so a slow
synchronous handler never delays heartbeats. A handler that takes a psycopg connection runs in a
transaction that its success ack joins (see ``transactions``). A timeout cancels an async handler; a sync one
cannot be interrupted, so it is abandoned (its thread runs on, its result is ignored) and the
attempt fails at once, which releases the lease.

Every outcome is storable by construction: whatever a handler returns or raises, its error text
is cleaned of what PostgreSQL's text refuses (NUL, lone surrogates), its retry delay is finite and
bounded, and a return value that cannot be stored as jsonb fails the attempt with a clear error
instead of failing the ack that carries it (and every ack batched with it).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
import logging
import math
import re
import time
import traceback
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from uuid import UUID

import psycopg

from .. import hooks
from ..context import JobContext
from ..errors import Fail, Retry
from ..jobs import MAX_DELAY_SECONDS, Status
from ..logcontext import current_job
from . import arrays
from .state import ClaimedJob
from .transactions import CommitUncertainError, Transactions

if TYPE_CHECKING:
    from ..app import App
    from ..tasks import Task

log = logging.getLogger("pgqueue.worker.executor")

MAX_ERROR_CHARS = 8000


@dataclass(slots=True)
class Outcome:
    """What the completer writes for one attempt."""

    job_id: int
    lease_token: UUID
    status: Status
    delay: float | None
    error: str | None
    result: str | None
    run_seconds: float
    queue: str
    pickup_seconds: float
    #: None: the completer writes it. True/False: the handler's own transaction already wrote
    #: it (transactional completion), and the lease was ours / had been lost.
    written: bool | None = None
    #: The write may have committed unseen (a failed COMMIT): the completer checks first.
    uncertain: bool = False
    #: Written in place of an outcome the database refused (see completer): never replaced.
    replaces: bool = False


#: How long an ack waits for a job's row lock before the completer writes around it (see
#: complete_jobs), in PostgreSQL's notation.
ACK_LOCK_TIMEOUT = "100ms"
#: How long a handler's transaction may sit idle between its ack and COMMIT
#: (complete_jobs_in_transaction): half the lease, which the executor passes; this is half the
#: default lease, for callers that do not.
ACK_IDLE_TIMEOUT = "15s"


def ack_params(
    batch: list[Outcome],
    *,
    packed: bool = False,
    lock_timeout: str = ACK_LOCK_TIMEOUT,
    idle: str = ACK_IDLE_TIMEOUT,
) -> dict[str, Any]:
    """``complete_jobs``'s parameters: one array per column, one element per job. ``packed``:
    pre-packed where ``arrays`` can (only on connections that ``arrays.register`` set up).
    ``idle``: complete_jobs_in_transaction's bound on the wait for COMMIT (unused elsewhere)."""
    ids = [o.job_id for o in batch]
    tokens = [o.lease_token for o in batch]
    statuses = [o.status for o in batch]
    delays = [o.delay or 0.0 for o in batch]
    errors = [o.error for o in batch]
    results = [o.result for o in batch]
    run_seconds = [o.run_seconds for o in batch]
    if not packed:
        return {
            "lock_timeout": lock_timeout,
            "idle": idle,
            "ids": ids,
            "tokens": tokens,
            "statuses": [s.value for s in statuses],
            "delays": delays,
            "errors": errors,
            "results": results,
            "run_seconds": run_seconds,
        }
    return {
        "lock_timeout": lock_timeout,
        "idle": idle,
        "ids": arrays.int8_array(ids),
        "tokens": arrays.uuid_array(tokens),
        "statuses": arrays.status_array(statuses),
        "delays": arrays.float8_array(delays),
        "errors": arrays.texts(errors),
        "results": arrays.texts(results),
        "run_seconds": arrays.float8_array(run_seconds),
    }


def storable_text(text: str) -> str:
    """``text`` as PostgreSQL's text type takes it: NUL and lone surrogates (from a bad decode)
    written as backslash escapes, everything else unchanged."""
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def format_error(exc: BaseException, *, with_traceback: bool = True) -> str:
    """``Type: message`` then the traceback, cut to a size that fits a row and a dashboard."""
    try:
        head = f"{type(exc).__name__}: {exc}".rstrip(": ")
    except Exception as broken:  # an exception whose __str__ raises
        head = f"{type(exc).__name__}: <str() failed: {type(broken).__name__}>"
    if not with_traceback:
        return storable_text(head[:MAX_ERROR_CHARS])
    try:
        tb = "".join(traceback.format_exception(exc))
    except Exception:
        tb = "<the traceback could not be formatted>"
    text = f"{head}\n\n{tb}"
    if len(text) > MAX_ERROR_CHARS:
        keep = MAX_ERROR_CHARS // 2
        text = f"{text[:keep]}\n... [truncated] ...\n{text[-keep:]}"
    return storable_text(text)


def bounded_delay(seconds: float) -> float:
    """A retry delay PostgreSQL's interval arithmetic takes: finite, 0 to MAX_DELAY_SECONDS."""
    if not math.isfinite(seconds):
        return MAX_DELAY_SECONDS if seconds > 0 else 0.0
    return min(max(seconds, 0.0), MAX_DELAY_SECONDS)


class TaskTimeoutError(Exception):
    pass


class TaskNotRegisteredError(Exception):
    """A claimed job's task has no handler here (the fetcher hands such jobs back first)."""


class ResultNotStorableError(Exception):
    """The handler's return value cannot be stored as jsonb: the attempt fails with this."""


#: ``\u0000`` escapes in JSON text (an odd number of backslashes before ``u0000``): jsonb refuses
#: them. An even number is an escaped backslash followed by the letters, which is fine.
_NUL_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def encode_result(result: Any) -> str | None:
    """The handler's return value as the JSON text ``complete_jobs`` stores as jsonb; raises
    ResultNotStorableError for anything PostgreSQL would refuse, so that no ack ever fails on
    it."""
    if result is None:
        return None
    try:
        text = json.dumps(result, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ResultNotStorableError(
            f"the handler's return value cannot be stored as JSON ({exc})"
        ) from None
    if "\\u0000" in text and _NUL_ESCAPE.search(text):
        raise ResultNotStorableError(
            "the handler's return value contains NUL (\\u0000), which jsonb cannot store"
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ResultNotStorableError(
            "the handler's return value contains a lone surrogate (not valid UTF-8)"
        ) from None
    return text


async def _no_ack(call: Awaitable[Any]) -> tuple[Any, None]:
    return await call, None


class Executor:
    def __init__(
        self,
        app: App,
        worker_id: UUID,
        threads: ThreadPoolExecutor,
        transactions: Transactions,
    ) -> None:
        self.app = app
        self.worker_id = worker_id
        self.threads = threads
        self.transactions = transactions
        #: A callback's parents' results (parent_results), set by the runtime.
        self.results_of: Callable[[int], Awaitable[list[Any]]] | None = None

    def context(self, job: ClaimedJob, lease_deadline: Callable[[], float]) -> JobContext:
        return JobContext(
            job_id=job.id,
            task=job.task,
            queue=job.queue,
            attempt=job.attempt,
            max_attempts=job.max_attempts,
            lease_token=job.lease_token,
            worker_id=self.worker_id,
            pickup_seconds=job.pickup_seconds,
            _lease_deadline=lease_deadline,
            _cancelled=lambda: job.cancel_asked,
            meta=job.meta,
            _progress=functools.partial(_keep_progress, job),
        )

    async def run(
        self,
        job: ClaimedJob,
        started: float,
        lease_deadline: Callable[[], float],
        on_ack: Callable[[], None],
    ) -> Outcome:
        """Run the handler; never raises except CancelledError (the handler's own or the
        worker's: the caller tells them apart). ``started`` is the monotonic start time;
        ``on_ack`` is called when a handler's own transaction is about to write its ack."""
        text: str | None = None
        # Log records of this attempt (its thread's too: see _call) name the job; JobRun gives
        # each job its own context, so nothing is reset.
        current_job.set(job)
        try:
            if self.app.middleware_stack:
                ctx = self.context(job, lease_deadline)
                result, written = await hooks.call_through(
                    self.app.middleware_stack,
                    ctx,
                    functools.partial(self._call, job, lease_deadline, started, on_ack, ctx),
                )
            else:
                result, written = await self._call(job, lease_deadline, started, on_ack)
            if written is None:  # else the handler's own transaction stored it already
                text = encode_result(result)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            return self.failure(job, started, exc)
        outcome = self._outcome(job, started, Status.SUCCEEDED, None, None, text)
        outcome.written = written
        return outcome

    def cancelled(self, job: ClaimedJob, started: float) -> Outcome:
        """The outcome of an attempt stopped because someone asked to cancel the job."""
        return self._outcome(
            job, started, Status.CANCELLED, None, "Cancelled: cancel requested while it ran"
        )

    def failure(self, job: ClaimedJob, started: float, exc: BaseException) -> Outcome:
        """The outcome of an attempt that raised ``exc``: a retry, or dead (cancelled, once
        someone asked to cancel the job: whatever it raised then is the cancellation's)."""
        if job.cancel_asked:
            return self.cancelled(job, started)
        if isinstance(exc, Retry):
            return self._retry(job, started, exc.after, exc)
        if isinstance(exc, Fail):
            return self._outcome(
                job, started, Status.DEAD, None, storable_text(f"Fail: {exc.reason}")
            )
        outcome = self._retry(job, started, self._backoff_delay(job), exc)
        outcome.uncertain = isinstance(exc, CommitUncertainError)
        return outcome

    def unstorable(self, job: ClaimedJob, outcome: Outcome, reason: str) -> Outcome:
        """What to write instead of an outcome the database refused: a failed attempt whose
        error says why, with nothing of the handler's in it (plain ASCII, no result)."""
        cause = reason.encode("ascii", "backslashreplace").decode("ascii")[: MAX_ERROR_CHARS // 2]
        error = (
            f"OutcomeNotStored: the database refused to store this attempt's "
            f"{outcome.status.value} outcome ({cause})"
        )
        dead = job.attempt >= job.max_attempts
        return Outcome(
            job_id=job.id,
            lease_token=job.lease_token,
            status=Status.DEAD if dead else Status.RETRYING,
            delay=None if dead else bounded_delay(self._backoff_delay(job)),
            error=error,
            result=None,
            run_seconds=outcome.run_seconds,
            queue=job.queue,
            pickup_seconds=job.pickup_seconds,
        )

    def _backoff_delay(self, job: ClaimedJob) -> float:
        task = self.app.tasks.get(job.task)
        backoff = (task.backoff if task else None) or self.app.backoff
        return backoff.delay(job.attempt)

    async def _call(
        self,
        job: ClaimedJob,
        lease_deadline: Callable[[], float],
        started: float,
        on_ack: Callable[[], None],
        ctx: JobContext | None = None,
    ) -> tuple[Any, bool | None]:
        """The handler's result, and whether its own transaction wrote the ack (see Outcome).
        ``ctx``: the middleware's context, given to the handler too (one per attempt)."""
        task = self.app.tasks.get(job.task)
        if task is None:
            raise TaskNotRegisteredError(f"no handler is registered for task {job.task!r}")
        kwargs = dict(job.args)
        if task.wants_results and "results" not in kwargs and self.results_of is not None:
            kwargs["results"] = await self.results_of(job.id)  # its parents', in their order
        if task.context_param:
            kwargs[task.context_param] = ctx or self.context(job, lease_deadline)
        call: Awaitable[tuple[Any, bool | None]]
        if task.connection_param:
            call = self._call_in_transaction(task, job, kwargs, started, on_ack)
        elif task.is_async:
            if task.timeout is None:
                return await task.func(**kwargs), None  # the common case, one coroutine less
            call = _no_ack(task.func(**kwargs))
        else:
            loop = asyncio.get_running_loop()
            # The job's context variables (the log context, a middleware's) reach the thread.
            func = functools.partial(contextvars.copy_context().run, task.func, **kwargs)
            call = _no_ack(loop.run_in_executor(self.threads, func))
        if task.timeout is None:
            return await call
        try:
            return await asyncio.wait_for(call, task.timeout)
        except TimeoutError:
            if not task.is_async:
                log.warning(
                    "job %d: sync task %r abandoned at its %g s timeout; its thread runs on "
                    "until the function returns", job.id, job.task, task.timeout,
                )  # fmt: skip
            raise TaskTimeoutError(
                f"task {job.task!r} exceeded its timeout of {task.timeout:g} s"
            ) from None

    def _call_in_transaction(
        self,
        task: Task[Any, Any],
        job: ClaimedJob,
        kwargs: dict[str, Any],
        started: float,
        on_ack: Callable[[], None],
    ) -> Awaitable[tuple[Any, bool]]:
        param = task.connection_param
        assert param is not None

        def ack(result: Any) -> dict[str, Any]:
            text = encode_result(result)  # raises (rolling the transaction back) if unstorable
            on_ack()
            return ack_params(
                [self._outcome(job, started, Status.SUCCEEDED, None, None, text)],
                lock_timeout=self.transactions.lock_timeout,
                idle=self.transactions.idle_timeout,
            )

        if task.is_async:

            async def call_async(conn: psycopg.AsyncConnection[Any]) -> Any:
                return await task.func(**kwargs, **{param: conn})

            return self.transactions.run_async(call_async, ack)

        def call_sync(conn: psycopg.Connection[Any]) -> Any:
            return task.func(**kwargs, **{param: conn})

        loop = asyncio.get_running_loop()
        return loop.run_in_executor(
            self.threads,
            functools.partial(contextvars.copy_context().run, self.transactions.run_sync,
                              call_sync, ack),
        )  # fmt: skip

    def _retry(self, job: ClaimedJob, started: float, delay: float, exc: BaseException) -> Outcome:
        traceback_wanted = not isinstance(
            exc, Retry | TaskTimeoutError | TaskNotRegisteredError | ResultNotStorableError
        )
        error = format_error(exc, with_traceback=traceback_wanted)
        if job.attempt >= job.max_attempts:
            return self._outcome(job, started, Status.DEAD, None, error)
        return self._outcome(job, started, Status.RETRYING, bounded_delay(delay), error)

    def _outcome(
        self,
        job: ClaimedJob,
        started: float,
        status: Status,
        delay: float | None,
        error: str | None,
        result: str | None = None,
    ) -> Outcome:
        return Outcome(
            job_id=job.id,
            lease_token=job.lease_token,
            status=status,
            delay=delay,
            error=error,
            result=result,
            run_seconds=time.monotonic() - started,
            queue=job.queue,
            pickup_seconds=job.pickup_seconds,
        )


def _keep_progress(job: ClaimedJob, text: str) -> None:
    """The handler's latest progress, for the next heartbeat to write (see heartbeat)."""
    job.progress = text
