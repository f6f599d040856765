"""A project's own tests of its tasks, with pgqueue's pytest plugin (docs/guides/testing.md).

The project turns the plugin on and names its app in its pytest configuration:

    [tool.pytest.ini_options]
    pgqueue = true
    pgqueue_app = "examples.quickstart:app"
"""

from __future__ import annotations

import pgqueue
from examples.quickstart import greet
from pgqueue.testing import eager, run_until_idle


def test_greet_runs_in_a_real_worker(pgqueue_app: pgqueue.App) -> None:
    job = greet.enqueue(name="Ada")
    runs = run_until_idle(pgqueue_app)
    assert runs.last(job).result == "Hello, Ada!"


def test_greet_runs_eagerly_without_a_database() -> None:
    with eager(greet.app) as runs:
        greet.enqueue(name="Ada")
    assert runs.results == ["Hello, Ada!"]
