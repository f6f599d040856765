"""The coalescing producer (``App(coalesce=True)``) against a real PostgreSQL: concurrent calls
share statements yet each caller gets its own job, its own answer for a unique key (as if the
calls had been made in turn) and its own error; a batch that dies takes no caller's job with it
silently; the caller's own transaction is never joined; closing never leaves a caller hanging."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest

import pgqueue
from pgqueue import ConfigurationError, DatabaseUnavailableError, Enqueued, InvalidJobError
from pgqueue import coalesce as coalescing
from pgqueue.coalesce import CoalesceStats
from pgqueue.hooks import Publish
from tests.helpers import wait_until, wait_until_async

Conn = psycopg.Connection[tuple[Any, ...]]

#: The other sessions of the test's database waiting for a lock: a batch held by a key that an
#: open transaction of the test inserted.
LOCK_WAITERS = (
    "SELECT {} FROM pg_stat_activity WHERE datname = current_database()"
    " AND pid <> pg_backend_pid() AND wait_event_type = 'Lock'"
)


@pytest.fixture
def capp(dsn: str) -> Iterator[pgqueue.App]:
    application = pgqueue.App(dsn, coalesce=True)
    try:
        yield application
    finally:
        application.close()


def stats(app: pgqueue.App) -> CoalesceStats:
    assert app.coalesce_stats is not None
    return app.coalesce_stats


def job_args(conn: Conn) -> dict[int, Any]:
    return dict(conn.execute("SELECT id, args FROM pgqueue_jobs").fetchall())


def count(conn: Conn) -> int:
    row = conn.execute("SELECT count(*) FROM pgqueue_jobs").fetchone()
    assert row is not None
    return int(row[0])


@contextmanager
def key_held(app: pgqueue.App, dsn: str, key: str) -> Iterator[psycopg.Connection[Any]]:
    """An open transaction holding unique key ``key`` of task "note": an insert of that key
    waits for it. Rolled back at the end."""
    with psycopg.connect(dsn) as holder:
        app.enqueue("note", {}, unique_key=key, connection=holder, allow_unknown=True)
        try:
            yield holder
        finally:
            holder.rollback()


def lock_waiters(conn: Conn) -> int:
    row = conn.execute(LOCK_WAITERS.format("count(*)")).fetchone()
    assert row is not None
    return int(row[0])


# --- many callers, one statement, each its own job ----------------------------------------------


async def test_concurrent_async_enqueues_share_a_statement_and_each_get_their_own_job(
    capp: pgqueue.App, conn: Conn
) -> None:
    ids = await asyncio.gather(
        *(capp.enqueue_async("note", {"i": i}, allow_unknown=True) for i in range(200))
    )
    assert len(set(ids)) == 200
    assert not any(job.duplicate for job in ids)
    args = job_args(conn)
    assert len(args) == 200
    assert [args[job]["i"] for job in ids] == list(range(200))  # each caller's id is its job
    # Calls queued in one turn of the loop all join the batch that the first one started.
    assert stats(capp) == CoalesceStats(batches=1, jobs=200)


def test_concurrent_threads_share_statements_and_each_get_their_own_job(
    capp: pgqueue.App, conn: Conn
) -> None:
    threads, per_thread = 50, 4
    start = threading.Barrier(threads)

    def produce(t: int) -> list[Enqueued]:
        start.wait(timeout=30)
        return [
            capp.enqueue("note", {"t": t, "i": i}, allow_unknown=True) for i in range(per_thread)
        ]

    with ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(produce, range(threads)))
    args = job_args(conn)
    assert len(args) == threads * per_thread
    for t, ids in enumerate(results):
        assert [args[job] for job in ids] == [{"t": t, "i": i} for i in range(per_thread)]
    written = stats(capp)
    assert written.jobs == threads * per_thread
    assert written.batches < threads * per_thread


def test_a_lone_call_is_written_at_once_in_a_batch_of_its_own(
    capp: pgqueue.App, conn: Conn
) -> None:
    job = capp.enqueue("note", {"alone": True}, allow_unknown=True)
    assert job_args(conn) == {job: {"alone": True}}
    assert stats(capp) == CoalesceStats(batches=1, jobs=1)


async def test_a_stuck_batch_holds_the_next_calls_up_only_for_the_window(
    capp: pgqueue.App, dsn: str, conn: Conn
) -> None:
    with key_held(capp, dsn, "blocked"):
        stuck = asyncio.ensure_future(
            capp.enqueue_async("note", {}, unique_key="blocked", allow_unknown=True)
        )
        await wait_until_async(lambda: lock_waiters(conn) == 1)
        later = await asyncio.wait_for(
            asyncio.gather(
                *(capp.enqueue_async("note", {"i": i}, allow_unknown=True) for i in range(10))
            ),
            30,
        )
        assert not stuck.done()  # still waiting for the key: the others went beside it
        assert sorted(job_args(conn)) == sorted(later)
    assert not (await asyncio.wait_for(stuck, 30)).duplicate


def test_a_stuck_batch_holds_the_next_threads_up_only_for_the_window(
    capp: pgqueue.App, dsn: str, conn: Conn
) -> None:
    # The pool outside: leaving the block releases the key before waiting for the threads.
    with ThreadPoolExecutor(11) as pool, key_held(capp, dsn, "blocked"):
        stuck = pool.submit(capp.enqueue, "note", {}, unique_key="blocked", allow_unknown=True)
        wait_until(lambda: lock_waiters(conn) == 1, what="the first batch waits for the key")
        later = [pool.submit(capp.enqueue, "note", {"i": i}, allow_unknown=True) for i in range(10)]
        ids = [f.result(timeout=30) for f in later]
        assert not stuck.done()
        assert sorted(job_args(conn)) == sorted(ids)
    assert not stuck.result(timeout=30).duplicate


# --- unique jobs: each caller's answer as if the calls came in turn ----------------------------


async def test_repeats_of_a_unique_key_in_one_batch_are_answered_as_if_made_in_turn(
    capp: pgqueue.App, conn: Conn
) -> None:
    held = capp.enqueue("note", {"v": 0}, unique_key="held", allow_unknown=True)
    # A job that no longer holds its key (it succeeded, no unique_for): the next one takes it.
    stale = capp.enqueue("note", {"v": 0}, unique_key="stale", allow_unknown=True)
    conn.execute(
        "UPDATE pgqueue_jobs SET status = 'succeeded', finished_at = now() WHERE id = %s",
        (stale,),
    )
    before = stats(capp)
    keys = ["fresh", "held", "fresh", "stale", None, "stale", "fresh"]
    answers = await asyncio.gather(
        *(
            capp.enqueue_async("note", {"v": i}, unique_key=key, allow_unknown=True)
            for i, key in enumerate(keys)
        )
    )
    assert stats(capp).batches == before.batches + 1  # all in one batch
    fresh, held_again, fresh2, stale_new, plain, stale2, fresh3 = answers
    assert not fresh.duplicate and fresh2 == fresh3 == fresh
    assert fresh2.duplicate and fresh3.duplicate
    assert held_again == held and held_again.duplicate
    assert stale_new != stale and not stale_new.duplicate
    assert stale2 == stale_new and stale2.duplicate
    assert not plain.duplicate
    assert not any(a.replaced for a in answers)
    args = job_args(conn)
    assert args[fresh] == {"v": 0} and args[stale_new] == {"v": 3}  # the first of each kept
    assert args[held] == {"v": 0}
    assert count(conn) == 5  # held, stale, and the new fresh, stale and plain jobs


async def test_the_same_answers_as_without_coalescing(dsn: str, conn: Conn) -> None:
    """The batch's answers, call for call, match the same calls made in turn by an app without
    coalescing, on a copy of the same starting state."""
    keys = ["a", "b", "a", None, "c", "b", "a"]
    answers: dict[bool, list[tuple[bool, int]]] = {}
    for coalesce in (False, True):
        conn.execute("TRUNCATE pgqueue_jobs")
        app = pgqueue.App(dsn, coalesce=coalesce)
        try:
            first = app.enqueue("note", {}, unique_key="c", allow_unknown=True)
            calls = [
                app.enqueue_async("note", {"v": i}, unique_key=key, allow_unknown=True)
                for i, key in enumerate(keys)
            ]
            if coalesce:
                got = await asyncio.gather(*calls)
            else:
                got = [await call for call in calls]
            # Ids differ between runs: compare which earlier answer (or the setup job) each is.
            seen = [first.id, *(g.id for g in got)]
            answers[coalesce] = [(g.duplicate, seen.index(g.id)) for g in got]
        finally:
            app.close()
    assert answers[True] == answers[False]


# --- errors: each caller its own -------------------------------------------------------------


async def test_an_invalid_job_fails_alone_before_batching(capp: pgqueue.App, conn: Conn) -> None:
    big = "x" * (capp.max_payload_bytes + 1)
    calls = [capp.enqueue_async("note", {"i": i}, allow_unknown=True) for i in range(10)]
    calls.insert(3, capp.enqueue_async("note", {"x": float("nan")}, allow_unknown=True))
    calls.insert(7, capp.enqueue_async("note", {"x": big}, allow_unknown=True))
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert isinstance(results.pop(7), InvalidJobError)
    assert isinstance(results.pop(3), InvalidJobError)
    assert all(isinstance(r, Enqueued) for r in results)
    assert count(conn) == 10
    assert stats(capp) == CoalesceStats(batches=1, jobs=10)


async def test_a_database_error_of_one_job_fails_only_its_caller(
    capp: pgqueue.App, conn: Conn
) -> None:
    conn.execute(
        "CREATE FUNCTION refuse_poison() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
        " IF NEW.task = 'poison' THEN RAISE EXCEPTION 'poison refused'; END IF;"
        " RETURN NEW; END $$"
    )
    conn.execute(
        "CREATE TRIGGER refuse_poison BEFORE INSERT ON pgqueue_jobs"
        " FOR EACH ROW EXECUTE FUNCTION refuse_poison()"
    )
    calls = [capp.enqueue_async("note", {"i": i}, allow_unknown=True) for i in range(10)]
    calls.insert(4, capp.enqueue_async("poison", {}, allow_unknown=True))
    results = await asyncio.gather(*calls, return_exceptions=True)
    refused = results.pop(4)
    assert isinstance(refused, psycopg.errors.RaiseException), refused
    assert all(isinstance(r, Enqueued) for r in results), results
    args = job_args(conn)
    assert [args[job]["i"] for job in results if isinstance(job, Enqueued)] == list(range(10))


async def test_a_batch_whose_connection_is_killed_fails_every_caller_and_writes_nothing(
    capp: pgqueue.App, dsn: str, conn: Conn
) -> None:
    with key_held(capp, dsn, "blocked"):
        calls = [capp.enqueue_async("note", {"i": i}, allow_unknown=True) for i in range(10)]
        calls.append(capp.enqueue_async("note", {}, unique_key="blocked", allow_unknown=True))
        batch = asyncio.gather(*calls, return_exceptions=True)
        await wait_until_async(lambda: lock_waiters(conn) == 1)
        conn.execute(LOCK_WAITERS.format("pg_terminate_backend(pid)"))
        results = await batch
    assert all(isinstance(r, DatabaseUnavailableError) for r in results), results
    assert len({id(r) for r in results}) == len(results)  # each caller raises its own
    assert count(conn) == 0
    # The app goes on: the next call gets a new connection.
    job = await capp.enqueue_async("note", {"after": True}, allow_unknown=True)
    assert job_args(conn) == {job: {"after": True}}


# --- never coalesced ---------------------------------------------------------------------------


def test_calls_in_the_callers_transaction_are_never_coalesced(
    capp: pgqueue.App, dsn: str, conn: Conn
) -> None:
    with psycopg.connect(dsn) as own:
        job = capp.enqueue("note", {}, connection=own, allow_unknown=True)
        assert count(conn) == 0  # not committed by anyone but the caller
        own.rollback()
    assert count(conn) == 0
    with psycopg.connect(dsn) as own:
        job = capp.enqueue("note", {}, connection=own, allow_unknown=True)
        own.commit()
    assert job_args(conn) == {job: {}}
    assert stats(capp) == CoalesceStats()


async def test_async_calls_in_the_callers_transaction_are_never_coalesced(
    capp: pgqueue.App, dsn: str, conn: Conn
) -> None:
    async with await psycopg.AsyncConnection.connect(dsn) as own:
        await asyncio.gather(
            *(capp.enqueue_async("note", {}, connection=own, allow_unknown=True) for _ in range(3))
        )
        await own.rollback()
    assert count(conn) == 0
    assert stats(capp) == CoalesceStats()


async def test_jobs_that_cannot_share_a_statement_go_alone_with_their_usual_answer(
    capp: pgqueue.App, conn: Conn
) -> None:
    parent = await capp.enqueue_async("note", {}, allow_unknown=True)
    first = await capp.enqueue_async("note", {"v": 1}, unique_key="r", allow_unknown=True)
    before = stats(capp)
    child, replaced = await asyncio.gather(
        capp.enqueue_async("note", {}, after=[parent], allow_unknown=True),
        capp.enqueue_async(
            "note", {"v": 2}, unique_key="r", on_conflict="replace", allow_unknown=True
        ),
    )
    assert stats(capp) == before
    assert replaced == first and replaced.duplicate and replaced.replaced
    assert job_args(conn)[first] == {"v": 2}
    row = conn.execute("SELECT status::text FROM pgqueue_jobs WHERE id = %s", (child,)).fetchone()
    assert row == ("blocked",)


# --- every option as without coalescing ----------------------------------------------------


SELECT_COLUMNS = (
    "SELECT queue, task, args, priority, max_attempts, limit_key, meta, unique_key, status::text,"
    " CASE WHEN run_at > '2029-01-01' THEN run_at ELSE NULL END,"
    " CASE WHEN run_at > '2029-01-01' THEN NULL ELSE run_at - created_at END"
    " FROM pgqueue_jobs WHERE id = %s"
)


def app_with_hooks(dsn: str, coalesce: bool, published: list[Publish]) -> pgqueue.App:
    """A limited task keyed per tenant, an enqueue hook adding to meta, a span per call."""
    app = pgqueue.App(dsn, coalesce=coalesce)

    @app.task(limit=2, limit_key=lambda args: f"tenant-{args['tenant']}")
    def per_tenant(tenant: int) -> None: ...

    @app.on_enqueue
    def tag(task: str, args: Any, meta: dict[str, Any]) -> None:
        meta["tagged"] = task

    @app.around_enqueue
    def span(publish: Publish) -> AbstractContextManager[None]:
        published.append(publish)
        return contextlib.nullcontext()

    return app


async def test_each_job_keeps_its_options_and_hooks_see_each_call(dsn: str, conn: Conn) -> None:
    at = datetime(2030, 1, 1, tzinfo=UTC)
    rows: dict[bool, list[tuple[Any, ...]]] = {}
    for coalesce in (False, True):
        conn.execute("TRUNCATE pgqueue_jobs")
        published: list[Publish] = []
        app = app_with_hooks(dsn, coalesce, published)
        try:
            calls = [
                app.enqueue_async("per_tenant", {"tenant": 1}, priority=7),
                app.enqueue_async("per_tenant", {"tenant": 2}, delay=3600),
                app.enqueue_async("per_tenant", {"tenant": 3}, run_at=at, meta={"m": 1}),
                app.enqueue_async(
                    "plain", {"p": 1}, allow_unknown=True, queue="other", max_attempts=2
                ),
            ]
            ids = await asyncio.gather(*calls) if coalesce else [await c for c in calls]
            rows[coalesce] = [conn.execute(SELECT_COLUMNS, (i,)).fetchone() or () for i in ids]
            assert [p.ids for p in published] == [[i] for i in ids]  # one span per call
            assert [p.written for p in published] == [1, 1, 1, 1]
        finally:
            app.close()
        if coalesce:
            assert stats(app) == CoalesceStats(batches=1, jobs=4)
    assert rows[True] == rows[False]
    assert rows[True][0][5] == "tenant-1" and rows[True][0][6] == {"tagged": "per_tenant"}


async def test_options_every_job_of_a_batch_shares_are_kept(dsn: str, conn: Conn) -> None:
    """A value the same in every row goes once beside a NULL array (coalesce._shared): the
    stored jobs are still those written one by one, non-default and zero values alike."""
    at = datetime(2030, 1, 1, tzinfo=UTC)
    batches: list[list[dict[str, Any]]] = [
        [{"queue": "other", "priority": 5, "max_attempts": 3, "delay": 3600}] * 3,
        [{"priority": 0, "delay": 0, "meta": {"m": 1}}] * 3,
        [{"priority": -2, "run_at": at}, {"priority": -2, "run_at": at, "queue": "q2"}],
    ]
    for options in batches:
        rows: dict[bool, list[tuple[Any, ...]]] = {}
        for coalesce in (False, True):
            conn.execute("TRUNCATE pgqueue_jobs")
            app = pgqueue.App(dsn, coalesce=coalesce)
            try:
                calls = [
                    app.enqueue_async("shared", {"i": i}, allow_unknown=True, **o)
                    for i, o in enumerate(options)
                ]
                ids = await asyncio.gather(*calls) if coalesce else [await c for c in calls]
                rows[coalesce] = [conn.execute(SELECT_COLUMNS, (i,)).fetchone() or () for i in ids]
            finally:
                app.close()
            if coalesce:
                assert stats(app) == CoalesceStats(batches=1, jobs=len(options))
        assert rows[True] == rows[False]


# --- closing --------------------------------------------------------------------------------


def test_close_fails_the_calls_still_waiting_and_lets_the_batch_in_flight_finish(
    capp: pgqueue.App, dsn: str, conn: Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(coalescing, "MAX_IN_FLIGHT", 1)  # the others wait for the one batch
    outcomes: dict[int, Enqueued | BaseException] = {}

    def call(i: int, key: str | None) -> None:
        try:
            outcomes[i] = capp.enqueue("note", {"i": i}, unique_key=key, allow_unknown=True)
        except BaseException as exc:
            outcomes[i] = exc

    with key_held(capp, dsn, "blocked"):
        leader = threading.Thread(target=call, args=(0, "blocked"))
        leader.start()
        wait_until(lambda: lock_waiters(conn) == 1, what="the first batch waits for the key")
        waiting = [threading.Thread(target=call, args=(i, None)) for i in range(1, 6)]
        for t in waiting:
            t.start()
        assert capp._coalescer is not None
        pending = capp._coalescer._sync._pending
        wait_until(lambda: len(pending) == 5, what="five calls waiting for the batch")
        capp.close()
        for t in waiting:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in waiting)
        assert all(isinstance(outcomes[i], DatabaseUnavailableError) for i in range(1, 6))
        assert leader.is_alive()  # its batch is still being written
    leader.join(timeout=30)
    assert not leader.is_alive()
    first = outcomes[0]
    assert isinstance(first, Enqueued) and not first.duplicate
    assert job_args(conn) == {first: {"i": 0}}


async def test_aclose_fails_the_async_calls_still_waiting(
    capp: pgqueue.App, dsn: str, conn: Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(coalescing, "MAX_IN_FLIGHT", 1)
    with key_held(capp, dsn, "blocked"):
        first = asyncio.ensure_future(
            capp.enqueue_async("note", {"i": 0}, unique_key="blocked", allow_unknown=True)
        )
        await wait_until_async(lambda: lock_waiters(conn) == 1)
        later = asyncio.gather(
            *(capp.enqueue_async("note", {"i": i}, allow_unknown=True) for i in range(1, 6)),
            return_exceptions=True,
        )
        assert capp._coalescer is not None
        batcher = capp._coalescer._batcher()
        # They queue: no batch can start while one is in flight.
        await wait_until_async(lambda: len(batcher._pending) == 5)
        await capp.aclose()
        results = await asyncio.wait_for(later, 30)
        assert all(isinstance(r, DatabaseUnavailableError) for r in results), results
        assert not first.done()
    job = await asyncio.wait_for(first, 30)
    assert job_args(conn) == {job: {"i": 0}}


# --- settings --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"coalesce_window": 0},
        {"coalesce_window": 2.0},
        {"coalesce_window": "2ms"},
        {"coalesce_max": 0},
        {"coalesce_max": 10_001},
        {"coalesce": "yes"},
    ],
)
def test_bad_settings_are_refused_when_the_app_is_made(options: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        pgqueue.App("postgresql://localhost/x", **options)


def test_without_coalesce_there_are_no_stats() -> None:
    assert pgqueue.App("postgresql://localhost/x").coalesce_stats is None
