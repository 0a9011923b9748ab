"""The sessions a viewer may see (live), and one session's executions and commands: the code,
its output and images, as the audit log and the kept outputs hold them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from markupsafe import Markup

from code_interpreter_wire.rest import SessionInfo
from orchestrator.console.console_auth import Viewer
from orchestrator.console.context import Console, ViewerDep, base, console_of, summary
from orchestrator.console.render import page, poll_block, polled, text
from orchestrator.console.shown_outputs import ShownOutput, ShownText
from orchestrator.governance import audit_kinds
from orchestrator.governance.stores.audit_store import AuditEvent, AuditQuery
from orchestrator.routes.sessions import image_response
from orchestrator.sessions import SessionError

router = APIRouter()

MAX_LISTED = 500  # sessions in the list
ACTIVITY = 50  # latest events of a session shown
OUTPUTS_SHOWN = 10  # executions whose output is read and shown (the latest)


@dataclass(frozen=True)
class SessionRow:
    owner: str
    key: str
    info: SessionInfo


@dataclass(frozen=True)
class ActivityItem:
    event: AuditEvent
    code: ShownText  # an execution's code or a command line, as the audit log kept it
    output: ShownOutput | None
    summary: str


MAX_ID_CHARS = 128  # a session id longer than any this service makes is no session


class SessionGone(SessionError):
    """No session of the viewer's by that id, now or in the audit log."""

    status = 404


def _cut_by_audit(details: dict[str, Any]) -> int:
    """The characters of code (or a command) the audit log's own cap left out."""
    for name in ("code", "command"):
        whole, kept = details.get(f"{name}_chars"), details.get(name)
        if isinstance(whole, int) and isinstance(kept, str):
            return max(0, whole - len(kept))
    return 0


async def _rows(console: Console, viewer: Viewer) -> list[SessionRow]:
    admission = console.service.admission
    found = await console.service.lifecycle.owned_infos(viewer.owner_filter)
    found.sort(key=lambda pair: pair[1].created_at, reverse=True)
    return [SessionRow(owner, admission.who(owner).name, info) for owner, info in found]


async def _listing(request: Request, viewer: Viewer) -> tuple[str, str]:
    rows = await _rows(console_of(request), viewer)
    inner = text(
        "sessions_list.html",
        base=base(request),
        rows=rows[:MAX_LISTED],
        cut=max(0, len(rows) - MAX_LISTED),
    )
    return f"{base(request)}/sessions/list", inner


@router.get("/sessions")
async def sessions(request: Request, viewer: ViewerDep) -> Response:
    url, inner = await _listing(request, viewer)
    return page(
        "sessions.html",
        title="Sessions",
        section="sessions",
        base=base(request),
        viewer=viewer,
        listing=poll_block("sessions-list", url, inner),
    )


@router.get("/sessions/list")
async def sessions_list(request: Request, viewer: ViewerDep) -> Response:
    url, inner = await _listing(request, viewer)
    return polled(request, "sessions-list", url, inner)


async def _live(console: Console, viewer: Viewer, session_id: str) -> SessionRow | None:
    """The viewer's session by that id, running or paused (None: not now, or not theirs)."""
    if len(session_id) > MAX_ID_CHARS:
        raise SessionGone(f"no session {session_id[:MAX_ID_CHARS]}…")
    found = await console.service.lifecycle.owned_info(viewer.owner_filter, session_id)
    if found is None:
        return None
    owner, info = found
    return SessionRow(owner, console.service.admission.who(owner).name, info)


async def _activity(
    request: Request, viewer: Viewer, session_id: str, live: SessionRow | None
) -> str:
    """The session's latest events as HTML; SessionGone if the viewer has no such session."""
    console = console_of(request)
    audit = console.service.trail
    items: list[ActivityItem] = []
    more = False
    if audit.enabled:
        query = AuditQuery(session_id=session_id, limit=ACTIVITY)
        found = await audit.query(viewer.principal, query)
        more = found.next_before is not None
        shown = 0
        for event in found.events:
            output = None
            execution_id = event.details.get("execution_id")
            is_execution = event.kind == audit_kinds.EXECUTION and isinstance(execution_id, str)
            if is_execution and live is not None and shown < OUTPUTS_SHOWN:
                output = await console.shown.of(session_id, str(execution_id))
                shown += 1
            kept = event.details.get("code", event.details.get("command", ""))
            code = ShownText.of(str(kept), _cut_by_audit(event.details))
            items.append(ActivityItem(event, code, output, summary(event.details)))
    if live is None and not items:
        raise SessionGone(f"no session {session_id}")
    return text(
        "session_activity.html",
        base=base(request),
        session_id=session_id,
        audit_on=audit.enabled,
        items=items,
        more=more,
    )


@router.get("/sessions/{session_id}")
async def session_page(request: Request, session_id: str, viewer: ViewerDep) -> Response:
    live = await _live(console_of(request), viewer, session_id)
    inner = await _activity(request, viewer, session_id, live)
    url = f"{base(request)}/sessions/{session_id}/activity"
    return page(
        "session.html",
        title=f"Session {session_id}",
        section="sessions",
        base=base(request),
        viewer=viewer,
        session_id=session_id,
        info=live.info if live is not None else None,
        key=live.key if live is not None else "",
        activity=Markup(poll_block("activity", url, inner)),
    )


@router.get("/sessions/{session_id}/activity")
async def session_activity(request: Request, session_id: str, viewer: ViewerDep) -> Response:
    live = await _live(console_of(request), viewer, session_id)
    inner = await _activity(request, viewer, session_id, live)
    return polled(request, "activity", f"{base(request)}/sessions/{session_id}/activity", inner)


@router.get("/sessions/{session_id}/artifacts/{artifact_id}")
async def artifact(
    request: Request, session_id: str, artifact_id: str, viewer: ViewerDep
) -> Response:
    """An image an execution made, shown (never run: the API's own headers for it)."""
    console = console_of(request)
    if await _live(console, viewer, session_id) is None:
        raise SessionGone(f"no session {session_id}")
    return image_response(await console.service.files.kept_artifact(session_id, artifact_id))
