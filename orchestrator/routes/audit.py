"""The audit log over HTTP: a page of events, or all of them as JSON lines. A key reads its own
events; an admin key reads every key's (and may name one with `key`)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from fastapi.responses import StreamingResponse

from orchestrator.governance.audit import parse_kinds, parse_time
from orchestrator.governance.stores.audit_store import AuditEvent, AuditQuery
from orchestrator.routes.deps import OwnerDep, ServiceDep

router = APIRouter(prefix="/v1/audit", tags=["audit"])

EXPORT_PAGE = 500  # events read from the store per step of an export

KeyParam = Annotated[
    str | None,
    Query(max_length=256, description="A key's name: only its events (admin keys only)."),
]
SessionParam = Annotated[str | None, Query(max_length=128, description="One session's events.")]
KindParam = Annotated[
    list[str] | None,
    Query(description="Kinds of events (repeatable, or comma-separated): e.g. execution."),
]
TimeParam = Annotated[
    str | None,
    Query(max_length=64, description="Seconds since the epoch, or an ISO 8601 time."),
]
MAX_SEQ = (1 << 63) - 1  # the largest seq a store can hold (SQLite's INTEGER)
BeforeParam = Annotated[
    int | None, Query(ge=1, le=MAX_SEQ, description="The cursor `next` of the previous page.")
]


async def audit_filters(
    key: KeyParam = None,
    session_id: SessionParam = None,
    kind: KindParam = None,
    since: TimeParam = None,
    until: TimeParam = None,
    before: BeforeParam = None,
) -> AuditQuery:
    """The filters both routes take, as the store's query (its limit: the route's); a kind no
    event has or a time that is no time is BadAuditQuery, saying what would be right. Async:
    FastAPI would run a plain function in its thread pool."""
    return AuditQuery(
        principal=key,
        session_id=session_id,
        kinds=parse_kinds(kind),
        since=parse_time(since) if since is not None else None,
        until=parse_time(until) if until is not None else None,
        before_seq=before,
    )


FiltersDep = Annotated[AuditQuery, Depends(audit_filters)]


def _shown(event: AuditEvent) -> dict[str, Any]:
    return event.model_dump(mode="json")


@router.get("", summary="Audit events, newest first, a page at a time")
async def list_events(
    service: ServiceDep,
    owner: OwnerDep,
    filters: FiltersDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> dict[str, Any]:
    """`next`: the cursor of the next (older) page, to pass as `before`; null at the end."""
    query = filters.model_copy(update={"limit": limit})
    page = await service.trail.query(service.trail.viewer(owner), query)
    return {"events": [_shown(e) for e in page.events], "next": page.next_before}


@router.get("/export", summary="Every audit event the filters select, as JSON lines")
async def export_events(
    service: ServiceDep,
    owner: OwnerDep,
    filters: FiltersDep,
    limit: Annotated[
        int | None, Query(ge=1, description="The most events to export (default: all).")
    ] = None,
) -> StreamingResponse:
    """Newest first, one JSON object a line, read from the store a page at a time (the
    answer is streamed: memory stays bounded however long the log)."""
    query = filters.model_copy(update={"limit": EXPORT_PAGE})
    events = await service.trail.export(service.trail.viewer(owner), query)

    async def lines() -> AsyncIterator[bytes]:
        sent = 0
        async with contextlib.aclosing(events):
            async for event in events:
                if limit is not None and sent >= limit:
                    return
                yield event.model_dump_json().encode() + b"\n"
                sent += 1

    return StreamingResponse(
        lines(),
        media_type="application/x-ndjson",
        headers={"Content-Disposition": 'attachment; filename="audit.jsonl"'},
    )
