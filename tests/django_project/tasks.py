"""Django tasks (Django's ``@task``) that the tests enqueue and pgqueue workers run."""

from __future__ import annotations

import asyncio
from typing import Any

from django.db import connection

from pgqueue.contrib.django._tasks import task  # django.tasks.task, or the backport's


class Refused(Exception):
    """An error of the project's own: its full path is in a failed task's errors."""


@task
def add(a: int, b: int) -> int:
    return a + b


@task(queue_name="emails", priority=10)
def send_welcome(user: str) -> dict[str, Any]:
    return {"sent_to": user}


@task
def explode(message: str) -> None:
    raise ValueError(message)


@task(takes_context=True)
def which_attempt(context: Any) -> int:
    return int(context.attempt)


@task
async def add_async(a: int, b: int) -> int:
    await asyncio.sleep(0)
    return a + b


@task
def record(note: str) -> int:
    """Writes through Django's connection in the worker (its own, per thread)."""
    with connection.cursor() as cursor:
        cursor.execute("INSERT INTO notes (body) VALUES (%s)", [note])
        cursor.execute("SELECT count(*) FROM notes")
        return int(cursor.fetchone()[0])
