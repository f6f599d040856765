"""Runs one job and decides its outcome: success, retry (with backoff or Retry-After) or dead.

Async handlers run on the event loop, plain functions in the worker's thread pool, so a slow
synchronous handler never delays heartbeats. A handler that takes a psycopg connection runs in a
transaction that its success ack joins (see ``transactions``). A timeout cancels an async handler; a sync one
cannot be interrupted, so it is abandoned (its thread runs on, its result is ignored) and the
attempt fails at once, which releases the lease.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import traceback
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from uuid import UUID

import psycopg

from ..context import JobContext
from ..errors import Fail, Retry
from ..jobs import Status
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


def ack_params(batch: list[Outcome], *, packed: bool = False) -> dict[str, Any]:
    """``complete_jobs``'s parameters: one array per column, one element per job. ``packed``:
    pre-packed where ``arrays`` can (only on connections that ``arrays.register`` set up)."""
    ids = [o.job_id for o in batch]
    tokens = [o.lease_token for o in batch]
    statuses = [o.status for o in batch]
    delays = [o.delay or 0.0 for o in batch]
    errors = [o.error for o in batch]
    results = [o.result for o in batch]
    run_seconds = [o.run_seconds for o in batch]
    if not packed:
        return {
            "ids": ids,
            "tokens": tokens,
            "statuses": [s.value for s in statuses],
            "delays": delays,
            "errors": errors,
            "results": results,
            "run_seconds": run_seconds,
        }
    return {
        "ids": arrays.int8_array(ids),
        "tokens": arrays.uuid_array(tokens),
        "statuses": arrays.status_array(statuses),
        "delays": arrays.float8_array(delays),
        "errors": arrays.texts(errors),
        "results": arrays.texts(results),
        "run_seconds": arrays.float8_array(run_seconds),
    }


def format_error(exc: BaseException, *, with_traceback: bool = True) -> str:
    """``Type: message`` then the traceback, cut to a size that fits a row and a dashboard."""
    head = f"{type(exc).__name__}: {exc}".rstrip(": ")
    if not with_traceback:
        return head[:MAX_ERROR_CHARS]
    tb = "".join(traceback.format_exception(exc))
    text = f"{head}\n\n{tb}"
    if len(text) > MAX_ERROR_CHARS:
        keep = MAX_ERROR_CHARS // 2
        text = f"{text[:keep]}\n... [truncated] ...\n{text[-keep:]}"
    return text


class TaskTimeoutError(Exception):
    pass


def encode_result(result: Any) -> tuple[str | None, str | None]:
    """The handler's return value as stored JSON, or a note on why it could not be stored."""
    if result is None:
        return None, None
    try:
        return json.dumps(result, ensure_ascii=False, allow_nan=False), None
    except (TypeError, ValueError) as exc:
        return None, f"ResultNotStored: the handler's result is not JSON-serialisable ({exc})"


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

    def context(self, job: ClaimedJob, lease_seconds: float) -> JobContext:
        return JobContext(
            job_id=job.id,
            task=job.task,
            queue=job.queue,
            attempt=job.attempt,
            max_attempts=job.max_attempts,
            lease_token=job.lease_token,
            lease_deadline=time.time() + lease_seconds,
            worker_id=self.worker_id,
        )

    async def run(
        self, job: ClaimedJob, lease_seconds: float, on_ack: Callable[[], None]
    ) -> Outcome:
        """Run the handler; never raises except CancelledError (lease lost or shutdown).
        ``on_ack`` is called when a handler's own transaction is about to write its ack."""
        started = time.monotonic()
        try:
            result, written = await self._call(job, lease_seconds, started, on_ack)
        except asyncio.CancelledError:
            raise
        except Retry as exc:
            return self._retry(job, started, exc.after, exc)
        except Fail as exc:
            return self._outcome(job, started, Status.DEAD, None, f"Fail: {exc.reason}")
        except Exception as exc:
            task = self.app.tasks.get(job.task)
            backoff = (task.backoff if task else None) or self.app.backoff
            outcome = self._retry(job, started, backoff.delay(job.attempt), exc)
            outcome.uncertain = isinstance(exc, CommitUncertainError)
            return outcome
        outcome = self._success(job, started, result)
        outcome.written = written
        return outcome

    async def _call(
        self, job: ClaimedJob, lease_seconds: float, started: float, on_ack: Callable[[], None]
    ) -> tuple[Any, bool | None]:
        """The handler's result, and whether its own transaction wrote the ack (see Outcome)."""
        task = self.app.tasks.get(job.task)
        if task is None:
            known = ", ".join(sorted(self.app.tasks)) or "none"
            raise LookupError(
                f"unknown task {job.task!r}: no handler is registered under that name in this "
                f"worker (registered: {known}); it will be retried in case a deploy adds it"
            )
        kwargs = dict(job.args)
        if task.context_param:
            kwargs[task.context_param] = self.context(job, lease_seconds)
        call: Awaitable[tuple[Any, bool | None]]
        if task.connection_param:
            call = self._call_in_transaction(task, job, kwargs, started, on_ack)
        elif task.is_async:
            if task.timeout is None:
                return await task.func(**kwargs), None  # the common case, one coroutine less
            call = _no_ack(task.func(**kwargs))
        else:
            loop = asyncio.get_running_loop()
            call = _no_ack(
                loop.run_in_executor(self.threads, functools.partial(task.func, **kwargs))
            )
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
            on_ack()
            return ack_params([self._success(job, started, result)])

        if task.is_async:

            async def call_async(conn: psycopg.AsyncConnection[Any]) -> Any:
                return await task.func(**kwargs, **{param: conn})

            return self.transactions.run_async(call_async, ack)

        def call_sync(conn: psycopg.Connection[Any]) -> Any:
            return task.func(**kwargs, **{param: conn})

        loop = asyncio.get_running_loop()
        return loop.run_in_executor(
            self.threads, functools.partial(self.transactions.run_sync, call_sync, ack)
        )

    def _retry(self, job: ClaimedJob, started: float, delay: float, exc: BaseException) -> Outcome:
        traceback_wanted = not isinstance(exc, Retry | TaskTimeoutError | LookupError)
        error = format_error(exc, with_traceback=traceback_wanted)
        if job.attempt >= job.max_attempts:
            return self._outcome(job, started, Status.DEAD, None, error)
        return self._outcome(job, started, Status.RETRYING, delay, error)

    def _success(self, job: ClaimedJob, started: float, result: Any) -> Outcome:
        text, note = encode_result(result)
        return self._outcome(job, started, Status.SUCCEEDED, None, note, text)

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
