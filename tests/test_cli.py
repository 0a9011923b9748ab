"""The `code-interpreter` command, run as a user runs it."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

from PIL import Image

CLI = [sys.executable, "-m", "orchestrator"]


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=cwd,
        env={**os.environ, "COLUMNS": "200"},
    )


def test_run_prints_output_and_saves_images(tmp_path: Path) -> None:
    code = (
        "import matplotlib.pyplot as plt\n"
        "print('hello from the sandbox')\n"
        "plt.plot([1, 2, 3]); plt.show()\n"
        "6 * 7"
    )
    done = run_cli("run", code, "--output-dir", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert done.stdout == "hello from the sandbox\n"
    assert "Out: 42" in done.stderr
    images = list((tmp_path / "out").glob("figure-*.png"))
    assert len(images) == 1
    assert Image.open(io.BytesIO(images[0].read_bytes())).format == "PNG"


def test_run_a_file(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text("import sys\nprint(sys.version_info[0])\n")
    done = run_cli("run", "-f", str(script))
    assert done.returncode == 0, done.stderr
    assert done.stdout == "3\n"


def test_exit_codes_say_how_it_ended(tmp_path: Path) -> None:
    raised = run_cli("run", "raise ValueError('bad input')")
    assert raised.returncode == 1
    assert "ValueError" in raised.stderr and "bad input" in raised.stderr
    timed_out = run_cli("run", "import time; time.sleep(30)", "--timeout", "1")
    assert timed_out.returncode == 124
    assert "ExecutionTimeout" in timed_out.stderr
    died = run_cli("run", "import os; os._exit(1)")
    assert died.returncode == 125


def test_bad_usage_is_explained() -> None:
    neither = run_cli("run")
    assert neither.returncode != 0
    assert "either CODE or --file" in neither.stderr
    unknown = run_cli("run", "1", "--backend", "nope")
    assert unknown.returncode == 2
    assert "unknown backend 'nope'" in unknown.stderr
