"""pgqueue's pytest fixtures; enabled by ``--pgqueue``, ``pgqueue = true`` in the ini file,
``-p pgqueue.testing.plugin`` or ``pytest_plugins = ["pgqueue.testing.plugin"]``.

- ``pgqueue_databases`` (session): the server and its migrated template (TemplateDatabases);
- ``pgqueue_dsn``: a fresh migrated database for the test, dropped after it;
- ``pgqueue_app_factory``: what ``pgqueue_app`` binds; override it to return your App;
- ``pgqueue_app``: that App bound to ``pgqueue_dsn`` for the test, closed after it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from ..app import App
from ..errors import ConfigurationError
from . import bind
from .databases import TemplateDatabases


@pytest.fixture(scope="session")
def pgqueue_databases() -> Iterator[TemplateDatabases]:
    """``$PGQUEUE_TEST_DSN`` (a server where this user may CREATE DATABASE), else a
    throwaway cluster for the session; one migrated template per test process."""
    try:
        databases = TemplateDatabases.start(label=os.environ.get("PYTEST_XDIST_WORKER", "main"))
    except ConfigurationError as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        yield databases
    finally:
        databases.close()


@pytest.fixture
def pgqueue_dsn(pgqueue_databases: TemplateDatabases) -> Iterator[str]:
    """A fresh database with pgqueue's tables (schema ``public``), for this test alone."""
    with pgqueue_databases.database() as dsn:
        yield dsn


@pytest.fixture
def pgqueue_app_factory(pytestconfig: pytest.Config) -> Callable[[], App]:
    """Returns the App that ``pgqueue_app`` binds: the ``pgqueue_app`` ini option's
    ``module:attribute`` if set, else a new App per test. Override this fixture to return your
    own (``return lambda: myproject.jobs.app``)."""
    try:
        spec = str(pytestconfig.getini("pgqueue_app") or "")
    except ValueError:  # the entry point (which declares the option) is disabled
        spec = ""
    if not spec:
        return App
    from ..cli import load_app

    def load() -> App:
        try:
            return load_app(spec)
        except ConfigurationError as exc:
            raise pytest.UsageError(f"pgqueue_app = {spec!r}: {exc}") from None

    return load


@pytest.fixture
def pgqueue_app(pgqueue_app_factory: Callable[[], App], pgqueue_dsn: str) -> Iterator[App]:
    """The App of ``pgqueue_app_factory``, bound to this test's database (``pgqueue_dsn``)
    and closed after the test. An app in another schema than ``public`` is migrated there
    first (a migration per test: slower than the template's clone)."""
    app = pgqueue_app_factory()
    with bind(app, pgqueue_dsn):
        if app.schema != "public":
            app.migrate()
        yield app
