"""The job detail page, the job search and "why isn't it running?" against a real PostgreSQL.

Rows are written as pgqueue writes them: jobs through App.enqueue (after= for blocked ones),
limits and pauses through the operator API, workers through their registration statement,
claims and rate logs as the claims write them.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from starlette.testclient import TestClient

import pgqueue
from pgqueue.dashboard import job_page
from pgqueue.dashboard.app import create_app
from pgqueue.dashboard.database import Database
from pgqueue.sql import queries
from tests.dashboard_data import XSS
from tests.helpers import running_worker, wait_until_async

Conn = psycopg.Connection[Any]
BEAT = {"lease": 3.0, "heartbeat_interval": 0.2, "poll_interval": 0.5, "reaper_interval": 1.0}


@pytest.fixture
def client(dsn: str) -> Iterator[TestClient]:
    with TestClient(create_app(dsn, refresh_interval=5), base_url="http://127.0.0.1") as c:
        yield c


def worker(
    conn: Conn,
    *,
    queues: list[str] | None = None,
    concurrency: int = 4,
    lease: float = 30,
    tasks: list[str] | None = None,
) -> uuid.UUID:
    """A live worker, registered as a worker registers itself (``tasks`` None: as a worker from
    before the workers' tasks were recorded)."""
    worker_id = uuid.uuid4()
    conn.execute(
        queries("public").register_worker,
        {"worker_id": worker_id, "host": "box", "pid": 7, "queues": queues,
         "concurrency": concurrency, "lease": lease, "tasks": tasks},
    )  # fmt: skip
    return worker_id


def claim(conn: Conn, job_id: int, worker_id: uuid.UUID) -> None:
    """What a claim writes on the job's row."""
    conn.execute(
        "UPDATE pgqueue_jobs SET status = 'running', attempts = attempts + 1,"
        " lease_token = gen_random_uuid(), worker_id = %s, claimed_at = now() WHERE id = %s",
        (worker_id, job_id),
    )


async def reasons_of(dsn: str, job_id: int) -> list[str]:
    """The reason codes job_page.read gives, on a session of the dashboard's own."""
    database = Database(dsn)
    try:
        async with database.session() as c:
            job = await job_page.read(c, "public", job_id)
    finally:
        await database.close()
    assert job is not None
    return [r.code for r in job.why or ()]


def why(client: TestClient, job_id: int) -> list[str]:
    response = client.get(f"/api/jobs/{job_id}")
    assert response.status_code == 200, response.text
    return [reason["code"] for reason in response.json()["why"]]


def test_a_job_due_with_a_free_worker_should_start_any_moment(
    client: TestClient, app: pgqueue.App, conn: Conn
) -> None:
    worker(conn)
    job = app.enqueue("t", {}, allow_unknown=True)
    assert why(client, job) == ["ready"]
    page = client.get(f"/jobs/{job}")
    assert "it should start any moment" in page.text


def test_no_worker_at_all_then_none_for_this_queue(
    client: TestClient, app: pgqueue.App, conn: Conn
) -> None:
    job = app.enqueue("t", {}, queue="mail", allow_unknown=True)
    assert why(client, job) == ["no_worker"]
    worker(conn, queues=["reports", "billing"])
    assert why(client, job) == ["no_worker_for_queue"]
    text = client.get(f"/api/jobs/{job}").json()["why"][0]["text"]
    assert "billing, reports" in text
    # A worker whose heartbeat is late does not count (the Workers panel shows it as late).
    conn.execute("UPDATE pgqueue_workers SET queues = NULL,"
                 " last_heartbeat_at = now() - interval '1 minute'")  # fmt: skip
    assert why(client, job) == ["no_worker"]


def test_a_task_no_serving_worker_has(client: TestClient, app: pgqueue.App, conn: Conn) -> None:
    job = app.enqueue("report", {}, queue="mail", allow_unknown=True)
    worker(conn, queues=["mail"], tasks=["send", "bounce"])
    # A worker of another queue that has the task does not serve this job.
    worker(conn, queues=["other"], tasks=["report"])
    reasons = client.get(f"/api/jobs/{job}").json()["why"]
    assert [r["code"] for r in reasons] == ["unknown_task"]
    assert "'report' is unknown to every live worker that serves its queue" in reasons[0]["text"]
    assert "unknown to every live worker" in client.get(f"/jobs/{job}").text
    # Not yet due as well: both are said, the missing code first.
    later = app.enqueue("report", {}, queue="mail", delay=120, allow_unknown=True)
    assert why(client, later) == ["unknown_task", "not_due"]
    # One serving worker with the task is enough; so is one from before tasks were recorded.
    added = worker(conn, queues=["mail"], tasks=["report"])
    assert why(client, job) == ["ready"]
    conn.execute("DELETE FROM pgqueue_workers WHERE id = %s", (added,))
    assert why(client, job) == ["unknown_task"]
    worker(conn, queues=None, tasks=None)
    assert why(client, job) == ["ready"]


def test_a_job_not_due_yet_says_when(client: TestClient, app: pgqueue.App, conn: Conn) -> None:
    worker(conn)
    job = app.enqueue("t", {}, delay=180, allow_unknown=True)
    reasons = client.get(f"/api/jobs/{job}").json()["why"]
    assert [r["code"] for r in reasons] == ["not_due"]
    assert reasons[0]["text"].startswith("It is due in 2m 5") or "3m 00s" in reasons[0]["text"]


def test_a_paused_queue(client: TestClient, app: pgqueue.App, conn: Conn) -> None:
    worker(conn)
    job = app.enqueue("t", {}, queue="mail", allow_unknown=True)
    app.pause_queue("mail")
    assert why(client, job) == ["paused"]
    app.resume_queue("mail")
    assert why(client, job) == ["ready"]


def test_a_queue_at_its_limit_and_out_of_rate(
    client: TestClient, app: pgqueue.App, conn: Conn
) -> None:
    w = worker(conn, concurrency=10)
    first = app.enqueue("t", {}, queue="mail", allow_unknown=True)
    second = app.enqueue("t", {}, queue="mail", allow_unknown=True)
    app.limit_queue("mail", limit=1)
    claim(conn, first, w)
    assert why(client, second) == ["queue_limit"]
    app.limit_queue("mail", limit=None, rate="1/m")
    # The limited claim's log of starts (claim_limited_jobs): one start ten seconds ago.
    conn.execute(
        "INSERT INTO pgqueue_rates (name, period, times, counts)"
        " VALUES ('q:mail', 60, ARRAY[now() - interval '10 seconds'], ARRAY[1])"
    )
    reasons = client.get(f"/api/jobs/{second}").json()["why"]
    assert [r["code"] for r in reasons] == ["queue_rate"]
    assert "1 started in the last 1m 00s (at most 1); room again in 5" in reasons[0]["text"]
    app.limit_queue("mail", limit=0, rate=None)
    assert "limit of 0" in client.get(f"/api/jobs/{second}").json()["why"][0]["text"]


def test_a_task_at_its_limit_and_out_of_rate(
    client: TestClient, app: pgqueue.App, conn: Conn
) -> None:
    w = worker(conn, concurrency=10)
    app.limit_task("report", limit=1)
    first = app.enqueue("report", {}, allow_unknown=True)
    second = app.enqueue("report", {}, allow_unknown=True)
    other = app.enqueue("other", {}, allow_unknown=True)
    claim(conn, first, w)
    assert why(client, second) == ["task_limit"]
    assert why(client, other) == ["ready"]
    app.limit_task("report", limit=None, rate="2/h")
    conn.execute(
        "INSERT INTO pgqueue_rates (name, period, times, counts) VALUES"
        " ('t:6:report:', 3600, ARRAY[now() - interval '1 minute', now()], ARRAY[1, 1])"
    )
    assert why(client, second) == ["task_rate"]


def test_every_serving_worker_busy(client: TestClient, app: pgqueue.App, conn: Conn) -> None:
    w = worker(conn, concurrency=1)
    running = app.enqueue("t", {}, allow_unknown=True)
    waiting = app.enqueue("t", {}, allow_unknown=True)
    claim(conn, running, w)
    reasons = client.get(f"/api/jobs/{waiting}").json()["why"]
    assert [r["code"] for r in reasons] == ["workers_busy"]
    assert "1 of 1 slot hold a job" in reasons[0]["text"]
    worker(conn, queues=["elsewhere"])  # free, but not for this queue
    assert why(client, waiting) == ["workers_busy"]
    worker(conn)
    assert why(client, waiting) == ["ready"]


def test_a_blocked_child_names_its_unfinished_parents(
    client: TestClient, app: pgqueue.App, conn: Conn
) -> None:
    worker(conn)
    done = app.enqueue("t", {}, allow_unknown=True)
    conn.execute("UPDATE pgqueue_jobs SET status = 'succeeded', finished_at = now() WHERE id = %s",
                 (done,))  # fmt: skip
    parent = app.enqueue("parent_task", {}, allow_unknown=True)
    child = app.enqueue("child_task", {}, after=[done, parent], allow_unknown=True)
    body = client.get(f"/api/jobs/{child}").json()
    assert body["status"] == "blocked"
    assert [r["code"] for r in body["why"]] == ["blocked"]
    assert body["why"][0]["jobs"] == [{"id": parent, "task": "parent_task", "status": "queued"}]
    assert "1 parent not finished yet" in body["why"][0]["text"]
    assert [p["id"] for p in body["parents"]] == [done, parent] and body["parent_count"] == 2
    parent_body = client.get(f"/api/jobs/{parent}").json()
    assert parent_body["children"] == [{"id": child, "task": "child_task", "status": "blocked"}]
    page = client.get(f"/jobs/{child}").text
    assert f'href="/jobs/{parent}"' in page and "Runs after" in page


def test_parents_and_children_are_capped_and_counted(
    client: TestClient, app: pgqueue.App, conn: Conn
) -> None:
    members = [app.enqueue("m", {"n": n}, allow_unknown=True) for n in range(60)]
    callback = app.enqueue("cb", {}, after=members, allow_unknown=True)
    body = client.get(f"/api/jobs/{callback}").json()
    assert body["parent_count"] == 60 and len(body["parents"]) == 50
    assert [p["id"] for p in body["parents"]] == members[:50]
    assert body["why"][0]["text"].startswith("It runs after other jobs: 60 parents")
    assert len(body["why"][0]["jobs"]) == 10
    assert "the first 50 shown" in client.get(f"/jobs/{callback}").text


def test_a_finished_job_has_no_why_and_shows_its_result(
    client: TestClient, app: pgqueue.App, conn: Conn
) -> None:
    job = app.enqueue("t", {"n": 1}, allow_unknown=True)
    conn.execute(
        "UPDATE pgqueue_jobs SET status = 'succeeded', attempts = 1, finished_at = now(),"
        " result = '{\"total\": 42}' WHERE id = %s",
        (job,),
    )
    body = client.get(f"/api/jobs/{job}").json()
    assert body["why"] is None and body["result"] == {"total": 42}
    page = client.get(f"/jobs/{job}")
    assert page.status_code == 200 and "Why isn" not in page.text
    assert "&#34;total&#34;: 42" in page.text


def test_the_api_keeps_its_old_fields(client: TestClient, app: pgqueue.App) -> None:
    job = app.enqueue("t", {"big": "x" * 9000}, meta={"by": "me"}, allow_unknown=True)
    body = client.get(f"/api/jobs/{job}").json()
    for name in ("id", "task", "queue", "status", "attempts", "max_attempts", "priority", "args",
                 "last_error", "created_at", "run_at", "claimed_at", "finished_at", "worker",
                 "meta", "progress", "cancel_requested_at"):  # fmt: skip
        assert name in body, name
    assert isinstance(body["args"], str) and len(body["args"]) == 8192
    assert body["meta"] == {"by": "me"}


def test_a_running_job_shows_its_worker_and_whether_it_is_alive(
    client: TestClient, app: pgqueue.App, conn: Conn
) -> None:
    w = worker(conn)
    job = app.enqueue("t", {}, allow_unknown=True)
    claim(conn, job, w)
    body = client.get(f"/api/jobs/{job}").json()
    assert body["worker"] == str(w) and body["worker_state"] == "alive" and body["why"] is None
    assert body["lease_token"] and body["lease_expires_at"]
    assert "cancel requested" not in client.get(f"/jobs/{job}").text
    app.cancel(job)  # a running job: its worker is asked to stop it
    assert client.get(f"/api/jobs/{job}").json()["cancel_requested_at"]
    assert "cancel requested" in client.get(f"/jobs/{job}").text
    conn.execute("UPDATE pgqueue_workers SET last_heartbeat_at = now() - interval '1 minute'")
    assert client.get(f"/api/jobs/{job}").json()["worker_state"] == "late"
    conn.execute("DELETE FROM pgqueue_workers")
    assert client.get(f"/api/jobs/{job}").json()["worker_state"] == "gone"
    assert "gone: no longer registered" in client.get(f"/jobs/{job}").text


def test_a_scheduled_job_names_its_schedule(
    client: TestClient, app: pgqueue.App, conn: Conn
) -> None:
    conn.execute(
        "INSERT INTO pgqueue_schedules (name, cron, task, queue, next_run_at)"
        " VALUES ('nightly', '0 3 * * *', 't', 'default', now() + interval '1 hour')"
    )
    row = conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, schedule_name, schedule_tick)"
        " VALUES ('default', 't', 'nightly', date_trunc('day', now())) RETURNING id"
    ).fetchone()
    assert row is not None
    assert client.get(f"/api/jobs/{row[0]}").json()["schedule"] == "nightly"
    assert "nightly" in client.get(f"/jobs/{row[0]}").text


def test_errors_and_arguments_are_escaped(client: TestClient, app: pgqueue.App, conn: Conn) -> None:
    job = app.enqueue(XSS[:60], {"note": XSS}, queue="q", allow_unknown=True)
    conn.execute("UPDATE pgqueue_jobs SET status = 'dead', last_error = %s WHERE id = %s",
                 ("Boom" + XSS, job))  # fmt: skip
    page = client.get(f"/jobs/{job}").text
    assert "<script>" not in page and "<img" not in page
    assert "&lt;script&gt;window.__xss=1&lt;/script&gt;" in page


def test_unknown_and_malformed_ids(client: TestClient) -> None:
    missing = client.get("/jobs/987654321")
    assert missing.status_code == 404 and "No job #987654321" in missing.text
    for bad in ("abc", "-1", "0", "1.5", "99999999999999999999", "%F0%9F%98%80"):
        response = client.get(f"/jobs/{bad}")
        assert response.status_code == 400, bad
        assert "is not a job id" in response.text
        assert client.get(f"/api/jobs/{bad}").status_code == 400, bad
    assert client.get("/api/jobs/987654321").status_code == 404


def test_pages_carry_the_security_headers_and_no_store(
    client: TestClient, app: pgqueue.App
) -> None:
    job = app.enqueue("t", {}, allow_unknown=True)
    for url in (f"/jobs/{job}", "/jobs/987654321", "/jobs/abc", f"/jobs?id={job}",
                f"/api/jobs/{job}", "/jobs?id=nope"):  # fmt: skip
        response = client.get(url, follow_redirects=False)
        assert response.headers["cache-control"] == "no-store", url
        assert "script-src 'self'" in response.headers["content-security-policy"], url
        assert "form-action 'self'" in response.headers["content-security-policy"], url
        assert response.headers["x-frame-options"] == "DENY", url
    page = client.get(f"/jobs/{job}")
    assert "<script" not in page.text  # the detail page needs no script at all
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        assert client.request(method, f"/jobs/{job}").status_code == 405
        assert client.request(method, f"/jobs?id={job}").status_code == 405
    assert client.head(f"/jobs/{job}").status_code == 200


def test_the_search_redirects_to_the_job(client: TestClient, app: pgqueue.App) -> None:
    job = app.enqueue("t", {}, allow_unknown=True)
    for typed in (str(job), f"#{job}", f"  {job} "):
        response = client.get("/jobs", params={"id": typed}, follow_redirects=False)
        assert response.status_code == 303 and response.headers["location"] == f"/jobs/{job}"
    assert client.get("/jobs", params={"id": "x1"}).status_code == 400
    assert client.get("/jobs").status_code == 400
    assert 'name="id"' in client.get("/").text  # the search box is on the dashboard too


def test_a_role_granted_before_the_detail_page_still_gets_the_page(
    dsn: str, app: pgqueue.App, conn: Conn
) -> None:
    """The documented grants before this page (no pgqueue_tasks, pgqueue_rates,
    pgqueue_job_waits, pgqueue_attempts): the page says what the role lacks instead of
    failing."""
    role = f"pgqueue_dashboard_{uuid.uuid4().hex[:8]}"
    try:
        conn.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'change-me'")
    except psycopg.errors.InsufficientPrivilege:
        pytest.skip("this test server does not let the test user create roles")
    try:
        conn.execute(
            f"GRANT SELECT ON pgqueue_jobs, pgqueue_workers, pgqueue_schedules, pgqueue_stats,"
            f" pgqueue_depth, pgqueue_queues, pgqueue_job_deps TO {role}"
        )
        job = app.enqueue("t", {}, allow_unknown=True)
        role_dsn = psycopg.conninfo.make_conninfo(dsn, user=role, password="change-me")
        with TestClient(create_app(role_dsn), base_url="http://127.0.0.1") as client:
            page = client.get(f"/jobs/{job}")
            assert page.status_code == 200
            assert "cannot read what this needs" in page.text and "pgqueue_tasks" in page.text
            assert "cannot read earlier attempts" in page.text  # pgqueue_attempts: version 16
    finally:
        conn.execute(f"DROP OWNED BY {role}")
        conn.execute(f"DROP ROLE {role}")


async def test_the_reasons_follow_a_real_worker(dsn: str, app: pgqueue.App) -> None:
    """A real worker registers, claims (plainly and under limits) and logs its starts: the page
    reads what it wrote, and a job it calls free is the next one to start."""
    release = asyncio.Event()

    @app.task
    async def hold(n: int) -> int:
        await release.wait()
        return n

    @app.task(queue="other")
    async def elsewhere() -> None: ...

    def status(job_id: int) -> str | None:
        job = app.get_job(job_id)
        return job.status if job else None

    lonely = elsewhere.enqueue()
    first, second = hold.enqueue(n=1), hold.enqueue(n=2)
    assert await reasons_of(dsn, second) == ["no_worker"]
    async with running_worker(app, queues=["default"], concurrency=1, prefetch=0, **BEAT):
        await wait_until_async(lambda: status(first) == "running" or status(second) == "running")
        waiting = second if status(first) == "running" else first
        assert await reasons_of(dsn, waiting) == ["workers_busy"]
        assert await reasons_of(dsn, lonely) == ["no_worker_for_queue"]
        # Limits are obeyed by the limited claim, which the worker switches to by itself.
        app.limit_queue("default", limit=1)
        assert await reasons_of(dsn, waiting) == ["queue_limit", "workers_busy"]
        release.set()
        await wait_until_async(lambda: status(waiting) == "succeeded")
        # A job called free starts; the rate it used up is in the limited claim's log of starts
        # (pgqueue_rates), and the next job waits for it.
        app.limit_queue("default", limit=None, rate="1/h")
        third = hold.enqueue(n=3)
        # (No reason at all once it started: the worker can be quicker than this read.)
        assert await reasons_of(dsn, third) in (["ready"], [])
        await wait_until_async(lambda: status(third) == "succeeded")
        fourth = hold.enqueue(n=4)
        assert await reasons_of(dsn, fourth) == ["queue_rate"]


async def test_a_real_worker_records_its_tasks_and_leaves_unknown_ones_waiting(
    dsn: str, app: pgqueue.App
) -> None:
    """The worker writes the tasks its code has when it starts; a job of another task, which it
    gives back unrun, is explained on the page rather than called free."""

    @app.task
    async def known() -> None: ...

    ghost = app.enqueue("ghost", {}, allow_unknown=True)
    async with running_worker(app, concurrency=2, **BEAT):
        done = known.enqueue()
        await wait_until_async(
            lambda: (j := app.get_job(done)) is not None and j.status == "succeeded"
        )
        assert await reasons_of(dsn, ghost) == ["unknown_task"]
        job = app.get_job(ghost)
        assert job is not None and job.status == "queued" and job.attempts == 0
