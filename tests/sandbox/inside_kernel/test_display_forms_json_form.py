"""A dict or list shown as a cell's value also comes as `application/json`, as E2B's kernel
gives it (template/startup_scripts/0002_data.py, `E2BJSONFormatter`): E2B's SDK reads it as
`Result.json`.

Run in a child interpreter with IPython's shell and the kernel's display forms file."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.sandbox.inside_kernel.forms_shell import SHELL_WITH_FORMS

pytestmark = pytest.mark.unit


PROBE = f"""
import json
{SHELL_WITH_FORMS}
shown = [shell.display_formatter.format(v)[0] for v in ({{"a": 1, "b": [1, 2]}}, [1, "x"])]
print(json.dumps([bundle.get("application/json") for bundle in shown]))
"""


def test_a_dict_or_list_value_also_comes_as_json() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    forms = json.loads(done.stdout.strip().splitlines()[-1])
    assert forms == [{"a": 1, "b": [1, 2]}, [1, "x"]]
