"""pgqueue: a job queue for Python where PostgreSQL is the whole broker."""

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
from .jobs import CancelResult, Enqueued, Job, Status
from .tasks import Task

try:
    __version__ = version("pgqueue-jobs")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0"

__all__ = [
    "App",
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
    "JobNotFoundError",
    "PgQueueError",
    "Retry",
    "Status",
    "Task",
    "UnknownTaskError",
    "WaitTimeoutError",
    "__version__",
]
