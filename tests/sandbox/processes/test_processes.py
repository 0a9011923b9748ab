"""Processes beside the kernel, on every backend: commands, background processes, terminals.

They run inside the same boundary as the kernel (the `sandbox` fixture runs each test on local
and Docker): same user, workspace, /tmp, no network, the kernel's interpreter; their output is
capped like executions'; a time limit kills them with their children; they end with the sandbox.
"""

from __future__ import annotations

import asyncio
import signal

import pytest

from code_interpreter_wire.errors import ProcessNotFound
from code_interpreter_wire.processes import ProcessEnd, ProcessOutput, ProcessRequest, TerminalSize
from sandbox import Sandbox
from sandbox.processes.managed import ProcessEvent


def shell(command: str, **options: object) -> ProcessRequest:
    return ProcessRequest.model_validate({"command": command, **options})


async def output_until(
    events: object, wanted: bytes, *, stream: str | None = None, timeout_s: float = 60
) -> bytes:
    """Read a process's events until `wanted` appears in its output; return what was read."""
    seen = b""

    async def read() -> bytes:
        nonlocal seen
        async for event in events:  # type: ignore[attr-defined]
            if isinstance(event, ProcessOutput) and (stream is None or event.stream == stream):
                seen += event.data
                if wanted in seen:
                    return seen
            if isinstance(event, ProcessEnd):
                raise AssertionError(f"ended before {wanted!r}: {seen!r}, {event}")
        raise AssertionError(f"no {wanted!r} in {seen!r}")

    return await asyncio.wait_for(read(), timeout_s)


async def test_a_command_runs_in_the_workspace_with_exit_code_and_output(
    sandbox: Sandbox,
) -> None:
    await sandbox.upload("data.txt", b"one\ntwo\nthree\n")
    result = await sandbox.run_command(shell("pwd; wc -l < data.txt; echo oops >&2; exit 3"))
    assert result.exit_code == 3
    assert result.stdout == "/workspace\n3\n"
    assert result.stderr == "oops\n"
    assert not result.timed_out


async def test_argv_env_cwd_and_stdin(sandbox: Sandbox) -> None:
    await sandbox.upload("sub/x.txt", b"x")
    result = await sandbox.run_command(
        ProcessRequest(argv=["sh", "-c", 'echo "$GREETING"; ls'], env={"GREETING": "hi"}, cwd="sub")
    )
    assert (result.exit_code, result.stdout) == (0, "hi\nx.txt\n")
    process = await sandbox.start_process(ProcessRequest(argv=["cat"], stdin=True))
    await process.write_stdin(b"hello ")
    await process.write_stdin(b"stdin\n")
    await process.close_stdin()
    done = await process.wait()
    assert (done.exit_code, done.stdout) == (0, "hello stdin\n")


async def test_commands_share_the_kernels_files_and_interpreter(sandbox: Sandbox) -> None:
    await sandbox.execute("open('from_kernel.txt', 'w').write('k')")
    result = await sandbox.run_command(
        shell("cat from_kernel.txt; echo c > from_command.txt; python3 -c 'import pandas'")
    )
    assert (result.exit_code, result.stdout) == (0, "k"), result
    execution = await sandbox.execute("print(open('from_command.txt').read())")
    assert execution.stdout == "c\n\n"
    login = await sandbox.run_command(
        ProcessRequest(argv=["sh", "-lc", "python3 -c 'import numpy'"])
    )
    assert login.exit_code == 0, login


async def test_ls_l_and_stat_work_and_say_what_is_missing(sandbox: Sandbox) -> None:
    """The first things agents run. Under gVisor (`make test-gvisor` runs this on runsc, and the
    gvisor backend's machines run the same images) coreutils' statx flag was refused with
    EINVAL until the images dropped it (kernel_images/statx_flags.c)."""
    await sandbox.execute("open('seen.txt', 'w').write('x')")
    listed = await sandbox.run_command(shell("ls -la && stat -c '%F %s' seen.txt"))
    assert listed.exit_code == 0, listed
    assert " seen.txt\n" in listed.stdout and listed.stdout.endswith("regular file 1\n"), listed
    missing = await sandbox.run_command(shell("stat missing.txt"))
    assert missing.exit_code == 1 and "No such file or directory" in missing.stderr, missing


async def test_a_background_process_is_listed_streamed_signalled_and_reconnected(
    sandbox: Sandbox,
) -> None:
    process = await sandbox.start_process(
        shell(
            "trap 'echo got-term; exit 7' TERM; echo ready; while true; do sleep 0.1; done",
            tag="srv",
        )
    )
    await output_until(process.events(replay=True), b"ready")
    listed = {p.pid: p for p in sandbox.list_processes()}
    assert listed[process.pid].running and listed[process.pid].tag == "srv"
    again = sandbox.process(process.pid)  # reconnecting: the recent output is replayed
    await output_until(again.events(replay=True), b"ready")
    await process.signal(signal.SIGTERM)
    result = await asyncio.wait_for(process.wait(), 60)
    assert result.exit_code == 7 and "got-term" in result.stdout
    assert process.pid not in {p.pid for p in sandbox.list_processes()}
    assert process.pid in {p.pid for p in sandbox.list_processes(include_ended=True)}
    with pytest.raises(ProcessNotFound):
        sandbox.process(999_999)


async def test_a_time_limit_kills_the_command_and_its_children(sandbox: Sandbox) -> None:
    result = await sandbox.run_command(
        shell("(sleep 300 &) ; sleep 300 & echo started; wait", timeout_s=2)
    )
    assert result.timed_out and result.exit_code is None and "started" in result.stdout
    count = (
        "import os\n"
        "print(sum(1 for p in os.listdir('/proc') if p.isdigit()"
        " and open(f'/proc/{p}/cmdline', 'rb').read() == b'sleep\\x00300\\x00'))"
    )
    left = await sandbox.run_command(ProcessRequest(argv=["python3", "-c", count]))
    assert left.stdout.strip() == "0", left


async def test_endless_output_is_capped_and_the_kernel_carries_on(sandbox: Sandbox) -> None:
    result = await sandbox.run_command(shell("yes flood", timeout_s=3))
    assert result.timed_out
    assert result.stdout_dropped > 0
    assert len(result.stdout) < 2 * sandbox.spec.output_limit_chars
    assert (await sandbox.execute("1 + 1")).results[0].text == "2"


_PROCESSES = "len([p for p in os.listdir('/proc') if p.isdigit()])"


async def processes_in(sandbox: Sandbox) -> int:
    """How many processes the sandbox holds, counted by its kernel (which needs no new pid)."""
    execution = await sandbox.execute(f"import os\nprint({_PROCESSES})")
    return int(execution.stdout)


async def until_at_most(sandbox: Sandbox, count: int) -> None:
    """Until the sandbox holds at most `count` processes (a fork bomb's leftovers die out as
    their forks keep failing), checked by the kernel, within a few minutes."""
    wait = (
        "import os, time\n"
        "deadline = time.monotonic() + 50\n"
        f"while {_PROCESSES} > {count} and time.monotonic() < deadline:\n"
        "    time.sleep(0.1)\n"
        f"print({_PROCESSES})"
    )
    for _ in range(4):
        if int((await sandbox.execute(wait)).stdout) <= count:
            return
    raise AssertionError(f"the sandbox still holds more than {count} processes")


async def test_a_fork_bomb_in_a_command_is_contained(sandbox: Sandbox) -> None:
    """It starts and fills the pids limit, no more. Under Docker the command ends with its
    first shell and its leftovers churn on (like any process a command leaves running, they
    live until the kernel is replaced or the sandbox ends): the kernel carries on beside them,
    and commands still start among them, one that needs no fork and a login shell that does."""
    result = await sandbox.run_command(shell("bomb() { bomb | bomb & }; bomb", timeout_s=5))
    assert result.timed_out or result.exit_code is not None
    assert (await sandbox.execute("2 + 2")).results[0].text == "4"
    among = await sandbox.run_command(ProcessRequest(argv=["/bin/echo", "among"], timeout_s=90))
    assert among.stdout == "among\n"
    # bash retries a fork that fails for up to ~31 s before it gives up, hence the long limit
    after = await sandbox.run_command(shell("echo alive", timeout_s=120))
    assert after.stdout == "alive\n"


async def test_a_command_holding_every_pid_is_killed_at_its_time_limit(sandbox: Sandbox) -> None:
    """Its children hold every pid the sandbox may have, forever: the time limit still kills it
    and all of them (killing needs no free pid), and the sandbox is whole again."""
    await sandbox.run_command(shell("true"))  # counted with what runs commands, where it stays
    before = await processes_in(sandbox)
    hold = (
        "import os, time\n"
        "while True:\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(1000)\n"
        "    except OSError:\n"
        "        time.sleep(0.01)\n"
    )
    result = await sandbox.run_command(ProcessRequest(argv=["python3", "-c", hold], timeout_s=3))
    assert result.timed_out
    await until_at_most(sandbox, before)
    after = await sandbox.run_command(shell("echo alive", timeout_s=30))
    assert after.stdout == "alive\n"


async def test_a_terminal_runs_a_shell_that_can_be_resized(sandbox: Sandbox) -> None:
    terminal = await sandbox.start_process(
        ProcessRequest(argv=["/bin/bash", "-i"], terminal=TerminalSize(cols=80, rows=24))
    )
    events = terminal.events(replay=True)
    await terminal.write_stdin(b"echo $((6 * 7))\n")
    await output_until(events, b"42")
    await terminal.resize(TerminalSize(cols=123, rows=45))
    await terminal.write_stdin(b"stty size\n")
    await output_until(events, b"45 123")
    await terminal.write_stdin(b"exit 5\n")
    result = await asyncio.wait_for(terminal.wait(), 60)
    assert result.exit_code == 5


async def test_processes_end_with_the_sandbox(backend: object) -> None:
    from sandbox.backends.base import Backend
    from tests.conftest import small_spec

    assert isinstance(backend, Backend)
    box = await backend.create(small_spec())
    process = await box.start_process(shell("sleep 600"))
    await box.close()
    result = await asyncio.wait_for(process.wait(), 60)
    assert result.exit_code != 0


async def test_a_command_cannot_reach_the_host(sandbox: Sandbox, host_listener: int) -> None:
    """A listener on the host's 127.0.0.1 is out of reach: the sandbox's loopback is its own."""
    connect = f"import socket; socket.create_connection(('127.0.0.1', {host_listener}), 2)"
    result = await sandbox.run_command(ProcessRequest(argv=["python3", "-c", connect]))
    assert result.exit_code != 0
    assert "ConnectionRefused" in result.stderr or "unreachable" in result.stderr, result


async def test_a_listener_that_never_reads_does_not_grow_memory(sandbox: Sandbox) -> None:
    """A flood followed by no one: the process is drained, the listener's backlog is capped and
    it is told what it missed."""
    process = await sandbox.start_process(shell("head -c 20000000 /dev/zero | tr '\\0' x"))
    events = process.events()
    result = await asyncio.wait_for(process.wait(), 120)
    assert result.exit_code == 0 and result.stdout_dropped > 0
    kinds: list[ProcessEvent] = [e async for e in events]
    assert isinstance(kinds[-1], ProcessEnd)
    assert any(type(e).__name__ == "Dropped" for e in kinds)
