"""Limits under gVisor, where they work differently from runc (docs/gvisor.md, "What differs")."""

from __future__ import annotations

import asyncio

from code_interpreter_wire.errors import SandboxStartError
from code_interpreter_wire.processes import ProcessRequest
from code_interpreter_wire.spec import ResourceLimits
from sandbox import Backend
from tests.conftest import small_spec
from tests.gvisor.conftest import GVISOR

# The processes a sandbox's kernel runs when nothing else does are fewer than this.
BOMB_GONE = 8
COUNT_PROCESSES = "import os\nsum(1 for name in os.listdir('/proc') if name.isdigit())"
MEMORY_BOMB = "chunks = []\nwhile True:\n    chunks.append(b'x' * (64 << 20))"


async def test_a_memory_bomb_as_a_command_ends_and_the_session_carries_on(
    docker_backend: Backend,
) -> None:
    """The host's memory limit ends gVisor's whole kernel container, and with it the command:
    its call ends (by its time limit at the latest) instead of waiting for ever on a stream
    the engine keeps open, and the session carries on in a new kernel."""
    sb = await docker_backend.create(
        small_spec(runtime=GVISOR, limits=ResourceLimits(memory_mb=512))
    )
    try:
        bomb = ProcessRequest(argv=["/opt/kernel/bin/python", "-c", MEMORY_BOMB], timeout_s=20)
        result = await asyncio.wait_for(sb.run_command(bomb), 120)
        assert result.exit_code != 0, result
        # The session carries on in a new kernel. Known limit (docs/gvisor.md): right after
        # gVisor ended by the memory limit, its memory may still be charged to the sandbox's
        # cgroup for a moment, so the new kernel's start can fail for memory; a later call
        # starts it. Nothing else may happen, and it must recover within a few calls.
        answers = []
        for _ in range(4):
            try:
                after = await sb.execute("6 * 7", timeout_s=60)
            except SandboxStartError as exc:
                assert "memory" in str(exc), exc
                answers.append("start failed for memory")
                await asyncio.sleep(2)
                continue
            answers.append(f"{after.status}: {after.text}")
            if after.text == "42" and after.status == "ok":
                break
            assert after.text == "42" or after.status == "kernel_died", after
        assert answers[-1] == "ok: 42", answers
    finally:
        await sb.close()


async def test_the_pids_limit_refuses_a_fork_without_ending_the_sandbox(
    docker_backend: Backend,
) -> None:
    """Held by gVisor's RLIMIT_NPROC (EAGAIN at fork), not by the host's pids cgroup, which
    would end gVisor itself."""
    sb = await docker_backend.create(small_spec(runtime=GVISOR, limits=ResourceLimits(pids=64)))
    try:
        ex = await sb.execute(
            "import os, time\n"
            "children, failed = 0, None\n"
            "for _ in range(500):\n"
            "    try:\n"
            "        if os.fork() == 0:\n"
            "            time.sleep(20); os._exit(0)\n"
            "        children += 1\n"
            "    except OSError as e:\n"
            "        failed = e.errno; break\n"
            "import errno; (children < 64, failed == errno.EAGAIN)",
            timeout_s=60,
        )
        assert ex.text == "(True, True)", ex
        assert (await sb.execute("2 + 2")).text == "4"
    finally:
        await sb.close()


async def test_a_fork_bomb_as_a_command_leaves_the_session_and_its_neighbour_working(
    docker_backend: Backend,
) -> None:
    """The bomb's shell returns at once and its processes live on, sharing the sandbox's process
    limit with the kernel (one uid): the kernel may be left unable to start a thread and die,
    then or at a later call, which ends the bomb with the kernel's container. The session carries
    on: each call answers or is told of a new kernel, the kernel dies at most once, and another
    sandbox is not touched at all."""
    sb = await docker_backend.create(small_spec(runtime=GVISOR))
    neighbour = await docker_backend.create(small_spec(runtime=GVISOR))
    try:
        await neighbour.execute("x = 1")
        bomb = ProcessRequest(command="bomb() { bomb | bomb & }; bomb", timeout_s=5)
        await asyncio.wait_for(sb.run_command(bomb), 120)
        deaths, processes = 0, None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 120
        while processes is None or processes > BOMB_GONE:
            assert loop.time() < deadline, f"the bomb still runs: {processes} processes"
            probe = await sb.execute(COUNT_PROCESSES, timeout_s=60)
            if probe.status == "kernel_died" or "restarted" in (probe.notice or ""):
                deaths += 1
            if probe.status == "ok":
                processes = int(probe.text or "")
            else:
                assert probe.status == "kernel_died", probe
        assert deaths <= 1, deaths
        assert (await sb.execute("6 * 7", timeout_s=60)).text == "42"
        assert (await neighbour.execute("x + 1")).text == "2"
    finally:
        await sb.close()
        await neighbour.close()
