"""`code-interpreter wasm fetch`: pure-Python wheels, by pip, from the index pip is pointed at
(here one on loopback: PIP_INDEX_URL), into the wasm backend's wheels directory."""

from __future__ import annotations

import os
from pathlib import Path

from tests.network.upstream import PACKAGE, upstream
from tests.orchestrator.cli.test_cli import run_cli


def test_fetch_downloads_pure_python_wheels_into_the_directory(tmp_path: Path) -> None:
    with upstream() as up:
        env = {
            **os.environ,
            "PIP_INDEX_URL": f"http://127.0.0.1:{up.port}/simple",
            "PIP_TRUSTED_HOST": "127.0.0.1",
            "PIP_NO_CACHE_DIR": "1",
            "PIP_CONFIG_FILE": os.devnull,  # none of the machine's own indexes
        }
        done = run_cli("wasm", "fetch", PACKAGE, "--into", str(tmp_path / "wheels"), env=env)
    assert done.returncode == 0, done.stderr
    (wheel,) = (tmp_path / "wheels").glob("*.whl")
    assert wheel.name.startswith(f"{PACKAGE}-1.0-") and wheel.name.endswith("-none-any.whl")
    assert wheel.name in done.stdout


def test_a_package_with_no_pure_python_wheel_is_refused_saying_why(tmp_path: Path) -> None:
    with upstream() as up:
        env = {
            **os.environ,
            "PIP_INDEX_URL": f"http://127.0.0.1:{up.port}/simple",
            "PIP_TRUSTED_HOST": "127.0.0.1",
            "PIP_CONFIG_FILE": os.devnull,
        }
        done = run_cli("wasm", "fetch", "no-such-package", "--into", str(tmp_path), env=env)
    assert done.returncode != 0
    assert "pure-Python wheels" in done.stderr
