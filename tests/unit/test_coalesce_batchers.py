"""The coalescing producer's batchers without a database: under many concurrent callers every
call is answered exactly once with its own outcome, batches respect their bounds, and no caller
is left waiting (a hang fails the test by pytest-timeout)."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import psycopg
import pytest

from pgqueue import DatabaseUnavailableError, InvalidJobError
from pgqueue import coalesce as coalescing
from pgqueue.coalesce import AsyncBatcher, Outcome, Settings, SyncBatcher, _Counter
from pgqueue.jobs import Enqueued
from pgqueue.producer import JobRow
from pgqueue.sql import queries
from tests.helpers import wait_until, wait_until_async


def row(n: int) -> JobRow:
    return JobRow("q", "t", f'{{"n":{n}}}', 0, None, 0.0, 1)


def answer(rows: list[JobRow]) -> list[Outcome]:
    """Job n gets id n; a job whose n ends in 7 gets an error of its own."""
    outcomes: list[Outcome] = []
    for r in rows:
        n = int(r.args_json[5:-1])
        outcomes.append(InvalidJobError(f"bad {n}") if n % 10 == 7 else Enqueued(n))
    return outcomes


def check(results: dict[int, Outcome]) -> None:
    for n, outcome in results.items():
        if n % 10 == 7:
            assert isinstance(outcome, InvalidJobError) and str(outcome) == f"bad {n}"
        else:
            assert outcome == n and isinstance(outcome, Enqueued)


@pytest.mark.parametrize("window", [0.0001, 0.002])
def test_every_threads_call_gets_its_own_outcome_once(window: float) -> None:
    sizes: list[int] = []
    lock = threading.Lock()

    def write(rows: list[JobRow]) -> list[Outcome]:
        with lock:
            sizes.append(len(rows))
        return answer(rows)

    counter = _Counter()
    batcher = SyncBatcher(Settings(window, 25), write, counter)
    threads, per_thread = 40, 50

    def produce(t: int) -> dict[int, Outcome]:
        mine: dict[int, Outcome] = {}
        for i in range(per_thread):
            n = t * per_thread + i
            try:
                mine[n] = batcher.submit(row(n))
            except InvalidJobError as exc:
                mine[n] = exc
        return mine

    with ThreadPoolExecutor(threads) as pool:
        results = {n: o for part in pool.map(produce, range(threads)) for n, o in part.items()}
    assert len(results) == threads * per_thread
    check(results)
    assert sum(sizes) == threads * per_thread and max(sizes) <= 25
    assert counter.stats.jobs == threads * per_thread and counter.stats.batches == len(sizes)


@pytest.mark.parametrize("window", [0.0001, 0.002])
async def test_every_coroutines_call_gets_its_own_outcome_once(window: float) -> None:
    sizes: list[int] = []
    in_flight = 0
    most = 0

    async def write(rows: list[JobRow]) -> list[Outcome]:
        nonlocal in_flight, most
        sizes.append(len(rows))
        in_flight += 1
        most = max(most, in_flight)
        for _ in range(len(rows) % 5 + 1):  # batches end in another order than they began
            await asyncio.sleep(0)
        in_flight -= 1
        return answer(rows)

    batcher = AsyncBatcher(Settings(window, 25), write, _Counter(), asyncio.get_running_loop())

    async def produce(t: int) -> dict[int, Outcome]:
        mine: dict[int, Outcome] = {}
        for i in range(50):
            n = t * 50 + i
            try:
                mine[n] = await batcher.submit(row(n))
            except InvalidJobError as exc:
                mine[n] = exc
        return mine

    parts = await asyncio.gather(*(produce(t) for t in range(40)))
    results = {n: o for part in parts for n, o in part.items()}
    assert len(results) == 2000
    check(results)
    assert sum(sizes) == 2000 and max(sizes) <= 25
    assert most <= coalescing.MAX_IN_FLIGHT


async def test_a_cancelled_caller_s_job_is_not_sent() -> None:
    sent: list[JobRow] = []
    gate = asyncio.Event()

    async def write(rows: list[JobRow]) -> list[Outcome]:
        sent.extend(rows)
        await gate.wait()
        return answer(rows)

    # The window is long: the two later calls wait for the first batch, not beside it.
    batcher = AsyncBatcher(Settings(1.0, 25), write, _Counter(), asyncio.get_running_loop())
    first = asyncio.ensure_future(batcher.submit(row(1)))
    await wait_until_async(lambda: sent)  # the first batch is being written
    second = asyncio.ensure_future(batcher.submit(row(2)))
    third = asyncio.ensure_future(batcher.submit(row(3)))
    await wait_until_async(lambda: len(batcher._pending) == 2)
    second.cancel()
    gate.set()
    assert await first == 1 and await third == 3
    assert [r.args_json for r in sent] == ['{"n":1}', '{"n":3}']


def test_an_interrupted_batch_answers_its_other_callers() -> None:
    """A leader interrupted while writing (KeyboardInterrupt in its thread) still answers the
    other callers of its batch: they raise instead of waiting forever."""
    started = threading.Event()
    release = threading.Event()
    batches: list[list[JobRow]] = []

    def write(rows: list[JobRow]) -> list[Outcome]:
        batches.append(rows)
        if len(batches) == 1:
            started.set()
            assert release.wait(30)
        if len(batches) == 2:
            raise KeyboardInterrupt
        return answer(rows)

    batcher = SyncBatcher(Settings(1.0, 25), write, _Counter())
    outcomes: dict[int, BaseException | Enqueued] = {}

    def call(n: int) -> None:
        try:
            outcomes[n] = batcher.submit(row(n))
        except BaseException as exc:
            outcomes[n] = exc

    threads = [threading.Thread(target=call, args=(n,)) for n in (1, 2, 3)]
    threads[0].start()
    assert started.wait(30)
    for t in threads[1:]:
        t.start()
    wait_until(lambda: len(batcher._pending) == 2, what="two calls waiting for the first batch")
    release.set()
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    assert outcomes[1] == 1
    assert [len(b) for b in batches] == [1, 2]
    leader = 2 if isinstance(outcomes[2], KeyboardInterrupt) else 3
    other = 5 - leader
    assert isinstance(outcomes[leader], KeyboardInterrupt)
    assert isinstance(outcomes[other], DatabaseUnavailableError)
    assert "may or may not have been written" in str(outcomes[other])
    assert batcher.submit(row(4)) == 4  # the batcher goes on


class FailingPool:
    """A pool whose first statement fails with ``error``; the next ones answer job ids."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.statements = 0

    def run(self, statement: object, *, read_only: bool = False) -> Enqueued:
        self.statements += 1
        if self.statements == 1:
            raise self.error
        return Enqueued(100 + self.statements)


def coalescer_on(pool: FailingPool) -> coalescing.Coalescer:
    async def no_async_pool() -> Any:
        raise AssertionError("not used")

    return coalescing.Coalescer(
        Settings(0.002, 25), queries("public"), lambda: cast(Any, pool), no_async_pool
    )


def test_a_batch_the_server_refused_is_sent_again_job_by_job() -> None:
    pool = FailingPool(psycopg.errors.RaiseException("refused"))
    outcomes = coalescer_on(pool)._write([row(1), row(2), row(3)])
    assert outcomes == [102, 103, 104] and pool.statements == 4


@pytest.mark.parametrize(
    "error",
    [psycopg.OperationalError("no answer from the server"), DatabaseUnavailableError("lost")],
)
def test_a_batch_whose_fate_is_unknown_is_never_sent_again(error: Exception) -> None:
    pool = FailingPool(error)
    outcomes = coalescer_on(pool)._write([row(1), row(2), row(3)])
    assert pool.statements == 1
    assert all(type(o) is type(error) and str(o) == str(error) for o in outcomes)
    assert len({id(o) for o in outcomes}) == 3  # each caller raises its own
