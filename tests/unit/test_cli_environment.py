"""Every `pgqueue` option can come from the environment: PGQUEUE_<COMMAND>_<OPTION>."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

import pgqueue
from pgqueue import environment
from pgqueue.cli import main


@pytest.fixture
def app_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """An importable module with an App, for `pgqueue worker --app`."""
    (tmp_path / "env_app.py").write_text(
        textwrap.dedent("""
        import pgqueue
        app = pgqueue.App("postgresql://nobody@127.0.0.1:1/none")
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "env_app:app"
    sys.modules.pop("env_app", None)


@pytest.fixture
def worker_options(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What `pgqueue worker` hands to App.run_worker (which is not run)."""
    seen: dict[str, Any] = {}
    monkeypatch.setattr(pgqueue.App, "run_worker", lambda self, **options: seen.update(options))
    return seen


def invoke(args: list[str], env: dict[str, str]) -> click.testing.Result:
    return CliRunner().invoke(main, args, env=env)


def test_worker_options_come_from_the_environment(
    app_module: str, worker_options: dict[str, Any]
) -> None:
    result = invoke(
        ["worker"],
        {
            "PGQUEUE_WORKER_APP": app_module,
            "PGQUEUE_WORKER_CONCURRENCY": "7",
            "PGQUEUE_WORKER_QUEUES": "emails, reports",
            "PGQUEUE_WORKER_LEASE": "45",
            "PGQUEUE_WORKER_NO_LISTEN": "true",
            "PGQUEUE_WORKER_EVENT_LOOP": "asyncio",
        },
    )
    assert result.exit_code == 0, result.output
    assert worker_options["concurrency"] == 7
    assert worker_options["queues"] == ["emails", "reports"]
    assert worker_options["lease"] == 45.0
    assert worker_options["listen"] is False
    assert worker_options["event_loop"] == "asyncio"


def test_the_command_line_wins_over_the_environment(
    app_module: str, worker_options: dict[str, Any]
) -> None:
    result = invoke(
        ["worker", "--app", app_module, "--concurrency", "3"],
        {"PGQUEUE_WORKER_CONCURRENCY": "7"},
    )
    assert result.exit_code == 0, result.output
    assert worker_options["concurrency"] == 3


def test_a_bad_value_in_the_environment_names_its_variable(app_module: str) -> None:
    result = invoke(["worker", "--app", app_module], {"PGQUEUE_WORKER_CONCURRENCY": "lots"})
    assert result.exit_code == 2
    assert (
        "Invalid value for '--concurrency' from $PGQUEUE_WORKER_CONCURRENCY: 'lots' is not a "
        "valid integer range" in result.output
    )


def test_an_out_of_range_value_in_the_environment_is_refused(app_module: str) -> None:
    result = invoke(["worker", "--app", app_module], {"PGQUEUE_WORKER_CONCURRENCY": "0"})
    assert result.exit_code == 2
    assert "from $PGQUEUE_WORKER_CONCURRENCY: 0 is not in the range" in result.output


def test_dashboard_options_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("starlette")
    from pgqueue.dashboard import cli as dashboard_cli

    seen: dict[str, Any] = {}
    monkeypatch.setattr(
        dashboard_cli, "serve", lambda *args, **kwargs: seen.update(args=args, **kwargs)
    )
    result = invoke(
        ["dashboard"],
        {
            "PGQUEUE_DSN": "postgresql://nobody@127.0.0.1:1/none",
            "PGQUEUE_DASHBOARD_PORT": "9123",
            "PGQUEUE_DASHBOARD_REFRESH": "2.5",
            "PGQUEUE_DASHBOARD_ALLOWED_HOST": "queue.example.com other.example.com",
        },
    )
    assert result.exit_code == 0, result.output
    assert seen["args"][3] == 9123
    assert seen["refresh_interval"] == 2.5
    assert seen["allowed_hosts"] == ["queue.example.com", "other.example.com"]


def test_nested_commands_carry_their_group_in_the_name() -> None:
    names = {(path, option.opts[0]): option.envvar for path, option in environment.options(main)}
    assert names[(("queues", "pause"), "--schema")] == "PGQUEUE_QUEUES_PAUSE_SCHEMA"
    assert names[(("worker",), "--app")] == "PGQUEUE_WORKER_APP"
    assert names[(("dashboard",), "--late-after")] == "PGQUEUE_DASHBOARD_LATE_AFTER"
    assert names[(("worker",), "--dsn")] == "PGQUEUE_DSN"  # its own name, kept


def test_every_option_has_a_variable_shown_in_help() -> None:
    missing = [
        (path, option.opts)
        for path, option in environment.options(main)
        if not option.envvar or not option.show_envvar
    ]
    assert missing == []
    result = invoke(["worker", "--help"], {})
    assert "PGQUEUE_WORKER_CONCURRENCY" in result.output


def test_version_and_help_read_no_variable(app_module: str, worker_options: dict[str, Any]) -> None:
    # A deploy's own PGQUEUE_VERSION must not turn every command into a version print.
    result = invoke(
        ["worker", "--app", app_module],
        {"PGQUEUE_VERSION": "1.2.3", "PGQUEUE_HELP": "1", "PGQUEUE_WORKER_HELP": "1"},
    )
    assert result.exit_code == 0, result.output
    assert worker_options["concurrency"] == 10
