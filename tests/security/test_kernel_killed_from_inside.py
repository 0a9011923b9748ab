"""A command that kills everything it may (`kill -9 -1`, as the sandbox's user) kills the kernel
too. The next call gets a new kernel (state lost, and said), never an error about a dead one,
and the reason names a signal from inside the sandbox: memory is blamed only on the memory
cgroup's own count of OOM kills (or the engine's OOM report), which stays still here.

Before: the call right after the command was sent to the dead kernel (its death not yet seen)
and failed as `kernel_died`, or (Docker, whose output channel had dropped) as
`503 SandboxStartError` "killed on start-up"; and both said "possibly out of memory".

Memory is blamed only for an OOM kill just before the death: the kernel shares its cgroup (or
container) with commands, and a command killed for memory minutes earlier once made a later
`kill -9 -1` read "ran out of memory" locally. Where nothing counts OOM kills (a local sandbox
without a memory cgroup: cgroup v2, not root), the reason says nothing here can tell.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator

import pytest

import sandbox.backends.docker_container as docker_container
import sandbox.cgroup_oom as cgroup_oom
import sandbox.kernel.driver as kernel_driver
from code_interpreter_wire.processes import ProcessRequest
from code_interpreter_wire.results import ExecutionStatus
from sandbox import Sandbox, cgroups, create_backend
from sandbox.kernel.process import CANNOT_TELL
from tests.conftest import require_backend, small_spec
from tests.orchestrator.service.conftest import (
    KEY_A,
    Server,
    leftovers,
    make_server,
    service_backends,
)

FROM_INSIDE = "a signal from inside the sandbox (SIGKILL)"


def counts_oom_kills(backend: str) -> bool:
    """Whether the backend has evidence of OOM kills here: a local sandbox only in a memory
    cgroup (cgroup v1, as root)."""
    return backend != "local" or cgroups.available()


def said_from_inside(text: str | None, backend: str) -> bool:
    if text is None or "out of memory" in text:
        return False
    return (FROM_INSIDE if counts_oom_kills(backend) else CANNOT_TELL) in text


async def test_the_call_after_a_command_killed_everything_runs_on_a_new_kernel(
    sandbox: Sandbox, bystander: Sandbox
) -> None:
    await sandbox.upload("kept.txt", b"files stay")
    await sandbox.execute("state = 'lost with the kernel'")
    killed = await sandbox.run_command(ProcessRequest(command="kill -9 -1; echo sent"))
    # Its echo, unless what relays its output died first: `kill -9 -1` kills the sandbox's
    # resident command server (local) or the container's kernel (Docker) too, whichever wins.
    assert killed.stdout == "sent\n" or str(killed.error).startswith("killed with its "), killed
    # At once: the kernel's death has not been seen yet.
    after = await sandbox.execute("'state' in globals(), open('kept.txt').read()")
    assert after.status is ExecutionStatus.OK, (after.status, after.error)
    assert after.text == "(False, 'files stay')"
    assert after.state_lost
    assert said_from_inside(after.notice, sandbox.backend), after.notice
    again = await sandbox.execute("1 + 1")
    assert again.ok and again.text == "2" and not again.state_lost and again.notice is None


async def test_a_kernel_killed_by_a_process_that_still_runs_is_replaced_for_the_next_call(
    sandbox: Sandbox,
) -> None:
    await sandbox.execute("state = 1")
    killer = await sandbox.start_process(
        ProcessRequest(command="kill -9 -1; echo killed; exec sleep 60")
    )
    try:
        async for event in sandbox.process(killer.pid).events(replay=True):
            if b"killed" in getattr(event, "data", b""):
                break
        after = await sandbox.execute("'state' in globals()")
        assert after.status is ExecutionStatus.OK, (after.status, after.error)
        assert after.text == "False" and after.state_lost
        assert said_from_inside(after.notice, sandbox.backend), after.notice
    finally:
        await killer.kill()


async def test_a_kernel_killed_mid_execution_by_a_command_says_who(sandbox: Sandbox) -> None:
    running = asyncio.ensure_future(sandbox.execute("import time; time.sleep(60)", timeout_s=90))
    await asyncio.sleep(1)  # the code runs; the command's kill lands in the middle of it
    await sandbox.run_command(ProcessRequest(command="kill -9 -1"))
    died = await asyncio.wait_for(running, 60)
    assert died.status is ExecutionStatus.KERNEL_DIED and died.state_lost
    assert died.error is not None and said_from_inside(died.error.value, sandbox.backend), (
        died.error
    )
    assert (await sandbox.execute("1 + 1")).text == "2"


async def test_an_earlier_oom_kill_of_a_command_is_not_blamed_for_a_later_kill(
    sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    # "Just before the death": 0.5 s rather than 5, so that the test need not wait long.
    monkeypatch.setattr(cgroup_oom, "OOM_BEFORE_DEATH_S", 0.5)
    monkeypatch.setattr(docker_container, "OOM_BEFORE_DEATH_S", 0.5)
    await sandbox.execute("state = 1")
    hog = await sandbox.run_command(
        ProcessRequest(command="python3 -c 'bytearray(4 << 30)' 2>/dev/null; echo $?")
    )
    if counts_oom_kills(sandbox.backend):
        assert hog.stdout == "137\n", hog  # killed for memory (SIGKILL)
    survived = await sandbox.execute("state")
    assert survived.text == "1" and not survived.state_lost, survived
    await asyncio.sleep(1.5)  # the OOM kill is now well before any death
    await sandbox.run_command(ProcessRequest(command="kill -9 -1"))
    after = await sandbox.execute("'state' in globals()")
    assert after.status is ExecutionStatus.OK and after.text == "False", after
    assert said_from_inside(after.notice, sandbox.backend), after.notice


async def test_the_wait_for_a_stopped_kernel_counts_against_the_time_limit(
    sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a command, an execution first makes sure the kernel answers; one stopped by the
    command never does, and that wait once came on top of the run's own time limit."""
    monkeypatch.setattr(kernel_driver, "PROBE_S", 60.0)  # any wait past the limit shows
    pid = (await sandbox.execute("import os; os.getpid()")).text
    stopped = await sandbox.run_command(ProcessRequest(command=f"kill -STOP {pid}; echo stopped"))
    assert stopped.stdout == "stopped\n", stopped
    ex = await asyncio.wait_for(sandbox.execute("1 + 1", timeout_s=1.0), 45)
    assert ex.status is ExecutionStatus.TIMEOUT, (ex.status, ex.error)
    assert ex.error is not None and "1 s time limit" in ex.error.value, ex.error
    # The limit, the interrupt's grace and a new kernel's start: far from the probe's 60 s.
    assert ex.duration_s < 30, ex.duration_s
    assert (await sandbox.execute("1 + 1")).text == "2"


async def test_without_a_memory_cgroup_the_reason_says_nothing_can_tell() -> None:
    """A local sandbox with per-process limits only (no cgroup v1, or not root) has no count of
    OOM kills: a SIGKILL may be either, and the reason says so rather than guess."""
    require_backend("local")
    backend = create_backend("local", use_cgroups=False)
    sandbox = await backend.create(small_spec())
    try:
        await sandbox.execute("state = 1")
        await sandbox.run_command(ProcessRequest(command="kill -9 -1"))
        after = await sandbox.execute("'state' in globals()")
        assert after.status is ExecutionStatus.OK and after.text == "False", after
        assert after.notice is not None and CANNOT_TELL in after.notice, after.notice
        assert "out of memory" not in after.notice and FROM_INSIDE not in after.notice
    finally:
        await sandbox.close()
        await backend.close()


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = make_server(pool_size=0)
    srv.start()
    yield srv
    srv.stop()
    assert leftovers(srv) == []
    shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


@pytest.mark.parametrize("backend", service_backends())
def test_over_the_api_the_execute_after_kill_all_answers(server: Server, backend: str) -> None:
    with server.client(KEY_A) as api:
        made = api.post("/v1/sessions", json={"backend": backend})
        assert made.status_code == 201, made.text
        sid = made.json()["id"]
        assert api.post(f"/v1/sessions/{sid}/execute", json={"code": "x = 1"}).status_code == 200
        for _ in range(3):  # the race with the death watch goes either way: each must answer
            killed = api.post(f"/v1/sessions/{sid}/commands", json={"command": "kill -9 -1"})
            assert killed.status_code == 200, killed.text
            after = api.post(f"/v1/sessions/{sid}/execute", json={"code": "'x' in globals()"})
            assert after.status_code == 200, after.text
            body = after.json()
            assert body["status"] == "ok" and body["results"][0]["text"] == "False", body
            assert body["state_lost"] and said_from_inside(body["notice"], backend), body
        api.delete(f"/v1/sessions/{sid}")
