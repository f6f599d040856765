"""Waiting on conditions with deadlines (never sleep-and-hope), and running workers in tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pgqueue
from pgqueue.worker.runtime import Worker

ROOT = Path(__file__).resolve().parent.parent


def wait_until(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s: {predicate}")
        time.sleep(interval)


async def wait_until_async(
    predicate: Callable[[], Any | Awaitable[Any]], timeout: float = 10.0, interval: float = 0.02
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s: {predicate}")
        await asyncio.sleep(interval)


@contextlib.asynccontextmanager
async def running_worker(app: pgqueue.App, **options: Any) -> AsyncIterator[Worker]:
    """An in-process worker for the duration of the block, stopped gracefully after."""
    options.setdefault("install_signal_handlers", False)
    worker = app.worker(**options)
    task = asyncio.create_task(worker.run())
    try:
        await wait_until_async(lambda: worker.started.is_set() or task.done(), timeout=15)
        if task.done():
            task.result()
        yield worker
    finally:
        worker.stop()
        await asyncio.wait_for(task, 60)


@contextlib.contextmanager
def worker_process(
    dsn: str,
    *args: str,
    app: str = "tests.acceptance.jobs_app:app",
    env: dict[str, str] | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """A real ``pgqueue worker`` subprocess; killed at the end if still alive."""
    environment = {**os.environ, "PGQUEUE_DSN": dsn, "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pgqueue.cli",
            "worker",
            "--app",
            app,
            "--log-level",
            "WARNING",
            *args,
        ],
        cwd=ROOT,
        env=environment,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
            proc.wait(10)
