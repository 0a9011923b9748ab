"""What reading a session tells, and what reading it does not do: a report is not use, so a
client watching a session does not keep it from idling out. Real service, local backend."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from code_interpreter_wire.network_policy import NetworkPolicy
from code_interpreter_wire.rest import CreateSessionRequest
from orchestrator.service import Service
from tests.orchestrator.local_service import local_service

pytestmark = pytest.mark.timeout(300)
OWNER = "key-a"


@pytest.fixture
async def service() -> AsyncIterator[Service]:
    async with local_service(OWNER, "views", network_ceiling=NetworkPolicy(mode="any")) as running:
        yield running


async def test_reading_a_sessions_network_report_leaves_its_idle_clock(service: Service) -> None:
    session = await service.lifecycle.create(
        OWNER, CreateSessionRequest(network=NetworkPolicy(mode="any"))
    )
    session.last_active -= 100  # idle for a while
    idle_since = session.last_active
    report = await service.views.network_report(session)
    assert report.policy.mode == "any"
    assert session.last_active == idle_since
