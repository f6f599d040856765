"""The dashboard app over HTTP: read-only routes, guards, API, metrics, recovery."""

from __future__ import annotations

import base64
import re
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from psycopg import conninfo, sql
from starlette.testclient import TestClient

from pgqueue import __version__
from pgqueue.dashboard.app import create_app
from pgqueue.dashboard.cli import dashboard_command
from pgqueue.dashboard.database import Database, writable_tables
from pgqueue.embedded import EmbeddedPostgres
from pgqueue.migrate import migrate
from tests.dashboard_data import plant, planted_retries_in_the_minute_to
from tests.helpers import ROOT

DOCS = ROOT / "docs" / "dashboard.md"

ROUTES = ["/", "/api/snapshot", "/api/jobs/1", "/events", "/metrics", "/health", "/healthz",
          "/readyz", "/static/dashboard.js", "/nope", "/jobs/1", "/jobs?id=1"]  # fmt: skip
PROBES = ("/health", "/healthz", "/readyz")
WRITE_METHODS = ["POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE"]


def wait_for(check: Callable[[], Any], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not met before the deadline")
        time.sleep(0.05)


def snapshot(client: TestClient, after: int = 0) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        response = client.get("/api/snapshot")
        if response.status_code != 200:
            return None
        body: dict[str, Any] = response.json()
        return body if body.get("refresh", 0) > after and body["status"] == "ok" else None

    result: dict[str, Any] = wait_for(ready)
    return result


def snapshot_read_after_now(client: TestClient) -> dict[str, Any]:
    """The first snapshot whose read began after this call. The refresh in flight may have taken
    its snapshot before rows the test just wrote were committed; the one after it cannot."""
    return snapshot(client, snapshot(client)["refresh"] + 1)


@pytest.fixture
def client(dsn: str) -> Iterator[TestClient]:
    app = create_app(dsn, refresh_interval=0.2)
    with TestClient(app, base_url="http://127.0.0.1") as test_client:
        yield test_client


def test_every_write_method_on_every_route_is_refused(client: TestClient) -> None:
    for route in ROUTES:
        for method in WRITE_METHODS:
            response = client.request(method, route)
            assert response.status_code == 405, (method, route)
            assert response.headers["allow"] == "GET, HEAD"


def test_pages_carry_a_strict_csp_and_hardening_headers(client: TestClient) -> None:
    response = client.get("/")
    assert response.status_code == 200
    csp = response.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp
    assert "frame-ancestors 'none'" in csp
    assert response.headers["x-content-type-options"] == "nosniff"
    assert f"v{__version__}" in response.text and "read-only" in response.text
    assert "<script>" not in response.text  # scripts are files only
    assert "access-control-allow-origin" not in response.headers


def test_every_response_but_static_files_is_no_store(dsn: str) -> None:
    """Metrics, errors (404, 405, 503) and the rest: a cache must never serve old figures."""
    with TestClient(create_app(dsn, refresh_interval=0.2), base_url="http://127.0.0.1") as client:
        snapshot(client)
        for route in ("/", "/api/snapshot", "/metrics", "/health", "/api/jobs/999999",
                      "/api/jobs/nope", "/nope"):  # fmt: skip
            assert client.get(route).headers.get("cache-control") == "no-store", route
        assert client.post("/metrics").headers.get("cache-control") == "no-store"
        assert "no-store" not in client.get("/static/dashboard.js").headers.get("cache-control", "")
    # The job API while the database cannot be read.
    app = create_app(conninfo.make_conninfo(dsn, port="1"), refresh_interval=0.2)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        response = client.get("/api/jobs/1")
        assert response.status_code == 503
        assert response.headers.get("cache-control") == "no-store"


def test_snapshot_api_reports_known_figures(
    client: TestClient, conn: psycopg.Connection[Any]
) -> None:
    first = snapshot(client)
    assert first["tiles"]["waiting"] == 0 and first["workers"] == []
    plant(conn)
    snap = snapshot_read_after_now(client)
    assert snap["tiles"]["waiting"] == 7 and snap["tiles"]["running"] == 2
    retries = planted_retries_in_the_minute_to(conn, snap["throughput"]["t"][-1])
    assert snap["tiles"]["retries_60s"] == retries and snap["tiles"]["failed_60s"] == 1
    assert snap["workers_alive"] == 1 and len(snap["workers"]) == 2
    assert len(snap["schedules"]) == 2 and snap["late_after"] == 15.0
    assert len(snap["throughput"]["t"]) == 120 and "emails" in snap["depth"]["queues"]


def test_depth_with_no_worker_is_the_count_now_and_unknown_before(
    client: TestClient, conn: psycopg.Connection[Any]
) -> None:
    """No worker ever sampled: the seconds before the dashboard looked were served as 0."""
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task) SELECT 'emails', 't' FROM generate_series(1, 5)"
    )
    waiting = snapshot_read_after_now(client)["depth"]["queues"]["emails"]
    assert waiting[-1] == 5 and waiting[0] is None  # (0 while it watched before the insert)


def test_job_api_returns_the_full_error_or_404(
    client: TestClient, conn: psycopg.Connection[Any]
) -> None:
    plant(conn)
    row = conn.execute("SELECT id FROM pgqueue_jobs WHERE status = 'dead'").fetchone()
    assert row is not None
    job = client.get(f"/api/jobs/{row[0]}").json()
    assert job["last_error"].endswith("END-OF-TRACEBACK")
    assert client.get("/api/jobs/999999").status_code == 404


def test_metrics_expose_depth_finished_latency_and_workers(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    plant(conn)  # before the dashboard starts: its counters begin with what is settled then
    with TestClient(create_app(dsn, refresh_interval=0.2), base_url="http://127.0.0.1") as client:
        snapshot(client)
        text = _scrape(client)
    found = re.search(r'finished_total\{outcome="succeeded",queue="emails"\} (\d+)', text)
    assert found is not None and 500 <= float(found[1]) <= 600
    assert "pgqueue_pickup_latency_seconds_bucket" in text
    assert "pgqueue_run_seconds_count" in text
    assert "pgqueue_workers_alive 1.0" in text
    assert "pgqueue_dashboard_database_up 1.0" in text
    assert re.search(r"pgqueue_dashboard_refreshes_total [1-9]", text)
    assert "pgqueue_dashboard_open_pages 0.0" in text


def _scrape(client: TestClient) -> str:
    def scraped() -> str | None:
        text = client.get("/metrics").text
        return text if 'pgqueue_jobs{queue="emails",status="queued"} 5.0' in text else None

    text: str = wait_for(scraped)
    return text


def test_the_refresh_loop_recovers_when_its_backend_is_killed(
    client: TestClient, conn: psycopg.Connection[Any]
) -> None:
    before = snapshot(client)
    conn.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
        " WHERE application_name = 'pgqueue-dashboard' AND datname = current_database()"
    )
    after = snapshot(client, before["refresh"] + 2)
    assert after["status"] == "ok"


def test_one_database_session_serves_the_dashboard(
    client: TestClient, conn: psycopg.Connection[Any]
) -> None:
    snapshot(client)
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'pgqueue-dashboard'"
        " AND datname = current_database()"
    ).fetchone()
    assert row == (1,)  # one session however many pages are open


async def test_dashboard_sessions_are_read_only_and_time_limited(dsn: str) -> None:
    database = Database(dsn, statement_timeout_ms=300)
    try:
        async with database.session() as session:
            cur = await session.execute("SHOW transaction_read_only")
            assert await cur.fetchone() == ("on",)
            cur = await session.execute("SHOW statement_timeout")
            assert await cur.fetchone() == ("300ms",)
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            async with database.session() as session:
                await session.execute("INSERT INTO pgqueue_jobs (queue, task) VALUES ('q', 't')")
        with pytest.raises(psycopg.errors.QueryCanceled):
            async with database.session() as session:
                await session.execute("SELECT pg_sleep(5)")
    finally:
        await database.close()


async def test_nothing_run_on_the_dashboards_session_can_write(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """What a READ ONLY transaction still allows (NOTIFY, lo_create, SET SESSION
    CHARACTERISTICS, which as a superuser turned a session's read-only default back off) is
    rolled back with it, and the next transaction is READ ONLY again whatever the session's
    defaults say. The test user is a superuser, as a careless deployment's would be."""
    listener = psycopg.connect(dsn, autocommit=True)
    listener.execute("LISTEN dashboard_probe")
    objects = "SELECT count(*) FROM pg_largeobject_metadata"
    large_objects = conn.execute(objects).fetchone()
    database = Database(dsn)
    try:
        async with database.session() as session:
            await session.execute("NOTIFY dashboard_probe, 'from the dashboard'")
            await session.execute("SELECT lo_create(0)")
        async with database.session() as session:
            await session.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ WRITE")
        async with database.session() as session:
            await session.execute("SET default_transaction_read_only = off")
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            async with database.session() as session:
                await session.execute("INSERT INTO pgqueue_jobs (queue, task) VALUES ('q', 't')")
        with pytest.raises(psycopg.errors.ActiveSqlTransaction):
            async with database.session() as session:
                await session.execute("VACUUM pgqueue_jobs")
        with pytest.raises(psycopg.errors.ActiveSqlTransaction):
            async with database.session() as session:  # too late: the snapshot is taken
                await session.execute("SET TRANSACTION READ WRITE")
    finally:
        await database.close()
    assert conn.execute("SELECT count(*) FROM pgqueue_jobs").fetchone() == (0,)
    assert conn.execute(objects).fetchone() == large_objects
    listener.execute("SELECT 1")  # a round trip delivers any pending notification
    assert list(listener.notifies(timeout=0.2, stop_after=1)) == []
    listener.close()


def test_a_superuser_dashboard_warns_on_the_page_and_in_its_log(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="pgqueue.dashboard"):
        assert snapshot(client)["writable"] == ["*"]  # the test user is a superuser
    assert any(
        "is a superuser" in r.getMessage() and "SELECT only" in r.getMessage()
        for r in caplog.records
    )
    page = client.get("/").text
    assert 'id="writable"' in page and "A role with SELECT only" in page


async def test_a_role_granted_a_write_on_one_table_is_reported_with_that_table(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    name = f"pgqueue_writer_{uuid.uuid4().hex[:8]}"
    role = sql.Identifier(name)
    try:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(role))
    except psycopg.errors.InsufficientPrivilege:
        pytest.skip("this test server does not let the test user create roles")
    try:
        conn.execute(sql.SQL("GRANT USAGE ON SCHEMA public TO {}").format(role))
        conn.execute(sql.SQL("GRANT SELECT, DELETE ON pgqueue_jobs TO {}").format(role))
        database = Database(conninfo.make_conninfo(dsn, user=name))
        try:
            async with database.session() as session:
                assert await writable_tables(session, "public") == ["pgqueue_jobs"]
        finally:
            await database.close()
    finally:
        conn.execute(sql.SQL("DROP OWNED BY {}").format(role))
        conn.execute(sql.SQL("DROP ROLE {}").format(role))


def test_head_is_served_wherever_get_is(client: TestClient) -> None:
    snapshot(client)  # /api/snapshot and /health answer 200 once the first refresh is in
    for route in ("/", "/api/snapshot", "/metrics", "/health", "/static/dashboard.css"):
        response = client.head(route)
        assert response.status_code == 200 and response.content == b"", route


def test_the_dashboard_works_as_the_documented_select_only_role(
    dsn: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """docs/dashboard.md's role SQL, run as written (with a unique role name)."""
    role = f"pgqueue_dashboard_{uuid.uuid4().hex[:8]}"
    block = re.search(r"```sql\n(.*?)\n\s*```", DOCS.read_text("utf-8"), re.DOTALL)
    assert block is not None, "docs/dashboard.md lost its role SQL"
    statements = [s.strip() for s in block[1].split(";") if s.strip()]
    try:
        for statement in statements:
            conn.execute(statement.replace("pgqueue_dashboard", role))
    except psycopg.errors.InsufficientPrivilege:
        pytest.skip("this test server does not let the test user create roles")
    try:
        plant(conn)
        role_dsn = conninfo.make_conninfo(dsn, user=role, password="change-me")
        app = create_app(role_dsn, refresh_interval=0.2)
        with (
            caplog.at_level("WARNING", logger="pgqueue.dashboard"),
            TestClient(app, base_url="http://127.0.0.1") as client,
        ):
            snap = snapshot(client)
            assert snap["writable"] == []  # no warning: this role cannot write
            assert not [r for r in caplog.records if "SELECT only" in r.getMessage()]
            assert snap["tiles"]["waiting"] == 7 and len(snap["schedules"]) == 2
            assert len(snap["problems"]) == 2 and len(snap["workers"]) == 2
            dead = next(p for p in snap["problems"] if p["status"] == "dead")
            assert client.get(f"/api/jobs/{dead['id']}").json()["last_error"]
            retrying = next(p for p in snap["problems"] if p["status"] == "retrying")
            assert client.get(f"/api/jobs/{retrying['id']}").json()["why"]
            assert "Why isn" in client.get(f"/jobs/{retrying['id']}").text
            assert "pgqueue_jobs_finished_total" in client.get("/metrics").text
        with (
            psycopg.connect(role_dsn, autocommit=True) as as_role,
            pytest.raises(psycopg.errors.ReadOnlySqlTransaction),
        ):
            as_role.execute("DELETE FROM pgqueue_jobs")
    finally:
        conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


@pytest.mark.slow
def test_the_dashboard_carries_on_after_a_database_restart() -> None:
    """A real restart of a cluster of its own (immediate mode: a crash and recovery)."""
    with EmbeddedPostgres() as cluster:
        with psycopg.connect(cluster.dsn, autocommit=True) as setup:
            migrate(setup, "public")
        app = create_app(cluster.dsn, refresh_interval=0.2)
        with TestClient(app, base_url="http://127.0.0.1") as client:
            before = snapshot(client)
            pid_before = _dashboard_backend(cluster.dsn)
            cluster.restart("immediate")
            with psycopg.connect(cluster.dsn, autocommit=True) as after_restart:
                after_restart.execute("INSERT INTO pgqueue_jobs (queue, task) VALUES ('q', 't')")
            after = wait_for(
                lambda: (s := snapshot(client, before["refresh"]))["tiles"]["waiting"] == 1 and s
            )
            assert after["status"] == "ok"
            assert client.get("/health").status_code == 200
            assert _dashboard_backend(cluster.dsn) not in (None, pid_before)


def _dashboard_backend(dsn: str) -> int | None:
    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = 'pgqueue-dashboard'"
        ).fetchone()
    return int(row[0]) if row else None


def test_missing_tables_are_reported_as_such(empty_dsn: str) -> None:
    app = create_app(empty_dsn, refresh_interval=0.2)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        body = wait_for(lambda: client.get("/api/snapshot").json().get("error"))
        assert "run `pgqueue migrate`" in body
        assert client.get("/health").status_code == 503
        assert "pgqueue_dashboard_refresh_failures_total" in client.get("/metrics").text


def test_unknown_host_header_is_refused(client: TestClient) -> None:
    assert client.get("/", headers={"host": "evil.example"}).status_code == 400


def test_basic_auth_guards_everything_but_health(dsn: str) -> None:
    app = create_app(dsn, basic_auth=("admin", "s3cret"))
    with TestClient(app, base_url="http://127.0.0.1") as c:
        for route in ROUTES:
            if route in PROBES:
                assert c.get(route).status_code != 401, route
                continue
            response = c.get(route)
            assert response.status_code == 401, route
            assert response.headers["www-authenticate"].startswith("Basic")
        assert c.get("/", auth=("admin", "wrong")).status_code == 401
        assert c.get("/", auth=("admin", "s3cret")).status_code == 200
        token = base64.b64encode(b"admin:s3cret").decode()
        assert c.get("/metrics", headers={"Authorization": f"Basic {token}"}).status_code == 200
        wait_for(lambda: c.get("/health").status_code == 200)


def test_cli_refuses_a_public_bind_without_auth(dsn: str) -> None:
    result = CliRunner().invoke(dashboard_command, ["--dsn", dsn, "--host", "0.0.0.0"])
    assert result.exit_code == 2 and "without authentication" in result.output
    result = CliRunner().invoke(dashboard_command, ["--dsn", dsn, "--username", "admin"])
    assert result.exit_code == 2 and "both" in result.output


def test_cli_refuses_nonsense_intervals(dsn: str) -> None:
    for option in ("--refresh", "--late-after"):
        result = CliRunner().invoke(dashboard_command, ["--dsn", dsn, option, "0"])
        assert result.exit_code == 2 and "positive number of seconds" in result.output
        assert "Traceback" not in result.output


def test_healthz_says_the_process_is_up_and_readyz_that_the_database_answers(
    client: TestClient,
) -> None:
    for route in ("/healthz", "/readyz"):
        response = client.get(route)
        assert (response.status_code, response.text) == (200, "ok"), route
        assert response.headers["cache-control"] == "no-store"


def test_readyz_is_503_within_its_timeout_when_the_database_is_unreachable(dsn: str) -> None:
    with socket.socket() as sock:  # a port nobody listens on: refused at once
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    down = conninfo.make_conninfo(dsn, host="127.0.0.1", port=port)
    app = create_app(down, refresh_interval=0.2, ready_timeout=1.0)
    with TestClient(app, base_url="http://127.0.0.1") as c:
        assert c.get("/healthz").status_code == 200  # the process is up all the same
        started = time.monotonic()
        response = c.get("/readyz")
        assert response.status_code == 503
        assert response.text.startswith("database unreachable")
        assert response.headers["cache-control"] == "no-store"
        assert time.monotonic() - started < 5


def test_readyz_gives_up_after_its_timeout_when_the_database_does_not_answer(dsn: str) -> None:
    from tests.chaos.proxy import BlackholeProxy

    params = conninfo.conninfo_to_dict(dsn)
    proxy = BlackholeProxy(str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))
    try:
        proxy.blackhole()  # a connection attempt hangs, as into a dead network
        through = conninfo.make_conninfo(dsn, host="127.0.0.1", port=proxy.port)
        app = create_app(through, refresh_interval=0.2, ready_timeout=0.5)
        with TestClient(app, base_url="http://127.0.0.1") as c:
            started = time.monotonic()
            response = c.get("/readyz")
            assert time.monotonic() - started < 3
            assert (response.status_code, response.text) == (
                503, "database unreachable: no answer within 0.5 s",
            )  # fmt: skip
            proxy.heal()
            wait_for(lambda: c.get("/readyz").status_code == 200)
    finally:
        proxy.close()
