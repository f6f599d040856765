"""Which job a log record was written during: ``job_id``, ``task``, ``queue`` and ``attempt`` on
every record that reaches a handler carrying ``JobLogFilter``.

The worker sets a context variable for the length of each attempt (the handler's thread
included), so records of pgqueue's own loggers and of any other logger the handler writes to
during the job carry the same four attributes. A filter on the handler, rather than a global
``logging.setLogRecordFactory``, because a record factory would set the attributes before
``extra=`` is applied, and a caller's own ``extra={"task": ...}`` would then raise KeyError in
``Logger.makeRecord``; the filter only fills in what the record does not already have.
"""

from __future__ import annotations

import contextvars
import logging
from typing import Protocol


class _Job(Protocol):
    @property
    def id(self) -> int: ...
    @property
    def task(self) -> str: ...
    @property
    def queue(self) -> str: ...
    @property
    def attempt(self) -> int: ...


#: The attempt running in this context (set by the worker's executor), else None.
current_job: contextvars.ContextVar[_Job | None] = contextvars.ContextVar(
    "pgqueue_current_job", default=None
)

#: The attributes ``JobLogFilter`` sets, in this order.
FIELDS = ("job_id", "task", "queue", "attempt")


class JobLogFilter(logging.Filter):
    """Adds ``job_id``, ``task``, ``queue`` and ``attempt`` to records written while a job runs
    (records written outside a job pass unchanged, without them). Add it to a handler, not a
    logger: a logger's filters never see records of its child loggers.

    ``handler.addFilter(pgqueue.JobLogFilter())``, or in ``dictConfig``:
    ``"filters": {"job": {"()": "pgqueue.JobLogFilter"}}``. ``pgqueue worker`` adds it to the
    handler it configures. Never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        job = current_job.get()
        if job is not None:
            values = record.__dict__
            # setdefault: a caller's own extra={"task": ...} wins.
            values.setdefault("job_id", job.id)
            values.setdefault("task", job.task)
            values.setdefault("queue", job.queue)
            values.setdefault("attempt", job.attempt)
        return True


def job_fields(job: _Job) -> dict[str, object]:
    """The same attributes as ``extra=``, for pgqueue's records about a job written outside its
    attempt (a lost lease seen by the heartbeat, a refused ack)."""
    return {"job_id": job.id, "task": job.task, "queue": job.queue, "attempt": job.attempt}
