"""A migrated, throwaway database per test: one template per session, cloned per test.

Cloning a template (``CREATE DATABASE ... TEMPLATE``) is a file copy inside PostgreSQL: tens of
milliseconds, against a second or more to migrate each new database, and every test starts from
the same schema, isolated from the others (and from parallel test processes, each with its own
template). pgqueue's own test suite and the pytest plugin both use this class.
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from collections.abc import Iterator

import psycopg
from psycopg import conninfo, sql

from ..embedded import EmbeddedPostgres
from ..errors import ConfigurationError
from ..migrate import migrate

#: The variable naming a server where the tests may CREATE DATABASE.
DSN_VARIABLE = "PGQUEUE_TEST_DSN"


def _admin(dsn: str) -> psycopg.Connection[tuple[object, ...]]:
    return psycopg.connect(dsn, autocommit=True)


class TemplateDatabases:
    """A PostgreSQL server and a migrated template database on it (``start``), from which
    ``database()`` clones one database per test; ``close`` drops the template (and stops the
    throwaway cluster, if one was started)."""

    def __init__(self, admin_dsn: str, cluster: EmbeddedPostgres | None, template: str) -> None:
        #: A connection string for a role that may CREATE DATABASE.
        self.admin_dsn = admin_dsn
        #: The throwaway cluster started for the session, if no DSN was given.
        self.cluster = cluster
        self.template = template

    @classmethod
    def start(cls, dsn: str | None = None, *, label: str = "main") -> TemplateDatabases:
        """On ``dsn``, else ``$PGQUEUE_TEST_DSN``, else a throwaway cluster (the PostgreSQL
        server binaries must be installed; ConfigurationError says so if they are not).
        ``label`` tells the templates of parallel test processes apart (an xdist worker id)."""
        dsn = dsn or os.environ.get("PGQUEUE_TEST_DSN")
        cluster: EmbeddedPostgres | None = None
        if not dsn:
            try:
                cluster = EmbeddedPostgres().start()
            except (ConfigurationError, RuntimeError) as exc:
                raise ConfigurationError(
                    f"no PostgreSQL for the tests: {exc}. Set {DSN_VARIABLE} to a server where "
                    "this user may CREATE DATABASE, or install the PostgreSQL server binaries."
                ) from None
            dsn = cluster.dsn
        safe_label = re.sub(r"\W", "_", label)[:20]
        template = f"pgqueue_tpl_{safe_label}_{os.getpid()}"
        try:
            with _admin(dsn) as conn:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(template)))
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(template)))
            databases = cls(dsn, cluster, template)
            with _admin(databases.dsn_for(template)) as conn:
                migrate(conn, "public")
        except BaseException:
            if cluster is not None:
                cluster.stop()
            raise
        return databases

    def dsn_for(self, dbname: str) -> str:
        return conninfo.make_conninfo(self.admin_dsn, dbname=dbname)

    def create(self, *, migrated: bool = True) -> str:
        """A new database's DSN: a clone of the template (pgqueue's tables in ``public``), or
        with ``migrated=False`` an empty one. ``drop`` it when done."""
        name = (
            f"pgqueue_t_{uuid.uuid4().hex[:12]}"
            if migrated
            else f"pgqueue_e_{uuid.uuid4().hex[:12]}"
        )
        statement = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if migrated:
            statement += sql.SQL(" TEMPLATE {}").format(sql.Identifier(self.template))
        with _admin(self.admin_dsn) as conn:
            conn.execute(statement)
        return self.dsn_for(name)

    def drop(self, dsn: str) -> None:
        """Drop a database ``create`` made, disconnecting whatever is still connected to it."""
        name = conninfo.conninfo_to_dict(dsn)["dbname"]
        with _admin(self.admin_dsn) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(str(name)))
            )

    @contextlib.contextmanager
    def database(self, *, migrated: bool = True) -> Iterator[str]:
        """``create`` for the block, dropped after it."""
        dsn = self.create(migrated=migrated)
        try:
            yield dsn
        finally:
            self.drop(dsn)

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()  # the template goes with the cluster
            return
        with _admin(self.admin_dsn) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                    sql.Identifier(self.template)
                )
            )
