"""E2B's `commands`, `pty` and `git`, unmodified SDK, against our process service: each on each
backend. Every process runs in the session's sandbox, beside its kernel."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest
from e2b import (
    CommandExitException,
    NotFoundException,
    PtySize,
    SandboxException,
    TimeoutException,
)
from e2b_code_interpreter import AsyncSandbox, Sandbox

from tests.orchestrator.service.conftest import Server


async def eventually(check: Callable[[], bool], within_s: float = 30.0) -> bool:
    """Whether `check` comes true within `within_s` (looked at every 0.1 s)."""
    for _ in range(int(within_s * 10)):
        if check():
            return True
        await asyncio.sleep(0.1)
    return check()


def test_a_foreground_command_with_output_env_cwd_and_exit_code(sbx: Sandbox) -> None:
    seen: list[str] = []
    result = sbx.commands.run(
        "echo out; echo err >&2; echo $GREETING; pwd",
        envs={"GREETING": "hello"},
        on_stdout=seen.append,
    )
    assert result.exit_code == 0 and result.error is None
    assert result.stdout == "out\nhello\n/workspace\n" and result.stderr == "err\n"
    assert "".join(seen) == result.stdout
    sbx.commands.run("mkdir -p sub")
    assert sbx.commands.run("pwd", cwd="sub").stdout == "/workspace/sub\n"
    # E2B's home, which clients pass as the cwd, is the workspace here.
    assert sbx.commands.run("pwd", cwd="/home/user").stdout == "/workspace\n"
    with pytest.raises(CommandExitException) as failed:
        sbx.commands.run("echo partial; exit 3")
    assert failed.value.exit_code == 3 and failed.value.stdout == "partial\n"
    assert failed.value.error == "exit status 3"
    assert sbx.run_code("1 + 1").text == "2"  # the kernel carries on beside


def test_a_command_shares_the_kernels_workspace_and_python(sbx: Sandbox) -> None:
    sbx.run_code("open('from_kernel.txt', 'w').write('k')")
    assert sbx.commands.run("cat from_kernel.txt").stdout == "k"
    # A login shell (E2B runs every command as `bash -l -c`) finds the kernel's packages.
    result = sbx.commands.run("python3 -c 'import pandas; print(pandas.__name__)'")
    assert result.stdout == "pandas\n"
    sbx.commands.run("echo c > from_command.txt")
    assert sbx.run_code("open('from_command.txt').read()").text == "c\\n"


def test_the_timeout_kills_the_command(sbx: Sandbox) -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 60; echo done > finished.txt", timeout=2)
    assert time.monotonic() - started < 30
    # Killed, it leaves the list once it has ended (a loaded host takes a moment to say so).
    while [p for p in sbx.commands.list() if "sleep 60" in " ".join(p.args)]:
        assert time.monotonic() - started < 30, "the command outlived its time limit"
        time.sleep(0.1)
    assert not sbx.files.exists("finished.txt")


def test_a_connect_to_a_command_its_timeout_killed_gets_its_end(sbx: Sandbox) -> None:
    """Only the call whose deadline was the command's time limit ends past it (envd's
    `deadline_exceeded`); a `connect` to it gets the end, as envd's does: exit -1."""
    handle = sbx.commands.run("sleep 30", background=True, timeout=1)
    with pytest.raises(TimeoutException):
        handle.wait()
    with pytest.raises(CommandExitException) as ended:
        sbx.commands.connect(handle.pid).wait()
    assert ended.value.exit_code == -1


def test_background_commands_stdin_list_connect_and_kill(sbx: Sandbox) -> None:
    cat = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.send_stdin(cat.pid, "typed\n")
    sbx.commands.close_stdin(cat.pid)
    assert cat.wait().stdout == "typed\n"

    sleeper = sbx.commands.run("sleep 300", background=True, envs={"MARK": "1"}, cwd="/home/user")
    listed = {p.pid: p for p in sbx.commands.list()}
    assert sleeper.pid in listed
    mine = listed[sleeper.pid]
    assert (mine.cmd, mine.args) == ("/bin/bash", ["-l", "-c", "sleep 300"])
    assert mine.envs == {"MARK": "1"} and mine.cwd == "/home/user"  # as it was asked for

    ticker = sbx.commands.run("for i in 1 2 3; do echo tick$i; sleep 1; done", background=True)
    again = sbx.commands.connect(ticker.pid)
    assert "tick3" in again.wait().stdout

    assert sbx.commands.kill(sleeper.pid) is True
    with pytest.raises(CommandExitException) as killed:
        sleeper.wait()
    assert killed.value.exit_code == -1 and "signal" in (killed.value.error or "")
    assert sleeper.pid not in {p.pid for p in sbx.commands.list()}
    assert sbx.commands.kill(999_999) is False  # NOT_FOUND, as envd answers
    with pytest.raises(NotFoundException):
        sbx.commands.send_stdin(999_999, "x")


def test_root_is_refused_with_the_reason_and_the_sandbox_user_works(sbx: Sandbox) -> None:
    """Local and Docker sandboxes keep every process unprivileged; the refusal names the way
    out (a gVisor machine's root: tests/gvisor/test_machine_root.py)."""
    with pytest.raises(SandboxException, match=r"no root.*gvisor backend"):
        sbx.commands.run("id -u", user="root")
    assert sbx.commands.run("echo ok", user="user").stdout == "ok\n"


def test_a_terminal_types_reads_and_resizes(sbx: Sandbox) -> None:
    terminal = sbx.pty.create(PtySize(rows=24, cols=80))
    sbx.pty.send_stdin(terminal.pid, b"echo $((6 * 7))x\n")
    sbx.pty.resize(terminal.pid, PtySize(rows=40, cols=120))
    sbx.pty.send_stdin(terminal.pid, b"stty size\nexit\n")
    seen = bytearray()
    ended = terminal.wait(on_pty=seen.extend)  # bash exits with `stty size`'s status
    assert ended.exit_code == 0
    text = seen.decode(errors="replace")
    assert "42x" in text and "40 120" in text


def test_git_on_a_local_repository(sbx: Sandbox) -> None:
    sbx.git.init("repo", initial_branch="main")
    sbx.files.write("repo/readme.md", "hello\n")
    sbx.git.add("repo", all=True)
    sbx.git.commit("repo", "first", author_name="Ada", author_email="ada@example.com")
    status = sbx.git.status("repo")
    assert status.current_branch == "main" and status.is_clean
    sbx.files.write("repo/new.txt", "n")
    assert [f.name for f in sbx.git.status("repo").file_status] == ["new.txt"]
    log = sbx.commands.run("git -C repo log --format=%an:%s").stdout
    assert log == "Ada:first\n"


@pytest.fixture
async def asbx(e2b_env: Server, template: str) -> AsyncIterator[AsyncSandbox]:
    sandbox = await AsyncSandbox.create(template=template)
    yield sandbox
    await sandbox.kill()


async def test_async_input_streams_interactively(asbx: AsyncSandbox) -> None:
    """Input sent through an open input stream reaches the process at once, not when the
    stream is closed."""
    seen: list[str] = []
    cat = await asbx.commands.run(
        "cat", background=True, stdin=True, on_stdout=seen.append, timeout=120
    )
    stream = asbx.commands.stream_input(cat.pid)
    await stream.send("first line\n")
    assert await eventually(lambda: "first line" in "".join(seen)), (
        "input was held until the stream closed"
    )
    await stream.send("second\n")
    await stream.close()
    await asbx.commands.close_stdin(cat.pid)
    result = await cat.wait()
    assert result.stdout == "first line\nsecond\n"


async def test_async_background_callbacks_and_a_terminal(asbx: AsyncSandbox) -> None:
    seen: list[str] = []
    handle = await asbx.commands.run(
        "echo one; sleep 1; echo two >&2", background=True, on_stderr=seen.append
    )
    result = await handle.wait()
    assert result.stdout == "one\n" and seen == ["two\n"]
    output = bytearray()
    terminal = await asbx.pty.create(PtySize(rows=24, cols=80), on_data=output.extend)
    await asbx.pty.send_stdin(terminal.pid, b"echo pty-$((1 + 2))\n")
    assert await eventually(lambda: b"pty-3" in output)
    assert await asbx.pty.kill(terminal.pid) is True


async def test_a_client_that_disconnects_leaves_its_command_running(asbx: AsyncSandbox) -> None:
    handle = await asbx.commands.run(
        "sleep 2; echo survived > survived.txt", background=True, timeout=120
    )
    await handle.disconnect()
    assert handle.pid in {p.pid for p in await asbx.commands.list()}
    for _ in range(300):
        if await asbx.files.exists("survived.txt"):
            break
        await asyncio.sleep(0.1)
    assert await asbx.files.read("survived.txt") == "survived\n"
