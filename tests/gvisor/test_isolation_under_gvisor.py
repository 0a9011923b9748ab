"""Walls that hold under gVisor whatever the egress work adds: shown from inside a runsc
sandbox."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from code_interpreter_wire.results import ExecutionStatus
from sandbox import Backend, Sandbox
from tests.conftest import small_spec
from tests.gvisor.conftest import GVISOR


@pytest.fixture(scope="module")
async def gvisor_sandbox(docker_backend: Backend) -> AsyncIterator[Sandbox]:
    sb = await docker_backend.create(small_spec(runtime=GVISOR))
    try:
        yield sb
    finally:
        await sb.close()


async def run_ok(sb: Sandbox, code: str) -> str:
    ex = await sb.execute(code, timeout_s=60)
    assert ex.status is ExecutionStatus.OK, (ex.error, ex.stdout, ex.stderr)
    assert ex.text is not None
    return ex.text


async def test_only_loopback_and_no_route_out(gvisor_sandbox: Sandbox, host_listener: int) -> None:
    names = await run_ok(gvisor_sandbox, "import socket; [n for _, n in socket.if_nameindex()]")
    assert names == "['lo']"
    attempt = (
        "import socket\n"
        "def attempt(where):\n"
        "    s = socket.socket(); s.settimeout(3)\n"
        "    try:\n"
        "        s.connect(where); return 'connected'\n"
        "    except OSError as e:\n"
        "        return type(e).__name__\n"
    )
    host = await run_ok(gvisor_sandbox, attempt + f"attempt(('127.0.0.1', {host_listener}))")
    assert host != "'connected'"
    outside = await run_ok(gvisor_sandbox, attempt + "attempt(('1.1.1.1', 443))")
    assert outside != "'connected'"


async def test_the_host_kernel_is_out_of_sight(gvisor_sandbox: Sandbox) -> None:
    """The code talks to gVisor's kernel: the host's version and its processes are unseen."""
    host_version = Path("/proc/version").read_text()
    inside = await run_ok(gvisor_sandbox, "open('/proc/version').read()")
    assert inside.strip("'") != host_version
    pids = await run_ok(
        gvisor_sandbox, "import os; sorted(int(p) for p in os.listdir('/proc') if p.isdigit())"
    )
    assert len(eval(pids)) < 20, pids  # the sandbox's own few, not the host's hundreds


async def test_not_root_and_no_capabilities(gvisor_sandbox: Sandbox) -> None:
    ids = await run_ok(gvisor_sandbox, "import os; os.getuid(), os.geteuid()")
    assert "0" not in ids.strip("()").replace(" ", "").split(",")
    caps = await run_ok(
        gvisor_sandbox,
        "[l.split()[1] for l in open('/proc/self/status') if l.startswith(('CapEff', 'CapPrm'))]",
    )
    assert caps == "['0000000000000000', '0000000000000000']"
