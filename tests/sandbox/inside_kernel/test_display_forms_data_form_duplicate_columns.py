"""Showing a DataFrame whose column names repeat prints no warning from the display forms file (the
user did nothing wrong, and the warning names a file they never wrote), and its `e2b/data` form
never silently holds fewer columns than the frame.

Run in a child interpreter with IPython's shell and the kernel's display forms file."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.sandbox.inside_kernel.forms_shell import SHELL_WITH_FORMS

pytestmark = pytest.mark.unit


PROBE = f"""
import json, warnings
{SHELL_WITH_FORMS}
import pandas as pd
frame = pd.DataFrame([[1, 2]], columns=["a", "a"])
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    bundle, _ = shell.display_formatter.format(frame)
print(json.dumps({{"warnings": [str(w.message) for w in caught],
                   "data": bundle.get("e2b/data"), "forms": sorted(bundle)}}))
"""


def test_repeated_column_names_warn_nothing_and_lose_no_column() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    assert probe["warnings"] == []
    assert "text/html" in probe["forms"]
    assert probe["data"] is None, "a form with fewer columns than the frame misleads its reader"
