"""A tiny Django project for the tests: settings, Django tasks, and pointing Django at a test's
database. Django's settings are configured once per process, so every Django test in a process
shares this project (tests/integration/test_django.py, the guides' example in test_examples)."""

from __future__ import annotations

import os
from typing import Any

SETTINGS = "tests.django_project.settings"


def database(dsn: str) -> dict[str, Any]:
    """A Django DATABASES entry for ``dsn``."""
    from psycopg import conninfo

    params = {k: str(v) for k, v in conninfo.conninfo_to_dict(dsn).items() if v is not None}
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": params.get("dbname", ""),
        "USER": params.get("user", ""),
        "PASSWORD": params.get("password", ""),
        "HOST": params.get("host", ""),
        "PORT": params.get("port", ""),
    }


def use_database(dsn: str) -> None:
    """Set Django up (once) and point its default database, and the task backends built from
    it, at ``dsn``."""
    import django
    from django.apps import apps
    from django.conf import settings
    from django.core.signals import setting_changed
    from django.db import connections

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", SETTINGS)
    if not apps.ready:
        django.setup()
    connections.close_all()
    close_task_backends()
    # Connections read their settings from these very dicts: changed in place, they apply.
    settings.DATABASES["default"].update(database(dsn))
    setting_changed.send(sender=None, setting="TASKS", value=settings.TASKS, enter=True)


def close_task_backends() -> None:
    """Close the pgqueue connections of the backends built so far (this thread's)."""
    from pgqueue.contrib.django import _tasks
    from pgqueue.contrib.django.backend import PgQueueBackend

    for backend in _tasks.task_backends().all(initialized_only=True):
        if isinstance(backend, PgQueueBackend) and "app" in backend.__dict__:
            backend.app.close()
