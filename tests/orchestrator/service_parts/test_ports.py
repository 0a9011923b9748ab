"""The service's ports part with real sessions (local backend): the caps on connections and on
bytes hold and say which was reached; an ended session's connections are closed; who may open
one; what each connection leaves in the audit log."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from code_interpreter_wire.ports import PortsRequest
from code_interpreter_wire.rest import CreateSessionRequest
from orchestrator.governance.stores.audit_store import AuditQuery
from orchestrator.service import Service
from orchestrator.service_parts.ports import (
    NoSuchPortRoute,
    PortAccessDenied,
    PortCaller,
    PortsBusy,
    PortsNotAllowed,
    PortsNotOpen,
)
from orchestrator.sessions import Session
from tests.conftest import host_processes_with
from tests.orchestrator.local_service import local_service
from tests.sandbox.test_port_relay import ECHO_SERVER

OWNER = "ports-key-" + uuid.uuid4().hex
OTHER = "ports-other-" + uuid.uuid4().hex
MOST_BYTES = 1 << 16


@pytest.fixture
async def service() -> AsyncIterator[Service]:
    async with local_service(
        OWNER,
        "ports",
        more_keys=[OTHER],
        ports_max_connections_per_session=2,
        ports_max_bytes_per_connection=MOST_BYTES,
        ports_public=False,
        ports_audited_per_minute=3,
    ) as running:
        yield running


def owner_of(service: Service, key: str) -> str:
    return service.admission.principals.authenticate(key).id  # type: ignore[union-attr]


async def serving(service: Service) -> Session:
    owner = owner_of(service, OWNER)
    session = await service.lifecycle.create(owner, CreateSessionRequest(ports=PortsRequest()))
    assert (await session.sandbox.execute(ECHO_SERVER.format(port=8765))).ok
    return session


async def test_the_connection_cap_holds_and_a_closed_one_frees_room(service: Service) -> None:
    session = await serving(service)
    caller = PortCaller(owner=session.owner, token=None, client="127.0.0.1")
    first = await service.ports.connect(session, 8765, caller)
    second = await service.ports.connect(session, 8765, caller)
    with pytest.raises(PortsBusy, match="ports_max_connections_per_session"):
        await service.ports.connect(session, 8765, caller)
    await first.close()
    third = await service.ports.connect(session, 8765, caller)
    assert service.ports.open_count(session.id) == 2
    # The session's end closes what is still open.
    await service.lifecycle.end(session.id, session.owner)
    assert second.closed and third.closed
    assert service.ports.open_count(session.id) == 0


async def test_a_connection_past_its_bytes_is_closed_and_logged(service: Service) -> None:
    session = await serving(service)
    caller = PortCaller(
        owner=None, token=session.ports.token if session.ports else None, client=None
    )
    connection = await service.ports.connect(session, 8765, caller)
    await connection.write(b"x" * (MOST_BYTES // 2))
    got = 0
    while got < MOST_BYTES // 2:
        chunk = await connection.read(1 << 16)
        assert chunk, "the echo ended early"
        got += len(chunk)
    with pytest.raises(ConnectionResetError, match="ports_max_bytes_per_connection"):
        await connection.write(b"y" * 10)
    assert connection.closed
    assert await connection.read(10) == b""
    query = AuditQuery(session_id=session.id, kinds=["port.connection"])
    viewer = service.trail.viewer(session.owner)
    for _ in range(300):  # until the log's writer has written it
        events = (await service.trail.query(viewer, query)).events
        if events:
            break
        await asyncio.sleep(0.1)
    [event] = events
    assert event.status == "closed" and event.details["caller"] == "token"
    assert event.details["bytes_in"] == MOST_BYTES // 2
    assert "over the cap" in event.details["reason"]


async def test_who_may_open_and_what_is_refused(service: Service) -> None:
    session = await serving(service)
    other = owner_of(service, OTHER)
    nobody = PortCaller(owner=None, token=None, client=None)
    with pytest.raises(PortAccessDenied, match="X-Port-Token"):
        service.ports.check(session, nobody)
    with pytest.raises(PortAccessDenied, match="not this session's port token"):
        service.ports.check(session, PortCaller(owner=other, token="wrong", client=None))
    assert await service.ports.session_for("nosuch", PortCaller(other, None, None)) is None
    with pytest.raises(NoSuchPortRoute):
        service.ports.check(None, nobody)
    plain = await service.lifecycle.create(session.owner, CreateSessionRequest())
    with pytest.raises(PortsNotOpen, match="created without ports"):
        service.ports.check(plain, PortCaller(owner=session.owner, token=None, client=None))
    with pytest.raises(NoSuchPortRoute):  # another key's session without ports: unknown
        service.ports.check(plain, PortCaller(owner=other, token=None, client=None))
    with pytest.raises(PortsNotAllowed, match="ports_public"):
        await service.lifecycle.create(
            session.owner, CreateSessionRequest(ports=PortsRequest(public=True))
        )
    # A session asking for ports on a backend that cannot is refused before a sandbox is made.
    assert service.ports.access_for("local", None) is None
    await asyncio.gather(
        service.lifecycle.end(session.id, session.owner),
        service.lifecycle.end(plain.id, plain.owner),
    )


async def test_a_paused_session_keeps_its_ports_and_its_owner_wakes_it(service: Service) -> None:
    session = await serving(service)
    assert session.ports is not None
    token = session.ports.token
    paused = await service.lifecycle.pause(session.id, session.owner)
    assert paused.state == "paused" and paused.ports is not None and paused.ports.token == token
    # A token does not wake it (nothing of a paused session listens): unknown until its owner
    # asks; the owner's key wakes it, with the same ports.
    assert await service.ports.session_for(session.id, PortCaller(None, token, None)) is None
    woken = await service.ports.session_for(session.id, PortCaller(session.owner, None, None))
    assert woken is not None and woken.ports is not None and woken.ports.token == token
    assert service.ports.check(woken, PortCaller(None, token, None)) == "token"
    await service.lifecycle.end(session.id, session.owner)


def _command_servers_of(session: Session) -> list[int]:
    """This session's command servers (of the processes in its sandbox's cgroups): other
    tests' sandboxes come and go meanwhile."""
    mine = []
    for pid in host_processes_with("command_server.py"):
        try:
            groups = Path(f"/proc/{pid}/cgroup").read_text()
        except OSError:
            continue
        if session.sandbox.id in groups:
            mine.append(pid)
    return mine


async def test_connections_at_once_keep_to_the_cap_and_share_one_command_server(
    service: Service,
) -> None:
    """Six connections asked at the same moment against a cap of two: two open. And many
    connections, one after another, start no command server each (they share the sandbox's)."""
    session = await serving(service)
    caller = PortCaller(owner=session.owner, token=None, client=None)
    results = await asyncio.gather(
        *(service.ports.connect(session, 8765, caller) for _ in range(6)), return_exceptions=True
    )
    opened = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, BaseException)]
    assert len(opened) == 2 and all(isinstance(r, PortsBusy) for r in refused), results
    for connection in opened:
        await connection.close()
    servers = len(_command_servers_of(session))
    assert servers >= 1
    for _ in range(10):
        connection = await service.ports.connect(session, 8765, caller)
        await connection.close()
    assert len(_command_servers_of(session)) == servers
    await service.lifecycle.end(session.id, session.owner)


async def _port_events(service: Service, session: Session, at_least: int) -> list[object]:
    query = AuditQuery(session_id=session.id, kinds=["port.connection"])
    viewer = service.trail.viewer(session.owner)
    for _ in range(300):  # until the log's writer has written them
        events = (await service.trail.query(viewer, query)).events
        if len(events) >= at_least:
            return list(events)
        await asyncio.sleep(0.1)
    return list(events)


async def test_others_connections_cannot_flood_the_audit_log(service: Service) -> None:
    """A token's holder (or a public port's anyone) opening connection after connection: at
    most `ports_audited_per_minute` events a session (3 here), the rest counted into the next
    event (the owner's are all written), or into one at the session's end."""
    first, second = await serving(service), await serving(service)
    for session in (first, second):
        assert session.ports is not None
        stranger = PortCaller(owner=None, token=session.ports.token, client="192.0.2.1")
        for _ in range(10):
            await (await service.ports.connect(session, 8765, stranger)).close()
    owner = PortCaller(owner=first.owner, token=None, client=None)
    await (await service.ports.connect(first, 8765, owner)).close()
    for session in (first, second):
        await service.lifecycle.end(session.id, session.owner)
    told = await _port_events(service, first, 4)
    assert sorted(e.details["caller"] for e in told) == ["owner"] + ["token"] * 3  # type: ignore[attr-defined]
    [owners] = [e for e in told if e.details["caller"] == "owner"]  # type: ignore[attr-defined]
    assert owners.details["unaudited_before"] == 7  # type: ignore[attr-defined]
    at_end = await _port_events(service, second, 4)
    statuses = sorted(e.status for e in at_end)  # type: ignore[attr-defined]
    assert statuses == ["closed"] * 3 + ["unaudited"], statuses
    [left] = [e for e in at_end if e.status == "unaudited"]  # type: ignore[attr-defined]
    assert left.details["unaudited_before"] == 7  # type: ignore[attr-defined]


STOP_COMMAND_SERVERS = """
import os, signal
stopped = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        if b"command_server" in open(f"/proc/{pid}/cmdline", "rb").read():
            os.kill(int(pid), signal.SIGSTOP)
            stopped.append(int(pid))
    except OSError:
        pass
len(stopped)
"""


async def test_a_sandbox_that_stops_its_relays_holds_no_slot(service: Service) -> None:
    """The sandbox stops its own command server (SIGSTOP) under an open connection: closing it
    frees its slot and writes its event at once, and the close itself ends in bounded time."""
    session = await serving(service)
    caller = PortCaller(owner=session.owner, token=None, client=None)
    connection = await service.ports.connect(session, 8765, caller)
    stopped = await session.sandbox.execute(STOP_COMMAND_SERVERS)
    assert stopped.ok and int(stopped.text or "0") >= 1, stopped
    try:
        closing = asyncio.ensure_future(connection.close())
        await asyncio.sleep(0)  # its first step: the slot is given back before any wait
        assert service.ports.open_count(session.id) == 0
        # Ends though the sandbox never lets its relay go (PortStream.CLOSE_WAIT_S).
        await asyncio.wait_for(closing, 60)
    finally:
        await session.sandbox.execute("for pid in stopped: os.kill(pid, signal.SIGCONT)")
    await service.lifecycle.end(session.id, session.owner)
