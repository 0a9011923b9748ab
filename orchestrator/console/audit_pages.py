"""The audit log, filtered (key for admins, session, kind, time) and paged, newest first."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from urllib.parse import urlencode

from fastapi import APIRouter, Request
from fastapi.responses import Response

from orchestrator.console.console_auth import Viewer
from orchestrator.console.context import ViewerDep, base, console_of, summary
from orchestrator.console.render import page
from orchestrator.governance.audit import parse_time
from orchestrator.governance.audit_kinds import ALL_KINDS
from orchestrator.governance.stores.audit_store import AuditEvent, AuditQuery
from orchestrator.sessions import SessionError

router = APIRouter()

PAGE = 50
MAX_FILTER_CHARS = 200


@dataclass(frozen=True)
class Filters:
    key: str = ""
    session: str = ""
    kind: str = ""
    since: str = ""
    until: str = ""

    def query_string(self, **more: str) -> str:
        given = {k: v for k, v in asdict(self).items() if v} | more
        return urlencode(given)


@dataclass(frozen=True)
class EventRow:
    event: AuditEvent
    summary: str


def _filters(request: Request, viewer: Viewer) -> Filters:
    get = request.query_params.get
    return Filters(
        key=get("key", "").strip()[:MAX_FILTER_CHARS] if viewer.admin else "",
        session=get("session", "").strip()[:MAX_FILTER_CHARS],
        kind=get("kind", "").strip()[:MAX_FILTER_CHARS],
        since=get("since", "").strip()[:64],
        until=get("until", "").strip()[:64],
    )


def _query(filters: Filters, before: str) -> AuditQuery:
    """The store's query of the filters; SessionError (400) saying what is wrong."""
    if filters.kind and filters.kind not in ALL_KINDS:
        raise SessionError(f"no kind of event is called {filters.kind!r}")
    if before and not before.isdigit():
        raise SessionError("`before` is the seq of an event: a whole number")
    return AuditQuery(
        principal=filters.key or None,
        session_id=filters.session or None,
        kinds=[filters.kind] if filters.kind else None,
        since=parse_time(filters.since) if filters.since else None,
        until=parse_time(filters.until) if filters.until else None,
        before_seq=int(before) if before else None,
        limit=PAGE,
    )


@router.get("/audit")
async def audit_page(request: Request, viewer: ViewerDep) -> Response:
    audit = console_of(request).service.trail
    filters = _filters(request, viewer)
    before = request.query_params.get("before", "").strip()[:20]
    rows: list[EventRow] = []
    message = None
    older_url = newer_url = None
    status = 200
    try:
        found = await audit.query(viewer.principal, _query(filters, before))
    except SessionError as refusal:
        message, status = str(refusal), refusal.status
    else:
        rows = [EventRow(e, summary(e.details)) for e in found.events]
        here = f"{base(request)}/audit?"
        if found.next_before is not None:
            older_url = here + filters.query_string(before=str(found.next_before))
        if before:
            newer_url = here + filters.query_string()
    return page(
        "audit.html",
        status,
        title="Audit log",
        section="audit",
        base=base(request),
        viewer=viewer,
        filters=filters,
        kinds=ALL_KINDS,
        events=rows,
        message=message,
        audit_on=audit.enabled,
        older_url=older_url,
        newer_url=newer_url,
    )
