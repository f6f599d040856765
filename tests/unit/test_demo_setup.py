"""The demo's refusals: each is one clear line, with nothing started."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from pgqueue import embedded
from pgqueue.cli import main
from pgqueue.embedded import start_throwaway
from pgqueue.errors import ConfigurationError


def test_unknown_backend_is_refused_before_anything_starts() -> None:
    with pytest.raises(ConfigurationError, match="unknown PostgreSQL backend"):
        start_throwaway("docker")


def test_demo_refuses_a_bad_schema_name_in_one_line() -> None:
    result = CliRunner().invoke(main, ["demo", "--schema", "x; DROP TABLE y"])
    assert result.exit_code == 1
    assert result.output.startswith("error: invalid schema name")
    assert "Traceback" not in result.output


def test_demo_refuses_an_unknown_postgres_choice() -> None:
    result = CliRunner().invoke(main, ["demo", "--postgres", "docker"])
    assert result.exit_code == 2
    assert "'docker' is not one of" in result.output


def test_no_local_server_and_no_pgserver_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(embedded, "find_bindir", lambda: None)
    monkeypatch.setattr(embedded, "import_pgserver", lambda: None)
    with pytest.raises(ConfigurationError) as error:
        start_throwaway("auto")
    message = str(error.value)
    assert "PostgreSQL server binaries" in message
    assert "pip install 'pgqueue-jobs[embedded]'" in message
    assert "--dsn" in message
