"""The session manager's coordinator (orchestrator/session_coordinator.py): what the manager
asks beyond its own table (admission under the caps, ends, lost sandboxes) goes through the one
object it is given, never a subclass; and a lost sandbox is told once, as that object says."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from code_interpreter_wire.errors import BackendUnavailable, SandboxLost
from orchestrator.config import Settings
from orchestrator.session_coordinator import LocalCoordinator
from orchestrator.sessions import (
    Session,
    SessionLimitReached,
    SessionLost,
    SessionManager,
)
from orchestrator.settings_sections import SessionTableSection
from sandbox import Backend, create_backend
from tests.conftest import require_backend, small_spec

pytestmark = pytest.mark.timeout(120)


class Recording(LocalCoordinator):
    """One machine's coordinator that also says what it was asked (and may refuse admission,
    and tells a lost sandbox as cluster mode does)."""

    def __init__(self, refuse: str | None = None) -> None:
        super().__init__()
        self.refuse = refuse
        self.asked: list[tuple[str, ...]] = []

    async def admit(self, owner: str, session_id: str) -> None:
        self.asked.append(("admit", owner))
        if self.refuse is not None:
            raise SessionLimitReached(self.refuse)
        await super().admit(owner, session_id)

    async def ended_here(self, session_id: str, owner: str, why: str) -> None:
        self.asked.append(("ended_here", session_id, owner, why))

    async def lost(
        self, session_id: str, owner: str, exc: SandboxLost, *, handle: str | None = None
    ) -> Exception:
        self.asked.append(("lost", session_id, str(exc)))
        return SessionLost(f"session {session_id} was lost: {exc}")


@pytest.fixture(scope="module")
async def local() -> AsyncIterator[Backend]:
    require_backend("local")
    backend = create_backend("local")
    yield backend
    await backend.close()


def _manager(tmp_path: Path, backend: Backend, coordinator: LocalCoordinator) -> SessionManager:
    settings = Settings(
        state_dir=tmp_path,
        auth_disabled=True,
        backends=[backend.name],
        default_backend=backend.name,
        reap_interval_s=3600,
    )
    return SessionManager(
        SessionTableSection.of(settings),
        given_backends={backend.name: backend},
        coordinator=coordinator,
    )


async def test_a_refused_admission_makes_no_session(tmp_path: Path, local: Backend) -> None:
    coordinator = Recording(refuse="the cluster holds its maximum of 2 sessions")
    manager = _manager(tmp_path, local, coordinator)
    await manager.start()
    try:
        with pytest.raises(SessionLimitReached, match="maximum of 2 sessions"):
            await manager.create("owner", spec=small_spec())
        assert manager.all() == []
        assert coordinator.asked == [("admit", "owner")]
    finally:
        await manager.close()


async def test_an_end_is_told_to_the_coordinator(tmp_path: Path, local: Backend) -> None:
    coordinator = Recording()
    manager = _manager(tmp_path, local, coordinator)
    await manager.start()
    try:
        session = await manager.create("owner", spec=small_spec())
        await manager.delete(session.id, "owner")
        assert coordinator.asked == [
            ("admit", "owner"),
            ("ended_here", session.id, "owner", "was deleted"),
        ]
    finally:
        await manager.close()


async def test_a_lost_sandbox_is_told_as_the_coordinator_says(
    tmp_path: Path, local: Backend
) -> None:
    """Whichever way the service reaches a session's sandbox (a run, a signal, a process's
    output read later), a `SandboxLost` becomes the coordinator's answer, asked once each."""
    coordinator = Recording()
    manager = _manager(tmp_path, local, coordinator)
    await manager.start()
    try:
        session = await manager.create("owner", spec=small_spec())
        with pytest.raises(SessionLost, match="node died"):
            async with session.activity():
                raise SandboxLost("its node died")
        assert session.busy == 0
        with pytest.raises(SessionLost, match="node died"):
            async with session.reach():
                raise SandboxLost("its node died")

        async def output() -> AsyncIterator[bytes]:
            yield b"first"
            raise SandboxLost("its node died")

        read: list[bytes] = []
        with pytest.raises(SessionLost, match="node died"):
            async for chunk in session.reaching(output()):
                read.append(chunk)
        assert read == [b"first"]
        lost = [x for x in coordinator.asked if x[0] == "lost"]
        assert lost == [("lost", session.id, "its node died")] * 3
    finally:
        await manager.close()


async def test_one_machine_tells_a_lost_sandbox_as_it_is(tmp_path: Path, local: Backend) -> None:
    manager = _manager(tmp_path, local, LocalCoordinator())
    await manager.start()
    try:
        session: Session = await manager.create("owner", spec=small_spec())
        with pytest.raises(SandboxLost, match="gone"):
            async with session.activity():
                raise SandboxLost("gone")
    finally:
        await manager.close()


async def test_a_sandbox_being_made_when_the_manager_closes_is_closed_not_left(
    tmp_path: Path, state_dir: Path
) -> None:
    """A request still making a session when the service shuts down (its client gone, say):
    the close waits for it, and the sandbox made is closed by its maker, never served."""
    require_backend("local")
    own = create_backend("local", state_dir=state_dir)  # no other test's sandboxes in it
    manager = _manager(tmp_path, own, Recording())
    await manager.start()
    try:
        root = state_dir / own.name
        making = asyncio.ensure_future(manager.create("owner", spec=small_spec()))
        async with asyncio.timeout(60):
            while not any(manager._creating.values()):  # noqa: ASYNC110  (the create's step)
                await asyncio.sleep(0.01)
        await manager.close()  # marks it closing at once: what is being made is not served
        assert making.done()  # waited for
        with pytest.raises(BackendUnavailable, match="shut down while the sandbox was made"):
            await making
        assert manager.all() == []
        assert not root.is_dir() or not any(root.iterdir())
        with pytest.raises(BackendUnavailable, match="shutting down"):
            await manager.create("owner", spec=small_spec())
    finally:
        await own.close()
