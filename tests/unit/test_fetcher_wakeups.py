"""The fetcher's wake-up rules, with the database calls replaced (the SQL is tested against
PostgreSQL in tests/integration/test_wakeups.py; this is the decision of when to claim)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

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


@pytest.mark.parametrize("kind", ["limited", "plain"])
async def test_a_wake_up_that_arrives_while_its_claim_is_on_the_way_is_not_lost(
    kind: str,
) -> None:
    """While limits apply, a claim that came back short is skipped for DRY_FOR unless something
    may have changed: a slot this worker freed (the limited claim) or a notification (both).
    One that arrived while that very claim was on its way (the claim had counted the slot as
    taken, or missed the job) was overwritten by the claim's own "skip": the round it woke
    skipped the claim and the worker slept until the poll with a job claimable. A CI run of
    test_dry_claims stopped a worker for the whole 60 s poll that way."""
    state = WorkerState(concurrency=2)
    fetcher, plain = fetcher_with_claims(state)
    fetcher.limited = True
    limited: list[int] = []

    async def claim_limited(limit: int) -> list[ClaimedJob]:
        limited.append(limit)
        if kind == "limited" and len(limited) == 1:
            fetcher.slot_freed()  # the slot's job ended while this claim was on its way
        return []

    async def claim(limit: int) -> list[ClaimedJob]:
        plain.append(limit)
        if kind == "plain" and len(plain) == 1:
            fetcher.notify()  # a job's NOTIFY arrived while this claim was on its way
        return []

    fetcher.claim_limited = claim_limited  # type: ignore[method-assign]
    fetcher.claim = claim  # type: ignore[method-assign]
    stopping = asyncio.Event()
    task: asyncio.Task[Any] = asyncio.create_task(fetcher.run(stopping))
    try:
        again = limited if kind == "limited" else plain
        await wait_until_async(lambda: len(again) == 2, timeout=5)  # the poll is 600 s away
    finally:
        stopping.set()
        state.wakeup.set()
        await asyncio.wait_for(task, 5)
