"""pgqueue: a job queue for Python where PostgreSQL is the whole broker."""

import logging
from importlib.metadata import PackageNotFoundError, version

from .app import App
from .backoff import Backoff
from .context import CancelledByRequest, JobContext
from .errors import (
    ConfigurationError,
    DatabaseUnavailableError,
    Fail,
    InvalidJobError,
    JobCancelledError,
    JobFailedError,
    JobNotFoundError,
    PgQueueError,
    Retry,
    UnknownTaskError,
    WaitTimeoutError,
)
from .jobs import Attempt, CancelResult, Enqueued, Job, Status
from .logcontext import JobLogFilter
from .tasks import Task

# A library's convention: its records go wherever the application configured logging, and
# nowhere (no "No handlers could be found" fallback to stderr) when it configured none.
logging.getLogger("pgqueue").addHandler(logging.NullHandler())

try:
    __version__ = version("pgqueue-jobs")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0"

__all__ = [
    "App",
    "Attempt",
    "Backoff",
    "CancelResult",
    "CancelledByRequest",
    "ConfigurationError",
    "DatabaseUnavailableError",
    "Enqueued",
    "Fail",
    "InvalidJobError",
    "Job",
    "JobCancelledError",
    "JobContext",
    "JobFailedError",
    "JobLogFilter",
    "JobNotFoundError",
    "PgQueueError",
    "Retry",
    "Status",
    "Task",
    "UnknownTaskError",
    "WaitTimeoutError",
    "__version__",
]
