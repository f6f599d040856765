from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner, Result

import pgqueue
from pgqueue.cli import main
from pgqueue.migrate import available

Conn = psycopg.Connection[tuple[Any, ...]]
UNREACHABLE = "postgresql://postgres@127.0.0.1:1/x"


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.delenv("PGQUEUE_DSN", raising=False)
    monkeypatch.delenv("DATABASE_URL", raising=False)
    return CliRunner()


def run(runner: CliRunner, *args: str, env: dict[str, str] | None = None) -> Result:
    return runner.invoke(main, list(args), env=env, catch_exceptions=False)


def test_version_prints_the_package_version(runner: CliRunner) -> None:
    result = run(runner, "--version")
    assert result.exit_code == 0
    assert result.output.strip() == f"pgqueue, version {version('pgqueue-jobs')}"
    assert pgqueue.__version__ == version("pgqueue-jobs")


def test_version_from_a_real_subprocess() -> None:
    exe = Path(sys.executable).with_name("pgqueue")
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "pgqueue.cli"]
    out = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert version("pgqueue-jobs") in out.stdout


def test_migrate_then_up_to_date(runner: CliRunner, empty_dsn: str) -> None:
    first = run(runner, "migrate", "--dsn", empty_dsn)
    assert first.exit_code == 0 and first.output.strip() == "applied migrations: " + ", ".join(
        f"{m.version:04d}" for m in available()
    )
    second = run(runner, "migrate", "--dsn", empty_dsn)
    assert second.exit_code == 0 and second.output.strip() == "schema is up to date"


def test_migrate_kept_waiting_past_its_timeout_is_one_error_line_naming_the_holder(
    runner: CliRunner, empty_dsn: str
) -> None:
    with psycopg.connect(empty_dsn, autocommit=True) as other:
        other.execute("SELECT pg_advisory_lock(hashtextextended('pgqueue.migrate:public', 0))")
        result = run(
            runner, "migrate", "--dsn", empty_dsn, "--lock-timeout", "0.1", "--timeout", "0.5"
        )
        assert result.exit_code == 1, result.output
        assert (
            result.stderr.strip()
            .splitlines()[-1]
            .startswith(
                "error: another migration of schema 'public' held the migration lock for all of "
                f"0.5 s (held by pid {other.info.backend_pid} (idle, connected for "
            )
        )
        assert "Traceback" not in result.output


@pytest.mark.parametrize("option", ["--lock-timeout", "--timeout"])
def test_migrate_refuses_a_timeout_that_is_not_positive(
    runner: CliRunner, empty_dsn: str, option: str
) -> None:
    result = runner.invoke(main, ["migrate", "--dsn", empty_dsn, option, "0"])
    assert result.exit_code == 2
    assert f"Invalid value for '{option}'" in result.stderr


def test_enqueue_with_a_unique_key_prints_the_holding_jobs_id_the_second_time(
    runner: CliRunner, dsn: str, conn: Conn
) -> None:
    first = run(runner, "enqueue", "hook", "--unique-key", "evt-1", "--dsn", dsn)
    second = run(runner, "enqueue", "hook", "--unique-key", "evt-1", "--dsn", dsn)
    assert first.exit_code == 0 and second.exit_code == 0, second.output
    job_id = int(first.output.strip())
    assert second.output.strip() == f"{job_id} (duplicate)"
    assert conn.execute("SELECT count(*) FROM pgqueue_jobs").fetchone() == (1,)
    too_long = run(runner, "enqueue", "hook", "--unique-key", "k" * 1001, "--dsn", dsn)
    assert too_long.exit_code != 0 and "the limit is 1,000" in too_long.output
    assert "Traceback" not in too_long.output


def test_enqueue_job_status_cancel_requeue(runner: CliRunner, dsn: str, conn: Conn) -> None:
    result = run(
        runner,
        "enqueue",
        "send_email",
        "--args",
        '{"to": "a@example.com", "n": 3}',
        "--queue",
        "emails",
        "--delay",
        "30",
        "--priority",
        "7",
        "--dsn",
        dsn,
    )
    assert result.exit_code == 0, result.output
    job_id = int(result.output.strip())
    row = conn.execute(
        "SELECT task, queue, priority, args, extract(epoch FROM run_at - created_at)::float8"
        " FROM pgqueue_jobs WHERE id = %s",
        (job_id,),
    ).fetchone()
    assert row is not None
    assert row[:4] == ("send_email", "emails", 7, {"to": "a@example.com", "n": 3})
    assert row[4] == pytest.approx(30, abs=0.01)

    shown = run(runner, "job", str(job_id), "--dsn", dsn)
    assert shown.exit_code == 0
    assert f"id: {job_id}" in shown.output and "status: queued" in shown.output
    assert 'args: {"n": 3, "to": "a@example.com"}' in shown.output  # jsonb key order
    as_json = json.loads(run(runner, "job", str(job_id), "--json", "--dsn", dsn).output)
    assert as_json["task"] == "send_email" and as_json["priority"] == 7

    status = run(runner, "status", "--dsn", dsn)
    assert status.exit_code == 0
    header, line = status.output.splitlines()
    assert header.split() == [
        "queue",
        "queued",
        "running",
        "retrying",
        "succeeded",
        "dead",
        "cancelled",
        "blocked",
    ]
    assert line.split() == ["emails", "1", "0", "0", "0", "0", "0", "0"]

    refused = runner.invoke(main, ["requeue", str(job_id), "--dsn", dsn])
    assert refused.exit_code == 1 and "is not dead or cancelled" in refused.output

    cancelled = run(runner, "cancel", str(job_id), "--dsn", dsn)
    assert cancelled.exit_code == 0 and cancelled.output.strip() == f"job {job_id} cancelled"
    again = runner.invoke(main, ["cancel", str(job_id), "--dsn", dsn])
    assert again.exit_code == 1 and "had already finished" in again.output

    requeued = run(runner, "requeue", str(job_id), "--dsn", dsn)
    assert requeued.exit_code == 0 and requeued.output.strip() == f"job {job_id} requeued"
    assert conn.execute("SELECT status::text FROM pgqueue_jobs").fetchone() == ("queued",)


def test_status_and_missing_job_on_an_empty_queue(runner: CliRunner, dsn: str) -> None:
    assert run(runner, "status", "--dsn", dsn).output.strip() == "no jobs"
    missing = runner.invoke(main, ["job", "999", "--dsn", dsn])
    assert missing.exit_code == 1 and "job 999 does not exist" in missing.output


def test_invalid_json_args_is_a_usage_error(runner: CliRunner, dsn: str, conn: Conn) -> None:
    result = runner.invoke(main, ["enqueue", "t", "--args", "{not json", "--dsn", dsn])
    assert result.exit_code == 2
    assert "Invalid value for --args" in result.output and "not valid JSON" in result.output
    assert conn.execute("SELECT count(*) FROM pgqueue_jobs").fetchone() == (0,)


def test_refused_job_is_one_error_line(runner: CliRunner, dsn: str) -> None:
    result = runner.invoke(main, ["enqueue", "t", "--args", '{"x": NaN}', "--dsn", dsn])
    assert result.exit_code == 1
    assert result.stderr.strip().startswith("error: argument x is nan")
    assert "Traceback" not in result.output


def test_missing_tables_say_to_migrate(runner: CliRunner, empty_dsn: str) -> None:
    result = runner.invoke(main, ["status", "--dsn", empty_dsn])
    assert result.exit_code == 1
    assert (
        result.stderr.strip()
        == "error: pgqueue's tables are missing or older than this pgqueue: run `pgqueue migrate` first"
    )


@pytest.mark.parametrize(
    "args",
    [
        ["migrate"],
        ["status"],
        ["job", "1"],
        ["cancel", "1"],
        ["requeue", "1"],
        ["enqueue", "t", "--args", "{}"],
    ],
)
def test_unreachable_database_is_one_line_and_exit_code_2(
    runner: CliRunner, args: list[str]
) -> None:
    result = runner.invoke(main, [*args, "--dsn", UNREACHABLE])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: cannot connect to PostgreSQL at 127.0.0.1:1/x")
    assert "Traceback" not in result.output
    assert result.stdout == ""


def test_unreachable_database_in_a_real_subprocess() -> None:
    exe = Path(sys.executable).with_name("pgqueue")
    env = {k: v for k, v in os.environ.items() if k not in ("PGQUEUE_DSN", "DATABASE_URL")}
    out = subprocess.run(
        [str(exe), "status", "--dsn", UNREACHABLE],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert out.returncode == 2
    assert out.stdout == ""
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: ")


def test_no_dsn_anywhere_is_a_clear_error(runner: CliRunner) -> None:
    result = runner.invoke(main, ["status"])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: no database configured")


@pytest.mark.parametrize("variable", ["PGQUEUE_DSN", "DATABASE_URL"])
def test_dsn_from_the_environment(runner: CliRunner, dsn: str, variable: str) -> None:
    result = run(runner, "enqueue", "t", env={variable: dsn})
    assert result.exit_code == 0, result.output
    job_id = int(result.output)
    assert run(runner, "job", str(job_id), env={variable: dsn}).exit_code == 0


def test_pgqueue_dsn_wins_over_database_url(runner: CliRunner, dsn: str) -> None:
    result = run(runner, "status", env={"PGQUEUE_DSN": dsn, "DATABASE_URL": UNREACHABLE})
    assert result.exit_code == 0 and result.output.strip() == "no jobs"
    flag = run(runner, "status", "--dsn", dsn, env={"PGQUEUE_DSN": UNREACHABLE})
    assert flag.exit_code == 0


def test_worker_refuses_a_negative_prefetch(runner: CliRunner, dsn: str) -> None:
    result = runner.invoke(main, ["worker", "--app", "x:app", "--prefetch", "-1", "--dsn", dsn])
    assert result.exit_code == 2
    assert "--prefetch" in result.output


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--delay", "1e300"], "error: delay must be at most 3,155,760,000 seconds (100 years)"),
        (["--delay", "3e11"], "error: delay must be at most 3,155,760,000 seconds (100 years)"),
        (["--delay", "inf"], "error: delay must be a finite, non-negative number of seconds"),
        (["--delay", "-1"], "error: delay must be a finite, non-negative number of seconds"),
        (["--queue", "emails,sms"], "error: queue name 'emails,sms' must not contain a comma"),
        (["--queue", "emails "], "error: queue name 'emails ' must not start or end with"),
        (["--priority", str(2**40)], "error: priority must be between"),
        (["--args", "[1]"], "error: args must be a mapping of keyword arguments"),
        (["--args", '{"x": "' + "a" * 2_000_000 + '"}'], "error: arguments are 2,000,008 bytes"),
    ],
)
def test_refused_enqueue_options_are_one_line_and_write_nothing(
    runner: CliRunner, dsn: str, conn: Conn, options: list[str], message: str
) -> None:
    result = runner.invoke(main, ["enqueue", "t", *options, "--dsn", dsn])
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1
    assert conn.execute("SELECT count(*) FROM pgqueue_jobs").fetchone() == (0,)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ("[" * 30_000 + "]" * 30_000, "nested too deeply (the limit is 100 levels)"),
        ('{"n": ' + "9" * 5000 + "}", "not valid JSON: Exceeds the limit (4300 digits)"),
        ("{not json", "not valid JSON"),
    ],
)
def test_args_python_cannot_parse_are_a_usage_error_not_a_traceback(
    runner: CliRunner, dsn: str, conn: Conn, args: str, message: str
) -> None:
    result = runner.invoke(main, ["enqueue", "t", "--args", args, "--dsn", dsn])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "Invalid value for --args: " + message in result.stderr
    assert conn.execute("SELECT count(*) FROM pgqueue_jobs").fetchone() == (0,)


@pytest.mark.parametrize("command", ["job", "cancel", "requeue"])
def test_a_job_id_beyond_bigint_is_a_usage_error(runner: CliRunner, dsn: str, command: str) -> None:
    result = runner.invoke(main, [command, str(2**63), "--dsn", dsn])
    assert result.exit_code == 2
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "is not in the range 1<=x<=9223372036854775807" in result.stderr


def test_a_row_python_cannot_read_is_one_line_not_a_traceback(
    runner: CliRunner, dsn: str, conn: Conn
) -> None:
    """Older versions accepted run_at in the year 11533, which no Python datetime can hold."""
    row = conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, args, run_at) "
        "VALUES ('default', 't', '{}', '11533-01-01 00:00+00') RETURNING id"
    ).fetchone()
    assert row is not None
    result = runner.invoke(main, ["job", str(row[0]), "--dsn", dsn])
    assert result.exit_code == 1
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert result.stderr.startswith("error: database error: ")
    assert result.stderr.count("\n") == 1


def test_worker_queues_flag_splits_on_commas_and_strips_spaces(
    runner: CliRunner, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    served: list[object] = []
    monkeypatch.setattr(pgqueue.App, "run_worker", lambda self, **o: served.append(o["queues"]))
    result = runner.invoke(
        main,
        ["worker", "--app", "tests.acceptance.jobs_app:app", "--queues", " a, b ,,c", "--dsn", dsn],
    )
    assert result.exit_code == 0, result.output
    assert served == [["a", "b", "c"]]
