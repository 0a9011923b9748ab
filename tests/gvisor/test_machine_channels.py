"""A gVisor machine's ways out, through its agent (sandbox/backends/gvisor/machine_channels.py):
host tools called from the kernel, across a whole-machine pause too, and a
network policy's egress proxy reached through the forwarder inside."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import httpx
import pytest

from orchestrator.host_tools import ChannelLimits, ToolChannel, ToolRegistry
from sandbox.backends.gvisor.backend import GvisorBackend, GvisorSandbox
from sandbox.install_places import (
    PIP_TARGET_IN_SANDBOX,
    USER_BIN_IN_SANDBOX,
    USER_BINS_IN_SANDBOX,
    USER_PREFIX_IN_SANDBOX,
)
from tests.conftest import require_backend, small_spec
from tests.network.conftest import FETCH, Net, new_session, served_net
from tests.network.debian_repo import DEB_INSTALLS, DEB_PACKAGE, DEB_SAYS
from tests.network.npm_registry import NPM_PACKAGE, NPM_SAYS
from tests.network.upstream import HELLO, PACKAGE, PACKAGE_VALUE
from tests.orchestrator.host_tools.tools_for_tests import TOOLS


async def _tools(sb: GvisorSandbox) -> ToolChannel:
    assert sb.host_channel is not None
    return await ToolChannel.open(
        sb.host_channel, ToolRegistry(TOOLS).select(["add"]), ChannelLimits()
    )


async def test_host_tools_are_reached_through_the_agent_and_kept_across_a_pause(
    gvisor: GvisorBackend,
) -> None:
    sb = await gvisor.create(small_spec(host_tools=True))
    channel = await _tools(sb)
    try:
        assert (await sb.execute("import host_tools\nawait host_tools.add(1, b=2)")).text == "3"
        # The host's socket is in the directory, unreachable from inside: only the agent's is.
        refused = await sb.execute(
            "import os, socket\ns = socket.socket(socket.AF_UNIX)\n"
            "s.connect(os.path.join(os.environ['CIR_HOST_TOOLS_DIR'], 'sock'))"
        )
        assert refused.error is not None, refused
        handle = await sb.suspend()
        assert handle is not None  # a Unix socket inside: saved whole
    finally:
        channel.close()
        await sb.close()
    woken = await gvisor.wake(handle, sb.spec)
    channel = await _tools(woken)
    try:  # its kernel and its listener restored; the host side is the new sandbox's
        assert (await woken.execute("await host_tools.add(4, b=5)")).text == "9"
    finally:
        channel.close()
        await woken.close()


@pytest.fixture(scope="module")
def gvisor_net() -> Iterator[Net]:
    require_backend("gvisor")
    with served_net(backends="gvisor", default_backend="gvisor") as served:
        yield served


def _allowed_session(net: Net, api: httpx.Client) -> contextlib.AbstractContextManager[str]:
    """A gvisor session whose policy allows the loopback internet's `allowed.test`, ended after."""
    policy = {"allow": [f"allowed.test:{net.up.port}"]}
    return new_session(api, {"backend": "gvisor", "network": policy})


def _run(api: httpx.Client, sid: str, code: str) -> str:
    reply = api.post(f"/v1/sessions/{sid}/execute", json={"code": code, "timeout_s": 120})
    assert reply.status_code == 200 and reply.json()["error"] is None, reply.text
    return str(reply.json()["stdout"])


def test_a_network_policy_is_served_through_the_agent_and_pauses_the_kernel_way(
    gvisor_net: Net,
) -> None:
    net = gvisor_net
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
        # The forwarder's TCP port cannot be saved by this gVisor: the kernel's state is.
        assert api.post(f"/v1/sessions/{sid}/pause").status_code == 200
        paused_dir = net.server.state_dir / "gvisor-paused"
        assert not paused_dir.exists() or not any(paused_dir.iterdir())
        assert api.post(f"/v1/sessions/{sid}/resume").status_code == 200
        assert _run(api, sid, "print(x + 1)").strip() == "42"
        assert json.loads(_run(api, sid, FETCH + fetch)) == [200, HELLO.decode()]


def test_pip_installs_from_an_allowed_index_in_a_machine(gvisor_net: Net) -> None:
    """An agent's `pip install` as a command: the package index the policy allows (here a test
    index on loopback) is reached through the proxy, the package lands in the workspace, and
    the kernel imports it."""
    net = gvisor_net
    with net.server.client() as api, _allowed_session(net, api) as sid:
        installed = api.post(
            f"/v1/sessions/{sid}/commands",
            json={
                "command": f"pip install --index-url {net.allowed}/simple "
                f"--trusted-host allowed.test {PACKAGE}",
                "timeout_s": 300,
            },
        ).json()
        assert installed["exit_code"] == 0, installed
        got = _run(api, sid, f"import {PACKAGE}; print({PACKAGE}.VALUE)")
        assert got.strip() == PACKAGE_VALUE


def test_sudo_apt_get_installs_from_an_allowed_repository_in_a_machine(gvisor_net: Net) -> None:
    """`sudo apt-get install` as agents write it: apt reaches the repository the policy allows
    (a flat one on the loopback internet) through the egress proxy, and dpkg installs."""
    net = gvisor_net
    source = f"deb [trusted=yes] {net.allowed}/apt ./"
    command = (
        f"echo '{source}' | sudo tee /etc/apt/sources.list.d/tests.list > /dev/null && "
        "sudo apt-get -q -o Dir::Etc::sourcelist=sources.list.d/tests.list "
        "-o Dir::Etc::sourceparts=- -o APT::Get::List-Cleanup=0 update && "
        f"sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -q {DEB_PACKAGE} && "
        f"cat {DEB_INSTALLS}"
    )
    with net.server.client() as api, _allowed_session(net, api) as sid:
        done = api.post(
            f"/v1/sessions/{sid}/commands", json={"command": command, "timeout_s": 300}
        ).json()
        assert done["exit_code"] == 0, done
        assert done["stdout"].endswith(DEB_SAYS.decode()), done


def test_npm_i_g_installs_into_the_workspace_and_sudo_into_the_machines_root(
    gvisor_net: Net,
) -> None:
    """`npm i -g` and `sudo npm i -g` as agents write them, from the registry the policy allows
    through the egress proxy: the user's into the workspace, root's into the image's own prefix
    (/usr/local); root, however asked for, keeps nothing of the user's installs (a root-owned
    file there would refuse the user's next install; root runs nothing the user installed)."""
    net = gvisor_net
    install = f"npm i -g --registry {net.allowed}/npm/ {NPM_PACKAGE}"
    found = f"command -v {NPM_PACKAGE} && {NPM_PACKAGE}"
    places = 'echo "$NPM_CONFIG_PREFIX:$PIP_TARGET:$PYTHONPATH:$PATH"'
    with net.server.client() as api, _allowed_session(net, api) as sid:

        def command(line: str, **more: str) -> str:
            body = {"command": line, "timeout_s": 300, **more}
            done = api.post(f"/v1/sessions/{sid}/commands", json=body).json()
            assert done["exit_code"] == 0, done
            return str(done["stdout"])

        says = f"{NPM_SAYS}\n"
        assert command(f"{install} && {found}").endswith(
            f"{USER_BIN_IN_SANDBOX}/{NPM_PACKAGE}\n{says}"
        )
        assert command(f"sudo {install} && {found}").endswith(
            f"/usr/local/bin/{NPM_PACKAGE}\n{says}"
        )
        user = command(places)
        assert user.startswith(
            f"{USER_PREFIX_IN_SANDBOX}:{PIP_TARGET_IN_SANDBOX}:{PIP_TARGET_IN_SANDBOX}:"
        )
        assert user.rstrip().endswith(":".join(USER_BINS_IN_SANDBOX)), user
        for as_root in (command(f"sudo sh -c '{places}'"), command(places, user="root")):
            assert as_root.startswith(":::") and USER_PREFIX_IN_SANDBOX not in as_root, as_root
            assert ":/usr/sbin:" in f"{as_root.rstrip()}:", as_root
