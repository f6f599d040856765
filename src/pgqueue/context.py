"""What a handler can ask for by declaring a parameter annotated ``JobContext``."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

#: Longest progress note kept (characters); longer ones are cut.
MAX_NOTE = 1000


def _no_lease() -> float:
    return 0.0


def _not_cancelled() -> bool:
    return False


def _no_progress(text: str) -> None:
    return None


class CancelledByRequest(Exception):
    """Raised by ``JobContext.check_cancelled()`` once someone asked to cancel the job: the
    attempt ends 'cancelled' whatever the handler raises from then on."""


@dataclass(slots=True)
class JobContext:
    """The attempt a handler is running: which job, which try, and until when its lease holds."""

    job_id: int
    task: str
    queue: str
    attempt: int
    max_attempts: int
    lease_token: UUID
    worker_id: UUID
    #: The worker's lease deadline on its monotonic clock (what ``lease_deadline`` converts).
    _lease_deadline: Callable[[], float] = field(default=_no_lease, repr=False, compare=False)
    _cancelled: Callable[[], bool] = field(default=_not_cancelled, repr=False, compare=False)
    #: The caller's own data, set at enqueue (``configure(meta=...)``); None if none was.
    meta: dict[str, Any] | None = None
    _progress: Callable[[str], None] = field(default=_no_progress, repr=False, compare=False)
    #: Seconds from when the job was due (its run_at) to this attempt's claim, both on the
    #: database's clock: how long it waited for a worker (metrics; see pgqueue.contrib.otel).
    pickup_seconds: float = 0.0

    def progress(self, current: float, total: float | None = None, note: str | None = None) -> None:
        """Report how far this attempt got (``pgqueue job ID``, the JSON API, the dashboard's
        Running jobs panel). Cheap: it only keeps the value; the worker's next heartbeat writes
        the latest one, fenced by this attempt's lease, so call it as often as you like."""
        for name, value in (("current", current), ("total", total)):
            if value is None and name == "total":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"progress {name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"progress {name} must be finite, got {value!r}")
        if note is not None and not isinstance(note, str):
            raise TypeError(f"progress note must be a string, got {type(note).__name__}")
        entry: dict[str, Any] = {"current": current}
        if total is not None:
            entry["total"] = total
        if note is not None:
            entry["note"] = note[:MAX_NOTE].replace("\x00", "")
        self._progress(json.dumps(entry, ensure_ascii=False))

    @property
    def cancelled(self) -> bool:
        """True once someone asked to cancel this job (``App.cancel`` while it runs). An async
        handler is cancelled at its next ``await``; a sync one cannot be interrupted, so a long
        one should look here (or call ``check_cancelled``) between steps."""
        return self._cancelled()

    def check_cancelled(self) -> None:
        """Raise ``CancelledByRequest`` if someone asked to cancel this job."""
        if self._cancelled():
            raise CancelledByRequest(f"job {self.job_id}: cancel requested")

    @property
    def lease_deadline(self) -> float:
        """Seconds since the epoch (this machine's clock) by which this attempt's lease runs out
        unless the worker's next heartbeat extends it. Heartbeats move it forward, so read it
        again rather than keeping it; a handler that runs past it has lost the job to a reaper
        and its result will be refused."""
        return time.time() + (self._lease_deadline() - time.monotonic())
