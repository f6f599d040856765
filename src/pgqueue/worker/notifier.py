"""LISTEN on a dedicated connection; every notification for a served queue wakes the fetcher.

NOTIFY is only a latency hint. Losing the connection costs latency, never a job: the fetcher
keeps polling while this service reconnects with capped exponential backoff.

Producers notify only while some worker waits for work (migration 0004): notifying commits
serialise, and a busy worker claims again on its own. The fetcher says when it starts and stops
waiting (``set_waiting``); this service holds the "waiting" advisory lock on its connection
meanwhile. A producer that looked before the lock was taken may have skipped its NOTIFY, so after
announcing itself the worker keeps waking the fetcher, at a growing interval, until no such
producer's transaction is open.

The LISTEN connection counts against the worker's connection budget (``budget``, see
``connections``): when the budget leaves no room for it (a fleet bigger than the server's
``max_connections`` allows, or the server refused the connection with 53300), the worker polls,
says so in one line, and tries again every ``BUDGET_RECHECK`` seconds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from ..sql import Queries
from .connections import WorkerPool, too_many_connections
from .outage import Outage
from .state import pause, round_failed

log = logging.getLogger("pgqueue.worker.notifier")

#: First re-check of unsettled producers after announcing; it doubles up to the poll interval or
#: SETTLE_RECHECK_MAX, whichever is shorter (a long producer transaction costs a claim a second).
#: A notification that asks the workers to cancel a running job ("cancel," and its id): no
#: queue name holds a comma, so it cannot be mistaken for one (cancel_job).
CANCEL_PREFIX = "cancel,"
SETTLE_RECHECK = 0.005
SETTLE_RECHECK_MAX = 1.0
#: Seconds between looks at whether the budget has room for LISTEN again.
BUDGET_RECHECK = 5.0


class Notifier:
    def __init__(
        self,
        dsn: str,
        q: Queries,
        channel: str,
        queues: frozenset[str] | None,
        wake: Callable[[], None],
        connect_kwargs: dict[str, Any],
        *,
        poll_interval: float,
        on_cancel: Callable[[str], None] = lambda job_id: None,
        outage: Outage | None = None,
        budget: WorkerPool | None = None,
    ) -> None:
        self.budget = budget
        self._polling_said = False
        self.dsn = dsn
        self.outage = outage or Outage()
        self.on_cancel = on_cancel
        self.q = q
        self.channel = channel
        self.queues = queues
        self.wake = wake
        self.connect_kwargs = connect_kwargs
        self.poll_interval = poll_interval
        self.listening = asyncio.Event()
        #: Backends of this worker's own pool that sent wake-ups (wake_waiting_workers): their
        #: notifications are for other workers. (A pid reused by another process's backend
        #: would cost that process's notifications a poll interval: the poll is the safety.)
        self.own_pids: set[int] = set()
        self.reconnects = 0
        self.waiting = False  # what the fetcher wants producers to know
        self.announced = False  # what they know: the lock is held on the connection
        self._changed = asyncio.Event()
        #: The current connection got as far as LISTEN (its loss is a new outage).
        self._established = False

    def set_waiting(self, waiting: bool) -> None:
        """Called by the fetcher after every claim: a short claim means it will wait for work."""
        if waiting != self.waiting:
            self.waiting = waiting
            self._changed.set()

    async def run(self, stopping: asyncio.Event) -> None:
        delay = 0.1
        while not stopping.is_set():
            self._established = False
            if self.budget is not None and not self.budget.reserve_listen():
                self._say_polling(f"the connection budget ({self.budget.cap}) has no room for it")
                await pause(stopping, BUDGET_RECHECK)
                continue
            refused: Exception | None = None
            try:
                await self._listen(stopping)
                delay = 0.1
            except Exception as exc:
                if self._established:  # it had been listening: a new outage starts over
                    delay = 0.1
                self.listening.clear()
                if too_many_connections(exc):
                    refused = exc
                    self._say_polling("PostgreSQL has no connection slot left (53300)")
                else:
                    round_failed(log, "LISTEN (polling until it is back)", exc, self.outage)
            finally:
                if self.budget is not None:
                    self.budget.release_listen(refused)
            if stopping.is_set():
                break
            # Jobs inserted while we were away are found by the fetcher's next claim.
            self.wake()
            await pause(stopping, BUDGET_RECHECK if refused is not None else delay)
            delay = min(delay * 2, 5.0)
            self.reconnects += 1

    def _say_polling(self, why: str) -> None:
        """One line when the worker goes from LISTEN to polling (not one per retry)."""
        if not self._polling_said:
            self._polling_said = True
            log.info(
                "no LISTEN connection: %s; polling every %g s, trying again every %g s",
                why, self.poll_interval, BUDGET_RECHECK,
            )  # fmt: skip

    async def _listen(self, stopping: asyncio.Event) -> None:
        conn = await psycopg.AsyncConnection.connect(self.dsn, **self.connect_kwargs)
        self.announced = False  # a new connection holds no lock
        loop = asyncio.get_running_loop()
        settle_delay: float | None = None  # None: no producer can be hiding a skipped NOTIFY
        settle_at = 0.0
        async with conn:
            await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
            self.listening.set()
            self._established = True
            self.outage.ok()
            if self._polling_said:
                self._polling_said = False
                log.info("LISTEN connection open again")
            self.wake()  # anything inserted before LISTEN took effect
            try:
                while not stopping.is_set():
                    if self.budget is not None and not self.budget.keep_listening():
                        self._say_polling(f"the connection budget is now {self.budget.cap}")
                        return  # closed here; run() tries again when the budget has room
                    self._changed.clear()
                    if self.waiting != self.announced:
                        settle_delay = await self._announce(conn)
                        settle_at = loop.time() + (settle_delay or 0.0)
                        continue
                    # A bounded wait (settling needs a look now and then), which a stop request
                    # ends at once: a stopping worker does not wait out the second.
                    timeout = 1.0
                    if settle_delay is not None:
                        timeout = min(timeout, max(settle_at - loop.time(), 0.0))
                    await self._receive(conn, timeout, stopping)
                    if settle_delay is not None and loop.time() >= settle_at:
                        if await self._settled(conn):
                            settle_delay = None
                        else:
                            settle_delay = min(
                                2 * settle_delay, self.poll_interval, SETTLE_RECHECK_MAX
                            )
                            settle_at = loop.time() + settle_delay
            finally:
                self.listening.clear()
                self.announced = False

    async def _announce(self, conn: psycopg.AsyncConnection[Any]) -> float | None:
        """Bring the lock in line with ``waiting``; the delay before looking at producers again
        (None when there is nothing to look for)."""
        if not self.waiting:
            await conn.execute(self.q.withdraw_waiting)
            self.announced = False
            return None
        await conn.execute(self.q.announce_waiting)
        self.announced = True
        return None if await self._settled(conn) else SETTLE_RECHECK

    async def _settled(self, conn: psycopg.AsyncConnection[Any]) -> bool:
        """Wake the fetcher to claim what producers that skipped their NOTIFY have committed;
        whether any of them can still be open."""
        cur = await conn.execute(self.q.enqueuers_settled)
        row = await cur.fetchone()
        self.wake()
        return row is not None and bool(row[0])

    async def _receive(
        self, conn: psycopg.AsyncConnection[Any], timeout: float, stopping: asyncio.Event
    ) -> None:
        """Pass on notifications until ``timeout``, until ``waiting`` changes or until the
        worker stops."""

        async def consume() -> None:
            async for notify in conn.notifies(timeout=timeout):
                if notify.pid in self.own_pids:
                    continue  # this worker's own wake-up of others: it knows already
                if notify.payload.startswith(CANCEL_PREFIX):
                    self.on_cancel(notify.payload[len(CANCEL_PREFIX) :])
                elif self.queues is None or notify.payload in self.queues:
                    self.wake()

        listener = asyncio.ensure_future(consume())
        changed = asyncio.ensure_future(self._changed.wait())
        stopped = asyncio.ensure_future(stopping.wait())
        try:
            await asyncio.wait({listener, changed, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            changed.cancel()
            stopped.cancel()
            if not listener.done():
                # Waiting for input only: nothing is half-read, the connection stays usable and
                # notifications that arrive meanwhile wait in psycopg's backlog.
                listener.cancel()
                await asyncio.wait({listener})
        if not listener.cancelled():
            listener.result()  # a lost connection: run() reconnects
