"""Exceptions: the ones handlers raise to steer retries, and the ones pgqueue raises to callers."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from .jobs import MAX_DELAY_SECONDS


class PgQueueError(Exception):
    """Base class of every error pgqueue raises."""


class ConfigurationError(PgQueueError, ValueError):
    """A setting is invalid (schema name, DSN missing, bad option)."""


class InvalidJobError(PgQueueError, ValueError):
    """A job was refused before anything was written: bad arguments, queue, delay or size."""


class UnknownTaskError(PgQueueError, LookupError):
    """A task name that this app has not registered."""


class JobNotFoundError(PgQueueError, LookupError):
    """No job has this id: it never existed, or it finished and was pruned."""

    @classmethod
    def of(cls, job_id: int) -> JobNotFoundError:
        return cls(f"no job {job_id}: it never existed, or it finished and was pruned")


class JobFailedError(PgQueueError):
    """``App.wait``: the job ended ``dead``; ``job`` holds it, with its last error."""

    def __init__(self, message: str, job: Any) -> None:
        super().__init__(message)
        self.job = job


class JobCancelledError(PgQueueError):
    """``App.wait``: the job was cancelled; ``job`` holds it."""

    def __init__(self, message: str, job: Any) -> None:
        super().__init__(message)
        self.job = job


class WaitTimeoutError(PgQueueError, TimeoutError):
    """``App.wait``: the job had not finished when the timeout ran out (it goes on)."""


class DatabaseUnavailableError(PgQueueError):
    """PostgreSQL could not be reached, or the connection was lost during a call; the message
    says where and why, and for a lost write that it may or may not have been applied.

    ``uncertain`` is True for that last case only: the write was sent and its answer lost, so
    it may have been committed (pgqueue never sends it again; see docs/failover.md). False:
    nothing of the call was written."""

    def __init__(self, message: str, *, uncertain: bool = False) -> None:
        super().__init__(message)
        self.uncertain = uncertain

    def __reduce__(self) -> tuple[Any, ...]:
        # copy.copy and pickle rebuild the error with its flag (the coalescer copies errors).
        return (_unavailable, (str(self), self.uncertain))


def _unavailable(message: str, uncertain: bool) -> DatabaseUnavailableError:
    return DatabaseUnavailableError(message, uncertain=uncertain)


class Retry(Exception):
    """Raised by a handler to be retried after exactly `after` (a Retry-After).

    The attempt counts toward ``max_attempts``, so a job that keeps asking to be retried still
    ends dead instead of looping forever.
    """

    def __init__(self, after: float | timedelta = 0, reason: str = "") -> None:
        try:
            seconds = after.total_seconds() if isinstance(after, timedelta) else float(after)
        except OverflowError:  # an int beyond float's range
            seconds = float("inf")
        # Checked here, where the handler raises it, so a bad delay fails that attempt with
        # this message instead of reaching the ack as a timestamp PostgreSQL cannot store.
        if not 0 <= seconds <= MAX_DELAY_SECONDS:  # also false for NaN
            raise ValueError(
                "Retry(after=...) must be between 0 and "
                f"{MAX_DELAY_SECONDS:,.0f} seconds (100 years), got {seconds:g}"
            )
        self.after = seconds
        self.reason = reason
        super().__init__(reason or f"retry requested after {seconds:g} s")


class Fail(Exception):
    """Raised by a handler to fail the job permanently: it goes straight to ``dead``."""

    def __init__(self, reason: str = "failed permanently") -> None:
        self.reason = reason
        super().__init__(reason)
