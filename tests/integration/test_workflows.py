"""Jobs that run after other jobs: after=, chains and groups, with real workers and races."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import psycopg
import pytest

import pgqueue
from tests.helpers import running_worker, wait_until_async

Conn = psycopg.Connection[tuple[Any, ...]]
FAST = {"lease": 5.0, "heartbeat_interval": 1.0, "poll_interval": 60.0, "reaper_interval": 1.0}


def status(conn: Conn, job_id: int) -> str:
    row = conn.execute("SELECT status::text FROM pgqueue_jobs WHERE id = %s", (job_id,))
    found = row.fetchone()
    assert found is not None
    return str(found[0])


async def test_a_child_waits_blocked_until_every_parent_succeeded(
    app: pgqueue.App, conn: Conn
) -> None:
    order: list[str] = []
    gates = {"a": asyncio.Event(), "b": asyncio.Event()}

    @app.task
    async def parent(name: str) -> str:
        await gates[name].wait()
        order.append(name)
        return name

    @app.task
    async def child() -> None:
        order.append("child")

    a = parent.enqueue(name="a")
    b = parent.enqueue(name="b")
    c = child.configure(after=[a, b]).enqueue()
    assert status(conn, c) == "blocked"
    async with running_worker(app, concurrency=4, **FAST):
        gates["a"].set()
        await wait_until_async(lambda: status(conn, a) == "succeeded", timeout=30)
        await asyncio.sleep(0.3)
        assert status(conn, c) == "blocked" and "child" not in order
        gates["b"].set()
        started = time.monotonic()
        await wait_until_async(lambda: "child" in order, timeout=30)
        assert time.monotonic() - started < 5  # released with the ack, not by a poll
    assert order == ["a", "b", "child"]


async def test_a_failed_parent_cancels_its_descendants_transitively_or_they_run_anyway(
    app: pgqueue.App, conn: Conn
) -> None:
    @app.task(max_attempts=1)
    async def breaks() -> None:
        raise ValueError("no")

    @app.task
    async def step(n: int) -> int:
        return n

    root = breaks.enqueue()
    first = step.configure(after=[root]).enqueue(n=1)
    second = step.configure(after=[first]).enqueue(n=2)
    regardless = step.configure(after=[root], after_failure="run").enqueue(n=3)
    async with running_worker(app, **FAST):
        assert await app.wait_async(regardless, timeout=30) == 3
        await wait_until_async(lambda: status(conn, second) == "cancelled", timeout=30)
    assert status(conn, first) == "cancelled"
    job = app.get_job(second)
    assert job is not None and "ParentFailed" in (job.last_error or "")
    with pytest.raises(pgqueue.JobCancelledError):
        app.wait(first, timeout=1)


def test_parents_that_finished_before_count_as_finished(app: pgqueue.App, conn: Conn) -> None:
    done = app.enqueue("x", {}, allow_unknown=True)
    dead = app.enqueue("x", {}, allow_unknown=True)
    conn.execute("UPDATE pgqueue_jobs SET status = 'succeeded' WHERE id = %s", (done,))
    conn.execute("UPDATE pgqueue_jobs SET status = 'dead' WHERE id = %s", (dead,))
    ready = app.enqueue("y", {}, after=[done], allow_unknown=True)
    assert status(conn, ready) == "queued"
    doomed = app.enqueue("y", {}, after=[done, dead], allow_unknown=True)
    assert status(conn, doomed) == "cancelled"
    with pytest.raises(pgqueue.InvalidJobError, match="some parent job does not exist"):
        app.enqueue("y", {}, after=[done, 10**12], allow_unknown=True)
    with pytest.raises(pgqueue.InvalidJobError, match="names no parent"):
        app.enqueue("y", {}, after=[], allow_unknown=True)
    with pytest.raises(pgqueue.InvalidJobError, match="after_failure"):
        app.enqueue("y", {}, after=[done], after_failure="ignore", allow_unknown=True)


def test_a_parent_acked_while_its_child_is_being_enqueued_releases_it(
    app: pgqueue.App, dsn: str, conn: Conn
) -> None:
    """The race: the child's transaction locks the parent; the parent's ack waits for it, then
    sees the child and releases it. Never a child blocked forever."""
    parent = app.enqueue("p", {}, allow_unknown=True)
    conn.execute(
        "UPDATE pgqueue_jobs SET status = 'running', lease_token = gen_random_uuid() WHERE id = %s",
        (parent,),
    )
    with psycopg.connect(dsn) as producer:  # a transaction left open by the caller
        child = app.enqueue("c", {}, after=[parent], allow_unknown=True, connection=producer)
        acked = threading.Event()

        def ack() -> None:
            with psycopg.connect(dsn, autocommit=True) as c:
                c.execute("UPDATE pgqueue_jobs SET status = 'succeeded' WHERE id = %s", (parent,))
            acked.set()

        thread = threading.Thread(target=ack)
        thread.start()
        time.sleep(0.3)
        assert not acked.is_set()  # the ack waits for the child's transaction
        producer.commit()
        thread.join(10)
    assert acked.is_set()
    assert status(conn, child) == "queued"


async def test_a_chain_runs_in_order_and_a_callback_gets_the_groups_results(
    app: pgqueue.App, conn: Conn
) -> None:
    ran: list[str] = []

    @app.task
    async def step(n: int) -> int:
        ran.append(f"step{n}")
        return n

    @app.task
    async def fetch(n: int) -> int:
        ran.append("fetch")
        return n * n

    @app.task
    async def total(results: list[int]) -> int:
        ran.append("total")
        return sum(results)

    chained = app.chain(step.s(n=1), step.s(n=2), step.s(n=3))
    assert [status(conn, j) for j in chained] == ["queued", "blocked", "blocked"]
    grouped = app.group([fetch.s(n=n) for n in range(10)], then=total.s())
    assert grouped.callback is not None and len(grouped.members) == 10
    async with running_worker(app, concurrency=8, **FAST):
        assert await app.wait_async(grouped.callback, timeout=60) == sum(n * n for n in range(10))
        assert await app.wait_async(chained[-1], timeout=60) == 3
    steps = [r for r in ran if r.startswith("step")]
    assert steps == ["step1", "step2", "step3"]
    assert ran.index("total") > max(i for i, r in enumerate(ran) if r == "fetch")


@pytest.mark.slow
async def test_a_group_of_100000_members_runs_its_callback_once(
    app: pgqueue.App, conn: Conn
) -> None:
    calls: list[int] = []

    @app.task
    async def noop(n: int) -> int:
        return 1

    @app.task
    async def done(results: list[int]) -> int:
        calls.append(len(results))
        return sum(results)

    started = time.monotonic()
    grouped = app.group([noop.s(n=n) for n in range(100_000)], then=done.s())
    enqueue_seconds = time.monotonic() - started
    assert grouped.callback is not None
    async with running_worker(app, concurrency=50, **FAST):
        assert await app.wait_async(grouped.callback, timeout=600) == 100_000
    assert calls == [100_000]
    assert enqueue_seconds < 120


async def test_a_parents_retry_does_not_release_its_child_and_its_success_does(
    app: pgqueue.App, conn: Conn
) -> None:
    ran: list[str] = []

    @app.task(max_attempts=3, backoff=pgqueue.Backoff(base=0.05, cap=0.05))
    async def flaky(ctx: pgqueue.JobContext) -> None:
        ran.append(f"flaky{ctx.attempt}")
        if ctx.attempt == 1:
            raise RuntimeError("first try fails")

    @app.task
    async def after_it() -> None:
        ran.append("child")

    parent = flaky.enqueue()
    child = after_it.configure(after=[parent]).enqueue()
    async with running_worker(app, **{**FAST, "poll_interval": 0.2}):
        await wait_until_async(lambda: status(conn, child) == "succeeded", timeout=30)
    assert ran == ["flaky1", "flaky2", "child"]


async def test_a_dead_group_member_cancels_the_callback_or_it_runs_with_the_gap(
    app: pgqueue.App, conn: Conn
) -> None:
    @app.task(max_attempts=1)
    async def member(n: int) -> int:
        if n == 2:
            raise ValueError("member 2 fails")
        return n

    @app.task
    async def collect(results: list[Any]) -> list[Any]:
        return results

    strict = app.group([member.s(n=n) for n in range(4)], then=collect.s())
    lenient = app.group([member.s(n=n) for n in range(4)], then=collect.s(), after_failure="run")
    assert strict.callback is not None and lenient.callback is not None
    async with running_worker(app, concurrency=4, **FAST):
        with pytest.raises(pgqueue.JobCancelledError):
            await app.wait_async(strict.callback, timeout=30)
        assert await app.wait_async(lenient.callback, timeout=30) == [0, 1, None, 3]


async def test_cancelling_a_blocked_job_cancels_it_and_its_children_and_it_never_runs(
    app: pgqueue.App, conn: Conn
) -> None:
    ran: list[str] = []

    @app.task
    async def step(name: str) -> None:
        ran.append(name)

    first, second, third = app.chain(step.s(name="a"), step.s(name="b"), step.s(name="c"))
    assert status(conn, second) == "blocked"
    assert app.cancel(second) == pgqueue.CancelResult.CANCELLED
    assert status(conn, second) == "cancelled" and status(conn, third) == "cancelled"
    with pytest.raises(pgqueue.JobCancelledError):
        app.wait(third, timeout=5)
    async with running_worker(app, **FAST):
        await wait_until_async(lambda: status(conn, first) == "succeeded", timeout=30)
        await asyncio.sleep(0.3)
    assert ran == ["a"]
    assert status(conn, second) == "cancelled" and status(conn, third) == "cancelled"


def test_a_workflow_refuses_unique_jobs_it_cannot_keep_unique(app: pgqueue.App, conn: Conn) -> None:
    """A chain's later steps and a group's callback run after other jobs, which a unique job
    cannot (as with after=), and a group's members are written in bulk without keys: each was
    written before without the key its task declares, so two equal jobs could both be queued."""

    @app.task(unique=True)
    def sync_user(user: int) -> None: ...

    @app.task
    def plain(n: int) -> None: ...

    @app.task
    def total(results: list[Any]) -> None: ...

    @app.task(unique=True)
    def report(results: list[Any]) -> None: ...

    with pytest.raises(pgqueue.InvalidJobError, match=r"step 2 of the chain .* unique"):
        app.chain(plain.s(n=1), sync_user.s(user=1))
    with pytest.raises(pgqueue.InvalidJobError, match=r"member 2 of the group .* unique"):
        app.group([plain.s(n=1), sync_user.s(user=1), sync_user.s(user=1)], then=total.s())
    with pytest.raises(pgqueue.InvalidJobError, match=r"callback .* unique"):
        app.group([plain.s(n=1)], then=report.s())
    parent = plain.enqueue(n=0)
    with pytest.raises(pgqueue.InvalidJobError, match=r"after=.* unique"):  # the same rule
        sync_user.configure(after=[parent]).enqueue(user=1)
    assert conn.execute("SELECT count(*) FROM pgqueue_jobs").fetchone() == (1,)

    # A chain may start with a unique job: its key holds, and a second chain's first step is
    # that job, which its next step then follows.
    first = app.chain(sync_user.s(user=7), plain.s(n=1))
    second = app.chain(sync_user.s(user=7), plain.s(n=2))
    assert not first[0].duplicate and second[0].duplicate
    assert int(second[0]) == int(first[0])
    assert conn.execute(
        "SELECT count(*) FROM pgqueue_jobs WHERE task = %s", [sync_user.name]
    ).fetchone() == (1,)
