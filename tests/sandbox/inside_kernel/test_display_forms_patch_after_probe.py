"""The display forms file patches Pillow when `PIL.Image` is first imported. Asking whether a module
exists (`importlib.util.find_spec`, as libraries do to probe optional dependencies) imports
nothing, so it must not use the patch up: the later import still gets it.

Run in a child interpreter with IPython's shell and the kernel's display forms file."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.sandbox.inside_kernel.forms_shell import SHELL_WITH_FORMS

pytestmark = pytest.mark.unit


PROBE = f"""
import importlib.util
{SHELL_WITH_FORMS}
assert importlib.util.find_spec("PIL.Image") is not None
from PIL import Image
print("patched" if hasattr(Image.Image.save, "__wrapped__") else "not patched")
"""


def test_probing_for_pillow_before_importing_it_keeps_its_patch() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip().splitlines()[-1] == "patched"
