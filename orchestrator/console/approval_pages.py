"""The approval queue: what waits for a human (session, key, tool, arguments, the code that made
the call) with approve and deny buttons, and what was decided."""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Form, Request
from fastapi.responses import RedirectResponse, Response

from orchestrator.console.console_auth import Viewer, check_post
from orchestrator.console.context import ViewerDep, base, console_of
from orchestrator.console.render import page, poll_block, polled, text
from orchestrator.console.shown_outputs import SHOWN_CHARS
from orchestrator.governance.approvals import MAX_REASON_CHARS
from orchestrator.governance.stores.approval_store import ApprovalRecord
from orchestrator.sessions import SessionError

router = APIRouter()

PENDING_SHOWN = 100
DECIDED_SHOWN = 25
ARGUMENTS_CHARS = 4096  # of a request's arguments on the page
KINDS = {"tool_call": "Tool call", "execution": "Execution", "command": "Command"}
# What an answer's redirect may say: fixed words, never text from a request.
ANSWERED = {
    "approved": "Approved: the call goes on.",
    "denied": "Denied: the call gets the denial and your reason.",
}


def _arguments(arguments: Any) -> str:
    shown = json.dumps(arguments, indent=2, ensure_ascii=False, default=str)
    if len(shown) <= ARGUMENTS_CHARS:
        return shown
    return shown[:ARGUMENTS_CHARS] + f"\n… {len(shown) - ARGUMENTS_CHARS} more characters"


async def _listing(request: Request, viewer: Viewer) -> tuple[str, str]:
    admission = console_of(request).service.admission
    pending = await admission.approval_requests(
        viewer.principal, state="pending", limit=PENDING_SHOWN
    )
    recent = await admission.approval_requests(
        viewer.principal, limit=DECIDED_SHOWN + PENDING_SHOWN
    )
    decided = [a for a in recent if a.state != "pending"][:DECIDED_SHOWN]

    def can_answer(record: ApprovalRecord) -> bool:
        return viewer.principal.may_answer(record.owner)

    inner = text(
        "approvals_list.html",
        base=base(request),
        viewer=viewer,
        pending=pending,
        decided=decided,
        kinds=KINDS,
        shown_arguments=_arguments,
        can_answer=can_answer,
        max_reason=MAX_REASON_CHARS,
        shown_chars=SHOWN_CHARS,
    )
    return f"{base(request)}/approvals/list", inner


@router.get("/approvals")
async def approvals_page(request: Request, viewer: ViewerDep) -> Response:
    return await _page(request, viewer, ANSWERED.get(request.query_params.get("said", "")))


async def _page(
    request: Request, viewer: Viewer, message: str | None, *, refused: int | None = None
) -> Response:
    """The page, saying `message` (a refusal of an answer, with its status, when `refused`)."""
    url, inner = await _listing(request, viewer)
    return page(
        "approvals.html",
        refused or 200,
        title="Approvals",
        section="approvals",
        base=base(request),
        viewer=viewer,
        message=message,
        refused=refused is not None,
        listing=poll_block("approvals-list", url, inner),
    )


@router.get("/approvals/list")
async def approvals_list(request: Request, viewer: ViewerDep) -> Response:
    url, inner = await _listing(request, viewer)
    return polled(request, "approvals-list", url, inner)


@router.post("/approvals/{approval_id}")
async def answer(
    request: Request,
    approval_id: str,
    viewer: ViewerDep,
    decision: Annotated[str, Form()] = "",
    reason: Annotated[str, Form()] = "",
    csrf: Annotated[str, Form()] = "",
) -> Response:
    check_post(request, viewer, csrf)
    if decision not in ("approve", "deny"):
        return await _page(request, viewer, "Choose approve or deny.", refused=400)
    if len(reason) > MAX_REASON_CHARS:
        return await _page(
            request,
            viewer,
            f"A reason is at most {MAX_REASON_CHARS} characters; this one has {len(reason)}: "
            "shorten it and answer again.",
            refused=400,
        )
    try:
        decided = await console_of(request).service.admission.answer_approval(
            approval_id, decision == "approve", reason.strip() or None, viewer.principal
        )
    except SessionError as refusal:  # not found, not this key's to answer, decided already
        return await _page(request, viewer, str(refusal), refused=refusal.status)
    return RedirectResponse(f"{base(request)}/approvals?said={decided.state}", 303)
