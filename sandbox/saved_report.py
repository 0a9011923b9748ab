"""What a saved state holds, as the service records it: apart from the saving itself
(saved_state.py), so that backends (`Sandbox.save_whole`) can report a save too."""

from __future__ import annotations

import time
from typing import Annotated

from pydantic import BaseModel, Field

from code_interpreter_wire.errors import SandboxError

REPORT_FILE = "state.json"
_Name = Annotated[str, Field(max_length=300)]
_Why = Annotated[str, Field(max_length=400)]


class StateTooLarge(SandboxError):
    """The state is over the size limit it is kept within."""


class KernelReport(BaseModel):
    """What the kernel says it saved: read from sandboxed code, so checked and bounded."""

    saved: list[_Name] = Field(default_factory=list, max_length=200)
    saved_count: int = Field(0, ge=0)
    unsaved: dict[_Name, _Why] = Field(default_factory=dict, max_length=200)
    unsaved_count: int = Field(0, ge=0)
    cwd: Annotated[str, Field(max_length=4096)] | None = None
    python: Annotated[str, Field(max_length=40)] | None = None


class SavedState(KernelReport):
    """What a save kept, and what it could not."""

    namespace_error: str | None = None  # nothing of the namespace could be saved: why
    other_languages: list[str] = Field(
        default_factory=list, description="Started kernels of other languages: not saved."
    )
    namespace_bytes: int = 0
    workspace_bytes: int = 0
    details_bytes: int = 0  # the description of the files' modes, times and links
    files: int = 0
    saved_at: float = Field(default_factory=time.time)
    # The whole sandbox was saved by its engine (`Sandbox.save_whole`): memory, every process
    # and kernel, the files; restored by `Backend.fork`, not by `restore_state`.
    machine: bool = False
    machine_bytes: int = 0

    @property
    def bytes(self) -> int:
        return self.namespace_bytes + self.workspace_bytes + self.details_bytes + self.machine_bytes
