"""The fetcher's wake-up rules, with the database calls replaced (the SQL is tested against
PostgreSQL in tests/integration/test_wakeups.py; this is the decision of when to claim)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from pgqueue.sql import queries
from pgqueue.worker.connections import Connections
from pgqueue.worker.fetcher import Fetcher
from pgqueue.worker.state import ClaimedJob, WorkerState
from tests.helpers import wait_until_async


def fetcher_with_claims(state: WorkerState) -> tuple[Fetcher, list[int]]:
    """A fetcher whose claims always come back empty (the queue looks drained), recorded."""
    claims: list[int] = []
    fetcher = Fetcher(
        None,  # type: ignore[arg-type]  # never used: claim and next_due_in are replaced
        queries("public"),
        state,
        worker_id=uuid.uuid4(),
        queues=None,
        tasks={},
        poll_interval=600.0,
        start=lambda job: None,
    )

    async def claim(limit: int) -> list[ClaimedJob]:
        claims.append(limit)
        return []

    async def next_due_in(pool: Connections | None = None) -> float | None:
        return None

    fetcher.claim = claim  # type: ignore[method-assign]
    fetcher.next_due_in = next_due_in  # type: ignore[method-assign]
    return fetcher, claims


async def test_a_notification_while_every_slot_is_busy_is_kept_until_a_slot_frees() -> None:
    state = WorkerState(concurrency=1, prefetch=4)
    fetcher, claims = fetcher_with_claims(state)
    stopping = asyncio.Event()
    task: asyncio.Task[Any] = asyncio.create_task(fetcher.run(stopping))
    try:
        await wait_until_async(lambda: claims == [1])  # short: it waits for work now
        state.running = 1  # the only slot is busy
        fetcher.notify()  # a NOTIFY for a new job arrives: nothing to claim it with
        await wait_until_async(lambda: not state.wakeup.is_set())  # the fetcher saw it
        assert claims == [1]
        state.running, state.finished = 0, 1  # the slot frees
        state.wakeup.set()
        await wait_until_async(lambda: claims == [1, 1], timeout=5)
    finally:
        stopping.set()
        state.wakeup.set()
        await asyncio.wait_for(task, 5)


async def test_a_job_due_soon_is_claimed_when_due_without_a_notification() -> None:
    state = WorkerState(concurrency=1)
    fetcher, claims = fetcher_with_claims(state)
    stopping = asyncio.Event()
    task: asyncio.Task[Any] = asyncio.create_task(fetcher.run(stopping))
    try:
        await wait_until_async(lambda: claims == [1])
        fetcher.ready_in(0.2)  # a retry this worker wrote becomes due in 0.2 s
        await wait_until_async(lambda: claims == [1, 1], timeout=5)
    finally:
        stopping.set()
        state.wakeup.set()
        await asyncio.wait_for(task, 5)


def test_a_sweep_in_flight_never_leaves_a_slot_idle() -> None:
    """A sweep sets aside part of the claim budget, taken when the prefetch target was large
    (a backlog draining). Once the backlog is gone the target falls to nothing; free slots are
    still claimed for while the sweep walks, where the budget once stayed below zero and every
    claim waited for the sweep (seen as a 60 s stall under load)."""
    state = WorkerState(concurrency=4, prefetch=256)
    fetcher, _ = fetcher_with_claims(state)
    fetcher._reserved = 50  # what a sweep set aside when the claims wanted 100
    assert fetcher.buffer_target(0.0) == 0  # nothing finished lately: no prefetch
    assert fetcher.wanted(0.0) == 4
