"""A paused queue is claimed by no worker until resumed; everything else about it goes on.

The state is a row in pgqueue_queues, read inside every claim: these tests pause through the
App, run real in-process workers on a real database, and check what a user would see (which
jobs ran, how soon a resumed queue starts, how often an idle worker claims).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg
import pytest

import pgqueue
from pgqueue.worker.fetcher import Fetcher
from tests.helpers import db_clock, listening, notifications, running_worker, wait_until_async

Conn = psycopg.Connection[tuple[Any, ...]]
#: Polling once a minute: anything that runs within seconds was woken, not polled.
NO_POLL = {"lease": 5.0, "heartbeat_interval": 1.0, "poll_interval": 60.0, "reaper_interval": 1.0}
#: Polling often, so a paused queue is asked for many times in a short test.
FAST_POLL = {**NO_POLL, "poll_interval": 0.05}


def statuses(conn: Conn, queue: str) -> list[str]:
    rows = conn.execute(
        "SELECT status::text FROM pgqueue_jobs WHERE queue = %s ORDER BY id", (queue,)
    ).fetchall()
    return [str(r[0]) for r in rows]


def record_runs(app: pgqueue.App) -> list[tuple[str, int]]:
    ran: list[tuple[str, int]] = []

    @app.task
    async def work(ctx: pgqueue.JobContext, n: int) -> None:
        ran.append((ctx.queue, n))

    return ran


@pytest.mark.parametrize("queues", [None, ["paused", "open"]])
async def test_a_paused_queue_is_not_claimed_while_other_queues_are(
    app: pgqueue.App, conn: Conn, queues: list[str] | None
) -> None:
    ran = record_runs(app)
    assert await app.pause_queue_async("paused")
    app.enqueue_many([{"task": "work", "args": {"n": n}, "queue": "paused"} for n in range(5)])
    app.enqueue_many([{"task": "work", "args": {"n": n}, "queue": "open"} for n in range(5)])
    async with running_worker(app, queues=queues, **FAST_POLL) as worker:
        await wait_until_async(lambda: len(ran) == 5, timeout=20)
        claims = worker.fetcher.claims
        await wait_until_async(lambda: worker.fetcher.claims >= claims + 5, timeout=20)
        assert sorted(ran) == [("open", n) for n in range(5)]
        assert statuses(conn, "paused") == ["queued"] * 5

        assert await app.resume_queue_async("paused")
        await wait_until_async(lambda: len(ran) == 10, timeout=20)
    assert statuses(conn, "paused") == ["succeeded"] * 5


async def test_a_job_running_when_its_queue_is_paused_finishes_and_is_acked(
    app: pgqueue.App, conn: Conn
) -> None:
    release = asyncio.Event()
    started: list[int] = []

    @app.task
    async def hold(n: int) -> str:
        started.append(n)
        await release.wait()
        return "done"

    first = hold.configure(queue="q").enqueue(n=1)
    async with running_worker(app, concurrency=2, **FAST_POLL) as worker:
        await wait_until_async(lambda: started == [1], timeout=20)
        assert await app.pause_queue_async("q")
        second = hold.configure(queue="q").enqueue(n=2)  # enqueues are still accepted
        claims = worker.fetcher.claims
        await wait_until_async(lambda: worker.fetcher.claims >= claims + 5, timeout=20)
        release.set()
        await wait_until_async(lambda: statuses(conn, "q")[0] == "succeeded", timeout=20)
        assert started == [1]  # the free slot took nothing from the paused queue
    job = app.get_job(first)
    assert job is not None and job.status == "succeeded" and job.result == "done"
    waiting = app.get_job(second)
    assert waiting is not None and waiting.status == "queued" and waiting.attempts == 0


@pytest.mark.parametrize("queues", [None, ["q"]])
async def test_resume_wakes_an_idle_worker_at_once(
    app: pgqueue.App, conn: Conn, queues: list[str] | None
) -> None:
    ran = record_runs(app)
    await app.pause_queue_async("q")
    async with running_worker(app, queues=queues, **NO_POLL) as worker:
        await wait_until_async(lambda: worker.notifier.announced, timeout=10)
        app.enqueue("work", {"n": 1}, queue="q")  # no NOTIFY: its queue is paused
        await wait_until_async(lambda: worker.notifier.announced, timeout=10)
        assert ran == []
        resumed = time.monotonic()
        assert await app.resume_queue_async("q")
        await wait_until_async(lambda: ran == [("q", 1)], timeout=20)
    # The poll is a minute away: the resume's NOTIFY woke it.
    assert time.monotonic() - resumed < 2.0


async def test_a_pause_is_kept_in_the_database_across_worker_restarts(
    app: pgqueue.App, dsn: str, conn: Conn
) -> None:
    app.pause_queue("q")
    other = pgqueue.App(dsn)  # another process's view: nothing is remembered in memory
    try:
        ran = record_runs(other)
        other.enqueue("work", {"n": 1}, queue="q")
        assert other.paused_queues() == ["q"]
        for _ in range(2):  # two worker lifetimes
            async with running_worker(other, **FAST_POLL) as worker:
                await wait_until_async(lambda: worker.fetcher.claims >= 5, timeout=20)
            assert ran == [] and statuses(conn, "q") == ["queued"]
        assert other.resume_queue("q")
        async with running_worker(other, **FAST_POLL):
            await wait_until_async(lambda: ran == [("q", 1)], timeout=20)
    finally:
        other.close()


@pytest.mark.parametrize("queues", [None, ["q"]])
async def test_an_idle_worker_with_only_paused_jobs_waits_for_a_notify_or_the_poll(
    app: pgqueue.App, conn: Conn, queues: list[str] | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Paused jobs that are due, and paused jobs that fall due one after another: the worker
    must not take either for work it could claim now or soon (claiming nothing, again and
    again), only wake for a NOTIFY or its poll, here a minute away."""
    ran = record_runs(app)
    await app.pause_queue_async("q")
    app.enqueue_many([{"task": "work", "args": {"n": n}, "queue": "q"} for n in range(5)])
    # Every wake-up from outside the fetcher's own loop (the notifier's LISTEN, its looks at
    # producers that skipped their NOTIFY, a notification, the reaper) may cost a claim, and a
    # claim woken so that reads past a backlog it may not take owes a sweep behind it (one more
    # claim a second later). Those are counted; so is whether the fetcher sits in its wait.
    wakes = 0
    notify = Fetcher.notify

    def counted(self: Fetcher) -> None:
        nonlocal wakes
        wakes += 1
        notify(self)

    idle = False
    wait = Fetcher._wait

    async def watched(self: Fetcher, stopping: asyncio.Event, timeout: float) -> bool:
        nonlocal idle
        idle = True
        try:
            return await wait(self, stopping, timeout)
        finally:
            idle = False

    monkeypatch.setattr(Fetcher, "notify", counted)
    monkeypatch.setattr(Fetcher, "_wait", watched)
    async with running_worker(app, queues=queues, **NO_POLL) as worker:
        fetcher = worker.fetcher
        # Start-up is over: announced as waiting, in the fetcher's wait with nothing due (a
        # sweep owed by start-up's claims is behind it) and no wake-up pending.
        await wait_until_async(
            lambda: (
                worker.notifier.announced
                and idle
                and not fetcher.state.wakeup.is_set()
                and fetcher._due_at is None
            ),
            timeout=20,
        )
        claims, woken = fetcher.claims, wakes
        app.enqueue_many(
            [{"task": "work", "args": {"n": n}, "queue": "q", "delay": 0.5 + n * 0.05}
             for n in range(5, 45)]
        )  # fmt: skip
        last_due = db_clock(conn) + 0.5 + 44 * 0.05
        # Every delayed job has fallen due (by the database clock), with a margin.
        await wait_until_async(lambda: db_clock(conn) > last_due + 0.3, timeout=20)
        assert fetcher.claims - claims <= 2 * (wakes - woken), (
            fetcher.claims - claims,
            wakes - woken,
        )
        assert ran == []


@pytest.mark.parametrize("name", ["", "   ", "a,b", " padded", "x" * 129, "nul\x00", 7, None])
def test_names_no_queue_could_have_are_refused_and_nothing_is_written(
    app: pgqueue.App, conn: Conn, name: Any
) -> None:
    with pytest.raises(pgqueue.InvalidJobError, match="queue name"):
        app.pause_queue(name)
    with pytest.raises(pgqueue.InvalidJobError, match="queue name"):
        app.resume_queue(name)
    assert conn.execute("SELECT count(*) FROM pgqueue_queues").fetchone() == (0,)


def test_pausing_and_resuming_say_whether_anything_changed(app: pgqueue.App) -> None:
    assert app.paused_queues() == []
    assert app.pause_queue("b") and app.pause_queue("a")
    assert not app.pause_queue("a")
    assert app.paused_queues() == ["a", "b"]
    assert app.resume_queue("a")
    assert not app.resume_queue("a") and not app.resume_queue("never-paused")
    assert app.paused_queues() == ["b"]


def test_jobs_enqueued_into_a_paused_queue_wake_no_waiting_worker(
    app: pgqueue.App, dsn: str
) -> None:
    """A woken worker would claim nothing and only read past the paused backlog; resume wakes
    the queue instead."""
    app.pause_queue("held")
    with listening(dsn, waiting=True) as listener:
        app.enqueue("work", {"n": 1}, queue="held", allow_unknown=True)
        app.enqueue_many([("work", {"n": n}) for n in range(3)], allow_unknown=True)  # 'default'
        assert [payload for _, payload in notifications(listener, expected=1)] == ["default"]
        app.resume_queue("held")
        assert [payload for _, payload in notifications(listener, expected=1)] == ["held"]
