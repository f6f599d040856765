"""The real-PostgreSQL test harness.

``PGQUEUE_TEST_DSN`` when set; otherwise a throwaway cluster started for the session. Every test
gets its own database cloned from a migrated template, so tests are isolated and can run in
parallel (``pytest -n 2``: each xdist worker has its own template and databases).
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

import pgqueue
from pgqueue.errors import ConfigurationError
from pgqueue.testing.databases import TemplateDatabases
from tests.helpers import own_cluster
from tests.replication import Replicated
from tests.replication import replicated as start_replicated

#: The harness is pgqueue.testing's (the pytest plugin's too): one implementation.
Server = TemplateDatabases


@pytest.fixture(scope="session")
def pg_server(worker_id: str) -> Iterator[Server]:
    try:
        server = TemplateDatabases.start(label=worker_id)
    except ConfigurationError as exc:
        pytest.exit(str(exc), returncode=3)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def dsn(pg_server: Server) -> Iterator[str]:
    """A fresh, migrated database for this test alone."""
    with pg_server.database() as database:
        yield database


@pytest.fixture(scope="session")
def other_server() -> Iterator[Server]:
    """A second PostgreSQL cluster of the session's own (initdb + pg_ctl), whatever
    ``PGQUEUE_TEST_DSN`` says about the first: for queues routed to another cluster."""
    with own_cluster("other") as server:
        yield server


@pytest.fixture
def other_dsn(other_server: Server) -> Iterator[str]:
    """A fresh, migrated database on the second cluster, for this test alone."""
    with other_server.database() as database:
        yield database


@pytest.fixture
def empty_dsn(pg_server: Server) -> Iterator[str]:
    """A fresh database with no pgqueue schema at all (for migration tests)."""
    with pg_server.database(migrated=False) as database:
        yield database


@pytest.fixture
def app(dsn: str) -> Iterator[pgqueue.App]:
    application = pgqueue.App(dsn)
    try:
        yield application
    finally:
        application.close()


@pytest.fixture
def conn(dsn: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """An autocommit connection to the test's database, for assertions in SQL."""
    with psycopg.connect(dsn, autocommit=True) as connection:
        yield connection


@pytest.fixture
def prefetch_learned_over_a_second(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefetch target is what finished in the last PREFETCH_WINDOW (50 ms). On a loaded
    machine a window can end with one fast job finished or none; then, as designed, nothing is
    prefetched behind a slow job, and a test's blocker would have nothing waiting behind it.
    Over a second, the fast jobs before it always teach the worker to prefetch."""
    from pgqueue.worker import fetcher

    monkeypatch.setattr(fetcher, "PREFETCH_WINDOW", 1.0)


@pytest.fixture
def replicated() -> Iterator[Replicated]:
    """A primary and a hot standby streaming from it, clusters of this test's own (a few
    seconds to start): see tests/replication.py."""
    with start_replicated() as pair:
        yield pair
