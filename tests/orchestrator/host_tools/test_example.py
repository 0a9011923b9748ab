"""The team-expenses example runs, both ways agree, and the program sends far less to the model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import require_backend

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "team_expenses.py"


def test_the_team_expenses_example() -> None:
    require_backend("local")  # fails in CI, skips only on a machine without bubblewrap
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--json"], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["same_answer"] and result["over_budget"]
    assert result["members"] == 20 and result["records"] > 1000
    assert result["direct"]["calls"] == 21 and result["program"]["calls"] == 1
    assert result["direct"]["bytes_to_model"] > 50 * result["program"]["bytes_to_model"]
