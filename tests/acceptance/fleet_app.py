"""The app of the fleet test: a job that naps and returns the pid of the worker that ran it, so
the stored results tell which worker ran what. No connection of its own (50 of these processes
share one PostgreSQL with the default max_connections)."""

from __future__ import annotations

import asyncio
import os

import pgqueue

app = pgqueue.App(backoff=pgqueue.Backoff(base=0.1, cap=0.5))


@app.task(max_attempts=10)
async def nap(seconds: float = 0.0) -> int:
    await asyncio.sleep(seconds)
    return os.getpid()
