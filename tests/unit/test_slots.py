"""Slot tasks run jobs as tasks of their own would: isolated contexts, per-job cancellation,
as many slots as jobs that wait and never more than the concurrency (no database needed: this is
the runtime's scheduling alone; the worker tests run the same code against PostgreSQL)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Callable, Coroutine
from typing import Any
from uuid import uuid4

from pgqueue.worker.slots import STREAK, JobRun, Slots
from pgqueue.worker.state import ClaimedJob, Held, WorkerState

Job = Callable[[], Coroutine[Any, Any, Any]]
LABEL: contextvars.ContextVar[str] = contextvars.ContextVar("label", default="unset")


class Harness:
    """The runtime's part, reduced: buffer jobs, run each one as a JobRun on a slot."""

    def __init__(self, concurrency: int) -> None:
        self.state = WorkerState(concurrency=concurrency)
        self.slots = Slots(self.state, self.execute)
        self.bodies: dict[int, Job] = {}
        self.outcomes: dict[int, Any] = {}
        self.slot_of: dict[int, asyncio.Task[Any] | None] = {}

    def submit(self, body: Job) -> Held:
        job_id = len(self.bodies) + 1
        self.bodies[job_id] = body
        job = ClaimedJob(job_id, "q", "t", {}, 1, 1, uuid4(), 0.0)
        held = Held(job)
        self.state.held[job.key] = held
        self.state.buffer.append(held)
        self.slots.buffered()
        return held

    async def execute(self, held: Held) -> None:
        self.slot_of[held.job.id] = asyncio.current_task()
        self.state.running += 1
        held.handler = run = JobRun(self.bodies[held.job.id](), self.slots)
        try:
            self.outcomes[held.job.id] = await run
        except asyncio.CancelledError:
            self.outcomes[held.job.id] = "cancelled"
        finally:
            held.handler = None
            self.state.running -= 1

    async def finish(self) -> None:
        assert await self.slots.wait(5)
        assert not self.slots.tasks and self.slots.ready == 0


async def test_jobs_that_never_await_share_one_slot() -> None:
    h = Harness(concurrency=10)

    async def quick() -> int:
        return 1

    for _ in range(3 * STREAK):
        h.submit(quick)
    await h.finish()
    assert h.outcomes == dict.fromkeys(range(1, 3 * STREAK + 1), 1)
    assert len(set(h.slot_of.values())) == 1


async def test_jobs_that_wait_fan_out_to_the_concurrency_and_no_further() -> None:
    h = Harness(concurrency=4)
    release = asyncio.Event()
    peak = 0

    async def waits() -> None:
        nonlocal peak
        peak = max(peak, h.state.running)
        await release.wait()

    for _ in range(10):
        h.submit(waits)
    while h.state.running < 4:
        await asyncio.sleep(0)
    for _ in range(20):  # give a fifth slot every chance to appear
        await asyncio.sleep(0)
    assert len(h.slots.tasks) == 4 and len(h.state.buffer) == 6
    release.set()
    await h.finish()
    assert peak == 4 and len(h.outcomes) == 10


async def test_a_context_variable_set_by_one_job_never_reaches_the_next() -> None:
    h = Harness(concurrency=1)
    seen: list[str] = []

    async def sets(label: str) -> None:
        seen.append(LABEL.get())
        LABEL.set(label)
        await asyncio.sleep(0)
        seen.append(LABEL.get())  # its own value survives its awaits

    h.submit(lambda: sets("a"))
    h.submit(lambda: sets("b"))
    await h.finish()
    assert seen == ["unset", "a", "unset", "b"]
    assert len(set(h.slot_of.values())) == 1
    assert LABEL.get() == "unset"


async def test_cancelling_a_job_cancels_that_job_only() -> None:
    h = Harness(concurrency=2)
    started = asyncio.Event()
    release = asyncio.Event()

    async def long() -> str:
        started.set()
        await asyncio.sleep(3600)
        return "finished"

    async def other() -> str:
        await release.wait()
        return "finished"

    victim = h.submit(long)
    h.submit(other)
    h.submit(other)  # waits in the buffer for a slot, then runs on the victim's
    await started.wait()
    assert victim.handler is not None
    victim.handler.cancel()
    release.set()
    await h.finish()
    assert h.outcomes == {1: "cancelled", 2: "finished", 3: "finished"}
    assert not any(t is not None and t.cancelled() for t in h.slot_of.values())


async def test_a_cancel_that_arrives_after_the_awaited_future_finished_still_lands() -> None:
    """The job's future is already done (its wake-up is queued) when the lease is lost: Task
    would deliver the cancellation at the next step, and so does JobRun."""
    h = Harness(concurrency=1)
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    reached: list[str] = []

    async def body() -> None:
        await future
        reached.append("resumed")
        await asyncio.sleep(0)
        reached.append("not reached")

    held = h.submit(body)
    while held.handler is None or h.slots.ready != 0:
        await asyncio.sleep(0)
    future.set_result(None)
    held.handler.cancel()
    await h.finish()
    assert h.outcomes == {1: "cancelled"}
    assert reached == []


async def test_a_job_may_catch_its_cancellation_and_finish() -> None:
    h = Harness(concurrency=1)
    started = asyncio.Event()

    async def stubborn() -> str:
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await asyncio.sleep(0)  # cancelled once, not again at every later await
            return "cleaned up"
        return "finished"

    held = h.submit(stubborn)
    await started.wait()
    assert held.handler is not None
    held.handler.cancel()
    await h.finish()
    assert h.outcomes == {1: "cleaned up"}


async def test_asyncio_timeout_inside_a_job_times_out_that_job_only() -> None:
    """asyncio.timeout() cancels the current task (the slot): the job sees TimeoutError and the
    slot goes on with the next job."""
    h = Harness(concurrency=1)

    async def bounded() -> str:
        try:
            async with asyncio.timeout(0.01):
                await asyncio.sleep(3600)
        except TimeoutError:
            return "timed out"
        return "finished"

    async def quick() -> str:
        await asyncio.sleep(0)
        return "finished"

    h.submit(bounded)
    h.submit(quick)
    await h.finish()
    assert h.outcomes == {1: "timed out", 2: "finished"}
    assert len(set(h.slot_of.values())) == 1


async def test_buffered_jobs_still_run_when_a_slot_fails() -> None:
    """A failure in the runtime's own code ends its slot (a bug, never a handler's error, which
    the executor turns into an outcome); another slot takes the jobs behind it."""
    h = Harness(concurrency=1)
    plain_execute = h.execute

    async def execute(held: Held) -> None:
        if held.job.id == 1:
            raise RuntimeError("bug")
        await plain_execute(held)

    h.slots.execute = execute

    async def quick() -> str:
        return "finished"

    for _ in range(3):
        h.submit(quick)
    failed = next(iter(h.slots.tasks))
    with contextlib.suppress(RuntimeError):
        await failed
    await h.finish()
    assert h.outcomes == {2: "finished", 3: "finished"}
