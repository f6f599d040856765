"""The worker's connections: one small elastic pool under a budget, shared by lanes.

A worker needs one connection to do everything (claims, acks, heartbeats, maintenance) and
runs best with one per lane, so that an ack never waits behind a claim or a reaper round:

- ``claims`` (the fetcher), ``acks`` (the completer), ``heartbeat`` and ``maintenance`` (reaper,
  scheduler, statistics, wake-ups, and the fetcher's sweep while a long transaction holds back
  vacuum), each using at most one connection at a time; when they
  share, the heartbeat takes the first connection that comes free, ahead of the others, so a
  lease is extended in time whatever the other lanes do;
- the LISTEN connection, the first extra (``reserve_listen``): without it the worker polls.

The pool connects in the caller when a lane finds no idle connection and the budget allows one
more, and closes connections beyond the first once they sit idle for ``MAX_IDLE``. The budget
(``cap``) is the user's ``connections`` lowered to the worker's share of the server when a fleet
would not fit (``share``, from ``max_connections`` and the live workers, refreshed with the
heartbeat), and held where it is while the server is nearly full (``budget``): so 50 workers
start and run under PostgreSQL's default of 100, and leave room for the other clients.

A connection that cannot be opened (``too_many_connections``, 53300, or any other failure) never
stops a worker that holds one: the lane waits for a connection another lane gives back, growth
is paused for ``GROWTH_PAUSE`` seconds, and one line says so. Only a worker left with none sees
the error, in the round that needed it (retried like any failed round).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any, Protocol

import psycopg
from psycopg.pq import TransactionStatus
from psycopg_pool import PoolTimeout

from ..pools import reusable

log = logging.getLogger("pgqueue.worker.connections")

AsyncConn = psycopg.AsyncConnection[Any]

#: The lanes, each using at most one connection at a time; with LISTEN, the most a worker holds.
LANES = ("claims", "acks", "heartbeat", "maintenance")
DEFAULT_CONNECTIONS = len(LANES) + 1
#: Seconds an extra connection (beyond the first) is kept idle before it is closed.
MAX_IDLE = 10.0
#: Seconds without trying to grow after the server refused a connection for want of slots
#: (53300), and after any other failure to connect (a server starting up, say).
GROWTH_PAUSE = 30.0
GROWTH_PAUSE_OTHER = 1.0
#: Seconds a lane waits for a connection before its round fails (PoolTimeout, retried).
WAIT_TIMEOUT = 10.0
#: The part of what ``max_connections`` leaves non-superusers that a fleet of workers takes at
#: most, together: the rest stays for producers, the dashboard and an operator's psql.
FLEET_FRACTION = 0.8


class ConnectFailed(PoolTimeout):
    """No connection could be opened and the worker holds none (the message says why). A
    PoolTimeout, as psycopg_pool raises when it cannot hand out a connection: every service
    treats it as a round that failed for want of the database (the completer keeps the batch
    and retries it), never as a statement the database refused."""


class Connections(Protocol):
    """What a worker service needs: a connection for a statement or a transaction (a ``Lane``
    of the worker's pool, or any psycopg_pool pool, as tests pass)."""

    def connection(self) -> contextlib.AbstractAsyncContextManager[AsyncConn]: ...


def too_many_connections(exc: BaseException) -> bool:
    """Whether a failed connect was the server refusing one more client (53300). libpq reports
    a refusal at connect time as text only, with no SQLSTATE on the exception."""
    if isinstance(exc, psycopg.Error) and exc.sqlstate == "53300":
        return True
    text = str(exc)
    return any(
        phrase in text
        for phrase in (
            "too many clients",  # max_connections
            "remaining connection slots are reserved",  # only reserved slots left
            "too many connections for",  # a role's or a database's CONNECTION LIMIT
        )
    )


def share(max_connections: int, reserved: int, workers: int) -> int:
    """Connections one of ``workers`` workers may hold so that the fleet takes at most
    FLEET_FRACTION of the non-superuser slots (at least one: a worker needs one to work)."""
    usable = max(max_connections - reserved, 1) * FLEET_FRACTION
    return max(int(usable // max(workers, 1)), 1)


def budget(max_connections: int, reserved: int, workers: int, in_use: int, held: int) -> int:
    """A worker's budget: its ``share``, and no more than it ``held`` while the server's client
    connections (``in_use``) fill FLEET_FRACTION of the slots. Workers that start together each
    count a fleet still registering; the second rule keeps their extras from filling the
    server before the next count corrects their share."""
    cap = share(max_connections, reserved, workers)
    if in_use >= max(max_connections - reserved, 1) * FLEET_FRACTION:
        cap = min(cap, max(held, 1))
    return cap


class WorkerPool:
    """See the module docstring. ``size`` is the user's budget (LISTEN included)."""

    def __init__(self, dsn: str, kwargs: dict[str, Any], *, size: int) -> None:
        self.dsn = dsn
        self.kwargs = kwargs
        self.size = size
        #: The budget now: ``size`` or the fleet share below it.
        self.cap = size
        self.listening = False
        #: The worker LISTENs (``listen=True``): with a budget of 2 or more, one of it is kept
        #: for the LISTEN connection, which comes before a lane's second connection.
        self.listen_wanted = True
        self._idle: list[tuple[float, AsyncConn]] = []  # most recently used last
        self._open = 0  # held by lanes, idle, or being opened
        self._waiters: deque[asyncio.Future[AsyncConn | None]] = deque()
        self._locks = {lane: asyncio.Lock() for lane in LANES}
        self._no_growth_until = 0.0
        self._refused = False  # the last connect failed; logged once until one succeeds
        self.closed = False
        #: Most connections held at once (the LISTEN one included), for tests and figures.
        self.peak = 0

    @property
    def held(self) -> int:
        """Connections the worker holds now, the LISTEN one included."""
        return self._open + int(self.listening)

    def _room(self) -> bool:
        """Whether a lane may open one more connection."""
        kept = int(self.listen_wanted and self.cap >= 2)
        return self._open + kept < self.cap and self._may_grow()

    def _may_grow(self) -> bool:
        return time.monotonic() >= self._no_growth_until and not self.closed

    def set_cap(self, cap: int) -> None:
        """Lower (or raise) the budget; idle connections above it close now, busy ones when
        they come back, and the LISTEN connection gives way (``keep_listening``)."""
        cap = max(min(cap, self.size), 1)
        if cap != self.cap:
            log.info("connection budget now %d (was %d)", cap, self.cap)
        self.cap = cap
        while self._idle and self.held > self.cap and self._open > 1:
            self._discard(self._idle.pop(0)[1])

    # --- LISTEN -------------------------------------------------------------------------

    def reserve_listen(self) -> bool:
        """Count a LISTEN connection against the budget, if it has room for one beside a
        lane's connection (a worker's only connection serves the lanes, never LISTEN)."""
        if self.listening or self.cap < 2 or self._open >= self.cap or not self._may_grow():
            return False
        self.listening = True
        self.peak = max(self.peak, self.held)
        return True

    def keep_listening(self) -> bool:
        """Whether the LISTEN connection still fits the budget (lanes' extras give way first:
        they close as they come back)."""
        return self.cap >= 2

    def release_listen(self, refused: BaseException | None = None) -> None:
        """The LISTEN connection closed, or could not be opened (``refused``)."""
        self.listening = False
        if refused is not None:
            self._growth_failed(refused, "the LISTEN connection")
        self._hand_on()

    # --- lanes --------------------------------------------------------------------------

    def lane(self, name: str) -> Lane:
        return Lane(self, name)

    @contextlib.asynccontextmanager
    async def connection(self, lane: str = "maintenance") -> AsyncIterator[AsyncConn]:
        """A connection for one statement or transaction of ``lane``."""
        async with self._locks[lane]:
            conn = await self._take(lane == "heartbeat")
            try:
                yield conn
            finally:
                self._give_back(conn)

    async def _take(self, first: bool = False) -> AsyncConn:
        if self.closed:
            raise PoolTimeout("the worker's connections are closed")
        self._expire_idle()
        while self._idle:
            conn = self._idle.pop()[1]
            if reusable(conn):  # no round trip: a closed session has something to read
                return conn
            self._discard(conn)
        if self._open == 0 or self._room():
            self._open += 1
            self.peak = max(self.peak, self.held)
            try:
                conn = await psycopg.AsyncConnection.connect(self.dsn, **self.kwargs)
            except BaseException as exc:
                self._open -= 1
                if not isinstance(exc, Exception):
                    raise
                if self._open == 0:  # nothing to wait for: the round fails and is retried
                    raise ConnectFailed(str(exc).strip()) from exc
                self._growth_failed(exc, "one more connection")
            else:
                self._connected()
                return conn
        return await self._wait(first)

    async def _wait(self, first: bool) -> AsyncConn:
        waiter: asyncio.Future[AsyncConn | None] = asyncio.get_running_loop().create_future()
        if first:
            self._waiters.appendleft(waiter)
        else:
            self._waiters.append(waiter)
        try:
            await asyncio.wait({waiter}, timeout=WAIT_TIMEOUT)
        except BaseException:
            # Cancelled: a connection handed over meanwhile is given on, not lost.
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                given = waiter.result()
                if given is not None:
                    self._give_back(given)
            self._forget(waiter)
            raise
        if not waiter.done():
            self._forget(waiter)
            raise PoolTimeout(
                f"no connection of the worker's {self._open} came free in {WAIT_TIMEOUT:g} s"
            )
        conn = waiter.result()
        if conn is None:  # a connection went away: room to open one now
            return await self._take(first)
        return conn

    def _forget(self, waiter: asyncio.Future[AsyncConn | None]) -> None:
        waiter.cancel()
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)

    def _give_back(self, conn: AsyncConn) -> None:
        usable = (
            not conn.closed
            and not conn.broken
            and conn.pgconn.transaction_status == TransactionStatus.IDLE
        )
        if not usable or self.closed or (self.held > self.cap and self._open > 1):
            self._discard(conn)
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return
        self._idle.append((time.monotonic(), conn))

    def _discard(self, conn: AsyncConn) -> None:
        self._open -= 1
        if not conn.closed:
            conn.pgconn.finish()  # synchronous, no round trip: fine from any callback
        self._hand_on()

    def _hand_on(self) -> None:
        """A connection went away: a waiting lane may now open its own."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _expire_idle(self) -> None:
        """Close the extras idle longer than MAX_IDLE (the oldest first; one stays)."""
        limit = time.monotonic() - MAX_IDLE
        while len(self._idle) > 0 and self._open > 1 and self._idle[0][0] < limit:
            self._discard(self._idle.pop(0)[1])

    def _growth_failed(self, exc: BaseException, what: str) -> None:
        full = too_many_connections(exc)
        pause = GROWTH_PAUSE if full else GROWTH_PAUSE_OTHER
        self._no_growth_until = time.monotonic() + pause
        if not self._refused:
            self._refused = True
            reason = "too many connections (53300)" if full else str(exc).strip().splitlines()[0]
            log.warning(
                "could not open %s (%s): working on with the %d the worker holds, trying again "
                "in %g s", what, reason, self._open, pause,
            )  # fmt: skip

    def _connected(self) -> None:
        if self._refused:
            self._refused = False
            log.info("connections can be opened again")

    async def close(self) -> None:
        self.closed = True
        idle, self._idle = self._idle, []
        for _, conn in idle:
            self._discard(conn)
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(PoolTimeout("the worker's connections are closed"))
        self._waiters.clear()


class Lane:
    """One lane's view of the pool, with the ``connection()`` its service calls."""

    def __init__(self, pool: WorkerPool, name: str) -> None:
        if name not in LANES:
            raise ValueError(f"unknown lane {name!r}")
        self.pool = pool
        self.name = name

    def connection(self) -> contextlib.AbstractAsyncContextManager[AsyncConn]:
        return self.pool.connection(self.name)
