"""Code a sandbox runs before it is handed over (a warm pool's sandboxes, a gVisor template),
so a session's first cell finds its libraries imported and their caches filled.

A preload runs silently in a namespace of its own (`Sandbox.preload`): a session's code sees the
modules it imported in `sys.modules` and nothing else of it.
"""

from __future__ import annotations

import re

from code_interpreter_wire.errors import SandboxError


class PreloadFailed(SandboxError):
    """The preload's own code raised (a module that is not there, a warm-up that fails): it
    would fail again in every sandbox of that image. Not a time limit or a kernel that died."""


# The data stack imported, a frame read from CSV, grouped and charted by pandas, then put
# through every display form a shown figure gets (the PNG as the inline backend renders it,
# E2B's chart, which imports e2b_charts: ~270 ms measured under gVisor), then closed: what a
# session's first chart would load and fill (modules, caches, fonts) is there. Twice: after one
# pass, a session's first chart still took twice its later ones (local: 160 ms, then 80 ms);
# after two, its first is as quick as its later ones.
ANALYST_PRELOAD = """\
import io
import numpy
import pandas
import matplotlib.pyplot as plt
from IPython import get_ipython
frame = pandas.read_csv(io.StringIO("x,y\\n0,0\\n1,1\\n2,4\\n"))
for _ in range(2):
    axes = frame.groupby("x")["y"].sum().plot(title="warm-up")
    get_ipython().display_formatter.format(axes.figure)
    plt.close("all")
"""

_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def check_module_names(names: list[str]) -> list[str]:
    """`names` if each is a dotted module name; a ValueError naming the first that is not."""
    for name in names:
        if not _MODULE_NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not a module name (e.g. pandas, matplotlib.pyplot)")
    return names


def preload_code(modules: list[str], warm_up: str = "") -> str:
    """The preload that imports `modules` (dotted names, checked), then runs `warm_up`."""
    imports = "".join(f"import {name}\n" for name in check_module_names(modules))
    return imports + warm_up
