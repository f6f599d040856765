"""A worker whose database becomes read-only (a standby not promoted yet: every write refused
with 25006) and then writable again, as during a failover behind one address: the worker keeps
running, logs the outage once and its end once, and then runs the jobs enqueued meanwhile."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import psycopg
import pytest

import pgqueue
from pgqueue.embedded import EmbeddedPostgres
from pgqueue.migrate import migrate
from tests.helpers import running_worker, wait_until_async


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
