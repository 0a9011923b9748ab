"""The audit log's async interface and rows, implemented by both stores (`sqlite_audit.py`,
`redis_audit.py`): appended in batches, read newest first with filters, trimmed by age."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from pydantic import BaseModel, Field


class AuditEvent(BaseModel):
    seq: int | None = None  # given by the store: the order, and the cursor of a listing
    id: str  # unique, made by the writer
    time: float
    kind: str  # e.g. "execution", "tool.call" (orchestrator/governance/audit_kinds.py)
    owner: str  # the principal's id
    principal: str  # the principal's name, as it was when this happened
    session_id: str | None = None
    status: str | None = None
    duration_s: float | None = None
    details: dict[str, Any] = Field(default_factory=dict)


class AuditQuery(BaseModel):
    owner: str | None = None  # None: every principal's (an admin's query)
    principal: str | None = None  # a principal's name, as its events carry it
    session_id: str | None = None
    kinds: list[str] | None = None
    since: float | None = None
    until: float | None = None
    before_seq: int | None = None  # paging: events older than this one
    limit: int = Field(100, ge=1, le=1000)


class AuditPage(BaseModel):
    """One page of a listing, newest first, and where the next one starts (None: no more).
    A store that stops looking early (Redis bounds the work of one call) may give fewer
    events than asked for with a `next_before` all the same: the listing goes on there."""

    events: list[AuditEvent]
    next_before: int | None = None


class AuditStore(ABC):
    @abstractmethod
    async def append_events(self, events: list[AuditEvent]) -> None:
        """Append in order, in one write."""

    @abstractmethod
    async def query_events(self, query: AuditQuery) -> list[AuditEvent]:
        """Newest first, at most `query.limit`."""

    async def query_page(self, query: AuditQuery) -> AuditPage:
        """`query_events`, with the cursor of the next page."""
        events = await self.query_events(query)
        more = len(events) == query.limit and events[-1].seq is not None
        return AuditPage(events=events, next_before=events[-1].seq if more else None)

    @abstractmethod
    async def delete_events_before(self, t: float) -> int:
        """Retention: remove events older than `t`; how many went."""

    def close(self) -> None:
        """Let go of what the store holds besides its database's connection (if anything)."""
        return None

    @abstractmethod
    async def keep_newest(self, most: int) -> int:
        """Retention by count: remove all but the newest `most` events; how many went."""
