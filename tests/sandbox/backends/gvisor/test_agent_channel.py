"""The machine agent and the host's channel to it, over real pipes, the agent a real process
(here outside gVisor: the protocol is the same). A rogue agent is a real process too, writing
what the host must refuse."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from code_interpreter_wire.errors import SandboxLost
from sandbox.backends.gvisor.agent_channel import AgentChannel, AgentError, ChannelStream, ChildEnd
from sandbox.inside_kernel import machine_agent
from sandbox.inside_kernel.machine_children import TAIL_BYTES
from sandbox.inside_kernel.machine_wire import HEADER, MAX_PAYLOAD, WINDOW

AGENT = machine_agent.__file__
UID, GID = os.getuid(), os.getgid()


async def drain(stream: ChannelStream) -> bytes:
    data = b""
    while chunk := await stream.read():
        data += chunk
    return data


async def over_pipes(
    argv: list[str], accepted: asyncio.Queue[tuple[str, ChannelStream]] | None = None
) -> tuple[AgentChannel, subprocess.Popen[bytes]]:
    to_r, to_w = os.pipe()
    from_r, from_w = os.pipe()
    process = await asyncio.to_thread(subprocess.Popen, argv, stdin=to_r, stdout=from_w)
    os.close(to_r)
    os.close(from_w)

    async def on_accept(name: str, stream: ChannelStream) -> None:
        assert accepted is not None
        await accepted.put((name, stream))

    return await AgentChannel.over_pipes(from_r, to_w, on_accept), process


@pytest.fixture
async def agent() -> AsyncIterator[AgentChannel]:
    channel, process = await over_pipes([sys.executable, "-I", "-S", AGENT])
    await channel.hello()
    yield channel
    await channel.close()
    process.kill()
    process.wait()


async def spawn(
    channel: AgentChannel, script: str, **options: object
) -> tuple[int, ChannelStream, ChannelStream | None]:
    return await channel.spawn(
        ["/bin/sh", "-c", script],
        env={"PATH": "/usr/bin:/bin"},
        cwd="/",
        uid=UID,
        gid=GID,
        tag="t",
        **options,  # type: ignore[arg-type]
    )


async def test_a_child_reads_its_input_and_its_output_comes_apart(agent: AgentChannel) -> None:
    pid, io, err = await spawn(agent, "read line; echo got $line; echo oops >&2; exit 3")
    assert err is not None
    await io.write(b"abc\n")
    io.write_eof()
    assert await drain(io) == b"got abc\n"
    assert await drain(err) == b"oops\n"
    assert await agent.wait_child(pid) == ChildEnd(3, None)


async def test_a_child_that_ends_at_once_is_still_heard_of(agent: AgentChannel) -> None:
    """Its end may come before the answer to its start is read."""
    for _ in range(20):
        pid, _io, _ = await spawn(agent, "exit 7")
        assert await asyncio.wait_for(agent.wait_child(pid), 10) == ChildEnd(7, None)


async def test_output_far_beyond_the_window_flows_and_is_never_held_whole(
    agent: AgentChannel,
) -> None:
    size = 8 * WINDOW
    pid, io, _ = await spawn(agent, f"head -c {size} /dev/zero")
    total = 0
    while chunk := await io.read(4096):
        total += len(chunk)
        assert len(io._buffer) <= WINDOW  # what arrived and was not read yet
        await asyncio.sleep(0)  # a slow reader: the agent waits for credit
    assert total == size
    assert await agent.wait_child(pid) == ChildEnd(0, None)


async def test_a_signal_reaches_what_left_the_group(agent: AgentChannel, tmp_path: Path) -> None:
    """A child that started a new session of its own still carries the marker."""
    flag = tmp_path / "alive"
    script = f"setsid sh -c 'while true; do touch {flag}; sleep 0.05; done' & echo started; wait"
    pid, io, _ = await spawn(agent, script, marker="m-123")
    assert await io.read() == b"started\n"
    await agent.signal(pid, 9)
    assert (await agent.wait_child(pid)).signal == 9
    # A touch begun before the kill may still land: the loop is gone once a window of 0.5 s
    # (ten of its rounds) passes without one.
    for _ in range(20):
        flag.unlink(missing_ok=True)
        await asyncio.sleep(0.5)
        if not flag.exists():
            break
    assert not flag.exists()


async def test_a_terminal_child(agent: AgentChannel) -> None:
    pid, io, err = await spawn(agent, "stty size; read x; echo x=$x", tty=(33, 101))
    assert err is None
    await io.write(b"7\n")
    out = await drain(io)
    assert b"33 101" in out and b"x=7" in out
    assert await agent.wait_child(pid) == ChildEnd(0, None)


async def test_connections_both_ways(agent: AgentChannel, tmp_path: Path) -> None:
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(tmp_path / "in.sock"))
    server.listen()
    server.setblocking(False)
    loop = asyncio.get_running_loop()

    async def echo_once() -> None:
        conn, _ = await loop.sock_accept(server)
        await loop.sock_sendall(conn, (await loop.sock_recv(conn, 100)).upper())
        conn.close()

    serving = asyncio.ensure_future(echo_once())
    stream = await agent.connect(str(tmp_path / "in.sock"))
    await stream.write(b"ping")
    assert await stream.read() == b"PING"
    await serving
    server.close()


async def test_a_listening_socket_inside_is_served_by_the_host(tmp_path: Path) -> None:
    accepted: asyncio.Queue[tuple[str, ChannelStream]] = asyncio.Queue()
    channel, process = await over_pipes([sys.executable, "-I", "-S", AGENT], accepted)
    try:
        path = tmp_path / "tools.sock"
        await channel.listen(str(path), "tools", uid=UID, gid=GID)
        reader, writer = await asyncio.open_unix_connection(str(path))
        writer.write(b"call")
        await writer.drain()
        name, stream = await asyncio.wait_for(accepted.get(), 10)
        assert (name, await stream.read()) == ("tools", b"call")
        await stream.write(b"answer")
        assert await reader.readexactly(6) == b"answer"
        writer.close()
    finally:
        await channel.close()
        process.kill()
        process.wait()


async def test_after_a_detach_a_new_host_adopts_a_child_with_the_last_of_its_output(
    agent: AgentChannel, tmp_path: Path
) -> None:
    written = tmp_path / "written"
    script = (
        f"head -c {TAIL_BYTES * 3} /dev/zero | tr '\\0' a; echo; echo last; touch {written}; read x"
    )
    pid, io, _ = await spawn(agent, script)
    assert await io.read(10) == b"aaaaaaaaaa"
    await agent.detach()  # nobody listens now: it writes on, into the agent's tail
    for _ in range(600):
        if written.exists():
            break
        await asyncio.sleep(0.05)
    assert written.exists()
    children = await agent.hello()  # talked to again (what `reattach` does)
    agent.not_detached()
    assert [c.pid for c in children if c.end is None] == [pid]
    io, _ = await agent.adopt(pid, stderr=True)
    await io.write(b"\n")
    kept = await drain(io)
    assert kept.endswith(b"a\nlast\n") and len(kept) <= TAIL_BYTES
    assert await agent.wait_child(pid) == ChildEnd(0, None)


@pytest.mark.parametrize(
    "written",
    [
        HEADER.pack(1, 2, MAX_PAYLOAD + 1),  # a frame over the cap
        HEADER.pack(9, 0, 0),  # a kind nobody knows
        HEADER.pack(0, 0, 5) + b"[1,2]",  # control that is not an object
        HEADER.pack(0, 0, 40) + b"[" * 40,  # nested deeper than any message
        HEADER.pack(0, 0, 5) + b"{bad ",  # not JSON
    ],
)
async def test_a_rogue_agent_ends_its_channel_and_nothing_else(written: bytes) -> None:
    rogue = f"import os, time; os.write(1, {written!r}); time.sleep(30)"
    channel, process = await over_pipes([sys.executable, "-c", rogue])
    try:
        reason = await asyncio.wait_for(channel.closed, 10)
        assert "rules" in reason
        with pytest.raises(SandboxLost):
            await channel.hello()
    finally:
        await channel.close()
        process.kill()
        process.wait()


async def test_a_rogue_agent_sending_beyond_its_credit_is_cut_off(tmp_path: Path) -> None:
    """Data on a stream the host opened, beyond the window it granted."""
    rogue = tmp_path / "rogue.py"
    rogue.write_text(
        "import os, struct, time\n"
        "os.read(0, 1 << 16)\n"  # the host's connect request
        'answer = b\'{"id": 1, "ok": true}\'\n'
        "os.write(1, struct.pack('>BII', 0, 0, len(answer)) + answer)\n"
        f"for _ in range({WINDOW // MAX_PAYLOAD + 1}):\n"
        f"    os.write(1, struct.pack('>BII', 1, 2, {MAX_PAYLOAD}) + bytes({MAX_PAYLOAD}))\n"
        "time.sleep(30)\n"
    )
    channel, process = await over_pipes([sys.executable, str(rogue)])
    try:
        stream = await channel.connect("/nowhere")
        reason = await asyncio.wait_for(channel.closed, 10)
        assert "credit" in reason
        assert len(await drain(stream)) <= WINDOW  # what it was owed, then the end
    finally:
        await channel.close()
        process.kill()
        process.wait()


async def test_a_rogue_agent_cannot_make_the_host_write_for_it(tmp_path: Path) -> None:
    """Data for streams the host never opened (or closed) is dropped without a word back: an
    agent that does not read its stdin cannot make the host's unread output grow."""
    rogue = tmp_path / "rogue.py"
    rogue.write_text(
        "import os, struct, time\n"
        "frame = struct.pack('>BII', 1, 4, 4) + b'junk'\n"
        "os.write(1, frame * 20000)\n"
        "os.write(1, struct.pack('>BII', 1, 6, 2) + b'ok')\n"
        "time.sleep(30)\n"
    )
    channel, process = await over_pipes([sys.executable, str(rogue)])
    try:
        for _ in range(40):  # its 20,000 frames read (their answers would be 180 KB)
            await asyncio.sleep(0.05)
            if process.poll() is not None or channel.closed.done():
                break
        assert not channel.closed.done()
        assert channel._writer.transport.get_write_buffer_size() == 0
    finally:
        await channel.close()
        process.kill()
        process.wait()


async def test_a_detached_channel_refuses_requests_unless_a_save_goes_on(
    agent: AgentChannel,
) -> None:
    await agent.detach()  # a save that stops the machine: nothing is asked of it any more
    with pytest.raises(AgentError, match="being saved"):
        await agent.signal(1, 0)
    with pytest.raises(AgentError, match="only a detached channel"):
        agent.not_detached()
        await agent.rebind(0, 1)
