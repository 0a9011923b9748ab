"""Which release of the project this is, as every front door says it (the CLI's `--version`,
the HTTP API's OpenAPI document, MCP's `serverInfo`): the installed distribution's own version,
so the three never disagree with what pip installed."""

from __future__ import annotations

import importlib.metadata

DISTRIBUTION = "code-interpreter-runtime"


def version() -> str:
    """The installed version; "unknown" when run from a tree that was never installed."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
