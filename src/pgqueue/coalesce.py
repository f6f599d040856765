"""The coalescing producer: many callers' single enqueues written by one INSERT and one commit.

A web server under load makes many ``enqueue`` calls at once, each one row, one round trip and
one commit (a WAL flush) of its own: the commits, not the rows, bound its jobs/s. With
``App(coalesce=True)`` the calls that arrive while a batch is being written wait for it to end
and then go together as the next batch ("group commit"): a lone call goes at once, and the
batch grows with the load by itself. A call waits for the batch in flight at most
``coalesce_window`` seconds before another batch starts beside it (up to ``MAX_IN_FLIGHT`` at
once, each on its own pooled connection), and a batch takes ``coalesce_max`` jobs at most.

Each caller gets its own answer only once its row is committed: its id, ``duplicate`` for a
unique job as if the calls had been made one after the other (a repeat of a key within a batch
is answered with the first one's job), or its own error. A job refused by its checks fails in
its caller before it is queued here. A batch is one autocommit statement (and, for unique keys
whose job no longer holds them, rarely one more for those jobs), so it commits as a whole or
not at all: a lost connection reaches every caller of the batch not yet answered as
``DatabaseUnavailableError`` (their jobs may or may not have been written, as for a single
call), and any other database error, after which nothing of the statement was written, sends
each of its jobs again alone, so an error is reported only to the caller whose job causes it.

What is never coalesced: a call with ``connection=`` (its job belongs to the caller's
transaction), a job with ``after=``, and a unique job with ``on_conflict`` "replace" or
"debounce" (its answer says whether it replaced; it goes the usual way, one statement).

The sync batcher lets the callers' threads write the batches (one caller leads each batch) and
the async one runs each batch in a task of its event loop: as in ``pgqueue.pools``, nothing runs
in the background between calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from . import pools, producer, wire
from .errors import ConfigurationError, DatabaseUnavailableError, PgQueueError
from .jobs import Enqueued
from .producer import JobRow
from .sql import Queries

DEFAULT_WINDOW = 0.002
DEFAULT_MAX = 500
#: Batches being written at once per batcher (the sync one, and each event loop's): each holds
#: one of the pool's ``pools.MAX_SIZE`` connections, and fewer, fuller batches commit more jobs.
MAX_IN_FLIGHT = 4
#: A batch stops taking jobs at this many bytes of arguments and meta (a job bigger than this,
#: within ``max_payload_bytes``, goes in a batch of its own).
MAX_BATCH_BYTES = 8 * 1024 * 1024

Outcome = Enqueued | BaseException


@dataclass(frozen=True, slots=True)
class Settings:
    window: float
    max_jobs: int

    @classmethod
    def of(cls, window: object, max_jobs: object) -> Settings:
        if isinstance(window, bool) or not isinstance(window, int | float) or not 0 < window <= 1:
            raise ConfigurationError(
                f"coalesce_window must be seconds, above 0 and at most 1, got {window!r}"
            )
        if (
            isinstance(max_jobs, bool)
            or not isinstance(max_jobs, int)
            or not 0 < max_jobs <= 10_000
        ):
            raise ConfigurationError(
                f"coalesce_max must be an integer from 1 to 10,000, got {max_jobs!r}"
            )
        return cls(float(window), max_jobs)


@dataclass(frozen=True, slots=True)
class CoalesceStats:
    """What the coalescing producer wrote since the app was made: ``jobs`` in ``batches``
    statements (a batch's retries for released unique keys are not counted again)."""

    batches: int = 0
    jobs: int = 0


def batchable(row: JobRow) -> bool:
    """Whether a job may share a statement with others without changing its answer."""
    return row.after is None and (row.unique_key is None or row.on_conflict == "keep")


# --- one batch: the statement and the answers (shared by the sync and async twins) ---------


def _column(values: list[Any]) -> list[Any] | None:
    """An array parameter of insert_coalesced_jobs, or NULL when every value is NULL: unnest
    pads a shorter array (a NULL one has no elements) with NULLs, while psycopg dumps a list
    element by element, Nones too. Most batches leave six of the twelve columns empty (no
    absolute run_at, no key, no limit group, no meta), and five more the same in every row
    (``_shared``): only the arguments are then an array of 100 (docs/performance.md,
    "Coalescing producer", for what each trim measured)."""
    return None if values.count(None) == len(values) else values


def _shared(values: list[Any]) -> tuple[list[Any] | None, Any]:
    """An array parameter of insert_coalesced_jobs and its ``*_all`` twin: (NULL, the value)
    when every row has the same non-NULL value, else (the values, NULL)."""
    if values and values[0] is not None and values.count(values[0]) == len(values):
        return None, values[0]
    return values, None


class Batch:
    """The rows of one batch and each one's outcome, filled in as statements answer."""

    def __init__(self, rows: Sequence[JobRow]) -> None:
        self.rows = rows
        self.outcomes: list[Outcome | None] = [None] * len(rows)
        #: A repeat of a key → the index of the first row with it (answered with its job).
        self.repeats: dict[int, int] = {}
        #: The rows the next statement writes.
        self.todo: list[int] = []
        firsts: dict[str, int] = {}
        for i, row in enumerate(rows):
            if row.unique_key is not None:
                first = firsts.setdefault(row.unique_key, i)
                if first != i:
                    self.repeats[i] = first
                    continue
            self.todo.append(i)

    def params(self) -> dict[str, Any]:
        rows = [self.rows[i] for i in self.todo]
        queues, queue = _shared([r.queue for r in rows])
        tasks, task = _shared([r.task for r in rows])
        priorities, priority = _shared([r.priority for r in rows])
        delays, delay = _shared([r.delay for r in rows])
        max_attempts, max_attempts_all = _shared([r.max_attempts for r in rows])
        return {
            "queues": queues,
            "queue_all": queue,
            "tasks": tasks,
            "task_all": task,
            "args": [r.args_json for r in rows],
            "priorities": priorities,
            "priority_all": priority,
            "run_ats": _column([r.run_at for r in rows]),
            "delays": delays,
            "delay_all": delay,
            "max_attempts": max_attempts,
            "max_attempts_all": max_attempts_all,
            "keys": _column([r.unique_key for r in rows]),
            "whiles": _column([r.unique_while for r in rows]),
            "fors": _column([r.unique_for for r in rows]),
            "limit_keys": _column([r.limit_key for r in rows]),
            "metas": _column([r.meta_json for r in rows]),
        }

    def answer(self, returned: list[tuple[Any, ...]]) -> bool:
        """Take a statement's rows; True when every row sent is answered. Plain rows' ids are
        drawn in their order (see insert_coalesced_jobs); unique ones are found by key."""
        by_key = {key: (job, existed) for job, key, existed in returned if key is not None}
        plain = sorted(job for job, key, _ in returned if key is None)
        sent = sum(1 for i in self.todo if self.rows[i].unique_key is None)
        if len(plain) != sent:
            raise PgQueueError(f"insert_coalesced_jobs answered {len(plain)} of {sent} plain jobs")
        left: list[int] = []
        ids = iter(plain)
        for i in self.todo:
            key = self.rows[i].unique_key
            if key is None:
                self.outcomes[i] = Enqueued(next(ids))
            elif key in by_key:
                job, existed = by_key[key]
                self.outcomes[i] = Enqueued(job, bool(existed))
            else:
                left.append(i)
        self.todo = left
        return not left

    def released_keys(self) -> dict[str, Any]:
        return {"keys": [self.rows[i].unique_key for i in self.todo]}

    def give_up(self) -> None:
        for i in self.todo:
            self.outcomes[i] = producer.no_answer(self.rows[i])
        self.todo = []

    def settle_repeats(self) -> None:
        """A repeat of a key not answered yet gets what its first row got, as a duplicate of
        that job."""
        for i, first in self.repeats.items():
            outcome = self.outcomes[first]
            if self.outcomes[i] is not None:
                continue
            if isinstance(outcome, Enqueued):
                self.outcomes[i] = Enqueued(outcome.id, duplicate=True)
            elif outcome is not None:
                self.outcomes[i] = _copy(outcome)

    def unanswered(self) -> list[int]:
        return [i for i, outcome in enumerate(self.outcomes) if outcome is None]

    def fail(self, error: BaseException) -> None:
        """``error`` for every caller not answered yet, each its own copy to raise."""
        for i in self.unanswered():
            self.outcomes[i] = _copy(error)

    def results(self) -> list[Outcome]:
        return [outcome if outcome is not None else _lost_track() for outcome in self.outcomes]


def _lost_track() -> PgQueueError:
    return PgQueueError("the coalescing producer lost track of this job (a bug: please report)")


def write(conn: psycopg.Connection[Any], q: Queries, batch: Batch) -> None:
    for _ in range(producer.UNIQUE_TRIES):
        if batch.answer(conn.execute(q.insert_coalesced_jobs, batch.params()).fetchall()):
            return
        conn.execute(q.release_unique_keys, batch.released_keys())
    batch.give_up()


async def write_async(conn: psycopg.AsyncConnection[Any], q: Queries, batch: Batch) -> None:
    for _ in range(producer.UNIQUE_TRIES):
        cursor = await conn.execute(q.insert_coalesced_jobs, batch.params())
        if batch.answer(await cursor.fetchall()):
            return
        await conn.execute(q.release_unique_keys, batch.released_keys())
    batch.give_up()


def _refused(exc: psycopg.Error) -> bool:
    """Whether the statement certainly wrote nothing: the server answered it with an error
    (a lost connection is DatabaseUnavailableError by then), or psycopg refused it before
    sending. Otherwise the batch's fate is unknown and no job of it may be sent again."""
    return exc.sqlstate is not None or not isinstance(exc, psycopg.OperationalError)


def _copy(error: BaseException) -> BaseException:
    """An error of a whole batch, as one caller's own exception (one object raised in many
    threads or tasks would collect all their tracebacks)."""
    try:
        mine = copy.copy(error)
    except Exception:
        return error
    mine.__cause__ = error.__cause__
    mine.__suppress_context__ = error.__suppress_context__
    return mine


def _raise(outcome: Outcome) -> Enqueued:
    if isinstance(outcome, Enqueued):
        return outcome
    raise outcome


def _closed() -> DatabaseUnavailableError:
    return DatabaseUnavailableError(
        "the app was closed while this job waited for its batch; nothing of it was written"
    )


def _interrupted() -> DatabaseUnavailableError:
    return DatabaseUnavailableError(
        "the write of this job's batch was interrupted; the job may or may not have been written"
    )


def _take(pending: deque[Any], settings: Settings) -> list[Any]:
    """The oldest pending calls, up to the batch's bounds (at least one)."""
    calls = [pending.popleft()]
    size = len(calls[0].row.args_json) + len(calls[0].row.meta_json or "")
    while pending and len(calls) < settings.max_jobs:
        row = pending[0].row
        size += len(row.args_json) + len(row.meta_json or "")
        if size > MAX_BATCH_BYTES:
            break
        calls.append(pending.popleft())
    return calls


class _Counter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.stats = CoalesceStats()

    def add(self, jobs: int) -> None:
        with self._lock:
            self.stats = CoalesceStats(self.stats.batches + 1, self.stats.jobs + jobs)


# --- sync: the callers' threads take turns writing ------------------------------------------


class _Call:
    __slots__ = ("nominated", "outcome", "row", "signalled", "since", "taken", "wake")

    def __init__(self, row: JobRow) -> None:
        self.row = row
        self.since = time.monotonic()
        self.outcome: Outcome | None = None
        self.taken = False
        #: Woken by a batch that ended: it may start the next at once, window or not.
        self.nominated = False
        # A bare lock, held until the call is woken: a wait is one acquire in C, where an Event
        # (a Condition written in Python) allocates a lock and takes two more per wait.
        self.wake = threading.Lock()
        self.wake.acquire()
        self.signalled = False

    def signal(self) -> None:
        """Wake the caller's thread (under the batcher's lock; repeated wakes count once)."""
        if not self.signalled:
            self.signalled = True
            self.wake.release()


class SyncBatcher:
    def __init__(
        self, settings: Settings, write: Callable[[list[JobRow]], list[Outcome]], counter: _Counter
    ) -> None:
        self.settings = settings
        self._write = write
        self._counter = counter
        self._lock = threading.Lock()
        self._pending: deque[_Call] = deque()
        self._in_flight = 0

    def submit(self, row: JobRow) -> Enqueued:
        call = _Call(row)
        queued = woken = False
        while True:
            calls: list[_Call] | None = None
            timeout: float | None = None
            with self._lock:
                if not queued:
                    self._pending.append(call)
                    queued = True
                if call.signalled:  # take the wake, so the next one can be given
                    if not woken:
                        call.wake.acquire(blocking=False)
                    call.signalled = False
                if call.outcome is not None:
                    break
                if not call.taken and self._may_start(call):
                    calls = self._start()
                else:
                    timeout = self._timeout(call)
            if calls is not None:
                self._lead(calls)
                woken = False
                continue
            woken = call.wake.acquire(timeout=-1 if timeout is None else timeout)
            # Set before the wake: read without taking the lock the other callers contend for.
            if woken and call.outcome is not None:
                break
        assert call.outcome is not None
        return _raise(call.outcome)

    def _may_start(self, call: _Call) -> bool:
        if self._in_flight >= MAX_IN_FLIGHT:
            return False
        waited = time.monotonic() - self._pending[0].since
        return self._in_flight == 0 or call.nominated or waited >= self.settings.window

    def _timeout(self, call: _Call) -> float | None:
        """The oldest pending call watches the window; the others wait to be answered or woken."""
        if call.taken or self._in_flight >= MAX_IN_FLIGHT or self._pending[0] is not call:
            return None
        return max(call.since + self.settings.window - time.monotonic(), 0.0)

    def _start(self) -> list[_Call]:
        calls = _take(self._pending, self.settings)
        for c in calls:
            c.taken = True
        self._in_flight += 1
        if self._pending:  # the new oldest watches the window from now
            self._pending[0].signal()
        return calls

    def _lead(self, calls: list[_Call]) -> None:
        outcomes: list[Outcome] | None = None
        try:
            outcomes = self._write([c.row for c in calls])
            self._counter.add(len(calls))
        finally:
            with self._lock:
                if outcomes is None:
                    outcomes = [_interrupted() for _ in calls]
                for c, outcome in zip(calls, outcomes, strict=True):
                    c.outcome = outcome
                    c.signal()
                self._in_flight -= 1
                if self._pending:
                    self._pending[0].nominated = True
                    self._pending[0].signal()

    def close(self) -> None:
        """Calls not yet in a batch fail, saying nothing was written; batches being written
        end as usual."""
        with self._lock:
            while self._pending:
                call = self._pending.popleft()
                call.outcome = _closed()
                call.signal()


# --- async: each batch is a task of the loop ------------------------------------------------


class _Waiting:
    __slots__ = ("future", "row", "since")

    def __init__(self, row: JobRow, future: asyncio.Future[Outcome], since: float) -> None:
        self.row = row
        self.future = future
        self.since = since


class AsyncBatcher:
    def __init__(
        self,
        settings: Settings,
        write: Callable[[list[JobRow]], Awaitable[list[Outcome]]],
        counter: _Counter,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.settings = settings
        self.loop = loop
        self._write = write
        self._counter = counter
        self._pending: deque[_Waiting] = deque()
        self._in_flight = 0
        #: A batch's task is made but has not run yet: it takes every call queued until then.
        self._starting = False
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def submit(self, row: JobRow) -> Enqueued:
        future: asyncio.Future[Outcome] = self.loop.create_future()
        self._pending.append(_Waiting(row, future, self.loop.time()))
        self._schedule(freed=False)
        return _raise(await future)

    def _schedule(self, *, freed: bool) -> None:
        """Start a batch if one may start now, else make sure the window's end is watched."""
        # A caller cancelled before its job was sent has given up on it: it is not written.
        while self._pending and self._pending[0].future.done():
            self._pending.popleft()
        if self._starting or not self._pending or self._in_flight >= MAX_IN_FLIGHT:
            return
        if self._in_flight and not freed:
            due = self._pending[0].since + self.settings.window
            if due > self.loop.time():
                if self._timer is None:
                    self._timer = self.loop.call_at(due, self._window_ended)
                return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._starting = True
        self._in_flight += 1
        # A context of its own: the batch is nobody's call (no caller's span or log context).
        task = self.loop.create_task(self._flush(), context=contextvars.Context())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _window_ended(self) -> None:
        self._timer = None
        self._schedule(freed=False)

    async def _flush(self) -> None:
        self._starting = False
        calls = (
            [c for c in _take(self._pending, self.settings) if not c.future.done()]
            if self._pending
            else []
        )
        self._schedule(freed=False)
        outcomes: list[Outcome] | None = None
        try:
            if calls:
                outcomes = await self._write([c.row for c in calls])
                self._counter.add(len(calls))
        finally:
            if outcomes is None:
                outcomes = [_interrupted() for _ in calls]
            for c, outcome in zip(calls, outcomes, strict=True):
                if not c.future.done():
                    c.future.set_result(outcome)
            self._in_flight -= 1
            self._schedule(freed=True)

    def close(self) -> None:
        """``SyncBatcher.close``, on the batcher's loop."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._pending:
            waiting = self._pending.popleft()
            if not waiting.future.done():
                waiting.future.set_result(_closed())


# --- what the App holds ---------------------------------------------------------------------


class Coalescer:
    """An app's coalescing producer: the sync batcher and one async batcher per event loop.
    ``sync_pool`` and ``async_pool`` give the app's pools (made again after ``App.close``)."""

    def __init__(
        self,
        settings: Settings,
        q: Queries,
        sync_pool: Callable[[], pools.Pool],
        async_pool: Callable[[], Awaitable[pools.AsyncPool]],
    ) -> None:
        self.settings = settings
        self.q = q
        self._sync_pool = sync_pool
        self._async_pool = async_pool
        self._counter = _Counter()
        self._sync = SyncBatcher(settings, self._write, self._counter)
        self._loops: dict[int, AsyncBatcher] = {}
        self._lock = threading.Lock()

    @property
    def stats(self) -> CoalesceStats:
        return self._counter.stats

    def enqueue(self, row: JobRow) -> Enqueued:
        return self._sync.submit(row)

    async def enqueue_async(self, row: JobRow) -> Enqueued:
        return await self._batcher().submit(row)

    def _batcher(self) -> AsyncBatcher:
        loop = asyncio.get_running_loop()
        batcher = self._loops.get(id(loop))
        if batcher is None or batcher.loop is not loop:
            with self._lock:
                for key in [k for k, b in self._loops.items() if b.loop.is_closed()]:
                    del self._loops[key]
                batcher = AsyncBatcher(self.settings, self._write_async, self._counter, loop)
                self._loops[id(loop)] = batcher
        return batcher

    def close(self) -> None:
        """Fail the calls still waiting for a batch (each loop's on its loop); see
        ``SyncBatcher.close``."""
        self._sync.close()
        with self._lock:
            batchers, self._loops = list(self._loops.values()), {}
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        for batcher in batchers:
            if batcher.loop is running:
                batcher.close()
            elif not batcher.loop.is_closed():
                # A loop closed meanwhile has nothing waiting on it.
                with contextlib.suppress(RuntimeError):
                    batcher.loop.call_soon_threadsafe(batcher.close)

    def _write(self, rows: list[JobRow]) -> list[Outcome]:
        if len(rows) == 1:  # alone: the usual statement, cheaper than a batch's arrays
            try:
                return [self._sync_pool().run(self._single(rows[0]))]
            except Exception as exc:
                return [exc]
        batch = Batch(rows)
        try:
            pool = self._sync_pool()
            pool.run(lambda conn: write(conn, self.q, batch))
        except psycopg.Error as exc:
            # Nothing of the refused statement was written: its jobs go again one by one, in
            # order, so only the job at fault fails, in its own caller.
            batch.settle_repeats()
            for i in batch.unanswered() if _refused(exc) else ():
                try:
                    batch.outcomes[i] = pool.run(self._single(rows[i]))
                except Exception as error:
                    batch.outcomes[i] = error
            batch.fail(exc)  # what was not refused may have been written: never sent again
        except Exception as exc:  # DatabaseUnavailableError: these jobs' fate is unknown
            batch.settle_repeats()
            batch.fail(exc)
        batch.settle_repeats()
        return batch.results()

    def _single(self, row: JobRow) -> Callable[[pools.SyncConn], Enqueued]:
        return lambda conn: wire.pooled_insert(conn, self.q, row)

    async def _write_async(self, rows: list[JobRow]) -> list[Outcome]:
        """``_write`` for async code."""
        if len(rows) == 1:
            try:
                pool = await self._async_pool()
                return [await pool.run(self._single_async(rows[0]))]
            except Exception as exc:
                return [exc]
        batch = Batch(rows)
        try:
            pool = await self._async_pool()
            await pool.run(lambda conn: write_async(conn, self.q, batch))
        except psycopg.Error as exc:
            batch.settle_repeats()
            for i in batch.unanswered() if _refused(exc) else ():
                try:
                    batch.outcomes[i] = await pool.run(self._single_async(rows[i]))
                except Exception as error:
                    batch.outcomes[i] = error
            batch.fail(exc)
        except Exception as exc:
            batch.settle_repeats()
            batch.fail(exc)
        batch.settle_repeats()
        return batch.results()

    def _single_async(self, row: JobRow) -> Callable[[pools.AsyncConn], Awaitable[Enqueued]]:
        return lambda conn: wire.pooled_insert_async(conn, self.q, row)
