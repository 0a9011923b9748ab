"""The E2B backend's processes are E2B's own commands and terminals: driven here through the
real SDK against our E2B front on 127.0.0.1 (which runs them in local sandboxes)."""

from __future__ import annotations

import asyncio
import signal

from code_interpreter_wire.processes import ProcessEnd, ProcessOutput, ProcessRequest, TerminalSize
from sandbox.backends.e2b_sandbox import E2BSandbox
from tests.sandbox.backends.test_e2b_backend import e2b_backend, remote

__all__ = ["e2b_backend", "remote"]  # the fixtures, used here by name


async def test_a_command_through_e2b(remote: E2BSandbox) -> None:
    result = await remote.run_command(
        ProcessRequest(command="echo out; echo err >&2; echo $GIVEN; pwd; exit 4")
    )
    assert result.exit_code == 4
    assert result.stdout == "out\nat start\n/workspace\n"
    assert result.stderr == "err\n"


async def test_background_stdin_and_a_signal_through_e2b(remote: E2BSandbox) -> None:
    cat = await remote.start_process(ProcessRequest(argv=["cat"], stdin=True))
    await cat.write_stdin(b"typed\n")
    await cat.close_stdin()
    done = await asyncio.wait_for(cat.wait(), 60)
    assert (done.exit_code, done.stdout) == (0, "typed\n")
    sleeper = await remote.start_process(ProcessRequest(command="sleep 300"))
    assert sleeper.pid in {p.pid for p in remote.list_processes()}
    await sleeper.signal(signal.SIGKILL)
    killed = await asyncio.wait_for(sleeper.wait(), 60)
    assert killed.exit_code is None and killed.signal == signal.SIGKILL


async def test_a_terminal_through_e2b(remote: E2BSandbox) -> None:
    terminal = await remote.start_process(
        ProcessRequest(argv=["/bin/bash", "-i"], terminal=TerminalSize(cols=100, rows=30))
    )
    events = terminal.events(replay=True)
    await terminal.write_stdin(b"echo $((6 * 7))\n")
    seen = b""
    async for event in events:
        assert not isinstance(event, ProcessEnd), seen
        if isinstance(event, ProcessOutput):
            seen += event.data
            if b"42" in seen:
                break
    await terminal.signal(signal.SIGKILL)
    await asyncio.wait_for(terminal.wait(), 60)
