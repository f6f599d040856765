"""pgqueue.testing works without pytest: only its plugin module imports it."""

from __future__ import annotations

import subprocess
import sys


def test_importing_pgqueue_and_its_testing_kit_does_not_import_pytest() -> None:
    code = (
        "import sys, pgqueue, pgqueue.testing; "
        "print(sorted(m for m in ('pytest', '_pytest') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
