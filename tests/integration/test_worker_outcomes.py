"""Outcomes of one attempt, with an in-process worker on a real database."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from typing import Any

import psycopg
import pytest

import pgqueue
from tests.helpers import db_clock, running_worker, wait_until, wait_until_async

Conn = psycopg.Connection[tuple[Any, ...]]
FAST = {"lease": 2.0, "heartbeat_interval": 0.5, "poll_interval": 0.2, "reaper_interval": 0.3}


def job_row(conn: Conn, job_id: int) -> tuple[Any, ...]:
    row = conn.execute(
        "SELECT status::text, attempts, last_error, result, lease_token, worker_id,"
        " extract(epoch FROM run_at)::float8 FROM pgqueue_jobs WHERE id = %s",
        (job_id,),
    ).fetchone()
    assert row is not None
    return row


def status_is(conn: Conn, job_id: int, *statuses: str) -> Any:
    return lambda: job_row(conn, job_id)[0] in statuses


async def test_success_stores_result_and_ends_the_lease(app: pgqueue.App, conn: Conn) -> None:
    @app.task
    async def add(a: int, b: int) -> dict[str, int]:
        return {"sum": a + b}

    job_id = add.enqueue(a=2, b=3)
    async with running_worker(app, **FAST):
        await wait_until_async(status_is(conn, job_id, "succeeded"))
    status, attempts, error, result, token, worker, _ = job_row(conn, job_id)
    assert (status, attempts, error, result, worker) == ("succeeded", 1, None, {"sum": 5}, None)
    assert token is not None  # kept: it identifies the attempt whose result this is
    row = conn.execute(
        "SELECT finished_at IS NOT NULL, started_at >= claimed_at - interval '1 second',"
        " lease_expires_at IS NULL FROM pgqueue_jobs WHERE id = %s",
        (job_id,),
    ).fetchone()
    assert row == (True, True, True)


async def test_sync_handler_runs_in_thread_without_blocking_heartbeats(
    app: pgqueue.App, conn: Conn
) -> None:
    @app.task
    def slow() -> str:
        time.sleep(2.5)  # longer than the lease: only heartbeats keep it
        return "done"

    job_id = slow.enqueue()
    async with running_worker(app, **FAST) as worker:
        await wait_until_async(status_is(conn, job_id, "succeeded"), timeout=15)
        assert worker.state is not None
        assert worker.state.counters.stale_writes == 0
    assert job_row(conn, job_id)[1] == 1


async def test_exception_retries_with_backoff_then_dies_with_last_error(
    app: pgqueue.App, conn: Conn
) -> None:
    app.backoff = pgqueue.Backoff(base=0.2, cap=0.4)

    @app.task(max_attempts=3)
    def flaky() -> None:
        raise RuntimeError("remote said no")

    job_id = flaky.enqueue()
    async with running_worker(app, **FAST):
        await wait_until_async(status_is(conn, job_id, "dead"), timeout=15)
    _status, attempts, error, *_ = job_row(conn, job_id)
    assert attempts == 3
    assert error.startswith("RuntimeError: remote said no")
    assert "Traceback" in error


async def test_retry_delay_is_within_the_backoff_bounds(app: pgqueue.App, conn: Conn) -> None:
    app.backoff = pgqueue.Backoff(base=30, cap=3600)

    @app.task(max_attempts=5)
    def fails() -> None:
        raise ValueError("x")

    job_id = fails.enqueue()
    async with running_worker(app, **FAST):
        await wait_until_async(status_is(conn, job_id, "retrying"))
    # run_at - started_at is the chosen delay plus the handler's (tiny) run time, both taken
    # from the database clock at the ack, so it does not depend on when the test looks.
    row = conn.execute(
        "SELECT extract(epoch FROM run_at - started_at)::float8 FROM pgqueue_jobs WHERE id = %s",
        (job_id,),
    ).fetchone()
    assert row is not None
    assert 0 <= row[0] <= 30 + 1  # first retry: uniform(0, base)


async def test_retry_after_delays_exactly_and_counts_the_attempt(
    app: pgqueue.App, conn: Conn
) -> None:
    @app.task(max_attempts=5)
    def rate_limited() -> None:
        raise pgqueue.Retry(after=120, reason="429 from upstream")

    before = db_clock(conn)
    job_id = rate_limited.enqueue()
    async with running_worker(app, **FAST):
        await wait_until_async(status_is(conn, job_id, "retrying"))
        after = db_clock(conn)
    _status, attempts, error, *_, run_at = job_row(conn, job_id)
    assert attempts == 1
    # 120 s after the ack, which came between the two clock readings, however slow the machine.
    assert before + 120 <= run_at <= after + 120
    assert "429 from upstream" in error


async def test_fail_goes_straight_to_dead(app: pgqueue.App, conn: Conn) -> None:
    @app.task(max_attempts=10)
    def invalid_order() -> None:
        raise pgqueue.Fail("order 7 does not exist")

    job_id = invalid_order.enqueue()
    async with running_worker(app, **FAST):
        await wait_until_async(status_is(conn, job_id, "dead"))
    _, attempts, error, *_ = job_row(conn, job_id)
    assert attempts == 1
    assert error == "Fail: order 7 does not exist"


async def test_requeued_dead_job_runs_again(app: pgqueue.App, conn: Conn) -> None:
    calls: list[int] = []

    @app.task(max_attempts=1)
    def once_broken(ctx: pgqueue.JobContext) -> None:
        calls.append(ctx.attempt)
        if len(calls) == 1:
            raise RuntimeError("first time fails")

    job_id = once_broken.enqueue()
    async with running_worker(app, **FAST):
        await wait_until_async(status_is(conn, job_id, "dead"))
        assert app.requeue(job_id)
        await wait_until_async(status_is(conn, job_id, "succeeded"))
    assert calls == [1, 1]


async def test_async_timeout_cancels_the_handler(app: pgqueue.App, conn: Conn) -> None:
    cancelled = asyncio.Event()

    @app.task(timeout=0.3, max_attempts=1)
    async def hangs() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    job_id = hangs.enqueue()
    async with running_worker(app, **FAST):
        await wait_until_async(status_is(conn, job_id, "dead"))
    assert cancelled.is_set()
    assert "exceeded its timeout of 0.3 s" in job_row(conn, job_id)[2]


async def test_sync_timeout_abandons_the_thread_and_frees_the_lease(
    app: pgqueue.App, conn: Conn
) -> None:
    @app.task(timeout=0.3, max_attempts=2)
    def stuck() -> None:
        time.sleep(1.5)

    def ended_attempt() -> tuple[Any, ...] | None:
        # One read: a retrying job may be claimed again within its jittered delay, so a second
        # read could find the next attempt's lease rather than the freed one.
        row = job_row(conn, job_id)
        return row if row[0] in ("retrying", "dead") else None

    job_id = stuck.enqueue()
    async with running_worker(app, **FAST):
        row = await wait_until_async(ended_attempt, timeout=15)
        _, _attempts, error, _, _token, worker, _ = row
        assert worker is None
        assert "TaskTimeoutError" in error


async def test_jobs_of_an_unknown_task_are_left_for_a_worker_that_knows_it(
    app: pgqueue.App, conn: Conn, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A rolling deploy: an older worker meets jobs of a task only the newer code has. It hands
    them back without counting the attempt, says so, and claims only its own tasks from then on;
    the newer worker runs them."""

    @app.task
    async def known() -> None:
        return None

    job_id = app.enqueue("not.deployed.yet", {}, max_attempts=2, allow_unknown=True)
    known_id = known.enqueue()
    with caplog.at_level(logging.WARNING, logger="pgqueue.worker.fetcher"):
        async with running_worker(app, **FAST) as worker:
            await wait_until_async(status_is(conn, known_id, "succeeded"))
            await wait_until_async(lambda: worker.fetcher.only_tasks == ["known"])
            claims = worker.fetcher.claims
            # Many claims later (polls), the job is still waiting, untouched.
            await wait_until_async(lambda: worker.fetcher.claims >= claims + 5, timeout=15)
            later = known.enqueue()
            await wait_until_async(status_is(conn, later, "succeeded"))
    status, attempts, error, *_ = job_row(conn, job_id)
    assert (status, attempts, error) == ("queued", 0, None)
    warnings = [r.getMessage() for r in caplog.records if "not.deployed.yet" in r.getMessage()]
    assert len(warnings) == 1, caplog.text
    assert "no handler is registered for it in this worker" in warnings[0]

    newer = pgqueue.App(dsn)

    @newer.task(name="not.deployed.yet")
    async def deployed() -> str:
        return "ran"

    try:
        async with running_worker(newer, **FAST):
            await wait_until_async(status_is(conn, job_id, "succeeded"))
    finally:
        newer.close()
    assert job_row(conn, job_id)[:2] == ("succeeded", 1)


async def test_handler_gets_its_context(app: pgqueue.App, conn: Conn) -> None:
    seen: list[pgqueue.JobContext] = []

    @app.task(queue="ctxq")
    async def introspect(ctx: pgqueue.JobContext, n: int) -> None:
        seen.append(ctx)

    job_id = introspect.enqueue(n=1)
    before = time.time()
    async with running_worker(app, **FAST) as worker:
        await wait_until_async(status_is(conn, job_id, "succeeded"))
    (ctx,) = seen
    assert (ctx.job_id, ctx.attempt, ctx.queue, ctx.worker_id) == (job_id, 1, "ctxq", worker.id)
    assert ctx.lease_deadline > before  # a wall-clock time: claimed after `before`, plus the lease


REQUEST_ID: contextvars.ContextVar[int | None] = contextvars.ContextVar("request_id", default=None)


async def test_handlers_run_isolated_like_tasks_of_their_own(app: pgqueue.App, conn: Conn) -> None:
    """Jobs share slot tasks (see worker/slots.py), yet a context variable a handler sets (as
    logging and tracing libraries do) never reaches another job, and asyncio.timeout inside a
    handler times out that handler alone."""
    inherited: list[int | None] = []

    @app.task
    async def tagged(n: int) -> str:
        inherited.append(REQUEST_ID.get())
        REQUEST_ID.set(n)
        try:
            async with asyncio.timeout(0.001 if n % 10 == 0 else 5):
                await asyncio.sleep(0.05 if n % 10 == 0 else 0)
        except TimeoutError:
            return "timed out"
        assert REQUEST_ID.get() == n
        return "done"

    ids = [tagged.enqueue(n=n) for n in range(60)]
    async with running_worker(app, concurrency=4, **FAST):
        await wait_until_async(lambda: all(job_row(conn, i)[0] == "succeeded" for i in ids))
    assert inherited == [None] * 60
    results = [job_row(conn, i)[3] for i in ids]
    assert results == ["timed out" if n % 10 == 0 else "done" for n in range(60)]


async def test_worker_registers_and_deregisters(app: pgqueue.App, conn: Conn) -> None:
    async with running_worker(app, concurrency=7, queues=["a", "b"], **FAST) as worker:
        row = conn.execute(
            "SELECT concurrency, queues, pid > 0 FROM pgqueue_workers WHERE id = %s", (worker.id,)
        ).fetchone()
        assert row == (7, ["a", "b"], True)
    assert conn.execute("SELECT count(*) FROM pgqueue_workers").fetchone() == (0,)


async def test_worker_only_claims_its_queues_and_never_more_than_its_slots(
    app: pgqueue.App, conn: Conn
) -> None:
    release = asyncio.Event()
    running_now = 0
    peak = 0

    @app.task(queue="mine")
    async def held() -> None:
        nonlocal running_now, peak
        running_now += 1
        peak = max(peak, running_now)
        await release.wait()
        running_now -= 1

    app.enqueue_many([("held", {}) for _ in range(20)])
    other = app.enqueue("held", {}, queue="theirs")
    async with running_worker(app, queues=["mine"], concurrency=4, **FAST):
        await wait_until_async(lambda: running_now == 4)
        counts: dict[str, int] = dict(
            conn.execute(
                "SELECT status::text, count(*) FROM pgqueue_jobs WHERE queue = 'mine' GROUP BY 1"
            ).fetchall()
        )
        assert counts == {"running": 4, "queued": 16}
        release.set()
        await wait_until_async(
            lambda: (
                conn.execute(
                    "SELECT count(*) FROM pgqueue_jobs WHERE queue='mine' AND status='succeeded'"
                ).fetchone()
                == (20,)
            )
        )
    assert peak == 4
    assert job_row(conn, other)[0] == "queued"


async def test_scheduled_job_runs_on_time_without_notification(
    app: pgqueue.App, conn: Conn
) -> None:
    ran_at: list[float] = []

    @app.task
    async def later() -> None:
        ran_at.append(time.monotonic())

    async with running_worker(app, **FAST):  # started first: its start-up is not the delay
        start = time.monotonic()
        later.configure(delay=1.0).enqueue()
        await wait_until_async(lambda: ran_at, timeout=15)
    # Not before it is due, and then within a poll (plus slack for a loaded machine).
    assert 0.95 <= ran_at[0] - start <= 1.0 + FAST["poll_interval"] + 2.0


@pytest.mark.parametrize("listen", [True, False])
async def test_polling_is_the_fallback_when_listen_is_off(
    app: pgqueue.App, conn: Conn, listen: bool
) -> None:
    done = asyncio.Event()

    @app.task
    async def ping() -> None:
        done.set()

    async with running_worker(app, listen=listen, **FAST):
        ping.enqueue()
        await asyncio.wait_for(done.wait(), 15)


@pytest.mark.parametrize("event_loop", ["uvloop", "asyncio"])
def test_run_sync_on_either_event_loop(app: pgqueue.App, conn: Conn, event_loop: str) -> None:
    import threading

    seen: list[str] = []

    @app.task
    async def which() -> str:
        name = type(asyncio.get_running_loop()).__module__
        seen.append(name)
        return name

    job_id = which.enqueue()
    worker = app.worker(install_signal_handlers=False, event_loop=event_loop, **FAST)
    thread = threading.Thread(target=worker.run_sync)
    thread.start()
    try:
        wait_until(status_is(conn, job_id, "succeeded"))
    finally:
        wait_until(worker.started.is_set)
        worker.stop()
        thread.join(timeout=30)
    assert not thread.is_alive()
    assert seen and seen[0].startswith("uvloop" if event_loop == "uvloop" else "asyncio")


def test_unknown_event_loop_is_refused(app: pgqueue.App) -> None:
    with pytest.raises(pgqueue.ConfigurationError, match="event_loop must be one of"):
        app.worker(event_loop="trio")


async def test_a_cancelled_error_of_the_handlers_own_is_a_failed_attempt(
    app: pgqueue.App, conn: Conn
) -> None:
    """A handler that awaits something someone else cancelled gets a CancelledError that is not
    the worker's: the attempt fails (with its traceback) like any other error, and the worker,
    even after more such jobs than it has slots and buffer, keeps claiming."""

    @app.task(max_attempts=1)
    async def awaits_a_cancelled_task() -> None:
        task = asyncio.create_task(asyncio.sleep(3600))
        task.cancel()
        await task

    @app.task
    async def fine() -> str:
        return "ok"

    ids = [awaits_a_cancelled_task.enqueue() for _ in range(6)]
    async with running_worker(app, concurrency=2, prefetch=2, **FAST):
        await wait_until_async(lambda: all(status_is(conn, j, "dead")() for j in ids), timeout=20)
        after = fine.enqueue()
        await wait_until_async(status_is(conn, after, "succeeded"))
    for job_id in ids:
        status, attempts, error, *_ = job_row(conn, job_id)
        assert (status, attempts) == ("dead", 1)
        assert error.startswith("CancelledError") and "Traceback" in error, error


async def test_key_and_index_errors_keep_their_traceback(app: pgqueue.App, conn: Conn) -> None:
    @app.task(max_attempts=1)
    def lookup(kind: str) -> None:
        found: dict[str, list[int]] = {"present": []}
        if kind == "key":
            _ = found["missing"]
        _ = found["present"][3]

    key, index = lookup.enqueue(kind="key"), lookup.enqueue(kind="index")
    async with running_worker(app, **FAST):
        await wait_until_async(
            lambda: status_is(conn, key, "dead")() and status_is(conn, index, "dead")()
        )
    for job_id, head in (
        (key, "KeyError: 'missing'"),
        (index, "IndexError: list index out of range"),
    ):
        error = job_row(conn, job_id)[2]
        assert error.startswith(head) and "Traceback" in error and "in lookup" in error, error
