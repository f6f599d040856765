"""One snapshot, many listeners: every open page waits on the same published value, so N tabs
cost one refresh per interval, not N."""

from __future__ import annotations

import asyncio


class Broadcaster:
    def __init__(self) -> None:
        self.latest: bytes | None = None
        self.seq = 0
        self._changed = asyncio.Condition()
        self.listeners = 0

    async def publish(self, payload: bytes) -> None:
        async with self._changed:
            self.latest = payload
            self.seq += 1
            self._changed.notify_all()

    async def next(self, after: int, timeout: float) -> tuple[int, bytes | None]:
        """The first snapshot newer than ``after``; (after, None) when ``timeout`` passes."""
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self.seq > after and self.latest is not None),
                    timeout,
                )
            except TimeoutError:
                return after, None
            return self.seq, self.latest
