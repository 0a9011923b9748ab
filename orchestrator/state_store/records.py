"""The rows the stores keep: a session as it outlives its sandbox, and a saved state."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field

from code_interpreter_wire.ports import PortAccess
from code_interpreter_wire.spec import SandboxSpec
from sandbox.saved_report import SavedState

SessionState = Literal["running", "paused"]
# A named snapshot, kept until deleted; or the state of a paused session, kept as long as it.
SnapshotKind = Literal["snapshot", "paused"]


class SessionRecord(BaseModel):
    """A session as a restarted service (or another replica) must find it."""

    id: str
    owner: str
    backend: str
    spec: SandboxSpec
    tools: list[str] = Field(default_factory=list)
    languages: list[str] = Field(default_factory=lambda: ["python"])
    idle_timeout_s: float | None = None
    on_idle: Literal["pause", "end"] = "pause"
    created_at: float = Field(default_factory=time.time)
    state: SessionState = "running"
    state_since: float = Field(default_factory=time.time)
    sandbox_id: str | None = None  # the running sandbox's, to find its files after a crash
    # What another replica attaches to the running sandbox by (a Ray actor's name); None where
    # the sandbox lives in one service's process only.
    sandbox_handle: str | None = None
    saved_state: str | None = None  # the snapshot id of a paused session's state
    suspended: str | None = None  # or the backend's handle of its whole paused sandbox (E2B)
    executions: int = 0
    notice: str | None = None  # said with the next execution after a resume
    state_lost: bool = False  # ... and whether its variables were lost
    labels: dict[str, str] = Field(default_factory=dict)  # a front's own (E2B's metadata...)
    ports: PortAccess | None = None  # its inbound ports, if it asked for them
    # Its secrets' names, bound again by name when it resumes (orchestrator/vault/); no value.
    secrets: list[str] = Field(default_factory=list)

    def names_another_than(self, handle: str | None) -> bool:
        """Whether a copy of the session running in sandbox `handle` is no longer the one this
        record names: paused, or running in another sandbox (resumed through another
        replica)."""
        if self.state != "running":
            return True
        return self.sandbox_handle is not None and self.sandbox_handle != handle


class SnapshotRecord(BaseModel):
    """A saved state: its owner, where it came from, how big, and what it holds."""

    id: str
    owner: str
    kind: SnapshotKind
    name: str | None = None
    session_id: str
    backend: str
    spec: SandboxSpec
    created_at: float = Field(default_factory=time.time)
    bytes: int = 0
    report: SavedState
