"""Processes beside the kernel, used as an attacker would: each must stay inside the kernel's own
boundary (namespaces, uid, capabilities, seccomp, no_new_privs, cgroup, rlimits, environment),
and neither the host, another session nor the kernel may notice. Every test runs on each backend
(the `sandbox` and `backend` fixtures) beside a bystander session that must be untouched.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from code_interpreter_wire.errors import FileMissing, ProcessesUnsupported
from code_interpreter_wire.processes import ProcessRequest, TerminalSize
from sandbox import Backend, Sandbox
from sandbox.backends.local import LocalBackend, LocalBackendConfig
from tests.conftest import host_processes_with, require_backend, small_spec

# What /proc/self/status says of a process's privileges and confinement.
_STATUS_FIELDS = (
    "Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb",
    "NoNewPrivs", "Seccomp",
)  # fmt: skip
_NAMESPACES = ("user", "mnt", "pid", "net", "ipc", "uts", "cgroup")
_LIMITS = ("Max file size", "Max data size", "Max processes", "Max open files", "Max core")
# Prints, as JSON, how the process that runs it is confined: run in the kernel and as a command.
DESCRIBE_SELF = f"""
import json, os
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
limits = [l for l in open("/proc/self/limits").read().splitlines() if l.startswith({_LIMITS!r})]
groups = dict(l.split(":", 2)[1:] for l in open("/proc/self/cgroup").read().splitlines())
print(json.dumps({{
    "status": {{k: status[k].split() for k in {_STATUS_FIELDS!r}}},
    "namespaces": {{n: os.readlink(f"/proc/self/ns/{{n}}") for n in {_NAMESPACES!r}}},
    "limits": limits,
    "memory_cgroup": groups.get("memory"),
    "cgroups": {{k: v for k, v in groups.items() if k and not k.startswith("name=")}},
    "cwd": os.getcwd(),
    "environment": dict(os.environ),
}}))
"""


def python(code: str, **options: object) -> ProcessRequest:
    return ProcessRequest.model_validate({"argv": ["python3", "-c", code], **options})


def shell(command: str, **options: object) -> ProcessRequest:
    return ProcessRequest.model_validate({"command": command, **options})


async def count_in_sandbox(sandbox: Sandbox, marker: str) -> int:
    """How many processes of the sandbox have `marker` in their command line."""
    code = (
        "import os\n"
        "def cmd(p):\n"
        "    try: return open(f'/proc/{p}/cmdline', 'rb').read()\n"
        "    except OSError: return b''\n"
        f"print(sum({marker.encode()!r} in cmd(p) for p in os.listdir('/proc') if p.isdigit()"
        " and int(p) != os.getpid()))"
    )
    result = await sandbox.run_command(python(code, timeout_s=60))
    assert result.exit_code == 0, result
    return int(result.stdout)


@pytest.fixture
def host_secret() -> Iterator[str]:
    """A variable in the orchestrator's own environment that no process may see."""
    name, value = "CIR_HOST_SECRET", uuid.uuid4().hex
    os.environ[name] = value
    try:
        yield value
    finally:
        del os.environ[name]


async def test_a_command_is_confined_exactly_as_the_kernel(backend: Backend) -> None:
    """Same namespaces, uid, groups, capabilities (none), no_new_privs, seccomp filter, memory
    cgroup and rlimits as the kernel, started in the workspace."""
    await check_a_command_is_confined_exactly_as_the_kernel(backend)


async def check_a_command_is_confined_exactly_as_the_kernel(
    backend: Backend, is_forked: Callable[[Sandbox], object] = lambda _: None
) -> dict[str, Any]:
    """The test above, on any backend; what the kernel said of itself. `is_forked` checks a
    sandbox's kernel was forked (where it must be)."""
    sandbox = await backend.create(small_spec(env={"SESSION_VAR": "s"}))
    try:
        is_forked(sandbox)
        kernel = await sandbox.execute(DESCRIBE_SELF)
        command = await sandbox.run_command(python(DESCRIBE_SELF, env={"REQUEST_VAR": "r"}))
    finally:
        await sandbox.close()
    assert command.exit_code == 0, command
    inside, beside = json.loads(kernel.stdout), json.loads(command.stdout)
    for field in ("status", "namespaces", "limits", "memory_cgroup"):
        assert beside[field] == inside[field], field
    assert beside["status"]["CapEff"] == ["0000000000000000"]
    assert beside["status"]["NoNewPrivs"] == ["1"] and beside["status"]["Seccomp"] == ["2"]
    assert beside["cwd"] == "/workspace"
    env = beside["environment"]
    assert env.pop("REQUEST_VAR") == "r" and env["SESSION_VAR"] == "s"
    kernels = inside["environment"]
    for name, value in env.items():  # the kernel's, or (Docker: its exec's own) none of the host's
        assert kernels.get(name) == value or os.environ.get(name) != value, name
    if sandbox.backend == "local":  # exactly the kernel's, nothing added
        assert env.items() <= kernels.items()
    return cast(dict[str, Any], inside)


async def test_a_command_sees_nothing_of_the_host_environment(
    sandbox: Sandbox, host_secret: str
) -> None:
    result = await sandbox.run_command(shell("env; cat /proc/1/environ || true", timeout_s=60))
    assert host_secret not in result.stdout + result.stderr
    assert "CIR_HOST_SECRET" not in result.stdout


async def test_a_command_cannot_see_or_signal_the_host_or_another_session(
    sandbox: Sandbox, bystander: Sandbox
) -> None:
    """Another session's process, and the host's, are not in sight; `kill -KILL -1` (everything
    the sandbox's user may signal) reaches only this sandbox."""
    theirs = await bystander.start_process(shell("exec sleep 4242"))
    await asyncio.sleep(0.5)
    assert await count_in_sandbox(sandbox, "4242") == 0
    assert await count_in_sandbox(sandbox, "pytest") == 0  # this test's own process
    result = await sandbox.run_command(shell("kill -KILL -1; echo sent", timeout_s=60))
    assert "sent" in result.stdout or result.signal == signal.SIGKILL
    await asyncio.sleep(1)
    assert theirs.running and await count_in_sandbox(bystander, "4242") == 1
    await theirs.kill()


async def test_a_memory_bomb_as_a_command_ends_typed_and_the_kernel_carries_on(
    sandbox: Sandbox, bystander: Sandbox
) -> None:
    await sandbox.execute("kept = 'still here'")
    bomb = "chunks = []\nwhile True:\n    chunks.append(b'x' * (64 << 20))"
    result = await sandbox.run_command(python(bomb, timeout_s=120))
    assert not result.timed_out, result
    killed = result.signal == signal.SIGKILL and "memory" in (result.error or "")
    refused = result.exit_code == 1 and "MemoryError" in result.stderr
    assert killed or refused, result
    assert (await sandbox.execute("kept")).text == "'still here'"
    after = await sandbox.run_command(shell("echo alive", timeout_s=60))
    assert after.stdout == "alive\n"


DAEMON = (
    "import os, sys\n"
    "if os.fork() == 0:\n"
    "    os.setsid()\n"
    "    if os.fork() == 0:\n"
    "        for fd in (0, 1, 2): os.close(fd)\n"
    "        os.execvp('sleep', ['sleep', sys.argv[1]])\n"
    "    os._exit(0)\n"
    "os.wait()\n"
    "print('detached', flush=True)\n"
)


async def test_a_time_limit_kills_what_left_the_commands_session(sandbox: Sandbox) -> None:
    """A double-forked, setsid daemon is no longer in the command's group or session: the time
    limit still ends it."""
    marker = str(7000 + os.getpid() % 1000)
    command = f"python3 -c {shlex.quote(DAEMON)} {marker} && sleep 300"
    result = await sandbox.run_command(shell(command, timeout_s=3))
    assert result.timed_out and "detached" in result.stdout, result
    await asyncio.sleep(0.5)
    assert await count_in_sandbox(sandbox, f"sleep\0{marker}") == 0


async def test_a_detached_daemon_dies_with_its_session(backend: Backend) -> None:
    """The daemon is left running after its command ended; closing the session ends it, on the
    host as well as in the sandbox."""
    marker = str(uuid.uuid4().int % 10**8 + 10**8)
    box = await backend.create(small_spec())
    try:
        daemon = ProcessRequest(argv=["python3", "-c", DAEMON, marker], timeout_s=60)
        result = await box.run_command(daemon)
        assert result.exit_code == 0 and "detached" in result.stdout, result
        assert await count_in_sandbox(box, f"sleep\0{marker}") == 1
        assert host_processes_with(marker)
    finally:
        await box.close()
    for _ in range(150):  # 30 s
        if not host_processes_with(marker):
            break
        await asyncio.sleep(0.2)
    assert not host_processes_with(marker)


async def test_a_fork_bomb_leaves_the_bystander_and_the_kernel_working(
    sandbox: Sandbox, bystander: Sandbox
) -> None:
    result = await sandbox.run_command(shell("bomb() { bomb | bomb & }; bomb", timeout_s=5))
    assert result.timed_out or result.exit_code is not None
    assert (await sandbox.execute("6 * 7")).text == "42"
    assert (await bystander.run_command(shell("echo fine", timeout_s=60))).stdout == "fine\n"


async def told_why_not(sandbox: Sandbox, request: ProcessRequest, name: str) -> None:
    """Either refused with a typed error or ended with status 127, naming what was missing."""
    try:
        result = await sandbox.run_command(request)
    except FileMissing as exc:
        assert name in str(exc)
    else:
        assert result.exit_code == 127 and name in result.stderr + (result.error or ""), result


async def test_a_missing_command_or_directory_is_told(sandbox: Sandbox) -> None:
    await told_why_not(sandbox, ProcessRequest(argv=["no-such-program"]), "no-such-program")
    await told_why_not(sandbox, ProcessRequest(argv=["true"], cwd="no-such-dir"), "no-such-dir")
    if sandbox.backend == "local":
        with pytest.raises(FileMissing, match="no-such-program"):
            await sandbox.run_command(ProcessRequest(argv=["no-such-program"]))
    assert (await sandbox.run_command(shell("echo still"))).stdout == "still\n"


async def test_a_kernel_restart_ends_the_processes_of_its_sandbox(sandbox: Sandbox) -> None:
    """Processes live in the kernel's sandbox; a new kernel is a new sandbox."""
    process = await sandbox.start_process(shell("exec sleep 600"))
    await sandbox.restart()
    result = await asyncio.wait_for(process.wait(), 60)
    assert result.exit_code is None and result.signal == signal.SIGKILL
    again = await sandbox.run_command(shell("echo after-restart", timeout_s=60))
    assert again.stdout == "after-restart\n"


async def test_a_terminal_is_the_processs_controlling_terminal(sandbox: Sandbox) -> None:
    """/dev/tty opens only for a process with a controlling terminal: the one it was given."""
    opens = "import os, sys; os.open('/dev/tty', os.O_RDWR); sys.exit(3)"
    terminal = await sandbox.start_process(python(opens, terminal=TerminalSize()))
    result = await asyncio.wait_for(terminal.wait(), 60)
    assert result.exit_code == 3, result


async def test_unsafe_mode_processes_are_plain_host_processes(state_dir: Path) -> None:
    """No sandbox, as documented for unsafe_no_sandbox: the host's filesystem and pid space,
    in the workspace, with the kernel's environment and nothing else of the host's."""
    require_backend("local")
    backend = LocalBackend(LocalBackendConfig(unsafe_no_sandbox=True, state_dir=state_dir))
    box = await backend.create(small_spec(env={"SESSION_VAR": "s"}))
    try:
        await box.upload("sub/x.txt", b"x")
        result = await box.run_command(
            shell('echo "$SESSION_VAR"; ls; readlink /proc/self/ns/pid', cwd="/workspace/sub")
        )
        assert result.exit_code == 0, result
        assert result.stdout == f"s\nx.txt\n{os.readlink('/proc/self/ns/pid')}\n"
    finally:
        await box.close()
        await backend.close()


async def test_processes_without_nsenter_are_refused_with_the_reason(state_dir: Path) -> None:
    require_backend("local")
    backend = LocalBackend(LocalBackendConfig(nsenter="/nonexistent/nsenter", state_dir=state_dir))
    box = await backend.create(small_spec())
    try:
        with pytest.raises(ProcessesUnsupported, match="util-linux"):
            await box.run_command(shell("true"))
        assert (await box.execute("1 + 1")).text == "2"  # the kernel does without
    finally:
        await box.close()
        await backend.close()
