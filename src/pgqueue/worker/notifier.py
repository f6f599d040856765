"""LISTEN on a dedicated connection; every notification for a served queue wakes the fetcher.

NOTIFY is only a latency hint. Losing the connection costs latency, never a job: the fetcher
keeps polling while this service reconnects with capped exponential backoff.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from .state import pause, round_failed

log = logging.getLogger("pgqueue.worker.notifier")

#: Detect a dead peer within about 15 s instead of hours: keepalives for an idle connection,
#: tcp_user_timeout for one whose bytes go unacknowledged, and a bounded connect.
KEEPALIVES: dict[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 5,
    "tcp_user_timeout": 15000,
    "connect_timeout": 10,
}


class Notifier:
    def __init__(
        self,
        dsn: str,
        channel: str,
        queues: frozenset[str] | None,
        wake: Callable[[], None],
        connect_kwargs: dict[str, Any],
    ) -> None:
        self.dsn = dsn
        self.channel = channel
        self.queues = queues
        self.wake = wake
        self.connect_kwargs = connect_kwargs
        self.listening = asyncio.Event()
        self.reconnects = 0

    async def run(self, stopping: asyncio.Event) -> None:
        delay = 0.1
        while not stopping.is_set():
            try:
                await self._listen(stopping)
                delay = 0.1
            except Exception as exc:
                self.listening.clear()
                round_failed(log, "LISTEN (polling until it is back)", exc)
            if stopping.is_set():
                break
            # Jobs inserted while we were away are found by the fetcher's next claim.
            self.wake()
            await pause(stopping, delay)
            delay = min(delay * 2, 5.0)
            self.reconnects += 1

    async def _listen(self, stopping: asyncio.Event) -> None:
        conn = await psycopg.AsyncConnection.connect(self.dsn, **self.connect_kwargs)
        async with conn:
            await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
            self.listening.set()
            self.wake()  # anything inserted before LISTEN took effect
            try:
                while not stopping.is_set():
                    # A bounded wait, so a stop request is seen within a second.
                    async for notify in conn.notifies(timeout=1.0):
                        if self.queues is None or notify.payload in self.queues:
                            self.wake()
            finally:
                self.listening.clear()
