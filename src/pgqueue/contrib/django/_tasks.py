"""Django's tasks framework: ``django.tasks`` (Django 6 and later), else the ``django-tasks``
backport, which has the same API, for older Djangos (Django 6 needs Python 3.12)."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from django.core.exceptions import ImproperlyConfigured


def _package() -> str:
    if importlib.util.find_spec("django.tasks") is not None:
        return "django.tasks"
    if importlib.util.find_spec("django_tasks") is not None:
        return "django_tasks"
    raise ImproperlyConfigured(
        "pgqueue's task backend needs Django's tasks framework: Django 6 (django.tasks), or "
        "the django-tasks backport on older Djangos (pip install django-tasks)"
    )


PACKAGE = _package()
_base = importlib.import_module(f"{PACKAGE}.base")
_exceptions = importlib.import_module(f"{PACKAGE}.exceptions")
_signals = importlib.import_module(f"{PACKAGE}.signals")

BaseTaskBackend: Any = importlib.import_module(f"{PACKAGE}.backends.base").BaseTaskBackend
Task: Any = _base.Task
TaskContext: Any = _base.TaskContext
TaskError: Any = _base.TaskError
TaskResult: Any = _base.TaskResult
TaskResultStatus: Any = _base.TaskResultStatus
TaskResultDoesNotExist: Any = _exceptions.TaskResultDoesNotExist
#: Named InvalidTaskError in the backport.
InvalidTask: Any = getattr(_exceptions, "InvalidTask", None) or _exceptions.InvalidTaskError
#: The decorator (``from django.tasks import task`` in your code).
task: Any = importlib.import_module(PACKAGE).task
task_enqueued: Any = _signals.task_enqueued
task_started: Any = _signals.task_started
task_finished: Any = _signals.task_finished


def task_backends() -> Any:
    """The framework's backends by alias (``TASKS``)."""
    return importlib.import_module(PACKAGE).task_backends


def normalize_json(value: Any) -> Any:
    """The framework's own JSON normalisation of arguments and return values."""
    if PACKAGE == "django.tasks":
        from django.utils.json import normalize_json as normalize
    else:
        from django_tasks.utils import normalize_json as normalize
    return normalize(value)
