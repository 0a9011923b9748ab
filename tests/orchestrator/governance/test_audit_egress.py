"""Egress connections in the audit log: a real sandbox (local backend) reaches a web server on
the host's loopback through the project's own egress proxy (its test resolver maps a made-up
name there, as tests/network does); the allowed connection and a refused one are recorded with
host, port, verdict and bytes. The service runs in this process; nothing dials outside."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from code_interpreter_wire.network_policy import NetworkPolicy
from code_interpreter_wire.rest import CreateSessionRequest
from orchestrator.config import Settings
from orchestrator.governance import audit_kinds
from orchestrator.governance.stores.audit_store import AuditEvent, AuditQuery
from orchestrator.service import Service
from tests.network.conftest import FETCH
from tests.network.upstream import HELLO, Upstream, upstream


@pytest.fixture(scope="module")
def web() -> Iterator[Upstream]:
    with upstream() as up:
        yield up


@pytest.fixture
async def service(state_dir: Path, web: Upstream) -> AsyncIterator[Service]:
    settings = Settings(
        auth_disabled=True,
        backends=["local"],
        default_backend="local",
        state_dir=state_dir,
        network_ceiling="any",  # type: ignore[arg-type]
        egress_resolve={"allowed.test": ["127.0.0.1"], "other.test": ["127.0.0.1"]},
        egress_private_hosts=[f"allowed.test:{web.port}", f"other.test:{web.port}"],
    )
    running = Service(settings)
    await running.start()
    try:
        yield running
    finally:
        await running.close()


async def connections(service: Service, session_id: str, count: int) -> list[AuditEvent]:
    query = AuditQuery(session_id=session_id, kinds=[audit_kinds.EGRESS_CONNECTION])
    deadline = time.monotonic() + 15
    while True:
        found = await service.persistence.governance.audit.query_events(query)
        if len(found) >= count:
            return list(reversed(found))
        assert time.monotonic() < deadline, f"{len(found)} of {count} connections recorded"
        await asyncio.sleep(0.05)


async def test_an_egress_connection_is_recorded_with_host_port_verdict_and_bytes(
    service: Service, web: Upstream
) -> None:
    policy = NetworkPolicy.model_validate({"allow": [f"allowed.test:{web.port}"]})
    session = await service.lifecycle.create("local", CreateSessionRequest(network=policy))
    try:
        ran = await service.runs.execute(session, FETCH)
        assert ran.error is None, ran.error
        code = (
            f"print(json.dumps([fetch('http://allowed.test:{web.port}/hello'), "
            f"fetch('http://other.test:{web.port}/hello')]))"
        )
        ran = await service.runs.execute(session, code)
        assert ran.error is None, ran.error
        (status, text), (refused_status, _) = json.loads(ran.stdout)
        assert (status, text) == (200, HELLO.decode())
        assert refused_status == 403
        allowed, refused = await connections(service, session.id, 2)
    finally:
        await service.lifecycle.end(session.id, "local")
    assert allowed.status == "allowed" and allowed.principal == "local"
    assert allowed.details["host"] == "allowed.test" and allowed.details["port"] == web.port
    assert allowed.details["method"] == "GET" and allowed.details["address"] == "127.0.0.1"
    assert allowed.details["bytes_down"] >= len(HELLO) and allowed.details["bytes_up"] > 0
    assert refused.status == "refused" and refused.details["host"] == "other.test"
    assert refused.details["bytes_down"] == 0 and refused.details["reason"]
