"""The `e2b/data` form of a DataFrame is given up before it costs the kernel more than the
form may hold: a frame whose columns cannot fit is not first turned into their whole JSON text.

Run in a child interpreter with IPython's shell and the kernel's display forms file, as a kernel
runs it, so the formatters it installs stay out of this process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.sandbox.inside_kernel.forms_shell import SHELL_WITH_FORMS

pytestmark = pytest.mark.unit


# 100 rows sharing one 1 MB string: the frame holds about 1 MB; its columns as JSON, 100 MB.
PROBE = f"""
import json, tracemalloc
{SHELL_WITH_FORMS}
import pandas as pd
frame = pd.DataFrame({{"doc": ["x" * 1_000_000] * 100}})
tracemalloc.start()
bundle, _ = shell.display_formatter.format(frame)
peak = tracemalloc.get_traced_memory()[1]
print(json.dumps({{"peak": peak, "forms": sorted(bundle)}}))
"""


def test_a_frame_too_big_for_its_data_form_costs_no_more_than_the_form_may_hold() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    assert "e2b/data" not in probe["forms"]  # over the form's limit: left out, as before
    assert "text/html" in probe["forms"]  # the table itself is still shown
    # The form may hold 4 MiB of text; building 100 MB of it first is what must not happen.
    assert probe["peak"] < 32 << 20, f"formatting peaked at {probe['peak'] >> 20} MiB"
