"""`code-interpreter wasm ...`: what wasm sessions may install (docs/wasm.md): pure-Python
wheels downloaded by pip into the directory `wasm_wheels_dir` names, and the Pyodide they run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Annotated

import typer

wasm_app = typer.Typer(
    help="The wasm backend's packages and Pyodide (docs/wasm.md).", no_args_is_help=True
)
# What a wheel must be for Pyodide's Python to import it with no compiler: pure Python.
PURE = ["--only-binary=:all:", "--implementation", "py", "--abi", "none", "--platform", "any"]


def pip_download(packages: list[str], into: Path, python_version: str) -> list[str]:
    """pip's command that downloads `packages` (and what they need) as pure-Python wheels."""
    return [
        sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--quiet",
        *PURE, "--python-version", python_version, "--dest", str(into), *packages,
    ]  # fmt: skip


@wasm_app.command("fetch")
def wasm_fetch(
    packages: Annotated[list[str], typer.Argument(help="Requirements, as pip takes them.")],
    into: Annotated[
        Path,
        typer.Option("--into", help="The wheels directory (the wasm_wheels_dir setting)."),
    ],
) -> None:
    """Download pure-Python wheels (and those they need) for wasm sessions to install."""
    from sandbox.backends.wasm.distribution import PYTHON_VERSION

    into.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(pip_download(packages, into, PYTHON_VERSION), check=False)
    if done.returncode != 0:
        typer.echo(
            "pip could not download them as pure-Python wheels: a package with compiled code "
            "cannot run in wasm sessions (only Pyodide's own builds of it could)",
            err=True,
        )
        raise typer.Exit(done.returncode)
    for wheel in sorted(into.glob("*.whl")):
        typer.echo(wheel.name)


@wasm_app.command("pyodide")
def wasm_pyodide() -> None:
    """Fetch the pinned Pyodide release (make install does), checked against its integrity."""
    from sandbox.backends.wasm.distribution import configured_dir, fetch

    typer.echo(fetch(configured_dir()))
