"""Approval requests: the async interface and rows both stores implement (`sqlite_approvals.py`,
`redis_approvals.py`), so that a request made on one replica can be answered through another."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Literal

from pydantic import BaseModel

ApprovalKind = Literal["tool_call", "execution", "command"]
ApprovalState = Literal["pending", "approved", "denied", "expired"]


class ApprovalRecord(BaseModel):
    id: str
    kind: ApprovalKind
    session_id: str
    owner: str  # the principal id of the session's key
    principal: str  # its name
    subject: str  # the tool's name, the command line, or "execution"
    arguments: Any = None  # a tool call's arguments (capped)
    code: str | None = None  # the code that made the call, or that waits to run (capped)
    created_at: float
    expires_at: float
    state: ApprovalState = "pending"
    decided_by: str | None = None  # the answering principal's name, "webhook", "mcp", "timeout"
    reason: str | None = None
    decided_at: float | None = None


class ApprovalStore(ABC):
    @abstractmethod
    async def put_approval(self, record: ApprovalRecord) -> None: ...

    @abstractmethod
    async def get_approval(self, approval_id: str) -> ApprovalRecord | None: ...

    @abstractmethod
    async def approvals(
        self,
        *,
        owner: str | None = None,
        state: ApprovalState | None = None,
        session_id: str | None = None,
        limit: int = 100,
    ) -> list[ApprovalRecord]:
        """Newest first."""

    @abstractmethod
    async def decide_approval(
        self, approval_id: str, state: ApprovalState, by: str, reason: str | None, at: float
    ) -> ApprovalRecord | None:
        """Set the decision if, and only if, the request is still pending (one answer wins,
        across replicas); the decided record, or None if it was not pending (or is unknown)."""
