"""What a handler can ask for by declaring a parameter annotated ``JobContext``."""

from __future__ import annotations

from dataclasses import dataclass
from uuid import UUID


@dataclass(slots=True)
class JobContext:
    job_id: int
    task: str
    queue: str
    attempt: int
    max_attempts: int
    lease_token: UUID
    #: Seconds since the epoch (worker clock) by which the current lease runs out unless the
    #: worker's next heartbeat extends it; heartbeats move it forward.
    lease_deadline: float
    worker_id: UUID
