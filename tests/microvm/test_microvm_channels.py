"""A machine's ways out, through its agent over the virtio-serial port: host tools called from
the kernel (the manifest copied into the machine as the service writes it), across a whole
pause too; a network policy's egress proxy reached through the forwarder inside, where the
machine has no network device at all."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import httpx
import pytest

from orchestrator.host_tools import ChannelLimits, ToolChannel, ToolRegistry
from sandbox import Sandbox
from sandbox.backends.microvm.backend import MicrovmBackend
from tests.conftest import require_backend
from tests.microvm.conftest import vm_spec
from tests.network.conftest import FETCH, Net, new_session, served_net
from tests.network.upstream import HELLO
from tests.orchestrator.host_tools.tools_for_tests import TOOLS

pytestmark = pytest.mark.timeout(600)


async def _tools(sb: Sandbox) -> ToolChannel:
    assert sb.host_channel is not None
    return await ToolChannel.open(
        sb.host_channel, ToolRegistry(TOOLS).select(["add"]), ChannelLimits()
    )


async def test_host_tools_are_called_from_the_machine_and_kept_across_a_pause(
    microvm: MicrovmBackend,
) -> None:
    sb = await microvm.create(vm_spec(host_tools=True))
    channel = await _tools(sb)
    try:
        assert (await sb.execute("import host_tools\nawait host_tools.add(1, b=2)")).text == "3"
        handle = await sb.suspend()
        assert handle is not None
    finally:
        channel.close()
        await sb.close()
    woken = await microvm.wake(handle, sb.spec)
    channel = await _tools(woken)
    try:  # its kernel and the agent's listener restored; the host side is the new sandbox's
        assert (await woken.execute("await host_tools.add(4, b=5)")).text == "9"
    finally:
        channel.close()
        await woken.close()
        await microvm.woken(handle)


@pytest.fixture(scope="module")
def microvm_net() -> Iterator[Net]:
    require_backend("microvm")
    with served_net(
        backends="microvm", default_backend="microvm", microvm_templates="false"
    ) as served:
        yield served


def _allowed_session(net: Net, api: httpx.Client) -> contextlib.AbstractContextManager[str]:
    policy = {"allow": [f"allowed.test:{net.up.port}"]}
    return new_session(api, {"backend": "microvm", "network": policy})


def _run(api: httpx.Client, sid: str, code: str) -> str:
    reply = api.post(f"/v1/sessions/{sid}/execute", json={"code": code, "timeout_s": 120})
    assert reply.status_code == 200 and reply.json()["error"] is None, reply.text
    return str(reply.json()["stdout"])


def test_a_network_policy_is_served_through_the_agent(microvm_net: Net) -> None:
    """Only what the policy allows, through the host's proxy; nothing else (the machine's
    only interface is its loopback), before and after a whole-machine pause."""
    net = microvm_net
    with net.server.client() as api, _allowed_session(net, api) as sid:
        _run(api, sid, FETCH + "x = 41")
        fetch = f"print(json.dumps(fetch('{net.allowed}/hello')))"
        assert json.loads(_run(api, sid, fetch)) == [200, HELLO.decode()]
        curl = api.post(
            f"/v1/sessions/{sid}/commands",
            json={"argv": ["curl", "-sS", f"{net.allowed}/hello"]},
        ).json()
        assert (curl["exit_code"], curl["stdout"]) == (0, HELLO.decode()), curl
        outside = json.loads(_run(api, sid, "print(json.dumps(fetch('http://other.test/')))"))
        assert outside[0] == 403, outside
        interfaces = _run(api, sid, "import os; print(sorted(os.listdir('/sys/class/net')))")
        assert interfaces.strip() == "['lo']"
        assert api.post(f"/v1/sessions/{sid}/pause").status_code == 200
        assert api.post(f"/v1/sessions/{sid}/resume").status_code == 200
        assert _run(api, sid, "print(x + 1)").strip() == "42"
        assert json.loads(_run(api, sid, fetch)) == [200, HELLO.decode()]
