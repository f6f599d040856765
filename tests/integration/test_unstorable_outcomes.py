"""Whatever a handler returns or raises, its attempt is recorded and its batch goes through.

An outcome the batched ack could not store (a NUL or a lone surrogate in an error or a result,
an infinite Retry-After) used to fail the whole ack statement: the worker retried the same batch
forever while the heartbeat kept every lease in it alive. These tests run real workers against a
real database; the property test feeds the executor every kind of value a handler can produce
and writes each outcome with the completer's own statement.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pgqueue
from pgqueue.worker.executor import Executor, ack_params
from pgqueue.worker.state import ClaimedJob
from pgqueue.worker.transactions import Transactions
from tests.helpers import register_worker, running_worker, wait_until_async

Conn = psycopg.Connection[tuple[Any, ...]]
FAST = {"lease": 2.0, "heartbeat_interval": 0.5, "poll_interval": 0.2, "reaper_interval": 0.3}


def statuses(conn: Conn, ids: Sequence[int]) -> dict[int, tuple[str, int, str | None]]:
    rows = conn.execute(
        "SELECT id, status::text, attempts, last_error FROM pgqueue_jobs WHERE id = ANY(%s)",
        (ids,),
    ).fetchall()
    return {int(r[0]): (str(r[1]), int(r[2]), r[3]) for r in rows}


def none_running(conn: Conn, ids: Sequence[int]) -> bool:
    """Every attempt of these jobs recorded: none waits or runs."""
    return all(status not in ("queued", "running") for status, _, _ in statuses(conn, ids).values())


def infinite_retry() -> pgqueue.Retry:
    """A Retry-After the constructor would refuse, as an older pgqueue (or a subclass) made."""
    retry = pgqueue.Retry(after=1)
    retry.after = float("inf")
    return retry


BAD_ERRORS: dict[str, BaseException] = {
    "nul_message": RuntimeError("bad\x00byte"),
    "surrogate_message": RuntimeError("half a pair: \udc80"),
    "infinite_retry": infinite_retry(),
    "nul_fail": pgqueue.Fail("reason\x00with NUL"),
}
BAD_RESULTS: dict[str, Any] = {
    "nul_result": {"text": "a\x00b"},
    "surrogate_result": ["\ud800"],
    "nan_result": float("nan"),
    "unserialisable_result": {1, 2, 3},
}


async def test_an_unstorable_outcome_fails_its_attempt_and_never_blocks_the_batch(
    app: pgqueue.App, conn: Conn
) -> None:
    @app.task(max_attempts=1)
    async def poisoned(kind: str) -> Any:
        if kind in BAD_ERRORS:
            raise BAD_ERRORS[kind]
        return BAD_RESULTS[kind]

    @app.task
    async def innocent(n: int) -> int:
        return n

    bad = {kind: poisoned.enqueue(kind=kind) for kind in [*BAD_ERRORS, *BAD_RESULTS]}
    good = [innocent.enqueue(n=n) for n in range(40)]
    async with running_worker(app, concurrency=20, **FAST):
        await wait_until_async(lambda: none_running(conn, [*bad.values(), *good]), timeout=30)
        # The worker is not wedged: a job enqueued afterwards runs too.
        later = innocent.enqueue(n=99)
        await wait_until_async(lambda: statuses(conn, [later])[later][0] == "succeeded")

    found = statuses(conn, [*bad.values(), *good])
    assert {found[j][:2] for j in good} == {("succeeded", 1)}
    for kind, job_id in bad.items():
        status, attempts, error = found[job_id]
        assert (status, attempts) == ("dead", 1), kind
        assert error is not None and "\x00" not in error, kind
    assert "bad\\x00byte" in str(found[bad["nul_message"]][2])
    assert "\\udc80" in str(found[bad["surrogate_message"]][2])
    for kind in BAD_RESULTS:
        assert str(found[bad[kind]][2]).startswith("ResultNotStorableError: "), kind


async def test_infinite_retry_after_waits_the_longest_allowed_delay(
    app: pgqueue.App, conn: Conn
) -> None:
    @app.task
    async def asks_forever() -> None:
        raise infinite_retry()

    job_id = asks_forever.enqueue()
    async with running_worker(app, **FAST):
        await wait_until_async(lambda: statuses(conn, [job_id])[job_id][0] == "retrying")
    years = conn.execute(
        "SELECT extract(epoch FROM run_at - now()) / (365.25 * 86400) FROM pgqueue_jobs"
        " WHERE id = %s",
        (job_id,),
    ).fetchone()
    assert years is not None and 99 < float(years[0]) <= 100


@pytest.fixture
def refuse_success_of(conn: Conn) -> Iterator[list[int]]:
    """Job ids whose success the database refuses (a trigger of the user's that raises)."""
    refused: list[int] = []
    conn.execute("CREATE TABLE refused_jobs (id bigint PRIMARY KEY)")
    conn.execute(
        """CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$
           BEGIN
             IF NEW.id IN (SELECT id FROM refused_jobs) AND NEW.status = 'succeeded' THEN
               RAISE EXCEPTION 'job % may not succeed', NEW.id;
             END IF;
             RETURN NEW;
           END $$"""
    )
    conn.execute(
        "CREATE TRIGGER refuse BEFORE UPDATE ON pgqueue_jobs FOR EACH ROW EXECUTE FUNCTION refuse()"
    )
    yield refused


async def test_a_refused_ack_is_isolated_and_recorded_as_a_failed_attempt(
    app: pgqueue.App, conn: Conn, refuse_success_of: list[int]
) -> None:
    app.backoff = pgqueue.Backoff(base=30, cap=30)

    @app.task
    async def work(n: int) -> int:
        return n

    ids = [work.enqueue(n=n) for n in range(30)]
    conn.execute("INSERT INTO refused_jobs VALUES (%s)", (ids[13],))
    async with running_worker(app, concurrency=30, **FAST) as worker:
        await wait_until_async(lambda: none_running(conn, ids), timeout=30)
        assert worker.state is not None
        assert worker.state.counters.unstorable == 1
    found = statuses(conn, ids)
    assert [found[j][:2] for j in ids if j != ids[13]] == [("succeeded", 1)] * 29
    status, attempts, error = found[ids[13]]
    assert (status, attempts) == ("retrying", 1)
    assert error is not None and error.startswith("OutcomeNotStored: ")
    assert f"job {ids[13]} may not succeed" in error


async def test_an_outcome_that_cannot_be_written_at_all_is_given_up_loudly(
    app: pgqueue.App, conn: Conn, caplog: pytest.LogCaptureFixture
) -> None:
    """Not even a plain failure can be written by the worker's acks (the statements that set
    lock_timeout): the attempt is given up with an error in the log, its lease expired, and the
    reaper records it."""
    conn.execute(
        """CREATE FUNCTION refuse_acks() RETURNS trigger LANGUAGE plpgsql AS $$
           BEGIN
             IF current_setting('lock_timeout') <> '0' AND NEW.id = (
                 SELECT min(id) FROM pgqueue_jobs) THEN
               RAISE EXCEPTION 'no acks for this one';
             END IF;
             RETURN NEW;
           END $$"""
    )
    conn.execute(
        "CREATE TRIGGER refuse_acks BEFORE UPDATE ON pgqueue_jobs FOR EACH ROW"
        " EXECUTE FUNCTION refuse_acks()"
    )
    app.backoff = pgqueue.Backoff(base=30, cap=30)

    @app.task
    async def work(n: int) -> int:
        return n

    ids = [work.enqueue(n=n) for n in range(10)]
    with caplog.at_level(logging.ERROR, logger="pgqueue.worker.completer"):
        async with running_worker(app, concurrency=10, **FAST) as worker:
            await wait_until_async(lambda: none_running(conn, ids), timeout=30)
            assert worker.state is not None
            assert worker.state.counters.given_up == 1
    found = statuses(conn, ids)
    assert [found[j][:2] for j in ids[1:]] == [("succeeded", 1)] * 9
    status, attempts, error = found[ids[0]]
    assert (status, attempts) == ("retrying", 1)
    assert error is not None and error.startswith("LeaseExpired: ")
    assert any(f"job {ids[0]}: giving the attempt up" in r.getMessage() for r in caplog.records), (
        caplog.text
    )


# --- every value a handler can produce ------------------------------------------------------

_any_text = st.text(
    st.characters(codec=None, categories=["L", "N", "P", "S", "Z", "Cc", "Cs"]), max_size=20
)
_json_like: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(10**5000), max_value=10**5000)
    | st.floats(allow_nan=True, allow_infinity=True)
    | _any_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_any_text, inner, max_size=4),
    max_leaves=12,
)
_values = (
    _json_like
    | st.sets(st.integers(), max_size=2)
    | st.binary(max_size=4)
    | st.builds(object)
    | st.integers(min_value=0, max_value=3000).map(lambda depth: _nested(depth))
)


def _nested(depth: int) -> Any:
    value: Any = "bottom"
    for _ in range(depth):
        value = [value]
    return value


class _BadStr(Exception):
    def __str__(self) -> str:
        raise ValueError("no string for you")


_behaviours = st.one_of(
    st.tuples(st.just("return"), _values),
    st.tuples(st.just("raise"), _any_text.map(RuntimeError)),
    st.tuples(st.just("raise"), st.just(_BadStr())),
    st.tuples(st.just("raise"), _any_text.map(pgqueue.Fail)),
    st.tuples(st.just("raise"), _any_text.map(KeyError)),
    st.tuples(
        st.just("raise"),
        st.floats(allow_nan=True, allow_infinity=True).map(lambda after: _retry_after(after)),
    ),
)


def _retry_after(after: float) -> pgqueue.Retry:
    retry = pgqueue.Retry(after=0)
    retry.after = after  # whatever a subclass or an older constructor let through
    return retry


@pytest.fixture
def executor(app: pgqueue.App, dsn: str) -> Iterator[Executor]:
    with ThreadPoolExecutor(2) as threads:
        transactions = Transactions(dsn, app.q, 1, {})
        yield Executor(app, uuid.uuid4(), threads, transactions)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(behaviour=_behaviours, attempt=st.integers(min_value=1, max_value=3))
def test_every_outcome_a_handler_can_produce_is_storable(
    app: pgqueue.App, conn: Conn, executor: Executor, behaviour: tuple[str, Any], attempt: int
) -> None:
    action, value = behaviour
    app.tasks.pop("anything", None)  # the previous example's, and its job
    conn.execute("DELETE FROM pgqueue_jobs")

    @app.task(name="anything", max_attempts=3)
    async def anything() -> Any:
        if action == "raise":
            raise value
        return value

    worker = uuid.uuid4()
    register_worker(conn, worker)
    job_id = app.enqueue("anything", {})
    token = uuid.uuid4()
    claimed = conn.execute(
        app.q.claim_jobs, {"worker_id": worker, "limit": 1, "token": token, "tasks": None}
    ).fetchall()
    assert [r[0] for r in claimed] == [job_id]
    job = ClaimedJob(job_id, "default", "anything", {}, attempt, 3, token, 0.0)
    outcome = asyncio.run(executor.run(job, 0.0, lambda: 0.0, lambda: None))
    written = [r[:1] for r in conn.execute(app.q.complete_jobs, ack_params([outcome]))]
    assert written == [(job_id,)], outcome


async def test_isolating_a_refused_outcome_reports_every_other_ack_exactly_once(
    app: pgqueue.App, conn: Conn, dsn: str
) -> None:
    """A batch is split around a refused outcome; a part already written stays written when a
    later part meets a transient error (here a serialization failure, once), and the retry
    does not report it again."""
    from psycopg_pool import AsyncConnectionPool

    from pgqueue.jobs import Status
    from pgqueue.worker.completer import Completer
    from pgqueue.worker.executor import Outcome

    worker = uuid.uuid4()
    register_worker(conn, worker)
    app.enqueue_many([("t", {}) for _ in range(4)], allow_unknown=True)
    token = uuid.uuid4()
    ids = sorted(
        int(r[0])
        for r in conn.execute(
            app.q.claim_jobs, {"worker_id": worker, "limit": 4, "token": token, "tasks": None}
        ).fetchall()
    )
    refused, _, _, flaky = ids
    conn.execute("CREATE SEQUENCE once")
    conn.execute(
        f"""CREATE FUNCTION odd_rows() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
              IF NEW.id = {refused} AND NEW.status = 'succeeded' THEN
                RAISE EXCEPTION 'not this one';
              END IF;
              IF NEW.id = {flaky} AND nextval('once') = 1 THEN
                RAISE EXCEPTION 'try again' USING ERRCODE = '40001';
              END IF;
              RETURN NEW;
            END $$"""
    )
    conn.execute(
        "CREATE TRIGGER odd_rows BEFORE UPDATE ON pgqueue_jobs FOR EACH ROW"
        " EXECUTE FUNCTION odd_rows()"
    )
    reported: list[int] = []

    def written(batch: list[Outcome], accepted: set[int]) -> None:
        reported.extend(o.job_id for o in batch if o.job_id in accepted)

    def instead(outcome: Outcome, reason: str) -> Outcome:
        return Outcome(outcome.job_id, token, Status.RETRYING, 60.0, "OutcomeNotStored", None,
                       0.0, "default", 0.0)  # fmt: skip

    async with AsyncConnectionPool(
        dsn, min_size=1, max_size=1, open=False, kwargs={"autocommit": True}
    ) as pool:
        completer = Completer(pool, app.q, written, on_refused=instead)
        for job_id in ids:
            completer.submit(
                Outcome(job_id, token, Status.SUCCEEDED, None, None, None, 0.0, "default", 0.0)
            )
        for _ in range(10):
            if not completer.pending:
                break
            await completer.flush_once()
    assert sorted(reported) == ids  # each once: the replacement for the refused one included
    states = statuses(conn, ids)
    assert states[refused][0] == "retrying"
    assert {states[j][0] for j in ids if j != refused} == {"succeeded"}


async def test_a_handler_waiting_for_its_connection_gets_one_once_the_server_is_back(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Transactional completion: the server is down (nothing listens) when a handler asks for
    its connection, for longer than psycopg_pool keeps trying (RECONNECT_TIMEOUT). The pool
    gave that attempt up and started no other for a request already waiting: the handler
    waited until WAIT (a day) after the server came back. A PostgreSQL restart in the fault
    suite left every slot of a worker waiting so, while its heartbeats kept the leases alive."""
    from psycopg import conninfo

    from pgqueue.jobs import Status
    from pgqueue.sql import queries
    from pgqueue.worker import transactions
    from pgqueue.worker.executor import Outcome
    from tests.chaos.proxy import BlackholeProxy

    monkeypatch.setattr(transactions, "RECONNECT_TIMEOUT", 0.2)
    monkeypatch.setattr(transactions, "ACQUIRE_STEP", 0.5)
    with socket.socket() as probe:  # a port nothing listens on, until the proxy does
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    info = conninfo.conninfo_to_dict(dsn)
    down = conninfo.make_conninfo(dsn, host="127.0.0.1", port=port)
    tx = Transactions(down, queries("public"), size=2, connect_kwargs={"connect_timeout": 5})
    # An ack for a job that does not exist: the handler's transaction runs, acks nothing and
    # rolls back.
    outcome = Outcome(10**12, uuid.uuid4(), Status.SUCCEEDED, None, None, None, 0.0, "default", 0.0)

    async def call(conn: psycopg.AsyncConnection[Any]) -> int:
        cur = await conn.execute("SELECT 42")
        row = await cur.fetchone()
        assert row is not None
        return int(row[0])

    task = asyncio.create_task(tx.run_async(call, lambda result: ack_params([outcome])))
    try:
        pool = await tx._async_pool()
        # The pool tried, and gave that attempt up (its size back to none).
        await wait_until_async(
            lambda: (
                pool.get_stats().get("connections_errors", 0) >= 2
                and pool.get_stats().get("pool_size", 0) == 0
            )
        )
        proxy = BlackholeProxy(
            str(info.get("host", "127.0.0.1")), int(str(info["port"])), port=port
        )
        try:
            result, acked = await asyncio.wait_for(task, timeout=15)
        finally:
            proxy.close()
    finally:
        task.cancel()
        await tx.close()
    assert (result, acked) == (42, False)  # ran; no such job to ack, so nothing stayed
