"""A revoked key's sessions do nothing more from the moment the service reads the revocation,
not only once the reaper has ended them: code it runs already calls no host tool, and nothing
that still reaches them (the E2B data plane's sandbox token, a relayed call) runs code or
commands. In this process: a real service, real sandbox, real store (the reaper held off)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from code_interpreter_wire.processes import ProcessRequest
from code_interpreter_wire.rest import CreateSessionRequest
from orchestrator.config import Settings
from orchestrator.governance.errors import PolicyDenied
from orchestrator.governance.principals import digest_of, new_key, new_principal_id
from orchestrator.governance.stores.principal_store import KeyDigest, PrincipalRecord
from orchestrator.host_tools.settings import HostToolsSettings
from orchestrator.service import Service

WAITS_THEN_CALLS = (
    "import host_tools, os, time\n"
    "deadline = time.monotonic() + 60\n"
    "while not os.path.exists('go') and time.monotonic() < deadline:\n"
    "    time.sleep(0.05)\n"
    "try:\n"
    "    print('CALLED', host_tools.sync.add(1, b=2))\n"
    "except host_tools.ToolNotAllowed as e:\n"
    "    print('REFUSED', e)\n"
)


@pytest.fixture
async def service(state_dir: Path) -> AsyncIterator[Service]:
    running = Service(
        Settings(
            api_keys=["settings-key-" + new_key()],
            backends=["local"],
            default_backend="local",
            state_dir=state_dir,
            reap_interval_s=3600,  # the reaper would end the sessions: held off here
            host_tools=HostToolsSettings(
                python=["tests.orchestrator.host_tools.tools_for_tests:TOOLS"]
            ),
        )
    )
    await running.start()
    try:
        yield running
    finally:
        await running.close()


async def test_a_revoked_keys_running_session_calls_no_tool_and_runs_nothing(
    service: Service,
) -> None:
    record = PrincipalRecord(
        id=new_principal_id(), name="leaving", keys=[KeyDigest(digest=digest_of(new_key()))]
    )
    store = service.persistence.governance.principals
    await store.put_principal(record)
    await service.admission.principals.reload()
    session = await service.lifecycle.create(record.id, CreateSessionRequest(tools=["add"]))
    before = await service.runs.execute(
        session, "import host_tools\nprint(host_tools.sync.add(1, b=2))"
    )
    assert before.stdout == "3\n", before.error
    running = asyncio.ensure_future(service.runs.execute(session, WAITS_THEN_CALLS))
    await asyncio.sleep(0.5)  # it has started, and waits for `go`

    revoked = record.model_copy(update={"revoked_at": time.time(), "keys": []})
    await store.put_principal(revoked)
    await service.admission.principals.reload()
    await service.files.upload(session, "go", b"")
    done = await asyncio.wait_for(running, 60)
    assert "REFUSED" in done.stdout and "CALLED" not in done.stdout, done.stdout

    for attempt in (
        service.runs.execute(session, "1 + 1"),
        service.runs.run_command(session, ProcessRequest(command="echo hi")),
        service.runs.start_process(session, ProcessRequest(command="sleep 1")),
    ):
        with pytest.raises(PolicyDenied) as caught:
            await attempt
        assert caught.value.rule == "revoked" and "'leaving'" in str(caught.value)
    with pytest.raises(PolicyDenied):
        await service.lifecycle.create(record.id, CreateSessionRequest())
    await service.lifecycle.end(session.id, record.id)
