"""A sandbox's way to the network, when its policy gives it one: a directory bound read-only into
it at /run/egress, where the host's egress proxy listens on a Unix socket, and a forwarder
inside the sandbox that offers that proxy on the sandbox's own loopback (127.0.0.1:3128).

The sandbox keeps no interface but `lo`, so nothing leaves except through the proxy, which
decides each connection by host name (sandbox/egress/). This module only lays the way:
the directory (with the modes of the host-tool channel, sandbox/host_channel.py: the sandbox
may connect, never add or remove), the forwarder's command line, and the variables that point
HTTP clients, pip and Java at the proxy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from sandbox.channel_dir import check_socket_path, make_channel_dir
from sandbox.inside_kernel import egress_forwarder
from sandbox.install_places import PIP_TARGET_IN_SANDBOX, install_environment
from sandbox.socket_peer import SocketPeer

EGRESS_DIR_IN_SANDBOX = "/run/egress"
SOCKET_NAME = "proxy.sock"
SOCKET_IN_SANDBOX = f"{EGRESS_DIR_IN_SANDBOX}/{SOCKET_NAME}"
PROXY_PORT = 3128
PROXY_URL = f"http://127.0.0.1:{PROXY_PORT}"
FORWARDER_FILE = Path(egress_forwarder.__file__)
FORWARDER_IN_SANDBOX = "/opt/code-interpreter/egress_forwarder.py"


@dataclass(frozen=True)
class EgressChannel:
    """The host side of one sandbox's egress directory; the proxy creates the socket in it."""

    path: Path
    peer: SocketPeer  # who may connect: the sandbox's uid (under gVisor, its gofer)
    peer_gid: int | None  # the group given the directory (as root), or None

    @classmethod
    def create(cls, path: Path, *, peer: SocketPeer, peer_gid: int | None) -> EgressChannel:
        channel = cls(path, peer, peer_gid if os.geteuid() == 0 else None)
        check_socket_path(channel.socket_path, "egress")
        make_channel_dir(path, channel.peer_gid)
        return channel

    @property
    def socket_path(self) -> Path:
        return self.path / SOCKET_NAME


def proxy_environment() -> dict[str, str]:
    """What points the sandbox's programs at its proxy: the usual variables in both cases (curl
    reads only the lower-case `http_proxy`; pip and npm read them too), Java's properties; and
    where installs go (sandbox/install_places.py)."""
    local = "localhost,127.0.0.1,::1"
    java = (
        f"-Dhttp.proxyHost=127.0.0.1 -Dhttp.proxyPort={PROXY_PORT} "
        f"-Dhttps.proxyHost=127.0.0.1 -Dhttps.proxyPort={PROXY_PORT} "
        "-Dhttp.nonProxyHosts=localhost|127.0.0.1"
    )
    return {
        "HTTP_PROXY": PROXY_URL,
        "HTTPS_PROXY": PROXY_URL,
        "http_proxy": PROXY_URL,
        "https_proxy": PROXY_URL,
        "NO_PROXY": local,
        "no_proxy": local,
        "JAVA_TOOL_OPTIONS": java,
        **install_environment(),
    }


def with_forwarder(
    python: str,
    command: list[str],
    forwarder: str = FORWARDER_IN_SANDBOX,
    socket_path: str = SOCKET_IN_SANDBOX,
) -> list[str]:
    """`command` started behind the forwarder: the proxy port is bound before it runs;
    `socket_path`: where the proxy is reached from inside."""
    return [
        python,
        forwarder,
        "--socket",
        socket_path,
        "--port",
        str(PROXY_PORT),
        "--make-dir",
        PIP_TARGET_IN_SANDBOX,
        "--",
        *command,
    ]
