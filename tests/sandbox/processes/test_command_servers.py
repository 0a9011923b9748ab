"""A sandbox's command server (sandbox/inside_kernel/command_server.py), locally and in a Docker
container under runc: one per sandbox, with no privilege the kernel lacks (no capability, its
seccomp filter, its uid), the parent of every command; killed or stopped by code in the sandbox,
it is replaced and what it ran is reported ended, never left waiting; in a container, code that
connects to the host's socket before it is refused."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest

from code_interpreter_wire.errors import SandboxStartError
from code_interpreter_wire.processes import ProcessRequest, TerminalSize
from sandbox import Backend, Sandbox, create_backend
from sandbox.backends import docker_command_server
from sandbox.backends.docker_command_server import start_exec
from sandbox.kernel.programs import COMMAND_SERVER_FILE
from sandbox.processes import served
from tests.conftest import DOCKER_RUNTIME, backend_config, require_backend, small_spec

# The kernel's view of the sandbox's command servers: pid, parent and confinement of each.
SERVERS = (
    "import json, os\n"
    "def status(pid):\n"
    "    return dict(line.split(':\\t', 1) for line in open(f'/proc/{pid}/status').read()"
    ".splitlines() if ':\\t' in line)\n"
    "servers = []\n"
    "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
    "    try:\n"
    "        argv = open(f'/proc/{pid}/cmdline', 'rb').read().split(b'\\0')\n"
    "    except OSError:\n"
    "        continue\n"
    "    if any(a.endswith(b'command_server.py') for a in argv):\n"
    "        s = status(pid)\n"
    "        servers.append({k: s[k].strip() for k in ('Pid', 'CapEff', 'CapPrm', 'CapBnd',"
    " 'NoNewPrivs', 'Seccomp', 'Uid')})\n"
    "print(json.dumps({'kernel_uid': os.getuid(), 'servers': servers}))"
)


@contextlib.asynccontextmanager
async def served_sandbox(backend: Backend) -> AsyncIterator[Sandbox]:
    """A sandbox of `backend` whose commands go through a server."""
    if backend.name == "docker" and DOCKER_RUNTIME == "runsc":
        pytest.skip("under gVisor, a container's commands are execs: it has no command server")
    sb = await backend.create(small_spec())
    try:
        yield sb
    finally:
        await sb.close()


@pytest.fixture
async def sandbox(backend: Backend) -> AsyncIterator[Sandbox]:
    async with served_sandbox(backend) as sb:
        yield sb


async def servers(sandbox: Sandbox) -> list[dict[str, str]]:
    found: list[dict[str, str]] = json.loads((await sandbox.execute(SERVERS)).stdout)["servers"]
    return found


async def kernel_uid(sandbox: Sandbox) -> str:
    return str(json.loads((await sandbox.execute(SERVERS)).stdout)["kernel_uid"])


async def test_one_server_without_privilege_is_every_commands_parent(sandbox: Sandbox) -> None:
    assert await servers(sandbox) == []  # started by the first command, not before
    parents = set()
    for _ in range(3):
        done = await sandbox.run_command(ProcessRequest(command="grep PPid /proc/self/status"))
        parents.add(done.stdout.split()[-1])
    (server,) = await servers(sandbox)
    assert parents == {server["Pid"]}
    for field in ("CapEff", "CapPrm", "CapBnd"):
        assert int(server[field], 16) == 0, server
    assert server["NoNewPrivs"] == "1" and server["Seccomp"] == "2", server
    assert set(server["Uid"].split()) == {await kernel_uid(sandbox)}, server


async def test_a_server_killed_from_the_sandbox_is_started_again_and_its_commands_live_on(
    sandbox: Sandbox,
) -> None:
    """What it ran lives on (a command's `kill -9 -1` kills the server too, never itself); the
    next command starts a new server; what outlived its server is still signalled, and its end
    is seen (how it ended is not)."""
    sleeper = await sandbox.start_process(ProcessRequest(argv=["sleep", "1000"]))
    (server,) = await servers(sandbox)
    killed = await sandbox.execute(f"import os, signal\nos.kill({server['Pid']}, signal.SIGKILL)")
    assert killed.status == "ok", killed
    again = await sandbox.run_command(ProcessRequest(argv=["echo", "again"]))
    assert again.stdout == "again\n", again
    (new_server,) = await servers(sandbox)
    assert new_server["Pid"] != server["Pid"]
    assert sleeper.info().running
    await sleeper.kill(grace_s=5)
    ended = await asyncio.wait_for(sleeper.wait(), 30)
    assert ended.exit_code is None and "how is not known" in (ended.error or ""), ended


async def test_a_kernel_restart_starts_a_new_server_in_the_new_sandbox(sandbox: Sandbox) -> None:
    await sandbox.run_command(ProcessRequest(argv=["true"]))
    await sandbox.restart()
    assert await servers(sandbox) == []
    done = await sandbox.run_command(ProcessRequest(argv=["echo", "after"]))
    assert done.stdout == "after\n"
    assert len(await servers(sandbox)) == 1


async def test_a_command_larger_than_a_socket_message_starts_and_spares_the_others(
    sandbox: Sandbox,
) -> None:
    """Its JSON goes in a memfd: 300 KB of environment and 120 KB of non-ASCII command start,
    and a command already running is left alone."""
    sleeper = await sandbox.start_process(ProcessRequest(argv=["sleep", "1000"]))
    env = {f"BIG_{i}": "x" * 100_000 for i in range(3)}
    done = await sandbox.run_command(ProcessRequest(command="echo ${#BIG_2}", env=env))
    assert done.stdout == "100000\n", done
    wide = "中" * 40_000
    done = await sandbox.run_command(ProcessRequest(command=f": {wide}; echo wide"))
    assert done.stdout == "wide\n", done
    assert sleeper.info().running
    await sleeper.kill(grace_s=0.5)


async def test_a_server_stopped_from_the_sandbox_fails_a_start_in_time_and_is_replaced(
    sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(served, "HANDSHAKE_TIMEOUT_S", 3.0)
    await sandbox.run_command(ProcessRequest(argv=["true"]))
    (server,) = await servers(sandbox)
    stopped = await sandbox.execute(f"import os, signal\nos.kill({server['Pid']}, signal.SIGSTOP)")
    assert stopped.status == "ok", stopped
    with pytest.raises(SandboxStartError, match="in time"):
        await asyncio.wait_for(sandbox.run_command(ProcessRequest(argv=["true"])), 60)
    done = await asyncio.wait_for(sandbox.run_command(ProcessRequest(argv=["echo", "on"])), 60)
    assert done.stdout == "on\n", done
    serving = [s["Pid"] for s in await servers(sandbox) if s["Pid"] != server["Pid"]]
    assert len(serving) == 1, serving
    if sandbox.backend == "local":  # killed with its nsenter (a container's is left stopped)
        assert [s["Pid"] for s in await servers(sandbox)] == serving


@pytest.fixture
async def container() -> AsyncIterator[Sandbox]:
    """A Docker sandbox under runc: where a server has an address."""
    require_backend("docker")
    backend = create_backend("docker", **backend_config("docker"))
    try:
        async with served_sandbox(backend) as sb:
            yield sb
    finally:
        await backend.close()


async def test_code_that_connects_to_the_hosts_socket_first_is_refused(
    container: Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a container the server connects to a socket the host listens on in the kernel's
    directory, which the sandbox can reach too: a process of the sandbox that connects before
    the server (made to, here: it runs and connects before the server's exec starts) is turned
    away, and the server the engine started is the one that serves."""
    sandbox = container  # locally the server's connection is a socketpair: it has no address
    impostors: list[bytes] = []

    def impostor_first(api: Any, container: str, user: str, argv: list[str]) -> str:
        impostor = api.exec_create(container, [argv[0], "-c", CONNECT, argv[5]], user=user)
        impostors.append(api.exec_start(impostor["Id"]))
        return start_exec(api, container, user, argv)

    monkeypatch.setattr(docker_command_server, "start_exec", impostor_first)
    done = await sandbox.run_command(ProcessRequest(argv=["echo", "served"]))
    assert done.stdout == "served\n", done
    assert impostors == [b"connected\n"]
    (server,) = await servers(sandbox)
    parent = await sandbox.run_command(ProcessRequest(command="grep PPid /proc/self/status"))
    assert parent.stdout.split()[-1] == server["Pid"]


CONNECT = (
    "import socket, sys\n"
    "s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
    "s.connect(sys.argv[1])\n"
    "print('connected')"
)


# A container's server as its exec starts it, under a parent that ends once the server has
# said its pid (then its connection is closed): is it still there to end on its own?
OUTLIVES_ITS_PARENT = """
import ctypes, json, os, socket, subprocess, sys, tempfile
assert ctypes.CDLL(None).prctl(36, 1, 0, 0, 0) == 0  # a child subreaper: the server's end is ours
server_file = sys.argv[1]
with tempfile.TemporaryDirectory() as where:
    path = os.path.join(where, "commands.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(1)
    starts = "import subprocess, sys; subprocess.Popen(sys.argv[1:]); sys.stdin.read()"
    argv = [sys.executable, "-I", "-S", server_file, "--connect", path, where]
    parent = subprocess.Popen([sys.executable, "-c", starts, *argv], stdin=subprocess.PIPE)
    connection, _ = listener.accept()
    pid = json.loads(connection.recv(1 << 16))["pid"]
    parent.stdin.close()
    parent.wait()  # its parent has ended: a parent-death signal would have been sent by now
    connection.close()
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"killed_by": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                      "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None}))
"""


async def test_a_containers_server_outlives_its_parent_and_ends_when_the_host_closes() -> None:
    """In a container the server's parent is a thread of the engine's shim, which may end while
    the container lives: the server must not end with it (a parent-death signal killed it there
    between its connection and its first word, under load), but when the host lets it go."""
    program = await asyncio.create_subprocess_exec(
        sys.executable, "-c", OUTLIVES_ITS_PARENT, str(COMMAND_SERVER_FILE),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(program.communicate(), 60)
    assert program.returncode == 0
    assert json.loads(out) == {"killed_by": None, "exit": 0}


async def test_a_terminal_is_the_sandboxs_own_with_a_name_and_a_type(sandbox: Sandbox) -> None:
    """Made by the server inside the sandbox: `tty` names it; TERM is set unless asked."""
    done = await sandbox.run_command(
        ProcessRequest(command="tty; echo TERM=$TERM", terminal=TerminalSize(cols=90, rows=30))
    )
    lines = done.stdout.split()
    assert lines[0].startswith("/dev/pts/") and lines[1] == "TERM=xterm-256color", done
    size = TerminalSize(cols=90, rows=30)
    sized = await sandbox.run_command(
        ProcessRequest(command="stty size; echo $TERM", terminal=size, env={"TERM": "vt100"})
    )
    assert sized.stdout.split() == ["30", "90", "vt100"], sized
