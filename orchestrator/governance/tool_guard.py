"""The guard of one session's host-tool calls (`host_tools.channel.CallGuard`), as the service
gives it to the session's channel: the execution (or command, process) that started the caller
still runs (call_origins.py), its key's policy (read at every call), a human's approval where
the tool or the policy wants one, showing that execution's code, and an audit event for every
call."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from code_interpreter_wire.approval_outcome import ABANDONED, ApprovalOutcome
from orchestrator.governance import audit_kinds
from orchestrator.governance.approval_errors import ApprovalsFull
from orchestrator.governance.approvals import Approvals, arguments_digest
from orchestrator.governance.call_origins import refusal_text
from orchestrator.governance.policy import Policy
from orchestrator.host_tools.base import HostTool
from orchestrator.host_tools.channel import CallGuard, ToolCall

if TYPE_CHECKING:
    from orchestrator.governance.audit import AuditLog

log = logging.getLogger(__name__)


class SessionToolGuard(CallGuard):
    def __init__(
        self,
        approvals: Approvals,
        *,
        session_id: str,
        owner: str,
        policy_of: Callable[[], Policy],
        revoked: Callable[[], bool] = lambda: False,
        audit: AuditLog | None = None,
    ) -> None:
        """`policy_of()`: the session's key's policy as it is now (a change holds at once);
        `revoked()`: whether that key is revoked now (its code calls nothing more, even before
        the reaper has ended its sessions)."""
        self._approvals = approvals
        self._session_id = session_id
        self._owner = owner
        self._policy_of = policy_of
        self._revoked = revoked
        self._audit = audit

    def may_call(self, name: str) -> bool:
        if self._revoked():
            return False
        allowed = self._policy_of().host_tools
        return allowed is None or name in allowed

    async def refusal(self, origin: str | None) -> str | None:
        if await self._approvals.origins.caller(self._session_id, origin) is not None:
            return None
        return refusal_text(origin)

    def requires_approval(self, tool: HostTool) -> bool:
        return tool.requires_approval or tool.name in self._policy_of().approval_tools

    async def approve(
        self, tool: HostTool, arguments: dict[str, Any], origin: str | None
    ) -> ApprovalOutcome:
        caller = await self._approvals.origins.caller(self._session_id, origin)
        if caller is None:  # it ended since it was checked: nothing is published
            return ApprovalOutcome(
                kind="tool_call",
                subject=tool.name,
                waited_s=0.0,
                decision="denied",
                reason=refusal_text(origin),
            )

        async def origin_runs() -> bool:
            return await self._approvals.origins.caller(self._session_id, origin) is not None

        try:
            outcome = await self._approvals.request(
                "tool_call",
                session_id=self._session_id,
                owner=self._owner,
                subject=tool.name,
                arguments=arguments,
                code=caller.code,
                made_by=caller.entry,
                waits_end_at=caller.waits_end_at,
                origin_runs=None if caller.entry is not None else origin_runs,
            )
        except ApprovalsFull as exc:  # refused before anyone was asked: a denial all the same
            outcome = ApprovalOutcome(
                kind="tool_call",
                subject=tool.name,
                waited_s=0.0,
                decision="denied",
                reason=str(exc),
            )
        except Exception as exc:  # the store failed: never run unapproved
            log.warning("approval of %s could not be asked: %s", tool.name, exc)
            outcome = ApprovalOutcome(
                kind="tool_call",
                subject=tool.name,
                waited_s=0.0,
                decision="denied",
                reason=f"the approval could not be asked ({exc}); try again",
            )
        if outcome.approved and not await origin_runs():  # it ended as it was approved
            why = f"approved by {outcome.decided_by}, but {refusal_text(origin)}"
            update = {"decision": "denied", "decided_by": ABANDONED, "reason": why}
            outcome = outcome.model_copy(update=update)
        if caller.entry is not None:
            self._approvals.note(caller.entry, outcome)
        return outcome

    def finished(self, call: ToolCall) -> None:
        if self._audit is None:
            return
        sha256, size = arguments_digest(call.arguments)
        details: dict[str, Any] = {
            "tool": call.tool,
            "arguments_sha256": sha256,
            "arguments_bytes": size,
            "outcome": call.outcome,
            "origin": call.origin,
        }
        if call.approval is not None:
            details |= {
                "approval_id": call.approval.approval_id,
                "decision": call.approval.decision,
                "approver": call.approval.decided_by,
                "waited_s": call.approval.waited_s,
            }
        self._audit.record(
            audit_kinds.TOOL_CALL,
            owner=self._owner,
            session_id=self._session_id,
            status=call.outcome,
            duration_s=call.duration_s,
            details=details,
        )
