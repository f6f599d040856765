"""What ``connection=`` accepts: the caller's transaction, for a transactional enqueue.

A psycopg connection as it is, or a SQLAlchemy session or connection whose driver is psycopg
(``postgresql+psycopg://``), unwrapped to the psycopg connection under its transaction by
``pgqueue.contrib.sqlalchemy``. SQLAlchemy is only imported for its own objects, so
``import pgqueue`` never imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeAlias

import psycopg

from .errors import InvalidJobError

if TYPE_CHECKING:
    import sqlalchemy
    import sqlalchemy.ext.asyncio
    import sqlalchemy.orm

    SyncConnection: TypeAlias = (
        psycopg.Connection[Any] | sqlalchemy.orm.Session | sqlalchemy.Connection
    )
    AsyncConnection: TypeAlias = (
        psycopg.AsyncConnection[Any]
        | sqlalchemy.ext.asyncio.AsyncSession
        | sqlalchemy.ext.asyncio.AsyncConnection
    )
else:  # the names exist at run time too, for annotations that are evaluated
    SyncConnection = AsyncConnection = Any


def _from_sqlalchemy(conn: object) -> bool:
    return type(conn).__module__.split(".", 1)[0] == "sqlalchemy"


def sync_connection(conn: object) -> psycopg.Connection[Any]:
    """The psycopg connection to write on for ``enqueue(connection=conn)``."""
    if isinstance(conn, psycopg.Connection):
        return conn
    if _from_sqlalchemy(conn):
        from .contrib.sqlalchemy import psycopg_connection

        return psycopg_connection(conn)  # type: ignore[arg-type]
    if isinstance(conn, psycopg.AsyncConnection):
        raise InvalidJobError("a psycopg AsyncConnection needs enqueue_async, not enqueue")
    raise InvalidJobError(
        "connection must be a psycopg Connection, or a SQLAlchemy Session or Connection on the "
        f"psycopg driver; got {type(conn).__name__}"
    )


async def async_connection(conn: object) -> psycopg.AsyncConnection[Any]:
    """The psycopg connection to write on for ``enqueue_async(connection=conn)``."""
    if isinstance(conn, psycopg.AsyncConnection):
        return conn
    if _from_sqlalchemy(conn):
        from .contrib.sqlalchemy import psycopg_connection_async

        return await psycopg_connection_async(conn)  # type: ignore[arg-type]
    if isinstance(conn, psycopg.Connection):
        raise InvalidJobError("a sync psycopg Connection needs enqueue, not enqueue_async")
    raise InvalidJobError(
        "connection must be a psycopg AsyncConnection, or a SQLAlchemy AsyncSession or "
        f"AsyncConnection on the psycopg driver; got {type(conn).__name__}"
    )
