"""Testing your tasks: a real worker until idle, an eager mode, and throwaway databases.

- ``run_until_idle(app)``: runs a real worker in-process until nothing is left to do, and
  returns what ran (``Runs``); ``run_until_idle_async`` for async tests.
- ``eager(app)``: enqueues run the handler at once, in the caller, with no database.
- ``bind(app, dsn)``: points an app (yours, declared at import time) at a test's database.
- ``TemplateDatabases``: a migrated database per test, cloned from a template.

The pytest plugin (``pgqueue.testing.plugin``, off unless enabled) gives the fixtures
``pgqueue_dsn`` and ``pgqueue_app`` on top of these; see docs/guides/testing.md. Nothing here
imports pytest.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from .databases import TemplateDatabases
from .drain import NotIdleError, PendingJob, run_until_idle, run_until_idle_async
from .eager import eager
from .runs import Run, Runs

if TYPE_CHECKING:
    from ..app import App


@contextlib.contextmanager
def bind(app: App, dsn: str) -> Iterator[App]:
    """Point ``app`` at ``dsn`` for the block, then close its connections and give it back its
    own DSN. For an app declared at import time, whose tasks enqueue through it: binding that
    object (not a new App) is what makes ``task.enqueue`` reach the test's database. An app's
    ``routes`` point at ``dsn`` too: in the block every queue is on the test's database."""
    app.close()
    previous = app._dsn  # None (resolved from the environment on first use) stays None
    previous_routes = app._routes
    app.dsn = dsn
    app._routes = dict.fromkeys(previous_routes, app.dsn)  # a route to its own DSN: no cluster
    try:
        yield app
    finally:
        app.close()
        app._dsn = previous
        app._routes = previous_routes


__all__ = [
    "NotIdleError",
    "PendingJob",
    "Run",
    "Runs",
    "TemplateDatabases",
    "bind",
    "eager",
    "run_until_idle",
    "run_until_idle_async",
]
