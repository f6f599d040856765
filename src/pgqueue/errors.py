"""Exceptions: the ones handlers raise to steer retries, and the ones pgqueue raises to callers."""

from __future__ import annotations

from datetime import timedelta


class PgQueueError(Exception):
    """Base class of every error pgqueue raises."""


class ConfigurationError(PgQueueError, ValueError):
    """A setting is invalid (schema name, DSN missing, bad option)."""


class InvalidJobError(PgQueueError, ValueError):
    """A job was refused before anything was written: bad arguments, queue, delay or size."""


class UnknownTaskError(PgQueueError, LookupError):
    """A task name that this app has not registered."""


class DatabaseUnavailableError(PgQueueError):
    """PostgreSQL could not be reached; the message says where and why."""


class Retry(Exception):
    """Raised by a handler to be retried after exactly `after` (a Retry-After).

    The attempt counts toward ``max_attempts``, so a job that keeps asking to be retried still
    ends dead instead of looping forever.
    """

    def __init__(self, after: float | timedelta = 0, reason: str = "") -> None:
        seconds = after.total_seconds() if isinstance(after, timedelta) else float(after)
        if seconds < 0 or seconds != seconds:
            raise ValueError("Retry(after=...) must be a non-negative number of seconds")
        self.after = seconds
        self.reason = reason
        super().__init__(reason or f"retry requested after {seconds:g} s")


class Fail(Exception):
    """Raised by a handler to fail the job permanently: it goes straight to ``dead``."""

    def __init__(self, reason: str = "failed permanently") -> None:
        self.reason = reason
        super().__init__(reason)
