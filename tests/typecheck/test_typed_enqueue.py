"""`task.enqueue(...)` is checked against the handler's signature by mypy and pyright, without
the parameters the worker fills. enqueue_calls.py holds calls both must accept and calls both
must refuse (marked ``# type: ignore[code]``, so that `make typecheck` passes and an expected
error that disappears is an unused ignore). Here both checkers run on a copy without the marks:
the lines they flag must be exactly the marked ones."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CALLS = Path(__file__).with_name("enqueue_calls.py")
MARK = re.compile(r"  # type: ignore\[[a-z-]+\]$")

pytestmark = pytest.mark.slow


def unmarked(tmp_path: Path) -> tuple[Path, set[int]]:
    """A copy of the calls without the bad calls' marks, and the lines that had one."""
    lines = CALLS.read_text().splitlines()
    bad_from = next(i for i, line in enumerate(lines) if line.startswith("async def bad_calls"))
    expected = set()
    for i in range(bad_from, len(lines)):
        if MARK.search(lines[i]):
            lines[i] = MARK.sub("", lines[i])
            expected.add(i + 1)
    copy = tmp_path / "enqueue_calls.py"
    copy.write_text("\n".join(lines) + "\n")
    return copy, expected


def test_only_bad_calls_are_marked(tmp_path: Path) -> None:
    copy, expected = unmarked(tmp_path)
    assert len(expected) >= 10
    assert "# type: ignore[" not in copy.read_text().split("async def bad_calls")[1]


def test_mypy_refuses_exactly_the_bad_calls(tmp_path: Path) -> None:
    copy, expected = unmarked(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
         "--cache-dir", str(ROOT / ".mypy_cache" / "typed-enqueue"), "--no-pretty",
         "--show-error-codes", str(copy)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    flagged = {int(m[1]) for m in re.finditer(r"^[^:\n]+:(\d+): error:", out.stdout, re.MULTILINE)}
    assert flagged == expected, out.stdout


@pytest.mark.skipif(importlib.util.find_spec("pyright") is None, reason="needs pyright (dev extra)")
def test_pyright_refuses_exactly_the_bad_calls(tmp_path: Path) -> None:
    copy, expected = unmarked(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "pyright", "--outputjson", "--pythonpath", sys.executable,
         str(copy)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    report = json.loads(out.stdout)
    flagged = {
        d["range"]["start"]["line"] + 1
        for d in report["generalDiagnostics"]
        if d["severity"] == "error"
    }
    assert flagged == expected, json.dumps(report["generalDiagnostics"], indent=1)
