"""What the worker's services share: the jobs this process holds and what happened to them."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from uuid import UUID

import psycopg

from .outage import Outage

if TYPE_CHECKING:
    from .slots import JobRun


class Phase(enum.Enum):
    PREFETCHED = "prefetched"  # claimed ahead, waiting in the buffer for a free slot
    RUNNING = "running"  # the handler is running
    ACKING = "acking"  # the handler finished; its result waits in the completer
    ABANDONED = "abandoned"  # lease lost or timed out: nothing more will be written for it


#: How the worker knows one attempt: the job id and the lease token of its claim (as an int:
#: hashing a UUID object costs a Python call, and this runs three times per job). A job id alone
#: is not enough: after a stall, the same worker can claim attempt N+1 while attempt N's refused
#: ack is still on its way, and each must find its own entry.
Key = tuple[int, int]


def key_of(job_id: int, token: UUID) -> Key:
    return (job_id, token.int)


@dataclass(slots=True)
class ClaimedJob:
    id: int
    queue: str
    task: str
    args: dict[str, Any]
    attempt: int
    max_attempts: int
    lease_token: UUID
    pickup_seconds: float
    #: Claimed by the limited claim: its end frees a slot or rate that other claims may wait for.
    limited: bool = False
    #: Someone asked to cancel this attempt (App.cancel): the handler is being stopped, and what
    #: the attempt writes is 'cancelled'. Read by ``JobContext.cancelled`` from any thread.
    cancel_asked: bool = False
    #: The caller's own data (``configure(meta=...)``), for ``JobContext.meta``.
    meta: dict[str, Any] | None = None
    #: The handler's last ``ctx.progress(...)`` as JSON text, until a heartbeat writes it.
    progress: str | None = None
    key: Key = field(init=False)

    def __post_init__(self) -> None:
        self.key = (self.id, self.lease_token.int)


@dataclass(slots=True)
class Held:
    """A job whose lease this worker holds until its result is written or the lease is lost."""

    job: ClaimedJob
    phase: Phase = Phase.PREFETCHED
    #: While the handler runs: what cancels it (a lost lease, the end of the grace period).
    handler: JobRun | None = None
    lost: bool = False
    #: Monotonic time the handler started (0 until it does).
    started: float = 0.0

    def acking(self) -> None:
        """The handler's own transaction is writing the ack (transactional completion): from
        here on a heartbeat that misses the job has met our own ack, not a lost lease."""
        self.phase = Phase.ACKING


@dataclass
class Counters:
    claimed: int = 0
    succeeded: int = 0
    retried: int = 0
    dead: int = 0
    cancelled: int = 0
    released: int = 0
    #: Writes (acks, heartbeats) refused by fencing because the lease was no longer ours.
    stale_writes: int = 0
    stale_unreported: int = 0
    reaped: int = 0
    #: Outcomes the database refused to store (see completer): recorded as failed attempts.
    unstorable: int = 0
    #: Attempts given up (an ack that could not be written at all, a job lost track of): their
    #: leases were expired for the reaper to record.
    given_up: int = 0


@dataclass
class WorkerState:
    concurrency: int
    #: Most jobs claimed ahead of a free slot: at most ``concurrency + prefetch`` unfinished
    #: jobs (running or prefetched) are held at once.
    prefetch: int = 0
    held: dict[Key, Held] = field(default_factory=dict)
    #: Monotonic time by which this worker's lease has surely run out in the database unless a
    #: heartbeat extends it first. One lease covers every job the worker holds (migration 0005).
    lease_deadline: float = 0.0
    #: Prefetched jobs in claim order. Entries that lost their lease meanwhile are skipped.
    buffer: collections.deque[Held] = field(default_factory=collections.deque)
    running: int = 0
    #: Handlers finished so far; the fetcher sizes the buffer from its recent rate.
    finished: int = 0
    counters: Counters = field(default_factory=Counters)
    #: Set whenever there may be work: a NOTIFY, a freed slot, a poll tick.
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    #: Whether the services reach the database: one log line per outage (see ``outage``).
    outage: Outage = field(default_factory=Outage)

    @property
    def free_slots(self) -> int:
        return max(self.concurrency - self.running, 0)

    def next_prefetched(self) -> Held | None:
        while self.buffer:
            held = self.buffer.popleft()
            if held.phase is Phase.PREFETCHED and self.held.get(held.job.key) is held:
                return held
        return None


#: What the database or the network can throw at a service's round: retried quietly.
TRANSIENT = (psycopg.Error, OSError, TimeoutError)


def round_failed(
    log: logging.Logger, what: str, exc: Exception, outage: Outage | None = None
) -> None:
    """A service round failed; the service goes on. The database being unreachable is the
    ``outage``'s to log (once per outage); other errors of the database and the network are
    expected (a warning); anything else (a MemoryError while a handler hogs memory, a bug)
    gets its traceback, but must not end the service: a worker whose heartbeat stopped would
    hold its leases without extending them."""
    if outage is not None and outage.failed(what, exc):
        return
    if isinstance(exc, TRANSIENT):
        log.warning("%s failed (%s); will retry", what, exc)
    else:
        log.error("%s failed unexpectedly; will retry", what, exc_info=exc)


def spread(interval: float, fleet: int) -> float:
    """The pause before one worker's next round of a chore the whole fleet shares (reaping,
    looking for schedule changes, sampling depth): ``interval`` times the live workers, jittered
    by half either way, so the fleet as a whole runs about one round per ``interval`` whatever
    its size, and the workers' rounds do not line up."""
    return interval * max(fleet, 1) * random.uniform(0.5, 1.5)


async def pause(stopping: asyncio.Event, seconds: float) -> None:
    """Sleep for ``seconds`` or until ``stopping`` is set, whichever comes first."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stopping.wait(), seconds)
