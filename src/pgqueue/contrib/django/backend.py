"""pgqueue as a backend of Django's tasks framework (the ``TASKS`` setting).

Every Django task is enqueued as a job of one pgqueue task, ``DJANGO_TASK``, whose arguments
name the task function by its module path: a worker imports it from there and calls it, so
Django tasks need no registration with pgqueue. The job is written on Django's own connection,
so a task enqueued inside ``transaction.atomic()`` exists only if that transaction commits.
"""

from __future__ import annotations

import builtins
import re
import traceback
from datetime import datetime
from functools import cached_property
from typing import Any

import psycopg
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, close_old_connections, connections
from django.utils import timezone
from django.utils.module_loading import import_string
from psycopg import conninfo
from psycopg.types.json import JsonbLoader

import pgqueue
from pgqueue import db, migrate, producer
from pgqueue.context import JobContext
from pgqueue.errors import ConfigurationError, Fail, InvalidJobError
from pgqueue.jobs import Job, Status
from pgqueue.sql import queries

from . import _tasks
from ._tasks import BaseTaskBackend, Task, TaskResult, TaskResultStatus

#: The pgqueue task that runs Django tasks (its jobs' ``task`` column).
DJANGO_TASK = "django_task"

OPTIONS = frozenset({"DATABASE", "SCHEMA", "MAX_ATTEMPTS", "APP"})

#: How a job's status reads in Django's terms. A job that will be retried is READY ("ready to
#: be executed again"); a cancelled one FAILED, as Django has no cancelled status.
STATUSES = {
    Status.QUEUED: TaskResultStatus.READY,
    Status.BLOCKED: TaskResultStatus.READY,
    Status.RETRYING: TaskResultStatus.READY,
    Status.RUNNING: TaskResultStatus.RUNNING,
    Status.SUCCEEDED: TaskResultStatus.SUCCESSFUL,
    Status.DEAD: TaskResultStatus.FAILED,
    Status.CANCELLED: TaskResultStatus.FAILED,
}

#: Keys of Django's connection parameters that are Django's own, not libpq's.
_NOT_LIBPQ = frozenset({"cursor_factory", "context", "prepare_threshold"})


class PgQueueBackend(BaseTaskBackend):  # type: ignore[misc]
    """``TASKS = {"default": {"BACKEND": "pgqueue.contrib.django.PgQueueBackend"}}``.

    OPTIONS: ``DATABASE``, the Django database alias holding pgqueue's tables and whose
    connection enqueues (default ``"default"``); ``SCHEMA``, their schema (default
    ``"public"``); ``MAX_ATTEMPTS`` (default 1: like Django's other backends, a task that raises
    is FAILED; more gives pgqueue's retries with backoff, which also rerun a task whose worker
    died); ``APP``, ``"module:attribute"`` of a pgqueue App of your own, to run Django tasks
    beside its tasks, with its middleware and hooks (instead of ``SCHEMA``).
    """

    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        unknown = set(self.options) - OPTIONS
        if unknown:
            raise ImproperlyConfigured(
                f"TASKS[{alias!r}]: unknown OPTIONS {sorted(unknown)} (known: {sorted(OPTIONS)})"
            )
        self.database: str = self.options.get("DATABASE", DEFAULT_DB_ALIAS)
        attempts = self.options.get("MAX_ATTEMPTS", 1)
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise ImproperlyConfigured(f"TASKS[{alias!r}]: MAX_ATTEMPTS must be an integer >= 1")
        self.max_attempts = attempts
        if "APP" in self.options and "SCHEMA" in self.options:
            raise ImproperlyConfigured(
                f"TASKS[{alias!r}]: give APP or SCHEMA, not both (the app has its schema)"
            )
        try:
            self.schema = db.validate_schema(self.options.get("SCHEMA", "public"))
        except ConfigurationError as exc:
            raise ImproperlyConfigured(f"TASKS[{alias!r}]: {exc}") from None

    # --- the pgqueue app and its database ---------------------------------------------------

    @cached_property
    def app(self) -> pgqueue.App:
        """The pgqueue App that enqueues and runs this backend's tasks, with ``DJANGO_TASK``
        registered: the ``APP`` option's, else one on Django's database."""
        spec = self.options.get("APP")
        if spec is None:
            app = pgqueue.App(self.dsn(), schema=self.schema)
        else:
            app = import_string(spec.replace(":", "."))
            if not isinstance(app, pgqueue.App):
                raise ImproperlyConfigured(f"TASKS[{self.alias!r}]: APP {spec!r} is not an App")
            try:
                app.dsn  # noqa: B018 (resolving it is the check)
            except ConfigurationError:
                app.dsn = self.dsn()
        app.task(name=DJANGO_TASK, max_attempts=self.max_attempts)(run_django_task)
        return app

    def dsn(self) -> str:
        """A DSN for the Django database (the worker's connections, migrations)."""
        params = connections[self.database].get_connection_params()
        libpq = {
            key: value
            for key, value in params.items()
            if key not in _NOT_LIBPQ
            and isinstance(value, str | int)
            and not isinstance(value, bool)
            and value != ""
        }
        return conninfo.make_conninfo("", **libpq)

    def connection(self) -> psycopg.Connection[Any]:
        """The psycopg connection under Django's, in the state Django left it: inside
        ``transaction.atomic()``, carrying its transaction."""
        wrapper = connections[self.database]
        wrapper.ensure_connection()
        wrapper.validate_no_broken_transaction()
        raw = wrapper.connection
        if not isinstance(raw, psycopg.Connection):
            raise ImproperlyConfigured(
                f"pgqueue's task backend needs database {self.database!r} on Django's "
                f"postgresql backend with psycopg 3; it has {wrapper.vendor} with "
                f"{type(raw).__module__}"
            )
        return raw

    def migrate(self) -> list[int]:
        """Apply pgqueue's pending migrations to the Django database; the versions applied."""
        with db.connect(self.dsn(), **self.app.connect_options) as conn:
            return migrate.migrate(conn, self.app.schema)

    # --- Django's backend interface ---------------------------------------------------------

    def validate_task(self, task: Any) -> None:
        super().validate_task(task)
        try:
            producer.check_name("queue", task.queue_name, producer.MAX_QUEUE_LENGTH)
            if task.run_after is not None:
                producer.check_delay(None, _aware(task.run_after))
        except InvalidJobError as exc:
            raise _tasks.InvalidTask(str(exc)) from None

    def enqueue(self, task: Any, args: Any, kwargs: Any) -> Any:
        self.validate_task(task)
        args, kwargs = _tasks.normalize_json(list(args)), _tasks.normalize_json(dict(kwargs))
        job = self.app.enqueue(
            DJANGO_TASK,
            {"path": task.module_path, "args": args, "kwargs": kwargs},
            queue=task.queue_name,
            priority=task.priority,
            max_attempts=self.max_attempts,
            run_at=None if task.run_after is None else _aware(task.run_after),
            connection=self.connection(),
        )
        result = TaskResult(
            task=task, id=str(job.id), status=TaskResultStatus.READY, enqueued_at=timezone.now(),
            started_at=None, finished_at=None, last_attempted_at=None, args=args, kwargs=kwargs,
            backend=self.alias, errors=[], worker_ids=[],
        )  # fmt: skip
        _tasks.task_enqueued.send(type(self), task_result=result)
        return result

    def get_result(self, result_id: str) -> Any:
        """The job as a TaskResult, read on Django's connection (so inside ``atomic()`` a task
        enqueued there is found). Raises TaskResultDoesNotExist for an id that is no job of a
        Django task."""
        job_id = _job_id(result_id)
        row = None
        if job_id is not None:
            with self.connection().cursor() as cur:
                # Django's connection loads jsonb as text (its JSONField decodes it): not here.
                cur.adapters.register_loader("jsonb", JsonbLoader)
                row = cur.execute(queries(self.app.schema).get_job, {"id": job_id}).fetchone()
        if row is None or row[2] != DJANGO_TASK:
            raise _tasks.TaskResultDoesNotExist(result_id)
        return self._result(Job.from_row(row))

    def check(self, **kwargs: Any) -> list[Any]:
        wrapper = connections[self.database]
        if wrapper.vendor != "postgresql":
            return [
                checks.Error(
                    f"pgqueue's task backend {self.alias!r} needs a PostgreSQL database; "
                    f"{self.database!r} is {wrapper.vendor}",
                    id="pgqueue.E001",
                )
            ]
        return []

    def _result(self, job: Job) -> Any:
        task = import_string(job.args["path"])
        if isinstance(task, Task):
            task = task.using(queue_name=job.queue, priority=job.priority, backend=self.alias)
        result = TaskResult(
            task=task, id=str(job.id), status=STATUSES[job.status], enqueued_at=job.created_at,
            started_at=job.started_at, finished_at=job.finished_at,
            last_attempted_at=job.started_at, args=job.args["args"], kwargs=job.args["kwargs"],
            backend=self.alias, errors=_errors(job.last_error),
            worker_ids=_worker_ids(job.attempts, job.worker_id),
        )  # fmt: skip
        if job.status is Status.SUCCEEDED:
            object.__setattr__(result, "_return_value", job.result)
        return result


def run_django_task(
    path: str, args: list[Any], kwargs: dict[str, Any], ctx: JobContext
) -> Any:  # fmt: skip
    """The handler of ``DJANGO_TASK``: import the Django task at ``path`` and call it, with
    Django's task signals around it. Stale database connections of this thread are closed
    before and after, as Django does around a request."""
    task = import_string(path)
    if not isinstance(task, Task):
        raise Fail(f"{path} is not a Django task (decorate it with @task)")
    now = timezone.now()
    result = TaskResult(
        task=task, id=str(ctx.job_id), status=TaskResultStatus.RUNNING, enqueued_at=None,
        started_at=now, finished_at=None, last_attempted_at=now, args=args, kwargs=kwargs,
        backend=task.backend, errors=[], worker_ids=_worker_ids(ctx.attempt, ctx.worker_id),
    )  # fmt: skip
    close_old_connections()
    try:
        _tasks.task_started.send(PgQueueBackend, task_result=result)
        if task.takes_context:
            value = task.call(_tasks.TaskContext(task_result=result), *args, **kwargs)
        else:
            value = task.call(*args, **kwargs)
        value = _tasks.normalize_json(value)
    except BaseException as exc:
        final = isinstance(exc, Fail) or ctx.attempt >= ctx.max_attempts
        object.__setattr__(result, "finished_at", timezone.now())
        object.__setattr__(
            result, "status", TaskResultStatus.FAILED if final else TaskResultStatus.READY
        )
        result.errors.append(_tasks.TaskError(
            exception_class_path=f"{type(exc).__module__}.{type(exc).__qualname__}",
            traceback=_traceback(exc),
        ))  # fmt: skip
        _tasks.task_finished.send(PgQueueBackend, task_result=result)
        raise
    else:
        object.__setattr__(result, "finished_at", timezone.now())
        object.__setattr__(result, "status", TaskResultStatus.SUCCESSFUL)
        object.__setattr__(result, "_return_value", value)
        _tasks.task_finished.send(PgQueueBackend, task_result=result)
        return value
    finally:
        close_old_connections()


def _aware(moment: datetime) -> datetime:
    """Django allows a naive run_after when USE_TZ is off: it is in Django's time zone."""
    return timezone.make_aware(moment) if timezone.is_naive(moment) else moment


def _job_id(result_id: object) -> int | None:
    try:
        job_id = int(str(result_id))
    except ValueError:
        return None
    return job_id if job_id > 0 else None


def _worker_ids(attempts: int, worker_id: object) -> list[str]:
    """One entry per attempt, so TaskResult.attempts is the job's. pgqueue keeps the worker of
    the running attempt only: earlier (and finished) attempts read ``"unknown"``."""
    if attempts < 1:
        return []
    return ["unknown"] * (attempts - 1) + [str(worker_id) if worker_id else "unknown"]


def _traceback(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


def _errors(last_error: str | None) -> list[Any]:
    """pgqueue keeps an attempt's error as ``Type: message``, a blank line and the traceback,
    whose last ``module.Type: message`` line gives the exception's full path."""
    if not last_error:
        return []
    name = last_error.split("\n", 1)[0].split(":", 1)[0].strip()
    path = name if "." in name else f"builtins.{name}" if hasattr(builtins, name) else name
    pattern = re.compile(rf"^((?:\w+\.)+){re.escape(name)}(?::|$)")
    for line in reversed(last_error.splitlines()):
        match = pattern.match(line)
        if match:
            path = match.group(1) + name
            break
    return [_tasks.TaskError(exception_class_path=path, traceback=last_error)]
