"""``pgqueue queues``: list, pause and resume queues from the command line."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from click.testing import CliRunner, Result

import pgqueue
from pgqueue.cli import main

Conn = psycopg.Connection[tuple[Any, ...]]
UNREACHABLE = "postgresql://postgres@127.0.0.1:1/x"


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.delenv("PGQUEUE_DSN", raising=False)
    monkeypatch.delenv("DATABASE_URL", raising=False)
    return CliRunner()


def run(runner: CliRunner, *args: str) -> Result:
    return runner.invoke(main, list(args), catch_exceptions=False)


def test_pause_list_and_resume(runner: CliRunner, dsn: str, app: pgqueue.App) -> None:
    assert run(runner, "queues", "list", "--dsn", dsn).output == (
        "no queues: no jobs, and none paused or limited\n"
    )
    app.enqueue("t", {}, queue="emails", allow_unknown=True)
    app.enqueue("t", {}, queue="reports", allow_unknown=True)

    paused = run(runner, "queues", "pause", "emails", "--dsn", dsn)
    assert paused.exit_code == 0 and paused.output == "queue 'emails' paused\n"
    again = run(runner, "queues", "pause", "emails", "--dsn", dsn)
    assert again.exit_code == 0 and again.output == "queue 'emails' was already paused\n"
    run(runner, "queues", "pause", "empty-yet", "--dsn", dsn)  # no job needed to pause
    assert app.paused_queues() == ["emails", "empty-yet"]

    listed = run(runner, "queues", "list", "--dsn", dsn)
    assert listed.exit_code == 0
    header, *rows = listed.output.splitlines()
    assert header.split() == [
        "queue", "queued", "running", "retrying", "succeeded", "dead", "cancelled", "blocked",
        "state",
    ]  # fmt: skip
    by_queue = {row.split()[0]: row.split()[1:] for row in rows}
    assert by_queue["emails"][:7] == ["1", "0", "0", "0", "0", "0", "0"]
    assert by_queue["emails"][7:9] == ["paused", "since"] and by_queue["emails"][-1] == "UTC"
    assert by_queue["empty-yet"][:9] == ["0", "0", "0", "0", "0", "0", "0", "paused", "since"]
    assert by_queue["reports"] == ["1", "0", "0", "0", "0", "0", "0"]

    resumed = run(runner, "queues", "resume", "emails", "--dsn", dsn)
    assert resumed.exit_code == 0 and resumed.output == "queue 'emails' resumed\n"
    not_paused = run(runner, "queues", "resume", "emails", "--dsn", dsn)
    assert not_paused.exit_code == 0 and not_paused.output == "queue 'emails' was not paused\n"
    assert app.paused_queues() == ["empty-yet"]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("a,b", "error: queue name 'a,b' must not contain a comma"),
        ("", "error: queue name must not be empty"),
        ("x" * 129, "error: queue name is 129 characters; the limit is 128"),
    ],
)
@pytest.mark.parametrize("command", ["pause", "resume"])
def test_a_name_no_queue_could_have_is_one_error_line(
    runner: CliRunner, dsn: str, conn: Conn, command: str, name: str, message: str
) -> None:
    result = runner.invoke(main, ["queues", command, name, "--dsn", dsn])
    assert result.exit_code == 1
    assert result.stderr == message + "\n" and result.stdout == ""
    assert conn.execute("SELECT count(*) FROM pgqueue_queues").fetchone() == (0,)


@pytest.mark.parametrize("args", [["list"], ["pause", "q"], ["resume", "q"]])
def test_unreachable_database_is_one_line_and_exit_code_2(
    runner: CliRunner, args: list[str]
) -> None:
    result = runner.invoke(main, ["queues", *args, "--dsn", UNREACHABLE])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: cannot connect to PostgreSQL at 127.0.0.1:1/x")
    assert len(result.stderr.strip().splitlines()) == 1 and result.stdout == ""


@pytest.mark.parametrize("args", [["list"], ["pause", "q"]])
def test_missing_tables_say_to_migrate(runner: CliRunner, empty_dsn: str, args: list[str]) -> None:
    result = runner.invoke(main, ["queues", *args, "--dsn", empty_dsn])
    assert result.exit_code == 1
    assert (
        result.stderr
        == "error: pgqueue's tables are missing or older than this pgqueue: run `pgqueue migrate` first\n"
    )


def test_limit_and_rate_a_queue_and_a_task_at_run_time(
    runner: CliRunner, dsn: str, app: pgqueue.App
) -> None:
    limited = run(runner, "queues", "limit", "api", "3", "--dsn", dsn)
    assert limited.exit_code == 0 and limited.output == "queue 'api': limit 3\n"
    rated = run(runner, "queues", "rate", "api", "100/m", "--dsn", dsn)
    assert rated.exit_code == 0 and rated.output == "queue 'api': rate 100/m\n"
    run(runner, "queues", "pause", "api", "--dsn", dsn)
    listed = run(runner, "queues", "list", "--dsn", dsn).output.splitlines()
    assert listed[1].split()[0] == "api" and listed[1].endswith("UTC; limit 3; rate 100/m")
    [setting] = app.queue_limits()
    assert (setting.limit, str(setting.rate), setting.paused) == (3, "100/m", True)

    cleared = run(runner, "queues", "limit", "api", "none", "--dsn", dsn)
    assert cleared.output == "queue 'api': no limit\n"
    assert [(s.limit, str(s.rate)) for s in app.queue_limits()] == [(None, "100/m")]

    assert run(runner, "tasks", "list", "--dsn", dsn).output == "no task has a limit or a rate\n"
    assert run(runner, "tasks", "limit", "send", "2", "--dsn", dsn).exit_code == 0
    assert run(runner, "tasks", "rate", "send", "10/5m", "--dsn", dsn).exit_code == 0
    header, row = run(runner, "tasks", "list", "--dsn", dsn).output.splitlines()
    assert header.split() == ["task", "limit", "rate", "per", "key", "set", "by"]
    assert row.split() == ["send", "2", "10/5m", "no", "operator"]
    assert run(runner, "tasks", "reset", "send", "--dsn", dsn).output == (
        "task 'send': the code's limit and rate apply from the next worker start\n"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["queues", "limit", "api", "2.5"], "give a whole number of jobs, or 'none'"),
        (["queues", "limit", "api", "lots"], "give a whole number of jobs, or 'none'"),
        (["queues", "rate", "api", "100"], "is not understood"),
        (["tasks", "rate", "t", "0/m"], "the count must be a whole number from 1"),
        (["queues", "limit", " bad", "1"], "queue name"),
    ],
)
def test_bad_limits_and_rates_get_one_line_errors(
    runner: CliRunner, dsn: str, args: list[str], message: str
) -> None:
    result = runner.invoke(main, [*args, "--dsn", dsn])
    assert result.exit_code != 0
    assert message in result.output
    assert "Traceback" not in result.output


def test_the_groups_alone_list_and_take_the_database_before_a_subcommand(
    runner: CliRunner, dsn: str, app: pgqueue.App
) -> None:
    app.enqueue("t", {}, queue="emails", allow_unknown=True)
    # `pgqueue queues` / `pgqueue tasks` alone list, like their `list`.
    assert (
        run(runner, "queues", "--dsn", dsn).output
        == run(runner, "queues", "list", "--dsn", dsn).output
    )
    assert run(runner, "tasks", "--dsn", dsn).output == "no task has a limit or a rate\n"
    # The database given before the subcommand is the one it uses...
    paused = run(runner, "queues", "--dsn", dsn, "pause", "emails")
    assert paused.exit_code == 0 and paused.output == "queue 'emails' paused\n"
    assert app.paused_queues() == ["emails"]
    assert run(runner, "tasks", "--dsn", dsn, "limit", "send", "2").exit_code == 0
    assert [(t.name, t.limit) for t in app.task_limits()] == [("send", 2)]
    # ... unless the subcommand names its own.
    resumed = run(runner, "queues", "--dsn", UNREACHABLE, "resume", "emails", "--dsn", dsn)
    assert resumed.exit_code == 0 and app.paused_queues() == []
    unreachable = run(runner, "queues", "--dsn", UNREACHABLE)
    assert unreachable.exit_code == 2 and unreachable.output.startswith("error: cannot connect")
