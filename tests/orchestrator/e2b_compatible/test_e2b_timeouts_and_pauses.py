"""The E2B front's timeouts and pauses beside the service's own sessions (issue 18): a /v1
session has no E2B timeout, traffic during a pause does not undo it, a connect during one says
so. The service and its sessions are real (an in-process `Service` on the local backend, real
kernels); only the E2B front's clock is moved forward, where a test must show what a timeout
minutes away would do.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from fastapi import Request, Response

from code_interpreter_wire.rest import CreateSessionRequest
from orchestrator.e2b_compatible import control
from orchestrator.e2b_compatible.errors import E2BError
from orchestrator.e2b_compatible.sandboxes import DEFAULT_TIMEOUT_S, E2BSandboxes, SandboxGone
from orchestrator.service import Service
from orchestrator.sessions import Session
from orchestrator.state_store.records import SessionRecord
from tests.orchestrator.local_service import local_service

pytestmark = pytest.mark.timeout(300)
OWNER = "key-a"


@pytest.fixture
async def service() -> AsyncIterator[Service]:
    async with local_service(OWNER, "review") as running:
        yield running


async def test_a_v1_session_the_e2b_front_looked_at_is_not_killed_by_an_e2b_timeout(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session made through /v1 has no E2B timeout: the service's idle expiry governs it.
    Listing E2B sandboxes (`GET /v2/sandboxes`) adopts it as a sandbox without one. Paused by
    the service's idle expiry and woken by its /v1 client, it must not be given E2B's 300 s
    timeout, which would then kill it, in use or not."""
    sandboxes = E2BSandboxes(service)
    session = await service.lifecycle.create(OWNER, CreateSessionRequest())
    await service.lifecycle.pause(session.id, OWNER)  # as the service's idle expiry does
    await sandboxes.found(session.id, OWNER)  # what listing the key's sandboxes does
    await sandboxes.sweep()  # the E2B sweeper sees it paused
    await service.lifecycle.get(session.id, OWNER)  # its /v1 client's next call wakes it
    await sandboxes.sweep()

    later = time.time() + DEFAULT_TIMEOUT_S + 60  # past any E2B timeout armed just now
    with monkeypatch.context() as clock:
        clock.setattr(time, "time", lambda: later)
        await sandboxes.sweep()
    assert isinstance(await service.lifecycle.state(session.id, OWNER), Session), (
        "the E2B front killed a /v1 session it had only listed"
    )
    await service.lifecycle.end(session.id, OWNER)


async def test_data_plane_traffic_that_wakes_a_v1_session_arms_no_e2b_timeout(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for a /v1 session reached through E2B's data plane (its token had from a
    connect) after the service's idle expiry paused it: woken by that traffic, it keeps the
    service's idle expiry rather than a 300 s E2B timeout nobody asked for."""
    sandboxes = E2BSandboxes(service)
    session = await service.lifecycle.create(OWNER, CreateSessionRequest())
    record, _ = await sandboxes.found(session.id, OWNER)  # what a connect does first
    await service.lifecycle.pause(session.id, OWNER)  # as the service's idle expiry does
    await sandboxes.reachable(session.id, record.token)  # E2B data-plane traffic wakes it

    later = time.time() + DEFAULT_TIMEOUT_S + 60
    with monkeypatch.context() as clock:
        clock.setattr(time, "time", lambda: later)
        await sandboxes.sweep()
    assert isinstance(await service.lifecycle.state(session.id, OWNER), Session), (
        "the E2B front killed a /v1 session its data plane had woken"
    )
    await service.lifecycle.end(session.id, OWNER)


async def test_data_plane_traffic_during_a_pause_does_not_undo_it(service: Service) -> None:
    """`sbx.pause()` answered True: the sandbox is paused, and stays so until a connect. A
    data-plane call that arrives while the pause is under way finds it gone (E2B's 502), as it
    would once paused; it must not wait for the pause and then wake the sandbox at once."""
    sandboxes = E2BSandboxes(service)
    session = await service.lifecycle.create(OWNER, CreateSessionRequest())
    await service.runs.execute(session, "x = 1")
    record, _ = await sandboxes.found(session.id, OWNER)
    pausing = asyncio.ensure_future(sandboxes.pause(record, session))
    await asyncio.sleep(0)  # the pause begins (then saves the kernel's state, which takes a while)
    assert record.pausing
    try:
        with pytest.raises(SandboxGone):
            await sandboxes.reachable(session.id, record.token)
    finally:
        await pausing
    assert isinstance(await service.lifecycle.state(session.id, OWNER), SessionRecord), (
        "traffic during the pause woke the sandbox it had just paused"
    )
    await sandboxes.kill(record)


# The request a route reads its host from (E2B's domain for the sandbox's hosts).
_HTTP = Request(
    {"type": "http", "method": "POST", "path": "/", "headers": [(b"host", b"localhost")]}
)


async def test_a_connect_during_a_pause_says_so_rather_than_running(service: Service) -> None:
    """E2B's connect answers 200 only for a running sandbox. One that arrives while a pause is
    under way must not say "running" (the sandbox is paused a moment later, and the client's
    next call finds it gone): it is refused with E2B's 409, to connect again once paused."""
    sandboxes = E2BSandboxes(service)
    session = await service.lifecycle.create(OWNER, CreateSessionRequest())
    await service.runs.execute(session, "x = 1")
    record, _ = await sandboxes.found(session.id, OWNER)
    pausing = asyncio.ensure_future(sandboxes.pause(record, session))
    await asyncio.sleep(0)
    assert record.pausing
    try:
        with pytest.raises(E2BError) as refused:
            await control.connect(session.id, {}, _HTTP, Response(), service, sandboxes, OWNER)
        assert refused.value.status == 409, refused.value
    finally:
        await pausing
    back = Response()
    await control.connect(session.id, {}, _HTTP, back, service, sandboxes, OWNER)  # now it resumes
    assert back.status_code == 201
    await sandboxes.kill(record)
