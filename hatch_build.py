"""Refuse to build a wheel without the dashboard's chart library.

uPlot is installed from npm by ``make assets`` into a gitignored folder and shipped in the wheel
(see ``artifacts`` in pyproject.toml). Without this check a build from a fresh clone would
produce a wheel whose dashboard has no charts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

VENDOR = Path("src/pgqueue/dashboard/static/vendor")
FILES = ("uPlot.iife.min.js", "uPlot.min.css")


class AssetsCheck(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if version == "editable":  # a checkout serves static/ in place; `make` adds assets
            return
        missing = [name for name in FILES if not (Path(self.root) / VENDOR / name).is_file()]
        if missing:
            raise RuntimeError(
                f"the dashboard's assets are missing ({', '.join(missing)} in {VENDOR}): "
                "run `make assets` (npm ci) before building"
            )
