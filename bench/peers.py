"""Peers a user might pick instead, measured on this machine in the same run.

Each runs from a virtualenv of its own (`.bench-venv/<peer>`), made on first use from PyPI.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
VENVS = HERE.parent / ".bench-venv"

NOT_RUNNABLE = {
    "AutoGen DockerJupyterCodeExecutor": (
        "its Jupyter server image is built FROM quay.io/jupyter/docker-stacks-foundation, a "
        "registry this machine cannot reach, and its client talks to the kernel gateway over a "
        "TCP port published from the container, which needs a bridged network; sandboxes here "
        "run with networking off (dockerd --bridge=none)"
    ),
}


def _venv(name: str, requirement: str) -> Path:
    venv = VENVS / name
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", requirement],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return python


def llm_sandbox(image: str, starts: int, runs: int) -> dict[str, Any]:
    python = _venv("llm-sandbox", "llm-sandbox[docker]>=0.3")
    out = subprocess.run(
        [str(python), str(HERE / "peer_llm_sandbox.py"), image, str(starts), str(runs)],
        capture_output=True,
        text=True,
        timeout=1800,
        check=True,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    version = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('llm-sandbox'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    result["version"] = version
    return result
