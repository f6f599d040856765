"""The Django app: ``manage.py migrate`` also brings pgqueue's tables up to date."""

from __future__ import annotations

import sys
from typing import Any

from django.apps import AppConfig
from django.db.models.signals import post_migrate


class PgQueueConfig(AppConfig):  # type: ignore[misc]
    name = "pgqueue.contrib.django"
    label = "pgqueue"
    verbose_name = "pgqueue"

    def ready(self) -> None:
        post_migrate.connect(migrate_pgqueue, sender=self)


def migrate_pgqueue(using: str, verbosity: int = 1, **kwargs: Any) -> None:
    """After Django's migrations on database ``using``, pgqueue's own, for every pgqueue task
    backend on that database. pgqueue's migrations are versioned SQL applied under an advisory
    lock (pgqueue.migrate), not Django migrations: the same schema serves ``pgqueue migrate``
    and apps outside Django, and a run with nothing pending changes nothing."""
    from . import _tasks
    from .backend import PgQueueBackend

    done: set[tuple[str, str]] = set()
    for backend in _tasks.task_backends().all():
        if not isinstance(backend, PgQueueBackend) or backend.database != using:
            continue
        key = (backend.dsn(), backend.app.schema)
        if key in done:
            continue
        done.add(key)
        applied = backend.migrate()
        if verbosity >= 1 and applied:
            out = kwargs.get("stdout") or sys.stdout  # migrate's own output, when it passes it
            out.write(f"  Applied pgqueue migrations {applied} (schema {backend.app.schema!r})\n")
