"""Transactional completion: a handler that takes a psycopg connection gets one inside a
transaction, and its success ack is written in that same transaction before it commits.

The ack is fenced like every other (``complete_jobs``: id and lease token, still running), so if
the lease was lost while the handler ran, the ack matches nothing and the whole transaction,
the handler's writes included, rolls back. A job's database effects therefore commit exactly
once even when the job runs twice.

Handler transactions use pools of their own (opened on first use, up to ``tx_pool_size``
connections each, the async and the sync handlers' pool; idle ones close after ``MAX_IDLE``), so
long handlers never starve the claims and acks on the worker's connections. A handler that finds
every connection taken waits for one (its timeout still applies). A connection goes back to
its pool reset (``RESET_SESSION``): a setting, a temporary table, a LISTEN or an advisory lock
one handler left on its session never reaches the next job that gets the connection.

Any isolation level works: nothing writes a running job's row between its claim and its ack (the
worker's lease is one row of its own, see ``heartbeat``), so the ack of a REPEATABLE READ or
SERIALIZABLE transaction conflicts with nothing of the worker's. The ack waits for the job's
row lock no longer than the lease (``lock_timeout`` in ``complete_jobs``): if someone else holds
the row that long, the attempt fails and is retried instead of waiting without end. Once the
ack is written the row stays locked until COMMIT, and a worker cut off from the server right
then would hold it for as long as the network takes to say so (the reaper skips locked rows):
the ack also sets the transaction's idle timeout to half the lease
(``complete_jobs_in_transaction``), past which the server ends the session.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool, ConnectionPool, PoolTimeout

from ..sql import Queries

#: Seconds psycopg_pool keeps retrying one lost connection before it gives up on it (the next
#: request for a connection starts a new attempt at once). Its backoff doubles from 1 s without
#: a cap: with its default (300 s) a pool could wait 16 s or more to try again after a 10 s
#: failover, while a short budget keeps attempts about a second apart.
RECONNECT_TIMEOUT = 2.0

#: Given the handler's result, the parameters of its success ack (``complete_jobs``).
AckParams = Callable[[Any], dict[str, Any]]

#: Seconds an idle handler connection is kept.
MAX_IDLE = 60.0
#: A handler waits this long at most for a connection (its own timeout usually ends it first).
WAIT = 24 * 3600.0
#: A handler asks the pool for a connection again after this many seconds of waiting. Once
#: psycopg_pool gave up an attempt to connect (RECONNECT_TIMEOUT, the server down), only a new
#: request starts another: handlers that were already waiting stayed waiting after the server
#: came back (a PostgreSQL restart in the fault suite left 16 of them, every slot of a worker,
#: waiting for minutes while its heartbeat kept their leases alive).
ACQUIRE_STEP = 4.0

#: What a handler may have left on its session, undone before the next job gets the connection
#: (DISCARD ALL without DEALLOCATE ALL, which would drop psycopg's prepared statements).
RESET_SESSION = (
    "CLOSE ALL; SET SESSION AUTHORIZATION DEFAULT; RESET ALL; UNLISTEN *; "
    "SELECT pg_advisory_unlock_all(); DISCARD SEQUENCES; DISCARD TEMP"
)


async def _reset_async(conn: psycopg.AsyncConnection[Any]) -> None:
    await conn.execute(RESET_SESSION)
    await conn.commit()


def _reset_sync(conn: psycopg.Connection[Any]) -> None:
    conn.execute(RESET_SESSION)
    conn.commit()


@contextlib.asynccontextmanager
async def _connection_async(
    pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]],
) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """``pool.connection()``, asking again every ACQUIRE_STEP seconds while it waits."""
    waited = 0.0
    while True:
        try:
            conn = await pool.getconn(timeout=ACQUIRE_STEP)
            break
        except PoolTimeout:
            waited += ACQUIRE_STEP
            if waited >= WAIT:
                raise
    try:
        async with conn:
            yield conn
    finally:
        await pool.putconn(conn)


@contextlib.contextmanager
def _connection_sync(
    pool: ConnectionPool[psycopg.Connection[Any]],
) -> Iterator[psycopg.Connection[Any]]:
    """The same for a sync handler, in its worker thread."""
    waited = 0.0
    while True:
        try:
            conn = pool.getconn(timeout=ACQUIRE_STEP)
            break
        except PoolTimeout:
            waited += ACQUIRE_STEP
            if waited >= WAIT:
                raise
    try:
        with conn:
            yield conn
    finally:
        pool.putconn(conn)


class CommitUncertainError(Exception):
    """The COMMIT of a handler's transaction failed on the client side: it may have committed."""


class Transactions:
    def __init__(
        self,
        dsn: str,
        q: Queries,
        size: int,
        connect_kwargs: dict[str, Any],
        *,
        lock_timeout: float = 30.0,
    ) -> None:
        self.dsn = dsn
        self.q = q
        self.size = size
        self.kwargs = {**connect_kwargs, "autocommit": False}
        #: How long a handler's ack waits for its row lock, in PostgreSQL's notation (whose
        #: lock_timeout ends at 2^31 - 1 ms, about 24 days).
        self.lock_timeout = f"{min(max(int(lock_timeout * 1000), 1), 2**31 - 1)}ms"
        #: How long the server lets the transaction sit idle between its ack and COMMIT (half
        #: the lease; complete_jobs_in_transaction): a worker cut off there leaves the job's
        #: row locked no longer than that, so the reaper can take it once the lease runs out.
        self.idle_timeout = f"{min(max(int(lock_timeout * 500), 1), 2**31 - 1)}ms"
        self._async: AsyncConnectionPool[psycopg.AsyncConnection[Any]] | None = None
        self._sync: ConnectionPool[psycopg.Connection[Any]] | None = None
        self._lock = threading.Lock()

    async def _async_pool(self) -> AsyncConnectionPool[psycopg.AsyncConnection[Any]]:
        if self._async is None:
            pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] = AsyncConnectionPool(
                self.dsn,
                min_size=0,
                max_size=self.size,
                open=False,
                kwargs=self.kwargs,
                reset=_reset_async,
                name="pgqueue-worker-handlers",
                reconnect_timeout=RECONNECT_TIMEOUT,
                max_idle=MAX_IDLE,
                timeout=WAIT,
            )
            await pool.open()
            self._async = pool
        return self._async

    def _sync_pool(self) -> ConnectionPool[psycopg.Connection[Any]]:
        with self._lock:
            if self._sync is None:
                self._sync = ConnectionPool(
                    self.dsn,
                    min_size=0,
                    max_size=self.size,
                    open=True,
                    kwargs=self.kwargs,
                    reset=_reset_sync,
                    name="pgqueue-worker-handlers",
                    reconnect_timeout=RECONNECT_TIMEOUT,
                    max_idle=MAX_IDLE,
                    timeout=WAIT,
                )
            return self._sync

    async def run_async(
        self,
        call: Callable[[psycopg.AsyncConnection[Any]], Awaitable[Any]],
        ack: AckParams,
    ) -> tuple[Any, bool]:
        """Run ``call`` in a transaction and ack in it; (result, whether the ack was ours)."""
        pool = await self._async_pool()
        acked = False
        async with _connection_async(pool) as conn:
            try:
                async with conn.transaction():
                    result = await call(conn)
                    cur = await conn.execute(self.q.complete_jobs_in_transaction, ack(result))
                    if not await cur.fetchall():
                        raise psycopg.Rollback()  # the lease is gone: none of it may stay
                    acked = True
            except (psycopg.OperationalError, OSError) as exc:
                if acked:
                    raise CommitUncertainError(f"COMMIT failed: {exc}") from exc
                raise
        return result, acked

    def run_sync(
        self,
        call: Callable[[psycopg.Connection[Any]], Any],
        ack: AckParams,
    ) -> tuple[Any, bool]:
        """The same for a sync handler, in its worker thread."""
        acked = False
        with _connection_sync(self._sync_pool()) as conn:
            try:
                with conn.transaction():
                    result = call(conn)
                    if not conn.execute(
                        self.q.complete_jobs_in_transaction, ack(result)
                    ).fetchall():
                        raise psycopg.Rollback()
                    acked = True
            except (psycopg.OperationalError, OSError) as exc:
                if acked:
                    raise CommitUncertainError(f"COMMIT failed: {exc}") from exc
                raise
        return result, acked

    async def close(self) -> None:
        if self._async is not None:
            await self._async.close()
        if self._sync is not None:
            await asyncio.to_thread(self._sync.close)
