"""The worker's hand-packed binary arrays (the completer's acks, the limited claim's groups)
read back in PostgreSQL as the values packed."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest

from pgqueue.jobs import Status
from pgqueue.worker import arrays
from pgqueue.worker.executor import Outcome, ack_params


@pytest.fixture
async def aconn(dsn: str) -> Any:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        arrays.register(conn)
        yield conn


async def back(conn: psycopg.AsyncConnection[Any], value: Any, sql_type: str) -> Any:
    cur = await conn.execute(f"SELECT %(v)b::{sql_type}".encode(), {"v": value})
    row = await cur.fetchone()
    assert row is not None
    return row[0]


@pytest.mark.parametrize(
    "values", [[1], [0, -1, 2**63 - 1, -(2**63)], list(range(1, 500)), []], ids=repr
)
async def test_int8(aconn: psycopg.AsyncConnection[Any], values: list[int]) -> None:
    assert await back(aconn, arrays.int8_array(values), "bigint[]") == values


@pytest.mark.parametrize("values", [[0.0], [1.5, -2.25, 1e-9, 3600.0, 5], []], ids=repr)
async def test_float8(aconn: psycopg.AsyncConnection[Any], values: list[float]) -> None:
    assert await back(aconn, arrays.float8_array(values), "float8[]") == values


async def test_uuid_status_and_null_texts(aconn: psycopg.AsyncConnection[Any]) -> None:
    tokens = [uuid.uuid4() for _ in range(3)] * 2
    assert await back(aconn, arrays.uuid_array(tokens), "uuid[]") == tokens
    statuses = list(Status) * 3
    assert await back(aconn, arrays.status_array(statuses), "text[]") == [s.value for s in statuses]
    assert await back(aconn, arrays.texts([None] * 4), "text[]") == [None] * 4
    mixed = [None, "ValueError: ü ✓", None]  # not all NULL: left to psycopg, which encodes it
    assert arrays.texts(mixed) is mixed
    assert await back(aconn, arrays.texts(mixed), "text[]") == mixed


@pytest.mark.parametrize(
    "values", [["billing"], ["tenant-ü ✓", "", 'a\tb\\c"d,{e}', "NULL", "🚀" * 40], []], ids=repr
)
async def test_utf8_texts(aconn: psycopg.AsyncConnection[Any], values: list[str]) -> None:
    packed = arrays.utf8_texts(aconn, values)
    assert isinstance(packed, arrays.Packed)
    assert await back(aconn, packed, "text[]") == values


async def test_utf8_texts_left_to_psycopg_on_another_encoding(dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, client_encoding="LATIN1") as conn:
        arrays.register(conn)
        values = ["tenant-ü", "b"]
        assert arrays.utf8_texts(conn, values) is values
        assert await back(conn, arrays.utf8_texts(conn, values), "text[]") == values


async def test_packed_and_plain_ack_parameters_say_the_same(
    aconn: psycopg.AsyncConnection[Any],
) -> None:
    token = uuid.uuid4()
    batch = [
        Outcome(1, token, Status.SUCCEEDED, None, None, '{"n": 1}', 0.25, "q", 0.1),
        Outcome(2, token, Status.RETRYING, 7.0, "Retry: later", None, 1.5, "q", 0.1),
        Outcome(3, uuid.uuid4(), Status.DEAD, None, "Fail: no", None, 0.0, "q", 0.1),
    ]
    plain, packed = ack_params(batch), ack_params(batch, packed=True)
    assert plain.keys() == packed.keys()
    for name, sql_type in [
        ("ids", "bigint[]"),
        ("tokens", "uuid[]"),
        ("statuses", "text[]"),
        ("delays", "float8[]"),
        ("errors", "text[]"),
        ("results", "text[]"),
        ("run_seconds", "float8[]"),
    ]:
        expected = await back(aconn, plain[name], sql_type)
        assert await back(aconn, packed[name], sql_type) == expected, name
