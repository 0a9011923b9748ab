"""Telling a client-only install what to add when something needs the server's packages.

`pip install code-interpreter-runtime` has the client and the `code-interpreter` command but not
the service's packages; the command and `CodeSession.embedded` say what to install instead of
ending in a traceback about some module deep inside.
"""

from __future__ import annotations

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
