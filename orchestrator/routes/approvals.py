"""Approval requests: list those waiting (or decided), read one, answer one. A key sees its own
sessions' requests, an admin key everyone's; who may answer is the key's policy's
(`self_approve`) or an admin's (docs/governance.md)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query
from pydantic import BaseModel, Field

from orchestrator.governance.approvals import MAX_REASON_CHARS
from orchestrator.governance.stores.approval_store import ApprovalRecord, ApprovalState
from orchestrator.routes.deps import OwnerDep, ServiceDep

router = APIRouter(prefix="/v1/approvals", tags=["approvals"])
ApprovalId = Annotated[str, Path(max_length=64, description="An id such as ap-0123456789abcdef.")]


class ApprovalAnswer(BaseModel):
    decision: Literal["approve", "deny"]
    reason: str | None = Field(
        None, max_length=MAX_REASON_CHARS, description="Why; the sandboxed code reads it."
    )


@router.get("", summary="Approval requests the caller may see, newest first")
async def list_approvals(
    service: ServiceDep,
    owner: OwnerDep,
    state: ApprovalState | None = None,
    session_id: Annotated[str | None, Query(max_length=64)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> list[ApprovalRecord]:
    viewer = service.admission.who(owner)
    return await service.admission.approval_requests(
        viewer, state=state, session_id=session_id, limit=limit
    )


@router.get("/{approval_id}", summary="One approval request")
async def get_approval(
    approval_id: ApprovalId, service: ServiceDep, owner: OwnerDep
) -> ApprovalRecord:
    return await service.admission.approval(approval_id, service.admission.who(owner))


@router.post(
    "/{approval_id}",
    summary="Approve or deny a waiting request (403 without the right, 409 once decided)",
)
async def answer_approval(
    approval_id: ApprovalId, body: ApprovalAnswer, service: ServiceDep, owner: OwnerDep
) -> ApprovalRecord:
    return await service.admission.answer_approval(
        approval_id, body.decision == "approve", body.reason, service.admission.who(owner)
    )
