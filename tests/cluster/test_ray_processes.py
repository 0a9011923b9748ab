"""Processes, terminals and host tools of a sandbox held by a session actor, driven from the
replica side (`RaySandbox`, `remote_process.py`) and as the service's relay loop does
(`tool_calls` / `answer_tool_call`, answered by a real `ToolChannel`).

The real `RayBackend` makes a real `SessionActor` (over a local, bubblewrap, sandbox) on the
module's multi-node cluster (conftest.py); one test also uses a bare actor of the two mixins,
to read its books.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import signal
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import ray

from code_interpreter_wire.errors import ProcessNotFound, SandboxLost
from code_interpreter_wire.processes import ProcessEnd, ProcessOutput, ProcessRequest, TerminalSize
from code_interpreter_wire.results import ExecutionStatus
from orchestrator.host_tools import ChannelLimits, ToolChannel, ToolRegistry
from sandbox import Sandbox, create_backend
from sandbox.backends.ray_cluster.backend import RayBackend
from sandbox.backends.ray_cluster.config import RayBackendConfig
from sandbox.backends.ray_cluster.node_processes import NodeProcesses
from sandbox.backends.ray_cluster.node_tool_relay import NodeToolRelay
from sandbox.backends.ray_cluster.ray_sandbox import RaySandbox
from sandbox.backends.ray_cluster.remote_process import (
    remote_get_process,
    remote_list_processes,
    remote_run_command,
    remote_start_process,
)
from sandbox.processes.managed import LISTENER_BACKLOG_BYTES, Dropped, ProcessEvent
from sandbox.tool_call_queue import CALLS_PER_POLL, MAX_UNANSWERED
from tests.cluster.conftest import RayTestCluster
from tests.conftest import small_spec
from tests.orchestrator.host_tools.tools_for_tests import TOOLS

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]
WAIT_S = 60.0  # the longest any wait for the cluster here lasts: past it the test fails


async def until(check: Any, what: str) -> None:
    """Await `check()` until it is true; fail, saying what was awaited, after WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail(f"still waiting after {WAIT_S} s for {what}")
        await asyncio.sleep(0.05)


SLOW_TOOL_TIMEOUT_S = 1.0  # the manifest's limit of `slow`: calls nobody answers end this soon
LIMITS = ChannelLimits(call_timeout_s=60.0, max_call_bytes=64 << 10, max_result_bytes=64 << 10)


class ProcessActor(NodeProcesses, NodeToolRelay):
    """The two mixins over a local sandbox, with its books open to the test."""

    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir

    async def set_up(self) -> None:
        self.backend = create_backend("local", state_dir=self.state_dir)
        self.sandbox: Sandbox = await self.backend.create(small_spec())

    @contextlib.asynccontextmanager
    async def activity(self, change: bool = False) -> AsyncIterator[None]:
        yield

    async def listeners(self, pid: int) -> int:
        """How many streams follow the process now."""
        return len(self.sandbox.process(pid)._listeners)

    async def close(self) -> None:
        await self.sandbox.close()
        await self.backend.close()


BareActor: Any = ray.remote(num_cpus=0)(ProcessActor)  # its methods are reached by name


@pytest.fixture(scope="module")
async def backend(ray_cluster: RayTestCluster) -> AsyncIterator[RayBackend]:
    ray_backend = RayBackend(RayBackendConfig(orchestrator_id="h1b", node_ip="127.0.0.1"))
    yield ray_backend
    await ray_backend.close()


@pytest.fixture(scope="module")
async def sandbox(backend: RayBackend) -> AsyncIterator[RaySandbox]:
    session = await backend.create(small_spec(host_tools=True))
    try:
        yield session
    finally:
        await session.close()


@pytest.fixture(scope="module")
def actor(sandbox: RaySandbox) -> Any:
    """The session actor itself, for the replica-side functions."""
    return sandbox._actor


@pytest.fixture(scope="module")
async def tools(sandbox: RaySandbox) -> ToolChannel:
    """The service's side: the tools the session may call, answering relayed frames; the
    manifest written on the node as the service has it written."""
    channel = ToolChannel.relayed(ToolRegistry(TOOLS).select(["add", "slow", "echo"]), LIMITS)
    manifest = json.loads(channel.manifest())
    for tool in manifest["tools"]:
        if tool["name"] == "slow":
            tool["timeout_s"] = SLOW_TOOL_TIMEOUT_S
    await sandbox.set_tool_manifest(json.dumps(manifest).encode())
    return channel


def shell(command: str, **options: object) -> ProcessRequest:
    return ProcessRequest.model_validate({"command": command, **options})


async def read_until(events: AsyncIterator[ProcessEvent], wanted: bytes) -> bytes:
    seen = b""
    async for event in events:
        if isinstance(event, ProcessOutput):
            seen += event.data
            if wanted in seen:
                return seen
        assert not isinstance(event, ProcessEnd), f"ended before {wanted!r}: {seen!r}"
    raise AssertionError(f"no {wanted!r} in {seen!r}")


async def to_the_end(events: AsyncIterator[ProcessEvent]) -> list[ProcessEvent]:
    return [event async for event in events]


# --- processes -------------------------------------------------------------------------------


async def test_a_command_gives_its_whole_result(sandbox: RaySandbox) -> None:
    result = await sandbox.run_command(shell("cd /workspace; echo out; echo err >&2; exit 3"))
    assert (result.exit_code, result.stdout, result.stderr) == (3, "out\n", "err\n")


async def test_a_streamed_command_comes_in_order_then_its_end(sandbox: RaySandbox) -> None:
    process = await sandbox.start_process(shell("for i in $(seq 1 300); do echo $i; done"))
    events = await to_the_end(process.events(replay=True))
    end = events[-1]
    assert isinstance(end, ProcessEnd) and end.exit_code == 0
    assert all(isinstance(e, ProcessOutput) for e in events[:-1])
    text = b"".join(e.data for e in events if isinstance(e, ProcessOutput)).decode()
    assert text.split() == [str(i) for i in range(1, 301)]
    assert (await process.wait()).stdout == text


async def test_input_goes_to_stdin_until_it_is_closed(sandbox: RaySandbox) -> None:
    process = await sandbox.start_process(ProcessRequest(argv=["cat"], stdin=True))
    events = process.events()
    await process.write_stdin(b"hello from the replica\n")
    assert b"hello from the replica\n" in await read_until(events, b"replica\n")
    await process.close_stdin()
    result = await process.wait()
    assert result.exit_code == 0 and result.stdout == "hello from the replica\n"
    listed = await sandbox.processes(include_ended=True)
    assert process.pid in {p.pid for p in listed}
    assert process.pid not in {p.pid for p in await sandbox.processes()}


async def test_a_terminal_is_the_controlling_tty_and_can_be_resized(sandbox: RaySandbox) -> None:
    terminal = await sandbox.start_process(
        ProcessRequest(argv=["/bin/bash", "-i"], terminal=TerminalSize(cols=80, rows=24))
    )
    assert terminal.info().terminal and terminal.info().running
    events = terminal.events(replay=True)
    await terminal.resize(TerminalSize(cols=123, rows=45))
    await terminal.write_stdin(b"stty size; [ -t 0 ] && echo in-a-$((6 * 7))-terminal\n")
    assert b"45 123" in await read_until(events, b"in-a-42-terminal")
    # It is the shell's controlling terminal: a process reading /dev/tty (which only a
    # controlling terminal answers) gets what is typed.
    await terminal.write_stdin(b"head -n1 /dev/tty | tr a-z A-Z\n")
    await terminal.write_stdin(b"typed\n")
    assert b"No such device" not in await read_until(events, b"TYPED")
    await terminal.write_stdin(b"exit 5\n")
    result = await terminal.wait()
    assert result.exit_code == 5


async def test_signal_and_kill_end_processes_with_their_signal(sandbox: RaySandbox) -> None:
    sleeper = await sandbox.start_process(shell("exec sleep 600"))
    await sleeper.signal(signal.SIGTERM)
    assert (await sleeper.wait()).signal == signal.SIGTERM
    stubborn = await sandbox.start_process(shell("trap '' TERM; echo ready; sleep 600"))
    await read_until(stubborn.events(replay=True), b"ready")
    await stubborn.kill(0.5)
    assert (await stubborn.wait()).signal == signal.SIGKILL


async def test_a_caller_that_leaves_a_command_kills_it(actor: Any) -> None:
    run = asyncio.ensure_future(remote_run_command(actor, shell("echo started; exec sleep 600")))
    running: list[Any] = []

    async def started() -> bool:
        running[:] = [p for p in await remote_list_processes(actor, False) if "600" in str(p.argv)]
        return bool(running)

    await until(started, "the actor to run the command")
    pid = running[0].pid
    assert (await actor.idle_state.remote())[1] == 1  # a call in flight: the session is in use
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    process = await remote_get_process(actor, pid)
    assert (await process.wait()).signal in (signal.SIGTERM, signal.SIGKILL)


async def test_an_unknown_pid_is_the_local_typed_error(actor: Any) -> None:
    with pytest.raises(ProcessNotFound) as caught:
        await remote_get_process(actor, 999_999)
    assert str(caught.value) == "process with pid 999999 not found"
    ended = await remote_start_process(actor, shell("true"))
    await ended.wait()
    again = await remote_get_process(actor, ended.pid)  # an ended one is remembered
    assert not again.info().running and again.info().end == ProcessEnd(exit_code=0)


async def test_a_slow_reader_loses_output_not_the_actors_memory(sandbox: RaySandbox) -> None:
    """A reader that stops reading: the actor's generator waits (backpressure), so what the
    process writes piles up in the listener's capped backlog, which drops past its cap and
    says so; without the backpressure, Ray would have taken it all in its buffers."""
    total = 24 << 20
    process = await sandbox.start_process(
        shell(f"echo ready; read go; head -c {total} /dev/zero | tr '\\0' x", stdin=True)
    )
    events = process.events(replay=True)
    await read_until(events, b"ready")  # the actor follows it from here
    await process.write_stdin(b"go\n")
    result = await process.wait()  # the reader paused until the very end
    assert result.exit_code == 0
    rest = await to_the_end(events)
    received = sum(len(e.data) for e in rest if isinstance(e, ProcessOutput))
    dropped = [e for e in rest if isinstance(e, Dropped)]
    assert dropped, "nothing was dropped: the stream did not wait for its reader"
    assert sum(e.bytes for e in dropped) + received == total
    assert received <= LISTENER_BACKLOG_BYTES + 64 * (32 << 10)
    assert isinstance(rest[-1], ProcessEnd)


async def test_a_reader_that_leaves_stops_the_actors_stream(ray_cluster: RayTestCluster) -> None:
    actor = BareActor.remote(str(ray_cluster.state_dir))
    await actor.set_up.remote()
    process = await remote_start_process(actor, ProcessRequest(argv=["yes"]))
    events = process.events(replay=True)
    await read_until(events, b"y\ny\n")
    assert await actor.listeners.remote(process.pid) == 1
    await events.aclose()  # type: ignore[attr-defined]

    async def following(count: int) -> bool:
        return bool(await actor.listeners.remote(process.pid) == count)

    await until(lambda: following(0), "the cancel to reach the actor")
    # A stream never read still follows the process on the actor (it starts at once):
    # closing it, or dropping it, stops that too.
    unread = process.events()
    await until(lambda: following(1), "the actor to follow the unread stream")
    await unread.aclose()  # type: ignore[attr-defined]
    await until(lambda: following(0), "the unread stream's cancel to reach the actor")
    dropped = process.events()
    await until(lambda: following(1), "the actor to follow the dropped stream")
    del dropped
    gc.collect()
    await until(lambda: following(0), "the dropped stream's cancel to reach the actor")
    await process.kill()
    assert (await process.wait()).signal == signal.SIGTERM
    await actor.close.remote()
    ray.kill(actor)


async def test_a_lost_session_actor_is_sandbox_lost(
    backend: RayBackend, ray_cluster: RayTestCluster
) -> None:
    before = _sandbox_dirs(ray_cluster)
    doomed = await backend.create(small_spec())
    leftovers = _sandbox_dirs(ray_cluster) - before
    assert leftovers  # its sandbox's directory on the node
    process = await doomed.start_process(shell("exec sleep 600"))
    ray.kill(doomed._actor)
    await until(lambda: _ended(doomed.facts.pid), "the killed actor's process to end")
    with pytest.raises(SandboxLost, match="the session's sandbox is lost"):
        await remote_list_processes(doomed._actor, False)  # a bare handle: lost too
    # A process handle's loss is the sandbox's: recorded there, with where and why...
    with pytest.raises(SandboxLost) as lost:
        await process.wait()
    assert doomed.lost == str(lost.value)
    assert doomed.node_id[:16] in doomed.lost and "ray.kill" in doomed.lost
    # ...so every later call of either fails at once, with that reason.
    with pytest.raises(SandboxLost, match=r"ray\.kill"):
        await doomed.execute("1")
    with pytest.raises(SandboxLost, match=r"ray\.kill"):
        await process.signal(signal.SIGTERM)
    with pytest.raises(SandboxLost):
        await doomed.get_process(process.pid)
    await doomed.close()
    # What the dead actor left on the machine goes with the next session actor to start.
    await (await backend.create(small_spec())).close()
    assert not leftovers & _sandbox_dirs(ray_cluster), "the dead actor's sandbox was not swept"


async def _ended(pid: int) -> bool:
    return not _running(pid)


def _sandbox_dirs(cluster: RayTestCluster) -> set[Path]:
    base = cluster.state_dir / "local"
    return set(base.iterdir()) if base.is_dir() else set()


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# --- host tools -------------------------------------------------------------------------------

RAW_CLIENT = """
import json, os, socket
def frame(obj):
    body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return len(body).to_bytes(4, 'big') + body
def read_frame(s):
    head = b''
    while len(head) < 4:
        chunk = s.recv(4 - len(head))
        if not chunk:
            return None
        head += chunk
    n, body = int.from_bytes(head, 'big'), b''
    while len(body) < n:
        body += s.recv(n - len(body))
    return json.loads(body)
def connect():
    s = socket.socket(socket.AF_UNIX)
    s.connect(os.path.join(os.environ['CIR_HOST_TOOLS_DIR'], 'sock'))
    s.settimeout(120)
    return s
"""


async def ok(sandbox: RaySandbox, code: str) -> str:
    execution = await sandbox.execute(code, timeout_s=120)
    assert execution.status is ExecutionStatus.OK, (execution.error, execution.stderr)
    return execution.stdout


async def answer_calls(sandbox: RaySandbox, tools: ToolChannel, count: int) -> list[str]:
    """Act as the service's relay loop for `count` calls; the tools they named."""
    named: list[str] = []
    while len(named) < count:
        for key, body in await sandbox.tool_calls(30.0):
            named.append(json.loads(body)["tool"])
            await sandbox.answer_tool_call(key, await tools.answer(body))
    return named


async def test_a_kernel_gets_the_answer_a_replica_gives(
    sandbox: RaySandbox, tools: ToolChannel
) -> None:
    await ok(sandbox, "import asyncio, host_tools")
    code = "print(await asyncio.gather(host_tools.add(a=1, b=2), host_tools.echo(value=[1, 'x'])))"
    execution = asyncio.ensure_future(ok(sandbox, code))
    assert sorted(await answer_calls(sandbox, tools, 2)) == ["add", "echo"]
    assert await execution == "[3, [1, 'x']]\n"


async def test_an_answer_over_the_result_cap_is_refused(
    sandbox: RaySandbox, tools: ToolChannel
) -> None:
    code = """
try:
    await host_tools.echo(value=1)
except host_tools.ToolTooLarge as exc:
    print(exc)
"""
    execution = asyncio.ensure_future(ok(sandbox, code))
    [(key, body)] = await sandbox.tool_calls(30.0)
    call_id = json.loads(body)["id"]
    oversize = json.dumps({"id": call_id, "result": "x" * LIMITS.max_result_bytes}).encode()
    await sandbox.answer_tool_call(key, oversize)
    assert "echo returned 65" in await execution and "over the limit of 65536" in await execution
    # What is not a call frame gets a refusal, never a tool run.
    refused = json.loads(await tools.answer(b'{"id": 1, "tool": "add"}'))
    assert refused["id"] is None and refused["error"]["type"] == "refused"


async def test_an_unanswered_call_times_out_with_an_error(
    sandbox: RaySandbox, tools: ToolChannel
) -> None:
    code = """
try:
    await host_tools.slow(seconds=0.1)
except host_tools.ToolTimeout as exc:
    print(exc)
"""
    untaken = await ok(sandbox, code)  # nobody polls
    assert f"slow was not answered within {SLOW_TOOL_TIMEOUT_S:g} s: no service" in untaken
    execution = asyncio.ensure_future(ok(sandbox, code))
    [(_key, body)] = await sandbox.tool_calls(30.0)  # taken, never answered
    assert json.loads(body)["tool"] == "slow"
    assert "the service that took the call did not answer" in await execution


async def test_the_relay_refuses_a_peer_of_another_uid(
    sandbox: RaySandbox, tools: ToolChannel, ray_cluster: RayTestCluster
) -> None:
    """This process (not the sandbox's uid) reaches the session's socket on the node: the
    relay closes the connection without reading a frame, and no call is queued."""
    [path] = [
        p
        for p in ray_cluster.state_dir.rglob("sock")
        if p.is_socket() and (p.parent / "manifest.json").exists()
    ]
    call = json.dumps({"id": 1, "tool": "add", "arguments": {"a": 1, "b": 2}}).encode()

    def knock() -> bytes:
        with socket.socket(socket.AF_UNIX) as peer:
            peer.settimeout(WAIT_S)
            peer.connect(str(path))
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                peer.sendall(len(call).to_bytes(4, "big") + call)
            try:
                return peer.recv(1024)
            except ConnectionResetError:
                return b""

    assert await asyncio.to_thread(knock) == b""  # closed at once: no answer, no refusal
    assert await sandbox.tool_calls(0.0) == []


async def test_an_oversize_frame_is_refused(sandbox: RaySandbox, tools: ToolChannel) -> None:
    code = (
        RAW_CLIENT
        + f"""
s = connect()
s.sendall(({LIMITS.max_call_bytes} + 1).to_bytes(4, 'big'))
print(read_frame(s)['error'])
print(read_frame(s))
"""
    )
    refused, closed = (await ok(sandbox, code)).splitlines()
    assert "'type': 'refused'" in refused and "over the limit of 65536" in refused
    assert closed == "None"


async def test_past_the_queue_cap_a_call_is_answered_busy(
    sandbox: RaySandbox, tools: ToolChannel
) -> None:
    send = (
        RAW_CLIENT
        + f"""
s = connect()
s.sendall(b''.join(frame({{'id': i, 'tool': 'add', 'arguments': {{'a': i}}}})
                   for i in range({MAX_UNANSWERED} + 1)))
busy = read_frame(s)
print(busy['id'], busy['error']['type'])
"""
    )
    # Nobody polls yet: the last call is over the cap, answered at once.
    assert await ok(sandbox, send) == f"{MAX_UNANSWERED} busy\n"
    receive = f"""
answers = sorted(read_frame(s)['result'] for _ in range({MAX_UNANSWERED}))
print(answers == [i + 2 for i in range({MAX_UNANSWERED})])
"""
    execution = asyncio.ensure_future(ok(sandbox, receive))
    polls: list[int] = []
    while sum(polls) < MAX_UNANSWERED:
        calls = await sandbox.tool_calls(30.0)
        polls.append(len(calls))
        for key, body in calls:
            await sandbox.answer_tool_call(key, await tools.answer(body))
    assert max(polls) == CALLS_PER_POLL
    assert await execution == "True\n"
