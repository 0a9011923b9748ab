"""A machine's ways out: its host tools and its egress proxy, through the agent.

On Docker a sandbox reaches both through Unix sockets the host listens on in directories bound
into it. A gVisor machine may hold no host socket (it could not be saved, and `--host-uds=none`
forbids it anyway), so the directories are still bound read-only (the tools' module and
manifest are read from there), but the sockets code connects to are the agent's, inside the
machine: each connection accepted there comes to the host as a stream of the agent's channel,
and is joined here to the host's own socket for it. The agent's listeners are saved with the
machine, so a restored one has them again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from code_interpreter_wire.spec import SandboxSpec
from sandbox.backends.gvisor.agent_channel import AgentChannel, ChannelStream, bridge
from sandbox.egress_channel import (
    EGRESS_DIR_IN_SANDBOX,
    EgressChannel,
    proxy_environment,
    with_forwarder,
)
from sandbox.host_channel import (
    HOST_TOOLS_DIR_IN_SANDBOX,
    HOST_TOOLS_ENV,
    HOST_TOOLS_SOCKET_ENV,
    HostChannel,
)
from sandbox.install_places import PIP_TARGET_IN_SANDBOX

log = logging.getLogger(__name__)

TOOLS = "tools"
EGRESS = "egress"
TOOLS_SOCKET_INSIDE = "/run/cir/tools.sock"
EGRESS_SOCKET_INSIDE = "/run/cir/egress.sock"
FORWARDER_TAG = "egress-forwarder"


def read_only_dirs(
    host_channel: HostChannel | None, egress_channel: EgressChannel | None
) -> dict[str, Path]:
    """The channels' host directories, by where they are bound in the machine."""
    found = {}
    if host_channel is not None:
        found[HOST_TOOLS_DIR_IN_SANDBOX] = host_channel.path
    if egress_channel is not None:
        found[EGRESS_DIR_IN_SANDBOX] = egress_channel.path
    return found


def channel_environment(spec: SandboxSpec) -> dict[str, str]:
    """What the kernels and processes of a machine of `spec` are given to find its channels
    (the proxy's variables first: the session's own may change them; the tools' last)."""
    env = {**proxy_environment(), **spec.env} if spec.network.enabled else dict(spec.env)
    if spec.host_tools:
        env[HOST_TOOLS_ENV] = HOST_TOOLS_DIR_IN_SANDBOX
        env[HOST_TOOLS_SOCKET_ENV] = TOOLS_SOCKET_INSIDE
    return env


async def open_inside(channel: AgentChannel, spec: SandboxSpec, python: str, uid: int) -> None:
    """In a new machine: the agent's listeners for the spec's channels, and the egress
    forwarder serving the proxy on the machine's loopback (it stays, detached, when the
    command it ran ends)."""
    if spec.host_tools:
        await channel.listen(TOOLS_SOCKET_INSIDE, TOOLS, uid=uid, gid=uid)
    if not spec.network.enabled:
        return
    await channel.listen(EGRESS_SOCKET_INSIDE, EGRESS, uid=uid, gid=uid)
    argv = with_forwarder(python, ["/bin/true"], socket_path=EGRESS_SOCKET_INSIDE)
    pid, io, _ = await channel.spawn(
        argv,
        env={"PATH": "/usr/bin:/bin", "PIP_TARGET": PIP_TARGET_IN_SANDBOX},
        cwd="/",
        uid=uid,
        gid=uid,
        tag=FORWARDER_TAG,
        separate_stderr=False,
    )
    io.close()
    end = await channel.wait_child(pid)  # the port is bound once the command runs
    if end.code != 0:
        raise OSError(f"the egress forwarder did not start (exit {end.code}, {end.signal})")


class ChannelRouter:
    """Joins each connection the agent accepted to the host socket of its channel."""

    def __init__(self) -> None:
        self.host_channel: HostChannel | None = None
        self.egress_channel: EgressChannel | None = None

    async def accept(self, name: str, stream: ChannelStream) -> None:
        target = {
            TOOLS: self.host_channel.socket_path if self.host_channel else None,
            EGRESS: self.egress_channel.socket_path if self.egress_channel else None,
        }.get(name)
        if target is None:
            stream.close()
            return
        try:
            reader, writer = await asyncio.open_unix_connection(str(target))
        except OSError as exc:  # the host side is not listening (yet, or any more)
            log.info("a machine's %s connection found no host listener: %s", name, exc)
            stream.close()
            return
        with contextlib.suppress(Exception):
            await bridge(stream, reader, writer)
