"""What every console page needs: the console's parts, where it is mounted, and who is looking."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, Request

from orchestrator.console.console_auth import ConsoleAuth, Viewer
from orchestrator.console.shown_outputs import ShownOutputs

if TYPE_CHECKING:
    from orchestrator.service import Service

SUMMARY_CHARS = 300  # of an event's details in a listing


@dataclass
class Console:
    service: Service
    auth: ConsoleAuth
    shown: ShownOutputs  # executions' kept outputs as pages show them


def console_of(request: Request) -> Console:
    console: Console = request.app.state.console
    return console


def base(request: Request) -> str:
    """The console's own path prefix (`/console`, or below a proxy's root path)."""
    return str(request.scope.get("root_path", "")).rstrip("/")


async def current_viewer(request: Request) -> Viewer:
    return await console_of(request).auth.viewer(request)


ViewerDep = Annotated[Viewer, Depends(current_viewer)]


def summary(details: dict[str, Any]) -> str:
    """An event's details on one line, capped (code and commands show in the session's page)."""
    shown = {k: v for k, v in details.items() if v is not None and v != [] and v != ""}
    # Each value cut first: a code field alone may be 64 KiB.
    parts = [f"{k}={json.dumps(_cut(v), default=str)[:SUMMARY_CHARS]}" for k, v in shown.items()]
    text = ", ".join(parts)
    return text if len(text) <= SUMMARY_CHARS else text[: SUMMARY_CHARS - 1] + "…"


def _cut(value: Any) -> Any:
    return value[:SUMMARY_CHARS] if isinstance(value, str) else value
