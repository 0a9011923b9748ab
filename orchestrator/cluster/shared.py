"""What the service needs of a sandbox that lives in the cluster rather than in this process
(the ray backend's `RaySandbox`), said as protocols: the orchestrator never imports Ray."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from code_interpreter_wire.network_policy import NetworkPolicy
from sandbox.egress import EgressSettings
from sandbox.egress.outbox import EgressBatch, EgressReport
from sandbox.egress.slots import SharedCaps


@runtime_checkable
class SharedSandbox(Protocol):
    async def activity(self) -> tuple[float, int]:
        """(seconds since its last call, calls in flight), counted by the sandbox itself for
        every replica."""
        ...

    async def touch(self) -> None:
        """Mark it active for every replica (a keepalive): its idle time starts again."""
        ...


@runtime_checkable
class RelayedTools(Protocol):
    """A sandbox whose host-tool channel listens on its own machine and relays the calls."""

    @property
    def id(self) -> str:
        """Its own, not its session's: a session resumed elsewhere has a new sandbox."""
        ...

    async def set_tool_manifest(self, manifest: bytes) -> None:
        """Write what its code learns of its tools (`ToolChannel.manifest()`)."""
        ...

    async def tool_calls(self, max_wait_s: float) -> list[tuple[str, bytes]]:
        """(key, call frame) its code made, each handed out once to whichever replica asks;
        waits up to `max_wait_s` for one."""
        ...

    async def answer_tool_call(self, key: str, body: bytes) -> None:
        """The answer frame of the call taken under `key`."""
        ...


@runtime_checkable
class FencedSaves(Protocol):
    """A sandbox any replica may change while one of them saves it for a pause: the save is
    kept only if no other replica changed it meanwhile, and then no call is taken until it
    stops (counted by the sandbox itself, atomically)."""

    async def fence_mark(self) -> tuple[int, int]:
        """Where a save starts."""
        ...

    async def fence(self, mark: tuple[int, int], why: str) -> bool:
        """Refuse every call from now on (`why` tells them) if nothing but this replica's own
        calls changed it since `mark`; False (and nothing refused) if another replica's did."""
        ...

    async def unfence(self) -> None:
        """Take calls again (a pause that fenced it failed after all)."""
        ...


@runtime_checkable
class RelayedEgress(Protocol):
    """A sandbox whose egress proxy runs beside it on its own machine: the service hands it the
    ceiling and settings, and takes the records of its connections for its log and audit."""

    @property
    def id(self) -> str:
        """Its own, not its session's (see RelayedTools.id)."""
        ...

    async def open_egress(
        self, ceiling: NetworkPolicy, settings: EgressSettings, caps: SharedCaps
    ) -> bool:
        """Start its proxy (again: nothing changes); whether one runs (none: no way out).
        `caps`: its key's and the service's, counted with every sandbox of its kind."""
        ...

    async def egress_records(self, max_wait_s: float) -> EgressBatch:
        """Connections ended since any replica last asked, each handed out once; waits up to
        `max_wait_s` for one."""
        ...

    async def egress_report(self, most: int) -> EgressReport | None:
        """Its proxy's totals and latest `most` records; None when it has none."""
        ...
