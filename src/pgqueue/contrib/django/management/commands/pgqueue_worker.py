"""``manage.py pgqueue_worker``: a pgqueue worker for the Django tasks of a TASKS backend."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError

from pgqueue.errors import ConfigurationError, PgQueueError

from ... import _tasks
from ...backend import PgQueueBackend


class Command(BaseCommand):  # type: ignore[misc]
    help = (
        "Run a pgqueue worker for the tasks of a TASKS backend until SIGTERM/SIGINT (a second "
        "signal exits at once). Django is set up first, so tasks can use the ORM."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--backend", default="default", help="The TASKS alias to serve (default: default)."
        )
        parser.add_argument(
            "--queue", action="append", dest="queues", metavar="NAME",
            help="Serve this queue; repeat for more (default: every queue).",
        )  # fmt: skip
        parser.add_argument("--concurrency", type=int, default=10, help="Tasks run at once.")
        parser.add_argument("--lease", type=float, default=30.0, help="Lease seconds.")
        parser.add_argument(
            "--grace-period", type=float, default=30.0,
            help="Seconds running tasks get to finish on SIGTERM.",
        )  # fmt: skip
        parser.add_argument(
            "--poll-interval", type=float, default=1.0,
            help="Seconds between claims when no NOTIFY arrives.",
        )  # fmt: skip

    def handle(self, *args: Any, **options: Any) -> None:
        alias = options["backend"]
        backend = _tasks.task_backends()[alias]
        if not isinstance(backend, PgQueueBackend):
            raise CommandError(f"TASKS[{alias!r}] is {type(backend).__name__}, not PgQueueBackend")
        try:
            worker = backend.app.worker(
                queues=options["queues"],
                concurrency=options["concurrency"],
                lease=options["lease"],
                grace_period=options["grace_period"],
                poll_interval=options["poll_interval"],
            )
        except ConfigurationError as exc:
            raise CommandError(str(exc)) from None
        try:
            worker.run_sync()
        except PgQueueError as exc:  # a service of the worker failed: exit non-zero
            raise CommandError(str(exc)) from None
