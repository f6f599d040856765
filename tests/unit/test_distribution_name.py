"""Every install line names the distribution pyproject.toml declares: `pgqueue` on PyPI is an
unrelated project, so `pip install pgqueue` would install someone else's code."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pgqueue

ROOT = Path(__file__).resolve().parents[2]
NAME = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"]
#: A package pip is told to install: `pip install [options] spec` or `'spec[extras]'`.
INSTALL = re.compile(r"pip install\s+(?:--?[\w-]+\s+)*['\"]?([\w.-]+)(\[[\w,-]*\])?")


def install_specs() -> list[tuple[str, str]]:
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "src").rglob("*.py")]
    return [
        (str(path.relative_to(ROOT)), match.group(1))
        for path in files
        for match in INSTALL.finditer(path.read_text())
    ]


def test_every_install_line_names_the_distribution() -> None:
    ours = [(path, spec) for path, spec in install_specs() if spec.startswith("pgqueue")]
    assert ours, "no install line found: is the pattern still right?"
    assert [(path, spec) for path, spec in ours if spec != NAME] == []


def test_the_readme_says_how_to_install_it() -> None:
    readme = (ROOT / "README.md").read_text()
    assert f"pip install {NAME}\n" in readme or f"pip install {NAME} " in readme
    assert f"pip install '{NAME}[dashboard]'" in readme


def test_the_version_is_read_from_the_distribution() -> None:
    # importlib.metadata.version() under the old name would fall back to 0.0.0
    assert (
        pgqueue.__version__
        == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    )


def test_the_dev_extra_refers_to_the_distribution_itself() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert any(req.startswith(f"{NAME}[") for req in extras["dev"])
