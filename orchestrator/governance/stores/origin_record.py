"""What the shared store keeps of a running origin of host-tool calls
(orchestrator/governance/call_origins.py): its kind, the code an approval shows, and the time
(time.time()) by which a wait for an approval of its call must end, if it has a time limit."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class OriginRecord(BaseModel):
    kind: Literal["execution", "command", "process", "terminal"]
    code: str
    waits_end_at: float | None = None
