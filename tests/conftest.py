"""The real-PostgreSQL test harness.

``PGQUEUE_TEST_DSN`` when set; otherwise a throwaway cluster started for the session. Every test
gets its own database cloned from a migrated template, so tests are isolated and can run in
parallel (``pytest -n 2``: each xdist worker has its own template and databases).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
import pytest
from psycopg import conninfo, sql

import pgqueue
from pgqueue.embedded import EmbeddedPostgres
from pgqueue.errors import ConfigurationError
from pgqueue.migrate import migrate


@dataclass
class Server:
    admin_dsn: str
    cluster: EmbeddedPostgres | None
    template: str

    def dsn_for(self, dbname: str) -> str:
        return conninfo.make_conninfo(self.admin_dsn, dbname=dbname)


def _admin(dsn: str) -> psycopg.Connection[tuple[object, ...]]:
    return psycopg.connect(dsn, autocommit=True)


@pytest.fixture(scope="session")
def pg_server(worker_id: str) -> Iterator[Server]:
    cluster: EmbeddedPostgres | None = None
    dsn = os.environ.get("PGQUEUE_TEST_DSN")
    if not dsn:
        try:
            cluster = EmbeddedPostgres().start()
        except (ConfigurationError, RuntimeError) as exc:
            pytest.exit(
                f"No PostgreSQL for the tests: {exc}. Set PGQUEUE_TEST_DSN to a server where "
                "this user may CREATE DATABASE, or install the PostgreSQL server binaries.",
                returncode=3,
            )
        dsn = cluster.dsn
    template = f"pgqueue_tpl_{worker_id}_{os.getpid()}"
    with _admin(dsn) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(template)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(template)))
    server = Server(dsn, cluster, template)
    with psycopg.connect(server.dsn_for(template), autocommit=True) as conn:
        migrate(conn, "public")
    try:
        yield server
    finally:
        if cluster is not None:
            cluster.stop()
        else:
            with _admin(dsn) as conn:
                conn.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                        sql.Identifier(template)
                    )
                )


@pytest.fixture
def dsn(pg_server: Server) -> Iterator[str]:
    """A fresh, migrated database for this test alone."""
    name = f"pgqueue_t_{uuid.uuid4().hex[:12]}"
    with _admin(pg_server.admin_dsn) as conn:
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(pg_server.template)
            )
        )
    try:
        yield pg_server.dsn_for(name)
    finally:
        with _admin(pg_server.admin_dsn) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@pytest.fixture
def empty_dsn(pg_server: Server) -> Iterator[str]:
    """A fresh database with no pgqueue schema at all (for migration tests)."""
    name = f"pgqueue_e_{uuid.uuid4().hex[:12]}"
    with _admin(pg_server.admin_dsn) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield pg_server.dsn_for(name)
    finally:
        with _admin(pg_server.admin_dsn) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


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
