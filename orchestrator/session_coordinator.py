"""One machine's session coordinator (`SessionCoordinator`, orchestrator/sessions.py): the caps
are counted in the manager's own table, and nothing is shared; cluster mode's coordinator is
orchestrator/cluster/coordinator.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

from code_interpreter_wire.errors import SandboxLost

if TYPE_CHECKING:
    from orchestrator.sessions import Session, SessionManager


class LocalCoordinator:
    """One machine: the caps are counted in memory, and nothing is shared."""

    shared_store = False

    def __init__(self) -> None:
        self._table: SessionManager | None = None

    def bind(self, table: SessionManager) -> None:
        self._table = table

    @property
    def table(self) -> SessionManager:
        assert self._table is not None, "bind() first"
        return self._table

    async def admit(self, owner: str, session_id: str) -> None:
        self.table.check_limits(owner)

    async def not_made(self, session_id: str) -> None:
        return None

    async def released(self, session_id: str) -> None:
        return None

    async def find(self, session_id: str, owner: str) -> Session | None:
        return None

    async def ended_here(self, session_id: str, owner: str, why: str) -> None:
        return None

    async def end_elsewhere(self, session_id: str, why: str) -> None:
        return None  # nothing but this table's

    async def lost(
        self, session_id: str, owner: str, exc: SandboxLost, *, handle: str | None = None
    ) -> Exception:
        return exc  # no backend of one machine loses a sandbox: said as it is

    async def held_by(self, owner: str) -> int:
        return len(self.table.list(owner))

    async def reap(self) -> int:
        return 0

    async def closing(self) -> None:
        return None

    async def close(self) -> None:
        return None
