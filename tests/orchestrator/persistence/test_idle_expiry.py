"""What idle expiry does: with `idle_action=end` an expired session answers 410, and the
reaper pauses only sessions still idle when their turn comes."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import httpx
import pytest

from orchestrator.config import Settings
from orchestrator.session_coordinator import LocalCoordinator
from orchestrator.sessions import Session, SessionManager
from orchestrator.settings_sections import SessionTableSection
from sandbox import Backend
from tests.conftest import small_spec
from tests.orchestrator.service.conftest import make_server, service_backends

pytestmark = pytest.mark.timeout(300)


def _start(api: httpx.Client, **fields: object) -> str:
    created = api.post("/v1/sessions", json={"backend": service_backends()[0], **fields})
    assert created.status_code == 201, created.text
    return str(created.json()["id"])


def test_with_idle_action_end_an_expired_session_answers_410() -> None:
    """docs/persistence.md: `idle_action=end` restores the old behaviour (an expired session
    answers 410), even when the call comes before the reaper's round."""
    srv = make_server(idle_action="end", idle_timeout_s=2, reap_interval_s=3600).start()
    try:
        with srv.client() as api:
            sid = _start(api)
            time.sleep(3)
            late = api.post(f"/v1/sessions/{sid}/execute", json={"code": "print(1)"})
            assert late.status_code == 410, late.text
            assert "without activity" in late.text
    finally:
        srv.stop()
        shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


async def test_a_session_used_while_the_reaper_pauses_others_is_not_paused(
    backend: Backend, tmp_path: Path
) -> None:
    """The reaper lists the sessions due, then pauses them one by one (seconds each, for a
    large state): one used meanwhile was paused all the same, in the middle of its user's
    work (its open connections and threads gone), because the list was not looked at again."""
    settings = Settings(
        state_dir=tmp_path,
        auth_disabled=True,
        backends=[backend.name],
        default_backend=backend.name,
        idle_timeout_s=60,
        reap_interval_s=3600,
    )
    expired: list[str] = []
    manager: SessionManager

    async def on_expiry(session: Session, why: str) -> None:
        expired.append(session.id)
        for other in manager.all():  # while this one is being paused, the other is used
            if other is not session:
                (await manager.get(other.id, other.owner)).touch()

    manager = SessionManager(
        SessionTableSection.of(settings),
        given_backends={backend.name: backend},
        on_expiry=on_expiry,
        coordinator=LocalCoordinator(),
    )
    await manager.start()
    try:
        first = await manager.create("owner", spec=small_spec())
        second = await manager.create("owner", spec=small_spec())
        for session in (first, second):
            session.last_active -= 120  # both idle past their expiry
        await manager.reap()
        assert expired == [first.id], expired
    finally:
        await manager.close()
