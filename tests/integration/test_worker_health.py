"""The worker's liveness endpoint and file: 200 while the heartbeat is recent, 503 once it
stalls (the database cut off by a blackholing proxy) or the worker stops."""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from psycopg import conninfo

import pgqueue
from tests.chaos.proxy import BlackholeProxy
from tests.helpers import running_worker, wait_until, wait_until_async, worker_process


def probe(port: int, path: str = "/healthz") -> tuple[int, dict[str, Any], str | None]:
    """Status, JSON body and Cache-Control of one GET (a thread: the worker's loop must run)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, json.loads(resp.read()), resp.headers["Cache-Control"]
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), err.headers["Cache-Control"]


async def aprobe(port: int) -> tuple[int, dict[str, Any], str | None]:
    return await asyncio.to_thread(probe, port)


@pytest.fixture
def proxy(dsn: str) -> Iterator[tuple[BlackholeProxy, str]]:
    """A proxy in front of the test's database, and the DSN through it."""
    params = conninfo.conninfo_to_dict(dsn)
    through = BlackholeProxy(
        str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432)
    )
    try:
        yield through, conninfo.make_conninfo(dsn, host="127.0.0.1", port=through.port)
    finally:
        through.close()


async def test_liveness_turns_503_when_the_heartbeat_stalls_and_200_when_it_is_back(
    proxy: tuple[BlackholeProxy, str], tmp_path: Path
) -> None:
    cut, dsn = proxy
    alive = tmp_path / "alive"
    app = pgqueue.App(dsn)
    try:
        options = {"lease": 5.0, "heartbeat_interval": 0.2, "poll_interval": 0.2,
                   "reaper_interval": 1.0, "health_port": 0, "health_host": "127.0.0.1",
                   "health_file": alive}  # fmt: skip
        async with running_worker(app, **options) as worker:
            assert worker.health is not None
            port = worker.health.port
            status, body, cache = await aprobe(port)
            assert (status, body["status"], cache) == (200, "ok", "no-store")
            assert alive.exists()
            touched = alive.stat().st_mtime_ns
            await wait_until_async(lambda: alive.stat().st_mtime_ns > touched, timeout=30)

            cut.blackhole()
            stalled: dict[str, Any] = {}

            async def stalled_seen() -> bool:
                status, body, _ = await aprobe(port)
                stalled.update(body)
                return status == 503

            await _until(stalled_seen)
            assert stalled["status"] == "heartbeat stalled"
            assert stalled["last_heartbeat_seconds_ago"] >= 0.6  # 3 intervals (rounded to ms)

            cut.heal()
            await _until(lambda: _status_is(port, 200))
            assert await asyncio.to_thread(probe, port, "/elsewhere") == (
                404, {"status": "not found"}, "no-store",
            )  # fmt: skip
            worker.stop()
            # 503 while it stops, or already gone: a loaded machine may close the port before a
            # probe lands in between (the probe then meets a reset, not an answer).
            await _until(lambda: _status_is(port, 503, gone=True))
        assert not alive.exists()  # removed at stop: an exec probe fails
        with pytest.raises(OSError):
            probe(port)  # and the port is closed
    finally:
        app.close()


async def _status_is(port: int, code: int, *, gone: bool = False) -> bool:
    try:
        return (await aprobe(port))[0] == code
    except OSError:
        if gone:
            return True
        raise


async def _until(check: Any, timeout: float = 30) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_pgqueue_worker_health_port_answers_while_the_worker_runs(dsn: str) -> None:
    port = free_port()
    with worker_process(
        dsn, "--health-port", str(port), "--health-host", "127.0.0.1",
        "--heartbeat-interval", "1", app="tests.acceptance.jobs_app:app",
    ) as proc:  # fmt: skip

        def healthy() -> bool:
            assert proc.poll() is None, "the worker exited"
            try:
                return probe(port)[0] == 200
            except OSError:
                return False  # not listening yet

        wait_until(healthy, timeout=30)
