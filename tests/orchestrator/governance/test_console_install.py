"""The console's packages (Jinja2, and MarkupSafe under it) belong to the server extra: an
install without them gets the one-line hint to install the extra, not a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

REFUSE = """
import importlib.abc
import sys

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == {module!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, Refuse())
sys.argv = ["code-interpreter", "serve", "--port", "9"]
from orchestrator.entry import main

main()
"""


@pytest.mark.parametrize("module", ["jinja2", "markupsafe"])
def test_serve_without_the_console_s_packages_says_which_extra(module: str, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "CODE_INTERPRETER_AUTH_DISABLED": "true",
        "CODE_INTERPRETER_STATE_DIR": str(tmp_path / "state"),
    }
    done = subprocess.run(
        [sys.executable, "-c", REFUSE.format(module=module)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    [line] = done.stderr.splitlines()
    assert f"({module} is not installed)" in line
    assert "pip install 'code-interpreter-runtime[server]'" in line
