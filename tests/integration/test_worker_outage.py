"""A worker through the outages of a failover: a database that becomes read-only (a standby not
promoted yet: every write refused with 25006) and then writable again, as behind one address
(the worker keeps running, logs the outage once and its end once, and then runs the jobs
enqueued meanwhile); and a claim whose answer was lost in the crash."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import pgqueue
from pgqueue.embedded import EmbeddedPostgres
from pgqueue.migrate import migrate
from pgqueue.worker import heartbeat
from tests.helpers import running_worker, wait_until_async

Conn = psycopg.Connection[tuple[Any, ...]]


@pytest.fixture
def cluster() -> Iterator[EmbeddedPostgres]:
    """A cluster of this test's own: the test makes all of it read-only."""
    with EmbeddedPostgres() as server:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            migrate(conn, "public")
        yield server


def read_only(dsn: str, on: bool) -> None:
    """Every session's next transaction read-only (or not), as on a standby."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        if on:
            conn.execute("ALTER SYSTEM SET default_transaction_read_only = on")
        else:
            conn.execute("ALTER SYSTEM RESET default_transaction_read_only")
        conn.execute("SELECT pg_reload_conf()")


async def test_a_worker_rides_out_a_read_only_database_with_one_warning_each_way(
    cluster: EmbeddedPostgres, caplog: pytest.LogCaptureFixture
) -> None:
    app = pgqueue.App(cluster.dsn)
    done: list[int] = []

    @app.task
    async def mark(n: int) -> None:
        done.append(n)

    caplog.set_level(logging.WARNING, logger="pgqueue")
    try:
        async with running_worker(app, lease=6, poll_interval=0.2) as worker:
            await app.enqueue_async("mark", {"n": 1})
            await wait_until_async(lambda: done == [1])
            read_only(cluster.dsn, True)
            assert worker.state is not None
            outage = worker.state.outage
            await wait_until_async(lambda: outage.since is not None and outage.rounds >= 5)
            read_only(cluster.dsn, False)
            await app.enqueue_async("mark", {"n": 2})
            await wait_until_async(lambda: done == [1, 2], timeout=60)
            assert not worker.stopped.is_set()
    finally:
        read_only(cluster.dsn, False)
        await app.aclose()
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("pgqueue")]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("PostgreSQL is unreachable (")
    assert "read-only transaction" in warnings[0]
    assert warnings[1].startswith("PostgreSQL is reachable again after ")


async def test_a_claim_whose_answer_was_lost_is_given_up_two_heartbeats_after_the_outage(
    app: pgqueue.App, conn: Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim that committed but whose answer never reached the worker (the primary crashed
    first) leaves a job running under the worker's lease that the worker does not know of, and
    the worker keeps that lease alive. After a heartbeat failed, the next two successful ones
    look for such jobs and expire them, instead of waiting for the hourly look (here)."""
    monkeypatch.setattr(heartbeat, "UNTRACKED_EVERY", 3600.0)
    async with running_worker(app, queues=["served"], lease=3, poll_interval=0.2) as worker:
        job = await app.enqueue_async("t", {}, queue="elsewhere", allow_unknown=True)
        # The claim whose answer was lost: running under this worker's lease, unknown to it.
        conn.execute(
            "UPDATE pgqueue_jobs SET status = 'running', worker_id = %s, lease_token = %s,"
            " attempts = 1, claimed_at = now() WHERE id = %s",
            (worker.id, uuid.uuid4(), job),
        )
        await wait_until_async(lambda: worker.heartbeat.beats >= 2)
        assert status(conn, job) == "running"  # the heartbeat's regular look is an hour away
        # The outage, as the heartbeat sees it: its statement gets no answer within its
        # interval (the worker's row locked here), so the round fails. (Terminating its idle
        # connection would not do: the worker's pool replaces a dead idle connection unseen.)
        with conn.transaction():
            conn.execute("SELECT 1 FROM pgqueue_workers WHERE id = %s FOR UPDATE", (worker.id,))
            await wait_until_async(lambda: worker.heartbeat._look_soon > 0, timeout=30)
        await wait_until_async(lambda: status(conn, job) == "retrying", timeout=30)


def status(conn: Conn, job: int) -> str:
    row = conn.execute("SELECT status FROM pgqueue_jobs WHERE id = %s", (job,)).fetchone()
    assert row is not None
    return str(row[0])
