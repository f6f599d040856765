"""Where handlers run: a few long-lived slot tasks take buffered jobs in turn.

A task per job cost ~5 us of the worker's CPU (creation, context copy, registration, a loop
round to start it, another to run its done callbacks): more than a tenth of what a no-op job costs
the worker in all. A slot task instead runs job after job from the buffer, and another slot is
started only when every slot is blocked in a job that awaits, up to ``concurrency`` slots. Jobs
that never await run back to back on one slot; jobs that wait on I/O fan out to as many slots as
they need.

Each job still runs as if it had a task of its own (``JobRun``): in its own copy of the context,
so context variables a handler sets never reach the next job, and with its own cancellation,
which reaches that job's coroutine and never the slot or another job.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Coroutine, Generator
from typing import Any

from .state import Held, WorkerState

#: Jobs a slot runs back to back before it lets the loop run other callbacks (heartbeats, the
#: completer's flush, the fetcher): jobs that never await would otherwise run a whole buffer in
#: one go.
STREAK = 32


class Slots:
    def __init__(
        self, state: WorkerState, execute: Callable[[Held], Coroutine[Any, Any, None]]
    ) -> None:
        self.state = state
        self.execute = execute
        #: The slots alive: each removes itself as it ends.
        self.tasks: set[asyncio.Task[None]] = set()
        #: Slots that will take the next buffered job without being woken: starting, between
        #: jobs, or running a job that has not awaited.
        self.ready = 0

    def buffered(self) -> None:
        """A job was added to the buffer: make sure a slot will take it."""
        if self.ready == 0 and len(self.tasks) < self.state.concurrency:
            self._spawn()

    def blocked(self) -> None:
        """A slot's job awaits: the buffer needs another slot, if there is room for one."""
        self.ready -= 1
        if self.ready == 0 and self.state.buffer and len(self.tasks) < self.state.concurrency:
            self._spawn()

    def resumed(self) -> None:
        self.ready += 1

    def _spawn(self) -> None:
        self.ready += 1
        self.tasks.add(asyncio.get_running_loop().create_task(self._slot(), name="pgqueue-slot"))

    async def _slot(self) -> None:
        state = self.state
        me = asyncio.current_task()
        assert me is not None
        streak = 0
        try:
            while not state.stopping.is_set() and (held := state.next_prefetched()):
                await self.execute(held)
                if me.cancelling():
                    break  # the slot itself is being cancelled (shutdown): take nothing more
                streak += 1
                if streak == STREAK:
                    streak = 0
                    await asyncio.sleep(0)
        finally:
            self.tasks.discard(me)
            self.ready -= 1
            # A slot ends with jobs still buffered only if something failed in it: another
            # takes them, rather than leaving them to wait for the next claim.
            if state.buffer and not state.stopping.is_set() and not me.cancelling():
                self.buffered()

    async def wait(self, timeout: float) -> bool:
        """Wait for every slot to finish (they do once the buffer is empty or the worker is
        stopping); False if some were still running after ``timeout`` seconds."""
        if not self.tasks:
            return True
        _, pending = await asyncio.wait(set(self.tasks), timeout=timeout)
        return not pending


class JobRun:
    """One job's coroutine, run by the slot that awaits this object as its own task would run
    it: each step in the job's own context, and cancellable on its own."""

    __slots__ = ("_cancel", "_context", "_coro", "_slots", "_waiting", "cancel_requested")

    def __init__(self, coro: Coroutine[Any, Any, Any], slots: Slots) -> None:
        self._coro = coro
        self._context = contextvars.copy_context()
        self._slots = slots
        self._waiting: asyncio.Future[Any] | None = None
        self._cancel = False
        #: The worker cancelled this job (a lost lease, the end of the grace period). A
        #: CancelledError without it is the handler's own (it awaited something someone else
        #: cancelled): an ordinary failure of the attempt, not a cancellation.
        self.cancel_requested = False

    def cancel(self) -> None:
        """Throw CancelledError into the job at its current await, as Task.cancel does: cancel
        the future it waits on, or, when that already finished, throw when the job resumes."""
        self.cancel_requested = True
        waiting = self._waiting
        if waiting is None or not waiting.cancel():
            self._cancel = True

    def __await__(self) -> Generator[Any, None, Any]:
        coro, run = self._coro, self._context.run
        error: BaseException | None = None
        while True:
            try:
                if error is not None:
                    yielded = run(coro.throw, error)
                elif self._cancel:
                    self._cancel = False
                    yielded = run(coro.throw, asyncio.CancelledError())
                else:
                    yielded = run(coro.send, None)
            except StopIteration as stop:
                return stop.value
            error = None
            # The slot's task waits on what the job yielded (a future, or None for a bare
            # yield); keep it so that cancel() can cancel it.
            self._waiting = yielded if isinstance(yielded, asyncio.Future) else None
            self._slots.blocked()
            try:
                yield yielded
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # the future's exception, e.g. CancelledError
                error = exc
            finally:
                self._waiting = None
                self._slots.resumed()
