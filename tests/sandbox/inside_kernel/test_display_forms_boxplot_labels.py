"""The display forms file has matplotlib's boxplot take `labels=` again (3.9 renamed it
`tick_labels`, 3.11 removed it), as E2B's template (3.10) does: model-written code and E2B's
own chart examples pass it. Run in a child interpreter with IPython's shell and the file."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.sandbox.inside_kernel.forms_shell import SHELL_WITH_FORMS

pytestmark = pytest.mark.unit

DRAW = f"""
import json
{SHELL_WITH_FORMS}import matplotlib
matplotlib.use("agg")
import matplotlib.pyplot as plt
fig, ax = plt.subplots()
ax.boxplot([[1, 2, 3], [4, 5, 6]], labels=["a", "b"], patch_artist=True)
on_axes = [t.get_text() for t in ax.get_xticklabels()]
plt.figure()
plt.boxplot([[1, 2, 3]], labels=["c"])
on_pyplot = [t.get_text() for t in plt.gca().get_xticklabels()]
plt.figure()
plt.boxplot([[1, 2, 3]], tick_labels=["d"])
named_anew = [t.get_text() for t in plt.gca().get_xticklabels()]
try:
    ax.boxplot([[1]], labels=["x"], tick_labels=["y"])
    both = "accepted"
except (TypeError, ValueError) as exc:
    both = str(exc)
print(json.dumps({{"axes": on_axes, "pyplot": on_pyplot, "anew": named_anew, "both": both}}))
"""


def test_boxplot_takes_labels_as_tick_labels() -> None:
    done = subprocess.run(
        [sys.executable, "-c", DRAW], capture_output=True, text=True, timeout=120, check=True
    )
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["axes"] == ["a", "b"] and got["pyplot"] == ["c"] and got["anew"] == ["d"]
    assert "not both" in got["both"] or "labels" in got["both"], got
