"""pgqueue for Django: a backend for Django's tasks framework, and a Django app.

``TASKS = {"default": {"BACKEND": "pgqueue.contrib.django.PgQueueBackend"}}`` sends Django
tasks to pgqueue; ``"pgqueue.contrib.django"`` in ``INSTALLED_APPS`` makes ``manage.py migrate``
create pgqueue's tables and adds ``manage.py pgqueue_worker``. See docs/guides/django.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .backend import PgQueueBackend

__all__ = ["PgQueueBackend"]


def __getattr__(name: str) -> Any:
    # Imported on first use, not with the app: loading INSTALLED_APPS stays light.
    if name == "PgQueueBackend":
        from .backend import PgQueueBackend

        return PgQueueBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
