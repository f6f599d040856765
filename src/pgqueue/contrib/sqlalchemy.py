"""SQLAlchemy 2: the psycopg connection under a session's transaction.

pgqueue writes a transactional job on the same connection as your data, so the job commits or
rolls back with it. Passing a ``Session``/``AsyncSession`` (or a ``Connection``/
``AsyncConnection``) as ``connection=`` calls these for you; they are public for code that wants
the psycopg connection itself. Only the psycopg (3) driver, ``postgresql+psycopg://``, has one:
psycopg2 and asyncpg connections are refused with a clear error.
"""

from __future__ import annotations

from typing import Any

import psycopg
import sqlalchemy
import sqlalchemy.orm
from sqlalchemy.ext import asyncio as sa_asyncio

from ..errors import InvalidJobError


def _refuse(dialect: Any) -> InvalidJobError:
    return InvalidJobError(
        "pgqueue needs SQLAlchemy's psycopg (3) driver, a URL starting postgresql+psycopg://; "
        f"this engine uses {dialect.name}+{dialect.driver}"
    )


def psycopg_connection(
    session: sqlalchemy.orm.Session | sqlalchemy.Connection,
) -> psycopg.Connection[Any]:
    """The psycopg connection that carries ``session``'s transaction (beginning it, as any
    statement on the session would, if it has not begun)."""
    if isinstance(session, sqlalchemy.orm.Session):
        conn = session.connection()
    elif isinstance(session, sqlalchemy.Connection):
        conn = session
    elif isinstance(session, sa_asyncio.AsyncSession | sa_asyncio.AsyncConnection):
        raise InvalidJobError(f"an {type(session).__name__} needs enqueue_async, not enqueue")
    else:
        raise InvalidJobError(f"not a SQLAlchemy Session or Connection: {type(session).__name__}")
    driver = conn.connection.driver_connection
    if not isinstance(driver, psycopg.Connection):
        raise _refuse(conn.dialect)
    return driver


async def psycopg_connection_async(
    session: sa_asyncio.AsyncSession | sa_asyncio.AsyncConnection,
) -> psycopg.AsyncConnection[Any]:
    """The psycopg ``AsyncConnection`` that carries ``session``'s transaction."""
    if isinstance(session, sa_asyncio.AsyncSession):
        conn = await session.connection()
    elif isinstance(session, sa_asyncio.AsyncConnection):
        conn = session
    elif isinstance(session, sqlalchemy.orm.Session | sqlalchemy.Connection):
        raise InvalidJobError(f"a sync {type(session).__name__} needs enqueue, not enqueue_async")
    else:
        raise InvalidJobError(
            f"not a SQLAlchemy AsyncSession or AsyncConnection: {type(session).__name__}"
        )
    raw = await conn.get_raw_connection()
    driver = raw.driver_connection
    if not isinstance(driver, psycopg.AsyncConnection):
        raise _refuse(conn.dialect)
    return driver
