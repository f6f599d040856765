"""Why isn't it running? The reasons a waiting job is not claimed, from one ``job_why`` row.

Every check mirrors what a claim requires (queries.sql, claim_jobs and claim_limited_jobs), in
the order a user would act on them: the parents it waits for, a worker for its queue, a worker
that has its task (workers record their tasks at start: a worker gives back, unrun, jobs of tasks
its code lacks), its due time, an operator's pause, a queue's limit or rate, its task's, and free
slots. All that apply are returned; the first is the answer. One thing is not known to the
database and so never given as a reason: a worker's prefetch (a busy worker may still hold a
claimed job that waits for a slot).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .humanize import duration, plural

WAITING = ("queued", "retrying", "blocked")
FINISHED = ("succeeded", "dead", "cancelled")


@dataclass(frozen=True, slots=True)
class Reason:
    code: str
    text: str
    #: Jobs a reason names (a blocked job's unfinished parents): (id, task, status).
    jobs: tuple[tuple[int, str, str], ...] = ()


#: When nothing stops it: the next claim of a serving worker takes it.
READY = Reason("ready", "Nothing holds it back: it should start any moment.")


def reasons(row: Sequence[Any]) -> list[Reason]:
    """The reasons that apply to a waiting job (``job_why``'s columns, in order); ``[READY]``
    when none does."""
    (status, due_in, live, live_queues, serving, slots, busy, paused, q_limit, q_rate,
     q_period, q_running, q_used, t_limit, t_rate, t_period, per_key, limit_key, t_running,
     t_used, waiting, failed_parent, after_failure, unfinished, task, known) = row  # fmt: skip
    found: list[Reason] = []
    if status == "blocked":
        found.append(_blocked(waiting, failed_parent, after_failure, unfinished))
    if live == 0:
        found.append(Reason("no_worker", "No worker is running (none has a recent heartbeat)."))
    elif serving == 0:
        served = ", ".join(live_queues) if live_queues else "none"
        found.append(Reason(
            "no_worker_for_queue",
            f"No live worker serves its queue (the live workers serve: {served}).",
        ))  # fmt: skip
    elif not known:
        found.append(_unknown_task(task, "its queue"))
    if due_in is not None and due_in > 0 and status != "blocked":
        what = "Its retry is" if status == "retrying" else "It is"
        found.append(Reason("not_due", f"{what} due in {duration(due_in)}."))
    if paused:
        found.append(Reason(
            "paused", 'Its queue is paused ("pgqueue queues resume" lets workers claim it again).'
        ))  # fmt: skip
    if q_limit is not None and q_running is not None and q_running >= q_limit:
        found.append(Reason("queue_limit", "Its queue " + _at_limit(q_running, q_limit)))
    if (rate := _rate_reason("queue_rate", "Its queue", q_rate, q_period, q_used)) is not None:
        found.append(rate)
    if t_limit is not None and t_running is not None and t_running >= t_limit:
        group = f" (key {limit_key!r})" if per_key and limit_key else ""
        found.append(Reason("task_limit", f"Its task{group} " + _at_limit(t_running, t_limit)))
    if (rate := _rate_reason("task_rate", "Its task", t_rate, t_period, t_used)) is not None:
        found.append(rate)
    if serving > 0 and busy >= slots:
        found.append(Reason(
            "workers_busy",
            f"Every worker that serves its queue is busy: {busy} of {plural(slots, 'slot')} "
            "hold a job.",
        ))  # fmt: skip
    return found or [READY]


def _blocked(
    waiting: int | None, failed_parent: int | None, after_failure: str | None,
    unfinished: list[list[Any]] | None,
) -> Reason:  # fmt: skip
    jobs = tuple((int(j[0]), str(j[1]), str(j[2])) for j in unfinished or ())
    count = waiting if waiting is not None else len(jobs)
    text = f"It runs after other jobs: {plural(count, 'parent')} not finished yet."
    if failed_parent is not None and after_failure == "run":
        text += f" Job #{failed_parent} failed; this one runs anyway (after_failure='run')."
    return Reason("blocked", text, jobs)


def _unknown_task(task: str, where: str) -> Reason:
    return Reason(
        "unknown_task",
        f"Its task {task!r} is unknown to every live worker that serves {where}: they leave "
        "its jobs for a worker whose code registers it (deploy one, or check the task's name).",
    )


def _at_limit(running: int, limit: int) -> str:
    if limit == 0:
        return "has a concurrency limit of 0: none of its jobs start until it is raised."
    return f"is at its concurrency limit: {running} running of {limit} allowed."


def _rate_reason(
    code: str, whose: str, rate: int | None, period: float | None, used: list[Any] | None
) -> Reason | None:
    if rate is None or period is None or not used or used[0] is None or int(used[0]) < rate:
        return None
    wait = float(used[1]) if used[1] is not None else 0.0
    return Reason(
        code,
        f"{whose} used its rate: {int(used[0])} started in the last {duration(period)} "
        f"(at most {rate}); room again in {duration(max(wait, 0.0))}.",
    )


#: A queue whose jobs wait when nothing at the queue's level holds them: their tasks' limits
#: are per job (its detail page says).
QUEUE_READY = Reason(
    "ready",
    "Nothing at the queue's level holds it back: its jobs should start any moment (a job's own "
    "page names a task limit or parents it waits for).",
)


def queue_reasons(
    *,
    live: int,
    live_queues: Sequence[str],
    serving: Sequence[tuple[int, int]],
    due_in: float | None,
    setting: Any,
    running: int,
    unknown_tasks: Sequence[str] = (),
) -> list[Reason]:
    """Why a queue's waiting jobs are not running: the job page's checks that belong to the
    queue, in the same order (no worker, none serving it, no serving worker has its due jobs'
    tasks, not due, paused, its limit, its rate, busy workers). ``unknown_tasks`` are the tasks
    of its due heads (the first job of each priority) that no serving worker has. ``serving`` is (leases, concurrency) of each live worker serving it;
    ``due_in`` the seconds until its earliest waiting job is due; ``setting`` its
    ``queries.QueueSetting`` or None. ``[QUEUE_READY]`` when none applies."""
    found: list[Reason] = []
    if live == 0:
        found.append(Reason("no_worker", "No worker is running (none has a recent heartbeat)."))
    elif not serving:
        served = ", ".join(live_queues) if live_queues else "none"
        found.append(Reason(
            "no_worker_for_queue", f"No live worker serves it (they serve: {served}).",
        ))  # fmt: skip
    elif unknown_tasks:
        names = ", ".join(repr(t) for t in unknown_tasks)
        found.append(Reason(
            "unknown_task",
            f"The task of its next jobs ({names}) is unknown to every live worker that serves "
            "it: they leave those jobs for a worker whose code registers the task.",
        ))  # fmt: skip
    if due_in is not None and due_in > 0:
        found.append(
            Reason("not_due", f"All its jobs are due later: the next in {duration(due_in)}.")
        )
    if setting is not None and setting.paused:
        found.append(Reason("paused", 'Paused ("pgqueue queues resume" lets workers claim it).'))
    if setting is not None and setting.limit is not None and running >= setting.limit:
        found.append(Reason("queue_limit", "It " + _at_limit(running, setting.limit)))
    if (
        setting is not None
        and (rate := _rate_reason("queue_rate", "It", setting.rate, setting.period, setting.used))
        is not None
    ):
        found.append(rate)
    if serving and all(held >= slots for held, slots in serving):
        slots = sum(s for _, s in serving)
        found.append(Reason(
            "workers_busy",
            f"Every worker that serves it is busy: {plural(slots, 'slot')}, all holding a job.",
        ))  # fmt: skip
    return found or [QUEUE_READY]
