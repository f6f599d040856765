"""Settings of the tests' Django project. Its database is ``$PGQUEUE_DJANGO_DSN`` (the tests set
it for ``manage.py`` subprocesses, and point it at each test's database in-process)."""

from __future__ import annotations

import importlib.util
import os

from tests.django_project import database

DATABASES = {"default": database(os.environ.get("PGQUEUE_DJANGO_DSN", "dbname=unset"))}

INSTALLED_APPS = ["pgqueue.contrib.django"]
if importlib.util.find_spec("django.tasks") is None:  # Django < 6: the backport's app
    INSTALLED_APPS.append("django_tasks")

TASKS = {
    "default": {
        "BACKEND": "pgqueue.contrib.django.PgQueueBackend",
        "QUEUES": ["default", "emails"],
    }
}

USE_TZ = True
SECRET_KEY = "only-for-tests"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
