"""The configuration reference cannot drift from the code: every parameter and environment
variable the code has is on the page, and the page names none the code lacks."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import pgqueue
from pgqueue import environment
from pgqueue.cli import main
from pgqueue.tasks import Task
from pgqueue.worker.runtime import Worker

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "reference" / "configuration.md").read_text()


def section(title: str) -> str:
    start = PAGE.index(f"## {title}")
    end = PAGE.find("\n## ", start + 1)
    return PAGE[start : end if end != -1 else None]


def first_column(text: str) -> set[str]:
    """Backticked names in the first cell of each table row."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("| `"):
            names.update(re.findall(r"`(\w+)`", line.split("|")[1]))
    return names


def parameters(func: Callable[..., Any]) -> set[str]:
    return {
        name
        for name, p in inspect.signature(func).parameters.items()
        if name not in ("self", "func", "app") and p.kind is not p.VAR_KEYWORD
    }


@pytest.mark.parametrize(
    ("title", "funcs"),
    [
        ("The app", [pgqueue.App.__init__]),
        ("Tasks", [pgqueue.App.task]),
        ("Per job", [Task.configure, pgqueue.App.enqueue]),
        ("Schedules", [pgqueue.App.periodic, pgqueue.App.schedule]),
        ("Workers", [Worker.__init__]),
        ("Migrations", [pgqueue.App.migrate]),
    ],
)
def test_every_parameter_is_documented_and_nothing_else(
    title: str, funcs: list[Callable[..., Any]]
) -> None:
    in_code = set().union(*(parameters(f) for f in funcs))
    if title == "Per job":
        in_code -= {"task", "args"}  # positional: what to run, not how
    assert first_column(section(title)) == in_code


def test_every_environment_variable_is_documented() -> None:
    in_code = set()
    for path in (ROOT / "src" / "pgqueue").rglob("*.py"):
        text = path.read_text()
        in_code |= set(re.findall(r'environ\.get\("([A-Z_]+)"', text))
        in_code |= set(re.findall(r'envvar="([A-Z_]+)"', text))
    assert first_column(section("Environment variables")) == in_code


@pytest.mark.parametrize(
    ("command", "title"),
    [
        ("worker", "Workers"),
        ("dashboard", "Dashboard"),
        ("migrate", "Migrations"),
        ("demo", "Demo"),
    ],
)
def test_every_option_of_the_command_has_its_environment_variable_documented(
    command: str, title: str
) -> None:
    variables = {
        str(option.envvar) for path, option in environment.options(main) if path == (command,)
    }
    assert variables, f"pgqueue {command} has no options?"
    documented = set(re.findall(r"`(PGQUEUE_[A-Z_]+)`", section(title)))
    assert variables - documented == set()
    # and the page names none the command does not read
    assert {v for v in documented if v.startswith(f"PGQUEUE_{command.upper()}_")} <= variables
