"""What ran: one record per attempt, as ``run_until_idle`` and ``eager`` report them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..jobs import Status


@dataclass(frozen=True, slots=True)
class Run:
    """One attempt of one job, and how it ended."""

    job_id: int
    task: str
    #: The arguments as the handler got them (JSON-decoded, as a worker passes them).
    args: dict[str, Any]
    #: 1 for the first attempt.
    attempt: int
    #: ``succeeded``; ``retrying`` (failed, attempts left); ``dead``; or ``cancelled``.
    status: Status
    #: The handler's return value as stored (JSON-decoded); None unless it succeeded.
    result: Any
    #: ``Type: message`` and the traceback, as the job's ``last_error``; None if it succeeded.
    error: str | None

    @property
    def succeeded(self) -> bool:
        return self.status is Status.SUCCEEDED


class Runs(list[Run]):
    """Every attempt in the order they ended (a list of ``Run``), with shortcuts for tests."""

    @property
    def results(self) -> list[Any]:
        """The results of the attempts that succeeded, in order."""
        return [run.result for run in self if run.status is Status.SUCCEEDED]

    @property
    def succeeded(self) -> Runs:
        return Runs(run for run in self if run.status is Status.SUCCEEDED)

    @property
    def failed(self) -> Runs:
        """Attempts that raised: ``retrying`` or ``dead``."""
        return Runs(run for run in self if run.status in (Status.RETRYING, Status.DEAD))

    def of(self, task: str) -> Runs:
        """The attempts of one task (by name)."""
        return Runs(run for run in self if run.task == task)

    def last(self, job_id: int) -> Run:
        """The last attempt of job ``job_id``; KeyError if it did not run."""
        for run in reversed(self):
            if run.job_id == job_id:
                return run
        raise KeyError(f"job {job_id} did not run")
