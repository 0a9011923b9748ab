"""A deadline a front gives a session is kept by the service's rules, the same for every front:
before it the session (and what is linked to it) is kept alive; at it the session is ended, or
paused when that is its action; a busy one is paused only after its call ends; one that cannot
be paused is ended. Real service, real kernels on the local backend."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from code_interpreter_wire.rest import CreateSessionRequest
from orchestrator.service import Service
from orchestrator.sessions import Session
from orchestrator.state_store import SessionRecord
from tests.orchestrator.local_service import local_service

pytestmark = pytest.mark.timeout(300)
OWNER = "key-a"


@pytest.fixture
async def service() -> AsyncIterator[Service]:
    async with local_service(OWNER, "deadlines") as running:
        yield running


async def test_before_its_deadline_a_session_and_its_linked_ones_are_kept_alive(
    service: Service,
) -> None:
    session = await service.lifecycle.create(OWNER, CreateSessionRequest())
    linked = await service.lifecycle.create(OWNER, CreateSessionRequest())
    marked = time.monotonic()

    async def never() -> None:
        raise AssertionError("neither ended nor paused before its deadline")

    outcome = await service.deadlines.enforce(
        session,
        time.time() + 3600,
        action="end",
        linked=[linked.id],
        pause=never,
        end=never,
        name="a session",
    )
    assert outcome == "kept"
    assert session.last_active >= marked  # its idle expiry starts again
    assert linked.last_active >= marked


async def test_at_its_deadline_a_session_is_ended(service: Service) -> None:
    session = await service.lifecycle.create(OWNER, CreateSessionRequest())
    outcome = await service.deadlines.enforce(
        session,
        time.time() - 1,
        action="end",
        pause=lambda: service.lifecycle.pause(session.id, OWNER),
        end=lambda: service.lifecycle.end(session.id, OWNER),
        name="a session",
    )
    assert outcome == "ended"
    assert await service.lifecycle.state(session.id, OWNER) is None


async def test_no_deadline_leaves_it_to_its_idle_expiry(service: Service) -> None:
    session = await service.lifecycle.create(OWNER, CreateSessionRequest())

    async def never() -> None:
        raise AssertionError("a session without a deadline was acted on")

    outcome = await service.deadlines.enforce(
        session, None, action="end", pause=never, end=never, name="a session"
    )
    assert outcome == "none"


async def test_a_busy_session_is_paused_only_after_its_call_ends(service: Service) -> None:
    session = await service.lifecycle.create(OWNER, CreateSessionRequest())
    release = "release-the-call"  # in its workspace, written through the service's files
    started = asyncio.Event()

    async def on_event(_: object) -> None:  # its first output: the call runs, the session is busy
        started.set()

    wait = (
        "import os, time\n"
        "print('started', flush=True)\n"
        f"while not os.path.exists({release!r}):\n"
        "    time.sleep(0.02)\n"
    )
    call = asyncio.ensure_future(service.runs.execute(session, wait, on_event=on_event))
    await asyncio.wait_for(started.wait(), 60)
    assert session.busy

    async def pause() -> None:
        await service.lifecycle.pause(session.id, OWNER)

    async def end() -> None:
        raise AssertionError("a session that can be paused was ended")

    async def past_its_deadline() -> str:
        return await service.deadlines.enforce(
            session, time.time() - 1, action="pause", pause=pause, end=end, name="a session"
        )

    outcome = await past_its_deadline()
    assert outcome == "later"
    assert isinstance(await service.lifecycle.state(session.id, OWNER), Session)
    await service.files.upload(session, release, b"")
    await asyncio.wait_for(call, 60)
    outcome = await past_its_deadline()
    assert outcome == "paused"
    assert isinstance(await service.lifecycle.state(session.id, OWNER), SessionRecord)


async def test_one_that_cannot_be_paused_is_ended(service: Service) -> None:
    session = await service.lifecycle.create(OWNER, CreateSessionRequest())

    async def broken_pause() -> None:
        raise RuntimeError("the backend cannot pause it")

    outcome = await service.deadlines.enforce(
        session,
        time.time() - 1,
        action="pause",
        pause=broken_pause,
        end=lambda: service.lifecycle.end(session.id, OWNER),
        name="a session",
    )
    assert outcome == "ended"
    assert await service.lifecycle.state(session.id, OWNER) is None
