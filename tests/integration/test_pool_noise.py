"""The worker's filter of psycopg_pool's warnings (``PoolNoise``) runs inside the pool's own code,
right before the pool replaces a connection it found closed. A filter that raised there skipped
the replacement: the connection's slot was gone for good. Found by the fault suite's blackhole:
handlers cancelled while the network was cut had their queries cancelled in vain, psycopg closed
their connections, the filter asked a closed connection for its application name, and after
eight of them (every slot of the handler pool) the worker's next jobs waited for a connection
for ever under its renewed lease."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import pgqueue
from pgqueue.worker.outage import Outage, PoolNoise
from pgqueue.worker.transactions import Transactions
from tests.helpers import proxied, running_worker, wait_until_async

NAME = "pgqueue-worker:1"


@pytest.fixture
def pool_noise(caplog: pytest.LogCaptureFixture) -> Iterator[Outage]:
    """PoolNoise on psycopg_pool's logger, as a running worker installs it; its warnings on."""
    caplog.set_level(logging.WARNING, logger="psycopg.pool")
    outage = Outage()
    noise = PoolNoise(outage, NAME)
    logger = logging.getLogger("psycopg.pool")
    logger.addFilter(noise)
    try:
        yield outage
    finally:
        logger.removeFilter(noise)


async def closed_by_psycopg(conn: psycopg.AsyncConnection[Any]) -> None:
    """What psycopg does when a cancelled query's cancel goes unanswered (a cut network): it
    gives the connection up with ``pgconn.finish()``, and the handler sees the cancellation."""
    await conn.execute("SELECT 1")
    conn.pgconn.finish()
    raise asyncio.CancelledError


@pytest.mark.parametrize("noisy", [False, True], ids=["no outage", "outage"])
async def test_a_handler_connection_closed_by_psycopg_is_replaced(
    app: pgqueue.App, dsn: str, pool_noise: Outage, noisy: bool
) -> None:
    if noisy:
        pool_noise.failed("heartbeat", OSError("cut"))
    tx = Transactions(dsn, app.q, 1, {"application_name": f"{NAME}:handlers"})
    try:
        with pytest.raises(asyncio.CancelledError):
            await tx.run_async(closed_by_psycopg, lambda _result: {})

        async def select(conn: psycopg.AsyncConnection[Any]) -> Any:
            cur = await conn.execute("SELECT 42")
            raise LookupError((await cur.fetchone() or [None])[0])

        # The pool's one slot must come back: the next handler gets a connection at once.
        with pytest.raises(LookupError, match="42"):
            await asyncio.wait_for(tx.run_async(select, lambda _result: {}), 20)
    finally:
        await tx.close()


def test_the_filter_never_raises_on_a_closed_connection(dsn: str, pool_noise: Outage) -> None:
    conn = psycopg.connect(dsn, application_name=f"{NAME}:handlers")
    conn.pgconn.finish()
    record = logging.LogRecord(
        "psycopg.pool", logging.WARNING, __file__, 1, "discarding closed connection: %s",
        (conn,), None,
    )  # fmt: skip
    noise = PoolNoise(pool_noise, NAME)
    assert noise.filter(record)  # no outage: whose it was cannot be told, so it is kept
    pool_noise.failed("claim", OSError("cut"))
    assert not noise.filter(record)  # during an outage: the outage's own line says it


@pytest.mark.slow
async def test_a_worker_cut_off_in_a_handlers_query_runs_its_jobs_once_the_network_is_back(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The fault suite's case whole: a handler in the middle of a query when the network is cut,
    abandoned when the worker's lease runs out, its query's cancel unanswered (psycopg gives the
    connection up after 5 + 5 s); the worker's only handler connection must come back."""
    caplog.set_level(logging.WARNING, logger="psycopg")
    with proxied(dsn) as (proxy, through):
        app = pgqueue.App(through)
        done: list[int] = []

        @app.task
        async def query(ctx: pgqueue.JobContext, conn: psycopg.AsyncConnection[Any], n: int) -> int:
            if n == 0 and ctx.attempt == 1:
                await conn.execute("SELECT pg_sleep(120)")
            done.append(n)
            return n

        options = {"lease": 2.0, "heartbeat_interval": 0.5, "poll_interval": 0.2,
                   "reaper_interval": 0.3, "concurrency": 1, "tx_pool_size": 1}  # fmt: skip
        try:
            async with running_worker(app, **options):
                query.enqueue(n=0)
                direct = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
                async with direct:

                    async def sleeping() -> bool:
                        cur = await direct.execute(
                            "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'SELECT pg_sleep(120)%%'"
                            " AND state = 'active' AND pid <> pg_backend_pid()"
                        )
                        return (await cur.fetchone() or [0])[0] == 1

                    await wait_until_async(sleeping, what="the handler's query running")
                    proxy.blackhole()
                    given_up = "query not terminated after cancellation"
                    await wait_until_async(
                        lambda: any(given_up in r.getMessage() for r in caplog.records),
                        timeout=60, what="psycopg giving the handler's connection up",
                    )  # fmt: skip
                    proxy.heal()
                    # The cut-off query still holds a server session: end it, as TCP would.
                    await direct.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                        " WHERE query LIKE 'SELECT pg_sleep(120)%%' AND pid <> pg_backend_pid()"
                    )
                query.enqueue(n=1)
                await wait_until_async(
                    lambda: sorted(done) == [0, 1], timeout=60, what="both jobs run"
                )
        finally:
            app.close()
