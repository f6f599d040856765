"""The producer's connections: one small pool for sync callers, one per event loop for async
ones, and nothing running in the background.

Why not psycopg_pool here: its pools fill and check connections from background threads
(sync) or tasks (async). Per event loop, those tasks are what ``asyncio.run()`` cancels on its
way out, and a pool left open by a finished loop keeps its connections forever; one whose
first connection failed can hang that cancellation. A producer needs none of what the
background work buys (it enqueues a row now and then), so these pools connect in the caller,
when a statement needs a connection and none is idle, and hold idle connections in a list.
An unreachable server is then a clear error at once, not a 10 s wait for a pool worker that
keeps retrying.

Before an idle connection is used it is checked without a round trip: an idle connection has
nothing to read, so a readable socket means the server has said goodbye (terminated the
session, shut down, timed out the session) or the path reset it. Such a connection is closed
and the statement goes to another idle one or a fresh connection, so it is never sent where it
would fail.

A call retries, with capped exponential backoff for up to ``retry_for`` seconds (the App's
``reconnect_timeout``), only what proves that nothing of it was committed: a connection that
could not be made (refused, the server starting up or shutting down, 57P03, a standby refused by
``target_session_attrs=read-write`` during a failover), and a statement PostgreSQL refused
because the server is read-only (25006: a standby not promoted yet). A connection failure that
no wait can fix (a wrong password, an unknown database) is raised at once. Once a write is sent,
a lost connection cannot tell whether it ran (libpq reports even a failed write only with the
read after it; a server shut down or crashed mid-COMMIT may have committed it), so the caller
gets ``DatabaseUnavailableError`` with ``uncertain`` set and the write is never sent again.
Pure reads are retried like connection failures, lost connection included.

An async pool belongs to the loop that made it. ``asyncio.run()`` (and ``asyncio.Runner``)
close every async generator still open in their loop before closing it
(``loop.shutdown_asyncgens()``), the one hook a library has into the end of a loop it did not
create: each pool parks such a generator, whose ``finally`` closes the pool's connections. A
loop closed another way is noticed on the next use from any loop, or by ``App.close()``.
"""

from __future__ import annotations

import asyncio
import os
import random
import select
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Generic, TypeVar

import psycopg
from psycopg import conninfo
from psycopg.pq import ConnStatus, TransactionStatus

from . import db
from .errors import DatabaseUnavailableError

T = TypeVar("T")
SyncConn = psycopg.Connection[Any]
AsyncConn = psycopg.AsyncConnection[Any]

#: Connections at most per pool (the sync pool, and each event loop's), unless the app sets
#: ``pool_size``.
MAX_SIZE = 8
#: Seconds an unused connection is kept; older ones are closed on the next use of their pool.
MAX_IDLE = 600.0
APPLICATION_NAME = "pgqueue-producer"
#: Seconds a call retries, by default, while PostgreSQL cannot take it (App's reconnect_timeout).
RETRY_FOR = 15.0
#: The first pause between retries; it doubles up to RETRY_MAX (see Retries).
RETRY_FIRST = 0.05
RETRY_MAX = 1.0
#: Connection failures that waiting does not fix (libpq's words; its connection errors carry no
#: SQLSTATE): raised at once instead of retried.
PERMANENT = (
    "authentication failed",
    "no pg_hba.conf entry",
    "does not exist",
    "password",
    "permission denied",
    "not support",
)
#: Defaults for what the DSN (or libpq's environment variable) does not set. Without them a
#: statement to a server that vanished from the network waits for TCP's own timeouts (minutes);
#: with them it fails within about 15 s, and a connect within 10 s.
DEFAULTS: dict[str, tuple[str | None, Any]] = {
    "application_name": ("PGAPPNAME", APPLICATION_NAME),
    **{key: (None, value) for key, value in db.KEEPALIVES.items()},
    "connect_timeout": ("PGCONNECT_TIMEOUT", db.KEEPALIVES["connect_timeout"]),
}


def connect_kwargs(dsn: str, options: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of every producer connection: autocommit, ``options``, and DEFAULTS
    where neither the DSN nor the environment sets them (a keyword would override both)."""
    given = conninfo.conninfo_to_dict(dsn)
    kwargs = {
        key: value
        for key, (variable, value) in DEFAULTS.items()
        if key not in given and not (variable and os.environ.get(variable))
    }
    return {**kwargs, **options, "autocommit": True}


def _readable(fd: int) -> bool:
    if hasattr(select, "poll"):  # select() cannot watch descriptors above 1023
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(0))
    return bool(select.select([fd], [], [], 0)[0])


def _settled(conn: SyncConn | AsyncConn) -> bool:
    """Open, in autocommit and outside a transaction, as pgqueue's statements expect (code
    given ``App.connection()`` may have changed that)."""
    pgconn = conn.pgconn
    return (
        pgconn.status == ConnStatus.OK
        and pgconn.transaction_status == TransactionStatus.IDLE
        and conn.autocommit
    )


def reusable(conn: SyncConn | AsyncConn) -> bool:
    """Whether an idle connection can take the next statement, judged without a round trip:
    settled, and with nothing to read."""
    return _settled(conn) and not _readable(conn.pgconn.socket)


def lost(conn: SyncConn | AsyncConn, exc: psycopg.OperationalError) -> bool:
    """Whether ``exc`` means the connection is gone, rather than the statement failing."""
    if conn.closed:
        return True
    sqlstate = exc.sqlstate or ""
    return sqlstate.startswith(("08", "57P0"))  # connection exception; shutdown, terminated


class _Lost(Exception):
    """A statement failed because its connection is gone (``cause``)."""

    def __init__(self, cause: psycopg.OperationalError) -> None:
        super().__init__(str(cause))
        self.cause = cause


class _NotDone(Exception):
    """Nothing of the call was committed, and it may be sent again: ``error`` is what the
    caller gets if the retries run out."""

    def __init__(self, error: DatabaseUnavailableError) -> None:
        super().__init__(str(error))
        self.error = error


def permanent(exc: BaseException) -> bool:
    """Whether a failed connect is a configuration error rather than an unavailable server."""
    text = str(exc).lower()
    return any(words in text for words in PERMANENT)


def standby_refused(exc: psycopg.Error) -> bool:
    """PostgreSQL refused the statement because the server is a standby (25006): nothing of it
    was written, and after a promotion (or on another host) it goes through."""
    return exc.sqlstate == "25006"


class Retries:
    """The retry budget of one call: pauses drawn between half and all of a ceiling that
    doubles up to RETRY_MAX (callers that failed together do not retry in step), for at most
    ``retry_for`` seconds from the first failure."""

    def __init__(self, retry_for: float) -> None:
        self.retry_for = retry_for
        self.deadline: float | None = None
        self.ceiling = RETRY_FIRST
        self.tries = 0

    def pause(self) -> float | None:
        """Seconds to wait before the next try, or None when the budget is spent."""
        now = time.monotonic()
        if self.deadline is None:
            self.deadline = now + self.retry_for
        if now >= self.deadline:
            return None
        self.tries += 1
        pause = random.uniform(self.ceiling / 2, self.ceiling)
        self.ceiling = min(self.ceiling * 2, RETRY_MAX)
        return min(pause, self.deadline - now)

    def gave_up(
        self, error: DatabaseUnavailableError, *, wrote: bool = False
    ) -> DatabaseUnavailableError:
        """What the caller gets when the budget is spent: ``error``, saying how long it was
        retried and, for a write, that nothing of it was written."""
        if not self.tries:
            return error
        outcome = "; nothing was written" if wrote else ""
        return DatabaseUnavailableError(f"{error} (retried for {self.retry_for:g} s){outcome}")


def unreachable(dsn: str, exc: BaseException) -> _NotDone | DatabaseUnavailableError:
    """A failed connect: retryable unless the settings themselves are wrong."""
    error = db.unavailable(dsn, exc)
    return error if permanent(exc) else _NotDone(error)


def refused_as_read_only(dsn: str, exc: psycopg.Error) -> _NotDone:
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else "read-only server"
    return _NotDone(
        DatabaseUnavailableError(
            f"PostgreSQL at {db.describe_dsn(dsn)} is read-only (a standby): {reason}"
        )
    )


def _close(conn: SyncConn | AsyncConn) -> None:
    # libpq's PQfinish is synchronous and needs no event loop, so a sync and an async
    # connection close alike, from any thread, even after their loop has closed.
    if not conn.closed:
        conn.pgconn.finish()


C = TypeVar("C", SyncConn, AsyncConn)


def _close_idle(lock: threading.Lock, idle: list[tuple[float, C]]) -> None:
    with lock:
        conns = [conn for _, conn in idle]
        idle.clear()
    for conn in conns:
        _close(conn)


class _Idle(Generic[C]):
    """What the sync and async pools share: the idle connections (newest last, so the oldest
    age out) under a thread lock, since ``App.close()`` may close them from any thread."""

    def __init__(self, dsn: str, kwargs: dict[str, Any], retry_for: float) -> None:
        self.dsn = dsn
        self.kwargs = kwargs
        #: Seconds a call retries while PostgreSQL cannot take it (see the module docstring).
        self.retry_for = retry_for
        self.closed = False
        self._idle: list[tuple[float, C]] = []
        self._lock = threading.Lock()
        # Also run when the pool is collected, or at exit if it is still alive: an app that is
        # never closed still says goodbye to the server instead of dropping its sockets.
        self._close_idle: weakref.finalize[Any, Any] = weakref.finalize(
            self, _close_idle, self._lock, self._idle
        )

    def _pop(self) -> C | None:
        """A reusable idle connection, or None; dead and expired ones are closed on the way."""
        discard: list[C] = []
        found = None
        now = time.monotonic()
        with self._lock:
            while self._idle and self._idle[0][0] < now - MAX_IDLE:
                discard.append(self._idle.pop(0)[1])
            while found is None and self._idle:
                conn = self._idle.pop()[1]
                if reusable(conn):
                    found = conn
                else:
                    discard.append(conn)
        for conn in discard:
            _close(conn)
        return found

    def _push(self, conn: C) -> None:
        # Not checked for input here: ``_pop`` does it when the connection is next used.
        if not self.closed and _settled(conn):
            with self._lock:
                if not self.closed:
                    self._idle.append((time.monotonic(), conn))
                    return
        _close(conn)

    def close(self) -> None:
        """Close the idle connections now; those in use are closed when they come back."""
        with self._lock:
            self.closed = True
        self._close_idle()


class Pool(_Idle[SyncConn]):
    """Sync producer connections, shared by threads."""

    def __init__(
        self, dsn: str, kwargs: dict[str, Any], retry_for: float = 0.0, size: int = MAX_SIZE
    ) -> None:
        super().__init__(dsn, kwargs, retry_for)
        self._slots = threading.BoundedSemaphore(size)

    def take(self) -> SyncConn:
        """A checked idle connection or a new one, retried while the server is unavailable
        (DatabaseUnavailableError once ``retry_for`` is spent); give it back with
        ``give_back``."""
        retries = Retries(self.retry_for)
        while True:
            try:
                return self._take()
            except _NotDone as exc:
                pause = retries.pause()
                if pause is None:
                    raise retries.gave_up(exc.error) from None
                time.sleep(pause)

    def _take(self) -> SyncConn:
        self._slots.acquire()
        try:
            conn = self._pop()
            if conn is not None:
                return conn
            try:
                return psycopg.connect(self.dsn, **self.kwargs)
            except psycopg.OperationalError as exc:
                raise unreachable(self.dsn, exc) from None
        except BaseException:
            self._slots.release()
            raise

    def give_back(self, conn: SyncConn) -> None:
        try:
            self._push(conn)
        finally:
            self._slots.release()

    def run(
        self, statement: Callable[[SyncConn], T], *, read_only: bool = False,
        replayable: bool = True,
    ) -> T:  # fmt: skip
        """``statement`` on one of the pool's connections, retried while nothing of it can
        have been committed (see the module docstring); ``read_only`` also after a lost
        connection. ``replayable=False`` (a statement that consumes its input as it goes)
        retries only connecting. A lost connection is a DatabaseUnavailableError."""
        retries = None  # made on the first failure: most calls never need one
        lost_once = False
        while True:
            try:
                return self._once(statement, replay=replayable)
            except _NotDone as exc:
                error = exc.error
            except _Lost as exc:
                if not read_only:
                    raise db.lost(self.dsn, exc.cause) from None
                if not lost_once:  # a read goes once more at once, whatever the budget
                    lost_once = True
                    continue
                error = db.lost(self.dsn, exc.cause, read_only=True)
            retries = retries or Retries(self.retry_for)
            pause = retries.pause()
            if pause is None:
                raise retries.gave_up(error, wrote=not read_only) from None
            time.sleep(pause)

    def _once(self, statement: Callable[[SyncConn], T], *, replay: bool) -> T:
        conn = self._take()
        try:
            return statement(conn)
        except psycopg.OperationalError as exc:
            if lost(conn, exc):
                raise _Lost(exc) from exc
            raise
        except psycopg.Error as exc:
            if standby_refused(exc):
                _close(conn)  # a standby: the next try connects again, maybe elsewhere
                refused = refused_as_read_only(self.dsn, exc)
                raise refused if replay else refused.error from None
            raise
        finally:
            self.give_back(conn)


class AsyncPool(_Idle[AsyncConn]):
    """One event loop's producer connections."""

    def __init__(
        self,
        dsn: str,
        kwargs: dict[str, Any],
        loop: asyncio.AbstractEventLoop,
        retry_for: float = 0.0,
        size: int = MAX_SIZE,
    ) -> None:
        super().__init__(dsn, kwargs, retry_for)
        #: Held, not weakly referenced: while the pool exists its loop cannot be collected and
        #: its id() reused by a new loop.
        self.loop = loop
        self._slots = asyncio.Semaphore(size)
        self._end_hook: AsyncIterator[None] | None = None

    async def watch_loop_end(self) -> None:
        """Park a generator that the loop's ``shutdown_asyncgens()`` will close (see above)."""
        self._end_hook = _closes_at_loop_end(self)
        await anext(self._end_hook)

    async def take(self) -> AsyncConn:
        retries = Retries(self.retry_for)
        while True:
            try:
                return await self._take()
            except _NotDone as exc:
                pause = retries.pause()
                if pause is None:
                    raise retries.gave_up(exc.error) from None
                await asyncio.sleep(pause)

    async def _take(self) -> AsyncConn:
        await self._slots.acquire()
        try:
            conn = self._pop()
            if conn is not None:
                return conn
            try:
                return await psycopg.AsyncConnection.connect(self.dsn, **self.kwargs)
            except psycopg.OperationalError as exc:
                raise unreachable(self.dsn, exc) from None
        except BaseException:
            self._slots.release()
            raise

    def give_back(self, conn: AsyncConn) -> None:
        try:
            self._push(conn)
        finally:
            self._slots.release()

    async def run(
        self, statement: Callable[[AsyncConn], Awaitable[T]], *, read_only: bool = False,
        replayable: bool = True,
    ) -> T:  # fmt: skip
        """The async twin of ``Pool.run``."""
        retries = None  # made on the first failure: most calls never need one
        lost_once = False
        while True:
            try:
                return await self._once(statement, replay=replayable)
            except _NotDone as exc:
                error = exc.error
            except _Lost as exc:
                if not read_only:
                    raise db.lost(self.dsn, exc.cause) from None
                if not lost_once:  # a read goes once more at once, whatever the budget
                    lost_once = True
                    continue
                error = db.lost(self.dsn, exc.cause, read_only=True)
            retries = retries or Retries(self.retry_for)
            pause = retries.pause()
            if pause is None:
                raise retries.gave_up(error, wrote=not read_only) from None
            await asyncio.sleep(pause)

    async def _once(self, statement: Callable[[AsyncConn], Awaitable[T]], *, replay: bool) -> T:
        conn = await self._take()
        try:
            return await statement(conn)
        except psycopg.OperationalError as exc:
            if lost(conn, exc):
                raise _Lost(exc) from exc
            raise
        except psycopg.Error as exc:
            if standby_refused(exc):
                _close(conn)
                refused = refused_as_read_only(self.dsn, exc)
                raise refused if replay else refused.error from None
            raise
        finally:
            self.give_back(conn)


async def _closes_at_loop_end(pool: AsyncPool) -> AsyncIterator[None]:
    try:
        yield
    finally:
        pool.close()


class LoopPools:
    """The async pools of one App, one per event loop that used it. ``settings`` gives the
    DSN and connection keywords (called when a pool is made, not on every statement)."""

    def __init__(
        self, settings: Callable[[], tuple[str, dict[str, Any], float]], size: int = MAX_SIZE
    ) -> None:
        self.settings = settings
        self.size = size
        self._pools: dict[int, AsyncPool] = {}
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._pools)

    async def get(self) -> AsyncPool:
        """The running loop's pool, made on first use. Pools of loops that have closed since
        are closed on the way (their connections would otherwise outlive them)."""
        loop = asyncio.get_running_loop()
        pool = self._pools.get(id(loop))
        if len(self._pools) > 1 or pool is None or pool.closed:
            self._sweep()
            pool = self._pools.get(id(loop))
        if pool is None or pool.closed:
            dsn, kwargs, retry_for = self.settings()
            pool = AsyncPool(dsn, kwargs, loop, retry_for, self.size)
            # Registered before the first await, so a second task of this loop finds it.
            with self._lock:
                self._pools[id(loop)] = pool
            await pool.watch_loop_end()
        return pool

    def _sweep(self) -> None:
        with self._lock:
            gone = [key for key, p in self._pools.items() if p.closed or p.loop.is_closed()]
            pools = [self._pools.pop(key) for key in gone]
        for pool in pools:
            pool.close()

    def close(self) -> None:
        """Close every loop's idle connections now, and the rest as they are given back."""
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()
