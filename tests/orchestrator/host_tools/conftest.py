"""Fixtures: a real sandbox on each backend with a tool channel, served by a real ToolChannel."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from code_interpreter_wire.results import ExecutionStatus
from orchestrator.host_tools import ChannelLimits, ToolChannel, ToolRegistry
from sandbox import Backend, Sandbox
from tests.conftest import small_spec
from tests.orchestrator.host_tools.tools_for_tests import TOOLS

ALLOWED = ["add", "slow", "blocking_slow", "fail", "big", "echo"]  # not "secret"
LIMITS = ChannelLimits(
    call_timeout_s=2.0, max_call_bytes=64 << 10, max_result_bytes=64 << 10, frame_timeout_s=1.0
)


@dataclass
class ToolSandbox:
    sandbox: Sandbox
    channel: ToolChannel

    async def run(self, code: str, timeout_s: float = 60) -> str:
        """Run code that must succeed; return its stdout and value."""
        ex = await self.sandbox.execute(code, timeout_s=timeout_s)
        assert ex.status is ExecutionStatus.OK, (ex.error, ex.stdout, ex.stderr)
        return ex.stdout + (ex.text or "")


@pytest.fixture(scope="module")
async def tool_sandbox(backend: Backend) -> AsyncIterator[ToolSandbox]:
    registry = ToolRegistry(TOOLS)
    sandbox = await backend.create(small_spec(host_tools=True))
    assert sandbox.host_channel is not None
    channel = await ToolChannel.open(sandbox.host_channel, registry.select(ALLOWED), LIMITS)
    try:
        await sandbox.execute("import asyncio, time, host_tools")
        yield ToolSandbox(sandbox, channel)
    finally:
        channel.close()
        await sandbox.close()


# Code run in the sandbox: a raw client of the channel, to send what the module never would.
RAW_CLIENT = """
import json, os, socket
def raw(data, wait=10):
    s = socket.socket(socket.AF_UNIX)
    tools_dir = os.environ['CIR_HOST_TOOLS_DIR']
    s.connect(os.environ.get('CIR_HOST_TOOLS_SOCKET') or os.path.join(tools_dir, 'sock'))
    s.settimeout(wait)
    s.sendall(data)
    got = b''
    while True:
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            return 'open', got
        if not chunk:
            return 'closed', got
        got += chunk
def frame(obj):
    body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return len(body).to_bytes(4, 'big') + body
def replies(data):
    out = []
    while data:
        n = int.from_bytes(data[:4], 'big')
        out.append(json.loads(data[4:4 + n]))
        data = data[4 + n:]
    return out
"""
