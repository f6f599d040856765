"""pgqueue as Django's task backend, in a real Django project (tests/django_project) against
PostgreSQL: enqueue inside atomic() commits or rolls back with the caller's data, real workers
run the tasks (in-process and ``manage.py pgqueue_worker``), get_result reads their outcome,
and ``manage.py migrate`` creates pgqueue's tables."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from pgqueue.backoff import Backoff
from tests import django_project
from tests.helpers import ROOT, wait_until

Conn = psycopg.Connection[tuple[Any, ...]]


@pytest.fixture
def django_db(dsn: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Django pointed at this test's (migrated) database."""
    monkeypatch.setenv("PGQUEUE_DJANGO_DSN", dsn)
    django_project.use_database(dsn)
    try:
        yield dsn
    finally:
        from django.db import connections

        django_project.close_task_backends()
        connections.close_all()


def backend() -> Any:
    from pgqueue.contrib.django import _tasks

    return _tasks.task_backends()["default"]


def jobs(conn: Conn) -> list[tuple[Any, ...]]:
    return conn.execute(
        "SELECT task, queue, priority, args, max_attempts FROM pgqueue_jobs ORDER BY id"
    ).fetchall()


def finished(result: Any) -> Any:
    """``result`` once its task has finished, read again until it has."""

    def look() -> bool:
        result.refresh()
        return bool(result.is_finished)

    wait_until(look, what=f"task result {result.id} finished")
    return result


@contextlib.contextmanager
def worker_thread(**options: Any) -> Iterator[None]:
    """A real pgqueue worker for the backend's tasks, in a thread, stopped gracefully after."""
    worker = backend().app.worker(install_signal_handlers=False, **options)
    thread = threading.Thread(target=worker.run_sync, name="pgqueue-worker")
    thread.start()
    try:
        wait_until(lambda: worker.started.is_set() or not thread.is_alive(), what="worker start")
        assert thread.is_alive(), "the worker stopped at once"
        yield
    finally:
        worker.stop()
        thread.join(60)


# --- enqueue ------------------------------------------------------------------------------


def test_a_task_enqueued_in_a_rolled_back_atomic_block_leaves_no_job(
    django_db: str, conn: Conn
) -> None:
    from django.db import connection, transaction

    from tests.django_project.tasks import add

    conn.execute("CREATE TABLE notes (body text)")
    with pytest.raises(RuntimeError), transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("INSERT INTO notes VALUES ('order')")
        add.enqueue(1, 2)
        raise RuntimeError("payment refused")
    assert jobs(conn) == []
    assert conn.execute("SELECT count(*) FROM notes").fetchone() == (0,)


def test_a_task_enqueued_in_a_committed_atomic_block_is_a_job_with_its_options(
    django_db: str, conn: Conn
) -> None:
    from django.db import transaction

    from pgqueue.contrib.django._tasks import TaskResultStatus
    from tests.django_project.tasks import add, send_welcome

    later = datetime.now(UTC) + timedelta(hours=1)
    with transaction.atomic():
        first = add.enqueue(1, b=2)  # the first statement of the transaction
        second = send_welcome.using(run_after=later).enqueue(user="ada")
        assert jobs(conn) == []  # not committed yet
        assert backend().get_result(first.id).status == TaskResultStatus.READY  # in the block
    assert first.status == TaskResultStatus.READY and first.backend == "default"
    assert jobs(conn) == [
        ("django_task", "default", 0,
         {"path": "tests.django_project.tasks.add", "args": [1], "kwargs": {"b": 2}}, 1),
        ("django_task", "emails", 10,
         {"path": "tests.django_project.tasks.send_welcome", "args": [], "kwargs": {"user": "ada"}},
         1),
    ]  # fmt: skip
    run_at = conn.execute("SELECT run_at FROM pgqueue_jobs WHERE id = %s", (int(second.id),))
    assert run_at.fetchone() == (later,)


def test_enqueue_outside_a_transaction_commits_at_once(django_db: str, conn: Conn) -> None:
    from tests.django_project.tasks import add

    result = add.enqueue(2, 2)
    assert [row[0] for row in jobs(conn)] == ["django_task"]
    assert result.task.module_path == "tests.django_project.tasks.add"


async def test_aenqueue_and_aget_result_from_async_code(django_db: str, conn: Conn) -> None:
    from tests.django_project.tasks import add

    result = await add.aenqueue(3, 4)
    again = await add.aget_result(result.id)
    assert (again.id, again.args, again.status) == (result.id, [3, 4], "READY")


def test_a_task_the_backend_cannot_run_is_refused_at_enqueue(django_db: str) -> None:
    from pgqueue.contrib.django._tasks import InvalidTask
    from tests.django_project.tasks import add

    with pytest.raises(InvalidTask, match="not valid for backend"):
        add.using(queue_name="nowhere")
    with pytest.raises(InvalidTask, match="run_at must be between"):
        add.using(run_after=datetime(4000, 1, 1, tzinfo=UTC))


def test_get_result_of_an_id_that_is_no_django_task_raises_does_not_exist(
    django_db: str, conn: Conn
) -> None:
    from pgqueue.contrib.django._tasks import TaskResultDoesNotExist

    row = conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, args) VALUES ('default', 'other', '{}')"
        " RETURNING id"
    ).fetchone()
    assert row is not None
    for result_id in ("nope", "0", "99999999", str(row[0])):
        with pytest.raises(TaskResultDoesNotExist):
            backend().get_result(result_id)


# --- workers ------------------------------------------------------------------------------


def test_a_worker_runs_django_tasks_and_get_result_reads_their_outcome(
    django_db: str, conn: Conn
) -> None:
    from pgqueue.contrib.django._tasks import TaskResultStatus
    from tests.django_project.tasks import add, add_async, explode, record, which_attempt

    conn.execute("CREATE TABLE notes (body text)")
    results = {
        "add": add.enqueue(2, 3),
        "async": add_async.enqueue(a=20, b=22),
        "context": which_attempt.enqueue(),
        "record": record.enqueue("from the worker"),
        "explode": explode.enqueue("boom"),
    }
    with worker_thread(concurrency=4):
        done = {name: finished(result) for name, result in results.items()}
    assert {name: r.status for name, r in done.items()} == {
        "add": TaskResultStatus.SUCCESSFUL, "async": TaskResultStatus.SUCCESSFUL,
        "context": TaskResultStatus.SUCCESSFUL, "record": TaskResultStatus.SUCCESSFUL,
        "explode": TaskResultStatus.FAILED,
    }  # fmt: skip
    assert done["add"].return_value == 5
    assert done["async"].return_value == 42
    assert done["context"].return_value == 1
    assert done["record"].return_value == 1
    assert conn.execute("SELECT body FROM notes").fetchall() == [("from the worker",)]

    failed = done["explode"]
    assert failed.attempts == 1 and failed.finished_at is not None
    [error] = failed.errors
    assert error.exception_class is ValueError
    assert "boom" in error.traceback and "raise ValueError(message)" in error.traceback
    with pytest.raises(ValueError, match="Task failed"):
        _ = failed.return_value

    ok = done["add"]
    assert ok.enqueued_at <= ok.started_at <= ok.finished_at
    assert ok.task.func is add.func and ok.args == [2, 3] and ok.errors == []


def test_manage_py_pgqueue_worker_runs_tasks_until_sigterm(django_db: str, conn: Conn) -> None:
    from pgqueue.contrib.django._tasks import TaskResultStatus
    from tests.django_project.tasks import add, send_welcome

    first, second = add.enqueue(40, 2), send_welcome.enqueue(user="grace")
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PGQUEUE_DJANGO_DSN": django_db}
    proc = subprocess.Popen(
        [sys.executable, "-m", "django", "pgqueue_worker", "--settings", django_project.SETTINGS,
         "--queue", "default", "--concurrency", "2"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip

    def done() -> bool:
        assert proc.poll() is None, "the worker exited"
        first.refresh()
        return bool(first.is_finished)

    try:
        wait_until(done, what="the task run by manage.py pgqueue_worker")
        assert first.status == TaskResultStatus.SUCCESSFUL and first.return_value == 42
        second.refresh()
        assert second.status == TaskResultStatus.READY  # its queue, emails, is not served
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        print(out.decode(errors="replace"))  # shown if the test fails
    assert proc.returncode == 0


# --- migrations ---------------------------------------------------------------------------


def test_manage_py_migrate_creates_pgqueue_tables(
    empty_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from django.core.management import call_command
    from django.db import connections

    monkeypatch.setenv("PGQUEUE_DJANGO_DSN", empty_dsn)
    django_project.use_database(empty_dsn)
    try:
        out = io.StringIO()
        call_command("migrate", verbosity=1, stdout=out)
        assert "Applied pgqueue migrations [1, 2," in out.getvalue()
        with psycopg.connect(empty_dsn) as conn:
            assert conn.execute("SELECT to_regclass('pgqueue_jobs')").fetchone() == (
                "pgqueue_jobs",
            )
        call_command("migrate", verbosity=0)  # nothing pending: a no-op
        from tests.django_project.tasks import add

        assert add.enqueue(1, 1).status == "READY"
    finally:
        django_project.close_task_backends()
        connections.close_all()


# --- options ------------------------------------------------------------------------------


def test_with_max_attempts_a_failed_attempt_is_ready_again_with_its_error(
    django_db: str, conn: Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    from django.test import override_settings

    from pgqueue.contrib.django._tasks import TaskResultStatus
    from tests.django_project.tasks import explode

    tasks = {"default": {"BACKEND": "pgqueue.contrib.django.PgQueueBackend",
                         "OPTIONS": {"MAX_ATTEMPTS": 3}}}  # fmt: skip
    # The retry a minute away, not within the first second (the backoff's full jitter): one
    # due before the worker stops runs a second attempt (seen under a loaded CI run).
    monkeypatch.setattr(Backoff, "delay", lambda self, attempt, rng=None: 60.0)
    with override_settings(TASKS=tasks):
        result = explode.enqueue("try again")
        with worker_thread():
            wait_until(
                lambda: conn.execute("SELECT status FROM pgqueue_jobs").fetchone() == ("retrying",),
                what="the first attempt failed",
            )
        result.refresh()
        django_project.close_task_backends()
    assert result.status == TaskResultStatus.READY and result.attempts == 1
    assert [e.exception_class_path for e in result.errors] == ["builtins.ValueError"]


def test_app_option_runs_django_tasks_beside_the_apps_own(
    django_db: str, conn: Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    from django.test import override_settings

    import pgqueue
    from tests.django_project import jobs
    from tests.django_project.tasks import add

    monkeypatch.delenv("PGQUEUE_DSN", raising=False)
    monkeypatch.delenv("DATABASE_URL", raising=False)
    app = pgqueue.App()
    monkeypatch.setattr(jobs, "app", app)

    @app.task
    def double(n: int) -> int:
        return n * 2

    tasks = {"default": {"BACKEND": "pgqueue.contrib.django.PgQueueBackend",
                         "OPTIONS": {"APP": "tests.django_project.jobs:app"}}}  # fmt: skip
    try:
        with override_settings(TASKS=tasks):
            assert backend().app is app and app.dsn == backend().dsn()
            result = add.enqueue(1, 2)
            job = double.enqueue(n=21)
            with worker_thread():
                assert app.wait(job, timeout=30) == 42
                assert finished(result).return_value == 3
    finally:
        app.close()


def test_unknown_options_are_refused_and_the_system_check_passes(django_db: str) -> None:
    from django.core.exceptions import ImproperlyConfigured

    from pgqueue.contrib.django import PgQueueBackend

    with pytest.raises(ImproperlyConfigured, match="unknown OPTIONS"):
        PgQueueBackend("x", {"OPTIONS": {"DSN": "..."}})
    with pytest.raises(ImproperlyConfigured, match="MAX_ATTEMPTS"):
        PgQueueBackend("x", {"OPTIONS": {"MAX_ATTEMPTS": 0}})
    assert backend().check() == []  # Django's system checks: the database is PostgreSQL


def test_an_errors_class_path_is_read_from_the_stored_traceback(django_db: str) -> None:
    from pgqueue.contrib.django.backend import _errors
    from pgqueue.worker.executor import format_error
    from tests.django_project.tasks import Refused

    for exc, path in [
        (Refused("no\nmore: of this"), "tests.django_project.tasks.Refused"),
        (KeyError("k"), "builtins.KeyError"),
        (psycopg.errors.UniqueViolation("dup"), "psycopg.errors.UniqueViolation"),
    ]:
        try:
            raise exc
        except Exception as raised:
            text = format_error(raised)
        [error] = _errors(text)
        assert (error.exception_class_path, error.traceback) == (path, text)
        assert error.exception_class is type(exc)
