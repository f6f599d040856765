"""Runs one job and decides its outcome: success, retry (with backoff or Retry-After) or dead.

Async handlers run on the event loop, plain functions in the worker's thread pool, so a slow
synchronous handler never delays heartbeats. A timeout cancels an async handler; a sync one
cannot be interrupted, so it is abandoned (its thread runs on, its result is ignored) and the
attempt fails at once, which releases the lease.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from uuid import UUID

from ..context import JobContext
from ..errors import Fail, Retry
from ..jobs import Status
from .state import ClaimedJob

if TYPE_CHECKING:
    from ..app import App

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


class Executor:
    def __init__(self, app: App, worker_id: UUID, threads: ThreadPoolExecutor) -> None:
        self.app = app
        self.worker_id = worker_id
        self.threads = threads

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

    async def run(self, job: ClaimedJob, lease_seconds: float) -> Outcome:
        """Run the handler; never raises except CancelledError (lease lost or shutdown)."""
        started = time.monotonic()
        try:
            result = await self._call(job, lease_seconds)
        except asyncio.CancelledError:
            raise
        except Retry as exc:
            return self._retry(job, started, exc.after, exc)
        except Fail as exc:
            return self._outcome(job, started, Status.DEAD, None, f"Fail: {exc.reason}")
        except Exception as exc:
            task = self.app.tasks.get(job.task)
            backoff = (task.backoff if task else None) or self.app.backoff
            return self._retry(job, started, backoff.delay(job.attempt), exc)
        return self._success(job, started, result)

    async def _call(self, job: ClaimedJob, lease_seconds: float) -> Any:
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
        if task.is_async:
            call = task.func(**kwargs)
        else:
            loop = asyncio.get_running_loop()
            call = loop.run_in_executor(self.threads, functools.partial(task.func, **kwargs))
        if task.timeout is None:
            return await call
        try:
            return await asyncio.wait_for(call, task.timeout)
        except TimeoutError:
            raise TaskTimeoutError(
                f"task {job.task!r} exceeded its timeout of {task.timeout:g} s"
            ) from None

    def _retry(self, job: ClaimedJob, started: float, delay: float, exc: BaseException) -> Outcome:
        traceback_wanted = not isinstance(exc, Retry | TaskTimeoutError | LookupError)
        error = format_error(exc, with_traceback=traceback_wanted)
        if job.attempt >= job.max_attempts:
            return self._outcome(job, started, Status.DEAD, None, error)
        return self._outcome(job, started, Status.RETRYING, delay, error)

    def _success(self, job: ClaimedJob, started: float, result: Any) -> Outcome:
        if result is None:
            return self._outcome(job, started, Status.SUCCEEDED, None, None)
        try:
            text = json.dumps(result, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as exc:
            note = f"ResultNotStored: the handler's result is not JSON-serialisable ({exc})"
            return self._outcome(job, started, Status.SUCCEEDED, None, note)
        return self._outcome(job, started, Status.SUCCEEDED, None, None, text)

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
