"""The integrations' frameworks are optional: importing pgqueue (and the Django app's package,
as INSTALLED_APPS does) imports none of them."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import ROOT

PROBE = """
import json, sys
import pgqueue, pgqueue.contrib, pgqueue.connections
loaded = sorted({m.split(".")[0] for m in sys.modules} & {"django", "sqlalchemy", "fastapi"})
print(json.dumps(loaded))
"""


def test_import_pgqueue_imports_no_framework_or_orm() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == []
