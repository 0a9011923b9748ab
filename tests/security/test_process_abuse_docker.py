"""Abuse through processes on the Docker backend: each attack, run as a command beside the
kernel, is contained with a typed outcome; the kernel and a bystander session carry on.

Docker must run here: in CI these fail (not skip) without an engine (`require_backend`).
"""

from __future__ import annotations

import asyncio
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator

import pytest

from code_interpreter_wire.processes import ProcessRequest
from sandbox import Backend, Sandbox, create_backend
from tests.conftest import (
    TEST_ORCHESTRATOR_ID,
    host_processes_with,
    require_backend,
    small_spec,
)

MEMORY_BOMB = "x = []\nwhile True:\n    x.append(b'x' * (64 << 20))\n"


@pytest.fixture(scope="module")
async def docker_backend() -> AsyncIterator[Backend]:
    require_backend("docker")
    backend = create_backend("docker", orchestrator_id=TEST_ORCHESTRATOR_ID)
    yield backend
    await backend.close()


@pytest.fixture
async def victim(docker_backend: Backend) -> AsyncIterator[Sandbox]:
    sb = await docker_backend.create(small_spec())
    try:
        assert (await sb.execute("state = 'kept'")).ok
        yield sb
    finally:
        await sb.close()


@pytest.fixture
async def bystander(docker_backend: Backend) -> AsyncIterator[Sandbox]:
    sb = await docker_backend.create(small_spec())
    await sb.execute("canary = 'untouched'")
    yield sb
    after = await sb.execute("canary")
    assert after.text == "'untouched'", "the bystander session was affected"
    await sb.close()


async def kernel_kept_its_state(sb: Sandbox) -> bool:
    return (await sb.execute("state")).text == "'kept'"


async def wait_until_gone(marker: str, timeout_s: float = 30) -> list[int]:
    """Host pids whose command line holds `marker`, once none are left or the time is up."""
    for _ in range(int(timeout_s / 0.2)):
        if not host_processes_with(marker):
            return []
        await asyncio.sleep(0.2)
    return host_processes_with(marker)


async def wait_until_running(marker: str, timeout_s: float = 30) -> bool:
    for _ in range(int(timeout_s / 0.1)):
        if host_processes_with(marker):
            return True
        await asyncio.sleep(0.1)
    return False


async def test_a_memory_bomb_command_ends_typed_and_the_kernel_carries_on(
    victim: Sandbox, bystander: Sandbox
) -> None:
    result = await victim.run_command(
        ProcessRequest(argv=["python3", "-c", MEMORY_BOMB], timeout_s=120)
    )
    assert not result.timed_out, result
    assert result.exit_code is None and result.signal == 9, result
    assert result.error is not None and "memory" in result.error, result
    assert await kernel_kept_its_state(victim)
    after = await victim.run_command(ProcessRequest(command="echo alive"))
    assert after.stdout == "alive\n"


async def test_a_double_forked_setsid_daemon_dies_with_its_command(victim: Sandbox) -> None:
    """Killing a command kills what escaped its process group too; the kernel is spared."""
    daemon = f"77{secrets.randbelow(10**6):06d}"
    process = await victim.start_process(
        ProcessRequest(
            command=f"(setsid sleep {daemon} >/dev/null 2>&1 </dev/null &); echo up; sleep 600"
        )
    )
    await asyncio.wait_for(_output_holds(victim, process.pid, "up"), 60)
    assert await wait_until_running(f"sleep\0{daemon}\0"), "the daemon never started"
    await process.kill()
    result = await asyncio.wait_for(process.wait(), 60)
    assert result.exit_code is None and result.signal is not None, result
    assert await wait_until_gone(f"sleep\0{daemon}\0") == []
    assert await kernel_kept_its_state(victim)


async def test_a_background_daemon_cannot_outlive_its_session(docker_backend: Backend) -> None:
    """Even one that left its group and wiped its environment (so no marker finds it)."""
    daemon = f"78{secrets.randbelow(10**6):06d}"
    box = await docker_backend.create(small_spec())
    try:
        started = await box.run_command(
            ProcessRequest(
                command=f"(env -i setsid sleep {daemon} >/dev/null 2>&1 </dev/null &); echo ok"
            )
        )
        assert started.stdout == "ok\n", started
        assert await wait_until_running(f"sleep\0{daemon}\0"), "the daemon never started"
    finally:
        await box.close()
    assert await wait_until_gone(f"sleep\0{daemon}\0") == []


@pytest.fixture
def host_process() -> Iterator[str]:
    """A process on the host, with a command line of its own, for sandboxes not to see."""
    marker = f"host-only-{secrets.token_hex(6)}"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", marker])
    try:
        yield marker
    finally:
        child.kill()
        child.wait()


async def test_a_command_cannot_see_the_hosts_or_another_sessions_processes(
    victim: Sandbox, bystander: Sandbox, host_process: str
) -> None:
    neighbour = f"79{secrets.randbelow(10**6):06d}"
    other = await bystander.start_process(ProcessRequest(argv=["sleep", neighbour]))
    try:
        listing = await victim.run_command(
            ProcessRequest(command="cat /proc/[0-9]*/cmdline | tr '\\0' ' '")
        )
        assert listing.exit_code == 0, listing
        assert "ipykernel" in listing.stdout  # its own kernel: the same container
        assert host_process not in listing.stdout
        assert f"sleep {neighbour}" not in listing.stdout
        assert "pytest" not in listing.stdout
        killed = await victim.run_command(ProcessRequest(command="kill -9 -1; echo done"))
        assert killed.signal == 9 or killed.stdout == "done\n", killed
    finally:
        await other.kill()
    assert host_processes_with(host_process), "the host's process was killed"


async def _output_holds(sb: Sandbox, pid: int, text: str) -> None:
    async for event in sb.process(pid).events(replay=True):
        if text.encode() in getattr(event, "data", b""):
            return
    raise AssertionError(f"{text!r} never came")
