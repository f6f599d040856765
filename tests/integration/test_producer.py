from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pgqueue
from pgqueue import InvalidJobError, Status, UnknownTaskError, producer
from pgqueue.jobs import EARLIEST_RUN_AT, LATEST_RUN_AT, MAX_DELAY_SECONDS
from tests.helpers import listening, notifications

Conn = psycopg.Connection[tuple[Any, ...]]


def _count(conn: Conn) -> int:
    row = conn.execute("SELECT count(*) FROM pgqueue_jobs").fetchone()
    assert row is not None
    return int(row[0])


def _row(conn: Conn, job_id: int) -> tuple[Any, ...]:
    row = conn.execute(
        "SELECT task, queue, priority, max_attempts, args, status::text, attempts,"
        " extract(epoch FROM run_at - created_at)::float8, run_at"
        " FROM pgqueue_jobs WHERE id = %s",
        (job_id,),
    ).fetchone()
    assert row is not None
    return row


@pytest.fixture
def send(app: pgqueue.App) -> pgqueue.Task[..., None]:
    @app.task(queue="emails", priority=3, max_attempts=7)
    def send_email(to: str, subject: str = "") -> None: ...

    return send_email


def test_enqueue_inserts_a_row_with_the_task_defaults(
    send: pgqueue.Task[..., None], conn: Conn
) -> None:
    job_id = send.enqueue(to="a@example.com", subject="hi")
    task, queue, priority, max_attempts, args, status, attempts, wait, _ = _row(conn, job_id)
    assert (task, queue, priority, max_attempts) == ("send_email", "emails", 3, 7)
    assert args == {"to": "a@example.com", "subject": "hi"}
    assert (status, attempts) == ("queued", 0)
    assert abs(wait) < 0.01


def test_app_defaults_apply_to_a_plain_task(app: pgqueue.App, conn: Conn) -> None:
    @app.task
    def plain() -> None: ...

    _, queue, priority, max_attempts, args, *_ = _row(conn, plain.enqueue())
    assert (queue, priority, max_attempts, args) == ("default", 0, 5, {})


def test_configure_overrides_queue_priority_attempts_and_delay(
    send: pgqueue.Task[..., None], conn: Conn
) -> None:
    job_id = send.configure(queue="bulk", priority=-5, max_attempts=1, delay=30).enqueue(to="b")
    _, queue, priority, max_attempts, _, _, _, wait, _ = _row(conn, job_id)
    assert (queue, priority, max_attempts) == ("bulk", -5, 1)
    assert wait == pytest.approx(30, abs=0.01)  # from the database clock: run_at - created_at


def test_delay_as_timedelta_and_run_at_absolute(app: pgqueue.App, conn: Conn) -> None:
    job_id = app.enqueue("t", {}, delay=timedelta(minutes=2), allow_unknown=True)
    assert _row(conn, job_id)[7] == pytest.approx(120, abs=0.01)
    when = datetime(2031, 5, 6, 7, 8, 9, tzinfo=UTC)
    job_id = app.enqueue("t", {}, run_at=when, allow_unknown=True)
    assert _row(conn, job_id)[8] == when


def test_enqueue_async_inserts_the_same_row(
    send: pgqueue.Task[..., None], app: pgqueue.App, conn: Conn
) -> None:
    async def produce() -> tuple[int, int, int]:
        try:
            return (
                await send.enqueue_async(to="x"),
                await send.configure(priority=9, delay=5).enqueue_async(to="y"),
                await app.enqueue_async("send_email", {"to": "z"}, queue="other"),
            )
        finally:
            await app.aclose()

    job_id, configured, direct = asyncio.run(produce())
    assert _row(conn, job_id)[:5] == ("send_email", "emails", 3, 7, {"to": "x"})
    assert _row(conn, configured)[2] == 9
    assert _row(conn, configured)[7] == pytest.approx(5, abs=0.01)
    assert _row(conn, direct)[1] == "other"


@pytest.mark.parametrize("commit", [True, False], ids=["commit", "rollback"])
def test_transactional_enqueue_with_a_sync_connection(
    send: pgqueue.Task[..., None], app: pgqueue.App, dsn: str, conn: Conn, commit: bool
) -> None:
    with psycopg.connect(dsn) as own:  # not autocommit: the caller owns the transaction
        own.execute("CREATE TABLE orders (id int)")
        own.execute("INSERT INTO orders VALUES (1)")
        via_configure = send.configure(connection=own).enqueue(to="a")
        via_app = app.enqueue("send_email", {"to": "b"}, connection=own)
        via_many = app.enqueue_many([("send_email", {"to": "c"})] * 3, connection=own)
        assert via_many == 3
        assert _count(conn) == 0  # invisible until the caller commits
        if commit:
            own.commit()
        else:
            own.rollback()
    if commit:
        assert _count(conn) == 5
        assert app.get_job(via_configure) is not None and app.get_job(via_app) is not None
    else:
        assert _count(conn) == 0
        assert app.get_job(via_configure) is None


@pytest.mark.parametrize("commit", [True, False], ids=["commit", "rollback"])
def test_transactional_enqueue_with_an_async_connection(
    send: pgqueue.Task[..., None], app: pgqueue.App, dsn: str, conn: Conn, commit: bool
) -> None:
    async def produce() -> int:
        async with await psycopg.AsyncConnection.connect(dsn) as own:
            job_id = await send.configure(connection=own).enqueue_async(to="a")
            await app.enqueue_async("send_email", {"to": "b"}, connection=own)
            assert await app.enqueue_many_async([("send_email", {"to": "c"})], connection=own) == 1
            assert _count(conn) == 0
            if commit:
                await own.commit()
            else:
                await own.rollback()
        return job_id

    job_id = asyncio.run(produce())
    assert _count(conn) == (3 if commit else 0)
    assert (app.get_job(job_id) is not None) is commit


def test_enqueue_many_copies_rows_with_per_row_options(app: pgqueue.App, conn: Conn) -> None:
    when = datetime(2030, 1, 1, tzinfo=UTC)
    jobs: list[Any] = [
        ("t", {"i": 0}),
        {"task": "t", "args": {"i": 1}, "queue": "q1", "priority": 4, "max_attempts": 2},
        {"task": "t", "args": {"i": 2}, "delay": 10},
        {"task": "t", "args": {"i": 3, "text": "é\u2028💥"}, "run_at": when},
    ]
    assert app.enqueue_many(jobs, allow_unknown=True) == 4
    rows = conn.execute(
        "SELECT args, queue, priority, max_attempts, run_at,"
        " extract(epoch FROM run_at - created_at)::float8"
        " FROM pgqueue_jobs ORDER BY (args->>'i')::int"
    ).fetchall()
    assert [r[0] for r in rows] == [j[1] if isinstance(j, tuple) else j["args"] for j in jobs]
    assert rows[0][1:4] == ("default", 0, 5)
    assert rows[1][1:4] == ("q1", 4, 2)
    assert rows[2][5] == pytest.approx(10, abs=0.05)
    assert rows[3][4] == when


@pytest.mark.parametrize(
    "position", [100, 3 * producer.COPY_CHUNK + 7], ids=["first-chunk", "mid-copy"]
)
def test_enqueue_many_with_one_bad_row_writes_nothing(
    app: pgqueue.App, conn: Conn, position: int
) -> None:
    """Jobs after the first chunk are checked while the COPY already runs: a bad one there
    must abort the COPY and roll back everything before it."""
    good = [("t", {"i": i}) for i in range(position)]
    with pytest.raises(InvalidJobError, match=f"job #{position}"):
        app.enqueue_many([*good, ("t", {"x": float("nan")}), *good], allow_unknown=True)
    assert _count(conn) == 0
    assert app.enqueue_many([], allow_unknown=True) == 0
    assert app.enqueue_many(good, allow_unknown=True) == position  # the pool is still usable


def test_bad_row_mid_copy_keeps_the_callers_transaction(
    app: pgqueue.App, dsn: str, conn: Conn
) -> None:
    """In the caller's transaction the refused batch rolls back to a savepoint: the caller's
    own statements, and jobs enqueued before, still commit."""
    bad_batch = [("t", {"i": i}) for i in range(2 * producer.COPY_CHUNK)] + [("t", {"x": {1}})]
    with psycopg.connect(dsn) as own:  # not autocommit: the caller owns the transaction
        own.execute("CREATE TABLE ledger (id int)")
        own.execute("INSERT INTO ledger VALUES (1)")
        before = app.enqueue("t", {"i": -1}, connection=own, allow_unknown=True)
        with pytest.raises(InvalidJobError, match=f"job #{2 * producer.COPY_CHUNK}"):
            app.enqueue_many(bad_batch, connection=own, allow_unknown=True)
        assert app.enqueue_many([("t", {"i": -2})], connection=own, allow_unknown=True) == 1
        own.commit()
    assert conn.execute("SELECT count(*) FROM ledger").fetchone() == (1,)
    assert app.get_job(before) is not None
    assert _count(conn) == 2


def test_bad_row_mid_copy_async_writes_nothing(app: pgqueue.App, dsn: str, conn: Conn) -> None:
    jobs = [("t", {"i": i}) for i in range(2 * producer.COPY_CHUNK)] + [("nope", {})]

    async def produce() -> None:
        try:
            with pytest.raises(UnknownTaskError, match=f"job #{2 * producer.COPY_CHUNK}"):
                await app.enqueue_many_async(jobs)
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as own:
                with pytest.raises(UnknownTaskError):
                    await app.enqueue_many_async(jobs, connection=own)
        finally:
            await app.aclose()

    @app.task
    def t(i: int) -> None: ...

    asyncio.run(produce())
    assert _count(conn) == 0


def test_enqueue_many_async(app: pgqueue.App, conn: Conn) -> None:
    async def produce() -> int:
        try:
            return await app.enqueue_many_async(
                [{"task": "t", "args": {"i": i}, "queue": "aq"} for i in range(50)],
                allow_unknown=True,
            )
        finally:
            await app.aclose()

    n = asyncio.run(produce())
    assert n == 50
    assert conn.execute("SELECT count(*) FROM pgqueue_jobs WHERE queue = 'aq'").fetchone() == (50,)


def test_refused_jobs_write_nothing(
    send: pgqueue.Task[..., None], app: pgqueue.App, conn: Conn
) -> None:
    before = _count(conn)
    attempts: list[Any] = [
        lambda: send.enqueue(to={1, 2}),
        lambda: send.enqueue(to="\x00"),
        lambda: send.enqueue(to="x" * (1024 * 1024)),
        lambda: send.configure(queue="").enqueue(to="a"),
        lambda: send.configure(delay=-1).enqueue(to="a"),
        lambda: send.enqueue(nope=1),
        lambda: app.enqueue("unknown", {}),
        lambda: app.enqueue_many([("send_email", {"to": "a"}), ("unknown", {})]),
    ]
    for attempt in attempts:
        with pytest.raises((InvalidJobError, UnknownTaskError)):
            attempt()
    assert _count(conn) == before == 0


def test_get_job_returns_the_record_or_none(app: pgqueue.App) -> None:
    job_id = app.enqueue("t", {"a": [1, 2]}, queue="q", allow_unknown=True)
    job = app.get_job(job_id)
    assert job is not None
    assert (job.id, job.task, job.queue, job.args, job.status) == (
        job_id,
        "t",
        "q",
        {"a": [1, 2]},
        Status.QUEUED,
    )
    assert job.lease_token is None and job.finished_at is None
    assert app.get_job(job_id + 1000) is None


def _set_status(conn: Conn, job_id: int, status: str, attempts: int = 3) -> None:
    conn.execute(
        "UPDATE pgqueue_jobs SET status = %s::pgqueue_status, attempts = %s,"
        " finished_at = now(), run_at = now() - interval '1 hour' WHERE id = %s",
        (status, attempts, job_id),
    )


@pytest.mark.parametrize("status", ["dead", "cancelled"])
def test_requeue_resets_a_dead_or_cancelled_job_and_wakes_listeners(
    app: pgqueue.App, conn: Conn, dsn: str, status: str
) -> None:
    job_id = app.enqueue("t", {}, queue="rq", allow_unknown=True)
    _set_status(conn, job_id, status)
    with listening(dsn) as listener:  # a requeue notifies whether or not a worker waits
        assert app.requeue(job_id) is True
        notes = notifications(listener, expected=1)
    assert notes == [("pgqueue", "rq")]
    job = app.get_job(job_id)
    assert job is not None
    assert (job.status, job.attempts, job.finished_at) == (Status.QUEUED, 0, None)
    assert job.run_at > job.created_at


@pytest.mark.parametrize("status", ["queued", "running", "retrying", "succeeded"])
def test_requeue_refuses_jobs_that_are_not_dead_or_cancelled(
    app: pgqueue.App, conn: Conn, status: str
) -> None:
    job_id = app.enqueue("t", {}, allow_unknown=True)
    _set_status(conn, job_id, status)
    assert app.requeue(job_id) is False
    job = app.get_job(job_id)
    assert job is not None and job.status == status and job.attempts == 3
    assert app.requeue(job_id + 1000) is False


@pytest.mark.parametrize("status", ["queued", "retrying"])
def test_cancel_stops_a_job_not_yet_running(app: pgqueue.App, conn: Conn, status: str) -> None:
    job_id = app.enqueue("t", {}, allow_unknown=True)
    _set_status(conn, job_id, status)
    assert app.cancel(job_id) == "cancelled"
    job = app.get_job(job_id)
    assert job is not None and job.status == Status.CANCELLED and job.finished_at is not None


@pytest.mark.parametrize("status", ["succeeded", "dead", "cancelled"])
def test_cancel_leaves_finished_jobs_alone(app: pgqueue.App, conn: Conn, status: str) -> None:
    job_id = app.enqueue("t", {}, allow_unknown=True)
    _set_status(conn, job_id, status)
    result = app.cancel(job_id)
    assert result == "already finished" and not result
    job = app.get_job(job_id)
    assert job is not None and job.status == status
    with pytest.raises(pgqueue.JobNotFoundError):
        app.cancel(job_id + 1000)


def test_cancel_asks_for_a_running_job_to_be_stopped(app: pgqueue.App, conn: Conn) -> None:
    job_id = app.enqueue("t", {}, allow_unknown=True)
    _set_status(conn, job_id, "running")
    result = app.cancel(job_id)
    assert result == "cancel requested" and result
    job = app.get_job(job_id)
    assert job is not None and job.status == "running"  # its worker ends it


def test_status_counts_per_queue_and_status(app: pgqueue.App, conn: Conn) -> None:
    assert app.status_counts() == []
    app.enqueue_many([("t", {})] * 3, allow_unknown=True)
    app.enqueue_many([{"task": "t", "queue": "b"}] * 2, allow_unknown=True)
    dead = app.enqueue("t", {}, queue="b", allow_unknown=True)
    _set_status(conn, dead, "dead")
    assert app.status_counts() == [("b", "dead", 1), ("b", "queued", 2), ("default", "queued", 3)]


def test_unreachable_database_is_a_clear_error() -> None:
    app = pgqueue.App("postgresql://postgres@127.0.0.1:1/x", reconnect_timeout=0)
    with pytest.raises(pgqueue.DatabaseUnavailableError, match=r"cannot connect .*127.0.0.1:1/x"):
        app.enqueue("t", {}, allow_unknown=True)
    with pytest.raises(pgqueue.DatabaseUnavailableError):
        asyncio.run(app.enqueue_async("t", {}, allow_unknown=True))


_text = st.text(st.characters(exclude_characters="\x00", exclude_categories=["Cs"]), max_size=20)
_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**53), max_value=2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | _text,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(_text, children, max_size=4),
    max_leaves=15,
)
_args = st.dictionaries(st.from_regex(r"\A[a-z_][a-z0-9_]{0,10}\Z"), _json, max_size=4)


def test_arguments_round_trip_through_insert_and_copy(app: pgqueue.App) -> None:
    """What a handler receives is what the producer passed, via both write paths."""

    @settings(max_examples=60, deadline=None, database=None)
    @given(_args)
    def round_trip(args: dict[str, Any]) -> None:
        job_id = app.enqueue("t", args, allow_unknown=True)
        job = app.get_job(job_id)
        assert job is not None and job.args == args
        app.enqueue_many([{"task": "t", "args": args, "queue": "copy"}], allow_unknown=True)
        with app.connection() as c:
            row = c.execute(
                "SELECT args FROM pgqueue_jobs WHERE queue = 'copy' ORDER BY id DESC LIMIT 1"
            ).fetchone()
        assert row is not None and row[0] == args

    round_trip()


def test_enqueue_many_escapes_names_and_arguments_for_copy(app: pgqueue.App, conn: Conn) -> None:
    """COPY text treats tabs, newlines and backslashes specially; none may leak into rows."""
    awkward = "tab\there\\back\nline\rret\\N"
    args = {"path": "C:\\temp\\new", "quote": '"\\"', "nl": "a\nb\tc"}
    assert app.enqueue_many(
        [{"task": awkward, "queue": awkward, "args": args}, (awkward, {"x": "\\."})],
        allow_unknown=True,
    ) == 2  # fmt: skip
    rows = conn.execute("SELECT queue, task, args FROM pgqueue_jobs ORDER BY id").fetchall()
    assert rows == [(awkward, awkward, args), ("default", awkward, {"x": "\\."})]


@pytest.mark.parametrize("timezone", ["Etc/GMT+12", "Etc/GMT-14"])  # UTC-12, UTC+14
def test_jobs_at_the_run_at_bounds_read_back_in_any_session_time_zone(
    dsn: str, conn: Conn, timezone: str
) -> None:
    """Whatever enqueue accepts, get_job and the CLI can read back as a Python datetime."""
    conn.execute(
        psycopg.sql.SQL("ALTER DATABASE {} SET TimeZone = {}").format(
            psycopg.sql.Identifier(conn.info.dbname), timezone
        )
    )
    app = pgqueue.App(dsn)
    latest = {"delay": None, "run_at": LATEST_RUN_AT}
    earliest = {"delay": None, "run_at": EARLIEST_RUN_AT}
    longest: dict[str, Any] = {"delay": MAX_DELAY_SECONDS, "run_at": None}

    async def enqueue_async() -> None:
        try:
            for options in (latest, longest):
                await app.enqueue_async("t", {}, allow_unknown=True, **options)
            await app.enqueue_many_async(
                [{"task": "t", **o} for o in (earliest, longest)], allow_unknown=True
            )
        finally:
            await app.aclose()

    try:
        for options in (latest, earliest, longest):
            app.enqueue("t", {}, allow_unknown=True, **options)
        app.enqueue_many(
            [{"task": "t", **o} for o in (latest, earliest, longest)], allow_unknown=True
        )
        asyncio.run(enqueue_async())
        stored = conn.execute("SELECT id FROM pgqueue_jobs ORDER BY id").fetchall()
        assert len(stored) == 10
        for (job_id,) in stored:
            job = app.get_job(job_id)
            assert job is not None and EARLIEST_RUN_AT <= job.run_at <= LATEST_RUN_AT
    finally:
        app.close()
