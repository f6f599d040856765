"""`make demo` and `make test` on a machine without npm stop at once, with one sentence saying
what to install, instead of failing after a minute of pip installs; with the dashboard's assets
already built, npm is not needed at all."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENDOR = Path("src/pgqueue/dashboard/static/vendor")

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def checkout(tmp_path: Path, *, built: bool) -> Path:
    """The files make reads, in a fresh directory: no .venv, no node_modules."""
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("Makefile", "dashboard.mk", "package.json", "package-lock.json", "pyproject.toml"):
        shutil.copy2(ROOT / name, tree / name)
    if built:
        (tree / VENDOR).mkdir(parents=True)
        for name in ("uPlot.iife.min.js", "uPlot.min.css"):
            (tree / VENDOR / name).write_text("/* built */")
    return tree


def tools_without_npm(tmp_path: Path) -> Path:
    """A PATH holding make and a shell, and no npm."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("make", "sh"):
        found = shutil.which(tool)
        assert found is not None
        (bin_dir / tool).symlink_to(found)
    return bin_dir


def run_make(tree: Path, path: Path, goal: str, *flags: str) -> subprocess.CompletedProcess[str]:
    # A python that records being called: the check must come before the venv and pip.
    fake_python = tree / "fake-python"
    fake_python.write_text(f"#!/bin/sh\ntouch {tree / 'python-was-run'}\nexit 1\n")
    fake_python.chmod(0o755)
    env = {"PATH": str(path), "HOME": os.environ.get("HOME", "/tmp")}
    return subprocess.run(
        ["make", *flags, goal, f"PYTHON={fake_python}"],
        cwd=tree, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.parametrize("goal", ["demo", "test", "assets"])
def test_without_npm_make_stops_before_installing_anything(tmp_path: Path, goal: str) -> None:
    tree = checkout(tmp_path, built=False)
    result = run_make(tree, tools_without_npm(tmp_path), goal)
    assert result.returncode != 0
    assert "npm is needed to build the dashboard's chart library" in result.stderr
    assert "install Node.js with npm" in result.stderr
    assert len([line for line in result.stderr.splitlines() if line.strip()]) == 1
    assert not (tree / "python-was-run").exists()
    assert not (tree / ".venv").exists()


def test_built_assets_need_no_npm(tmp_path: Path) -> None:
    tree = checkout(tmp_path, built=True)
    result = run_make(tree, tools_without_npm(tmp_path), "demo", "-n")
    assert result.returncode == 0, result.stderr
    assert "npm ci" not in result.stdout
    assert "pip install" in result.stdout


def test_goals_that_build_no_assets_need_no_npm(tmp_path: Path) -> None:
    tree = checkout(tmp_path, built=False)
    result = run_make(tree, tools_without_npm(tmp_path), "lint", "-n")
    assert result.returncode == 0, result.stderr
