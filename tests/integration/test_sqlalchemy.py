"""SQLAlchemy sessions and connections as ``connection=``: the job is written in their
transaction (psycopg driver only), sync and async."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import pgqueue
from pgqueue.contrib.sqlalchemy import psycopg_connection, psycopg_connection_async
from tests.helpers import sqlalchemy_url

Conn = psycopg.Connection[tuple[Any, ...]]


@pytest.fixture
def engine(dsn: str) -> Iterator[sqlalchemy.Engine]:
    engine = sqlalchemy.create_engine(sqlalchemy_url(dsn))
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture
async def async_engine(dsn: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(sqlalchemy_url(dsn))
    try:
        yield engine
    finally:
        await engine.dispose()


def jobs(conn: Conn) -> list[str]:
    return [str(r[0]) for r in conn.execute("SELECT task FROM pgqueue_jobs ORDER BY id")]


def test_a_job_enqueued_with_a_session_commits_and_rolls_back_with_it(
    app: pgqueue.App, engine: sqlalchemy.Engine, conn: Conn
) -> None:
    with Session(engine) as session, session.begin():
        app.enqueue("kept", {}, allow_unknown=True, connection=session)
        assert jobs(conn) == []  # not committed yet
    with pytest.raises(RuntimeError), Session(engine) as session, session.begin():
        app.enqueue("dropped", {}, allow_unknown=True, connection=session)
        raise RuntimeError("rolled back")
    assert jobs(conn) == ["kept"]


def test_the_job_shares_the_sessions_transaction_with_its_other_writes(
    app: pgqueue.App, engine: sqlalchemy.Engine, conn: Conn
) -> None:
    with Session(engine) as session, session.begin():
        session.execute(sqlalchemy.text("CREATE TABLE notes (body text)"))
        session.execute(sqlalchemy.text("INSERT INTO notes VALUES ('hello')"))
        assert psycopg_connection(session) is session.connection().connection.driver_connection
        app.enqueue_many([("many", {}), ("many", {})], allow_unknown=True, connection=session)
        session.rollback()
    assert jobs(conn) == []
    assert conn.execute("SELECT to_regclass('notes')").fetchone() == (None,)


def test_a_sqlalchemy_connection_is_accepted_too(
    app: pgqueue.App, engine: sqlalchemy.Engine, conn: Conn
) -> None:
    with engine.begin() as connection:
        app.enqueue("on_connection", {}, allow_unknown=True, connection=connection)
    assert jobs(conn) == ["on_connection"]


async def test_an_async_session_commits_and_rolls_back_with_its_job(
    app: pgqueue.App, async_engine: AsyncEngine, conn: Conn
) -> None:
    @app.task
    async def note(text: str) -> None: ...

    async with AsyncSession(async_engine) as session, session.begin():
        await note.configure(connection=session).enqueue_async(text="kept")
        await app.enqueue_many_async([("note", {"text": "many"})], connection=session)
    with pytest.raises(RuntimeError):
        async with AsyncSession(async_engine) as session, session.begin():
            await note.configure(connection=session).enqueue_async(text="dropped")
            raise RuntimeError("rolled back")
    assert jobs(conn) == ["note", "note"]


async def test_an_async_connection_is_accepted_and_unwrapped(
    app: pgqueue.App, async_engine: AsyncEngine, conn: Conn
) -> None:
    async with async_engine.begin() as connection:
        driver = await psycopg_connection_async(connection)
        assert isinstance(driver, psycopg.AsyncConnection)
        await app.enqueue_async("on_async_connection", {}, allow_unknown=True,
                                connection=connection)  # fmt: skip
    assert jobs(conn) == ["on_async_connection"]


async def test_sync_and_async_sessions_are_refused_by_the_other_method(
    app: pgqueue.App, engine: sqlalchemy.Engine, async_engine: AsyncEngine
) -> None:
    with Session(engine) as session, pytest.raises(pgqueue.InvalidJobError, match="needs enqueue,"):
        await app.enqueue_async("t", {}, allow_unknown=True, connection=session)  # type: ignore[arg-type]
    async with AsyncSession(async_engine) as asession:
        with pytest.raises(pgqueue.InvalidJobError, match="needs enqueue_async"):
            app.enqueue("t", {}, allow_unknown=True, connection=asession)  # type: ignore[arg-type]


def test_a_driver_other_than_psycopg_is_refused_with_the_url_to_use(app: pgqueue.App) -> None:
    engine = sqlalchemy.create_engine("sqlite://")
    try:
        with (
            Session(engine) as session,
            pytest.raises(
                pgqueue.InvalidJobError,
                match=r"postgresql\+psycopg://; this engine uses sqlite\+pysqlite",
            ),
        ):
            app.enqueue("t", {}, allow_unknown=True, connection=session)
    finally:
        engine.dispose()
