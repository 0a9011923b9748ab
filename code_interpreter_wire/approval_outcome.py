"""What came of one wait for a human: kept with the execution it happened in, told to the model
in the tool's output, and said to the sandboxed code when it was a denial."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

ApprovalDecision = Literal["approved", "denied"]
TIMEOUT = "timeout"  # decided_by of a request no one answered in time
ABANDONED = "abandoned"  # ... of one whose caller went first (its execution or session ended)


class ApprovalOutcome(BaseModel):
    kind: Literal["tool_call", "execution", "command"]
    subject: str = Field(description="The tool's name, `execution`, or the command line.")
    approval_id: str | None = Field(None, description="GET /v1/approvals/{id} tells it all.")
    waited_s: float
    decision: ApprovalDecision
    decided_by: str | None = Field(
        None, description="The approver's key name, `webhook`, `mcp`, or `timeout`."
    )
    reason: str | None = None

    @property
    def approved(self) -> bool:
        return self.decision == "approved"

    def explain(self) -> str:
        """`approved by alice`, `denied by bob: too much`, `denied: no one answered in time`."""
        if self.decided_by == TIMEOUT:
            return f"denied: {self.reason or 'no one answered in time'}"
        if self.decided_by == ABANDONED:
            return f"abandoned: {self.reason or 'its caller went first'}"
        by = f" by {self.decided_by}" if self.decided_by else ""
        return f"{self.decision}{by}" + (f": {self.reason}" if self.reason else "")

    def line(self) -> str:
        """What the model reads of it: `send_money waited 2.1 s: approved by alice`."""
        subject = self.subject if len(self.subject) <= 80 else self.subject[:77] + "..."
        return f"{subject} waited {self.waited_s:.1f} s: {self.explain()}"
