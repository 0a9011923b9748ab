"""The `code-interpreter` command's entry point: the CLI, or one line saying what to install.

A client-only install (`pip install code-interpreter-runtime`) has the command but not the
service's packages; without this, it would end in a traceback about some module deep inside.
"""

from __future__ import annotations

import sys

INSTALL_SERVER = "pip install 'code-interpreter-runtime[server]'"
# The top-level modules of the `server` extra's packages (pyproject.toml), and of the web stack
# they bring: a missing one means the extra is not installed.
SERVER_MODULES = frozenset(
    {
        "jupyter_client", "zmq", "pydantic_settings", "docker", "typer", "click", "rich",
        "fastapi", "starlette", "uvicorn", "multipart", "python_multipart", "prometheus_client",
        "mcp", "jsonschema", "griffe", "e2b", "e2b_code_interpreter", "pyseccomp", "jinja2",
        "markupsafe", "limits", "cryptography",
    }
)  # fmt: skip


def missing_server_module(exc: ModuleNotFoundError) -> str | None:
    """The server module whose absence `exc` reports, or None if it is about another module."""
    top = (exc.name or "").split(".")[0]
    return top if top in SERVER_MODULES else None


def server_extra_hint(what: str, module: str) -> str:
    return f"{what} needs the server extra ({module} is not installed): {INSTALL_SERVER}"


def main() -> None:
    try:
        from orchestrator.cli import app

        # Its commands import some of the server's packages only when they run.
        app(prog_name="code-interpreter")
    except ModuleNotFoundError as exc:
        module = missing_server_module(exc)
        if module is None:
            raise
        print(f"code-interpreter: {server_extra_hint('the command', module)}", file=sys.stderr)
        raise SystemExit(1) from None
