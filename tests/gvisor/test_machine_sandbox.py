"""The gvisor backend: each sandbox a gVisor machine driven by raw runsc, paused and resumed
whole by gVisor's checkpoint and restore (docs/gvisor.md, "Machine sandboxes")."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from code_interpreter_wire.processes import ProcessRequest, TerminalSize
from code_interpreter_wire.spec import ResourceLimits
from sandbox import create_backend
from sandbox.backends.gvisor.backend import GvisorBackend, GvisorSandbox
from sandbox.backends.gvisor.machine import ImageUnusable
from tests.conftest import require_backend, small_spec

# A generator: no kernel-level save can keep it (it does not pickle); a machine image does.
COUNTER = (
    "def counting():\n    n = 0\n    while True:\n        n += 1\n        yield n\n"
    "c = counting()\nnext(c), next(c)"
)
# The count is written beside /tmp/ticks and renamed over it, so a reader never finds the file
# truncated between two ticks (empty), as a plain `echo $i > /tmp/ticks` would leave it a moment.
TICKER = (
    "i=0; while true; do i=$((i+1)); echo tick $i;"
    " echo $i > /tmp/ticks.new; mv /tmp/ticks.new /tmp/ticks; sleep 0.1; done"
)


async def until(condition: Callable[[], object], what: str, limit_s: float = 30.0) -> None:
    """Wait for `condition` to hold, looking again and again; fail after `limit_s`."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
async def gvisor(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[GvisorBackend]:
    require_backend("gvisor")
    state = tmp_path_factory.mktemp("gv", numbered=True)
    backend = create_backend("gvisor", state_dir=state)
    assert isinstance(backend, GvisorBackend)
    yield backend
    await backend.close()


async def paused_and_woken(backend: GvisorBackend, sb: GvisorSandbox) -> GvisorSandbox:
    handle = await sb.suspend()
    assert handle is not None
    woken = await backend.wake(handle, sb.spec)
    assert isinstance(woken, GvisorSandbox)
    return woken


async def test_a_machine_runs_code_commands_and_files(gvisor: GvisorBackend) -> None:
    sb = await gvisor.create(small_spec())
    try:
        assert (await sb.execute("x = 6 * 7\nx")).text == "42"
        result = await sb.run_command(ProcessRequest(command="echo out; echo err >&2; exit 3"))
        assert (result.exit_code, result.stdout, result.stderr) == (3, "out\n", "err\n")
        await sb.upload("data/in.txt", b"hello")
        made = await sb.execute("open('data/in.txt').read().upper()")
        assert made.text == "'HELLO'"
        await sb.execute("open('out.txt', 'w').write('from the kernel')")
        assert await sb.download("out.txt") == b"from the kernel"
        # A forked child's output comes back through the kernel's pipe (an ipc socket here:
        # a listening TCP socket would make the machine impossible to save).
        forked = await sb.execute(
            "import multiprocessing as mp\n"
            "p = mp.get_context('fork').Process(target=print, args=('from a child',))\n"
            "p.start(); p.join()"
        )
        assert "from a child" in forked.stdout, forked
        who = await sb.run_command(
            ProcessRequest(command="id -u; cat /proc/1/cmdline | tr '\\0' ' '")
        )
        assert who.stdout.splitlines()[0] != "0", who
    finally:
        await sb.close()


async def test_a_machines_limits_hold(gvisor: GvisorBackend) -> None:
    """Memory and CPU in the host cgroup runsc made for it; processes, open files and file
    size as gVisor's own limits, which the code cannot raise."""
    limits = ResourceLimits(memory_mb=512, cpus=0.5, pids=64, open_files=256, file_size_mb=8)
    sb = await gvisor.create(small_spec(limits=limits))
    try:
        group = f"/sys/fs/cgroup/%s/code-interpreter-gvisor/{sb.id}"
        memory = Path(group % "memory", "memory.limit_in_bytes").read_text()
        assert int(memory) == 512 << 20
        assert int(Path(group % "cpu", "cpu.cfs_quota_us").read_text()) == 50_000
        inside = await sb.execute(
            "import resource as r\n"
            "[r.getrlimit(x)[1] for x in (r.RLIMIT_NPROC, r.RLIMIT_NOFILE, r.RLIMIT_FSIZE)]"
        )
        assert inside.text == f"[64, 256, {8 << 20}]", inside
        raised = await sb.execute("r.setrlimit(r.RLIMIT_NPROC, (65, 65))")
        assert raised.status == "error", raised
        big = await sb.execute("open('big', 'wb').write(bytes(9 << 20))")
        assert big.status == "error" and "File too large" in str(big.error), big
    finally:
        await sb.close()


async def test_pause_and_resume_keep_memory_processes_and_files(gvisor: GvisorBackend) -> None:
    sb = await gvisor.create(small_spec())
    try:
        assert (await sb.execute(COUNTER)).text == "(1, 2)"
        await sb.upload("kept.txt", b"kept")
        ticker = await sb.start_process(ProcessRequest(command=TICKER))
        process = sb.process(ticker.pid)
        await until(lambda: "tick 3" in process.result().stdout, "the ticker ticked")
        woken = await paused_and_woken(gvisor, sb)
    except BaseException:
        await sb.close()
        raise
    try:
        assert (await woken.execute("next(c)")).text == "3"  # the generator itself went on
        assert await woken.download("kept.txt") == b"kept"
        again = woken.process(ticker.pid)
        assert again.running
        # What it printed before the pause is there, and it goes on counting from there.
        await until(lambda: "tick 1\n" in again.result().stdout, "its earlier output")
        before = int((await woken.run_command(ProcessRequest(command="cat /tmp/ticks"))).stdout)
        await until(lambda: f"tick {before + 3}" in again.result().stdout, "the ticker ticking on")
        await again.kill()
        ended = await asyncio.wait_for(again.wait(), 30)
        assert ended.exit_code != 0 and not again.running
    finally:
        await woken.close()


async def test_a_pause_copies_links_as_links_and_leaves_special_files(
    gvisor: GvisorBackend,
) -> None:
    """The workspace is saved without following a link the code made (to a host file here:
    the gofer sees the session's own paths only, but the copy runs on the host)."""
    sb = await gvisor.create(small_spec())
    try:
        made = await sb.execute(
            "import os\n"
            "os.symlink('/etc/shadow', 'shadow')\n"
            "os.mkfifo('pipe')\n"
            "open('private', 'w').write('mine'); os.chmod('private', 0o600)\n"
            "os.makedirs('locked/inner'); open('locked/inner/f', 'w').write('f')\n"
            "os.chmod('locked', 0o500)"
        )
        assert made.status == "ok", made
        woken = await paused_and_woken(gvisor, sb)
    except BaseException:
        await sb.close()
        raise
    try:
        kept = await woken.execute(
            "import os, stat\n"
            "(os.readlink('shadow'), os.path.exists('pipe'), "
            "oct(stat.S_IMODE(os.stat('private').st_mode)), open('private').read(), "
            "oct(stat.S_IMODE(os.stat('locked').st_mode)), open('locked/inner/f').read())"
        )
        # The FIFO is gVisor's own (a file of its kernel, saved in the image), not a host one.
        assert kept.text == "('/etc/shadow', True, '0o600', 'mine', '0o500', 'f')", kept
    finally:
        await woken.close()


async def test_a_terminals_shell_keeps_its_state_across_a_pause(gvisor: GvisorBackend) -> None:
    sb = await gvisor.create(small_spec())
    try:
        shell = await sb.start_process(
            ProcessRequest(
                argv=["/bin/bash", "--norc", "-i"], terminal=TerminalSize(rows=24, cols=80)
            )
        )
        await sb.process(shell.pid).write_stdin(b"secret=machine-$((40 + 2))\n")
        await until(lambda: "secret=" in sb.process(shell.pid).result().stdout, "the echo")
        woken = await paused_and_woken(gvisor, sb)
    except BaseException:
        await sb.close()
        raise
    try:
        terminal = woken.process(shell.pid)
        await terminal.write_stdin(b"echo got $secret\n")
        await until(lambda: "got machine-42" in terminal.result().stdout, "the shell's variable")
    finally:
        await woken.close()


async def test_a_paused_machine_wakes_in_another_service_process(
    gvisor: GvisorBackend,
) -> None:
    """A restart of the service: a new backend on the same state directory wakes it."""
    sb = await gvisor.create(small_spec())
    await sb.execute("state = {'n': 41}")
    handle = await sb.suspend()
    assert handle is not None
    again = create_backend("gvisor", state_dir=gvisor.config.state_dir)
    assert isinstance(again, GvisorBackend)
    woken = await again.wake(handle, sb.spec)
    try:
        assert (await woken.execute("state['n'] + 1")).text == "42"
        # Kept until the service has it recorded running: a failed resume wakes it again.
        assert (gvisor.paused_dir / handle).is_dir()
        await again.woken(handle)
    finally:
        await woken.close()
    assert not (gvisor.paused_dir / handle).exists()


async def test_a_corrupt_image_is_a_typed_error_and_the_machine_stays_paused(
    gvisor: GvisorBackend,
) -> None:
    sb = await gvisor.create(small_spec())
    await sb.execute("x = 1")
    handle = await sb.suspend()
    assert handle is not None
    image = gvisor.paused_dir / handle / "image"
    saved = {path: path.read_bytes() for path in image.iterdir()}
    largest = max(saved, key=lambda p: len(saved[p]))
    largest.write_bytes(saved[largest][: len(saved[largest]) // 2])  # truncated
    with pytest.raises(ImageUnusable) as refused:
        await gvisor.wake(handle, sb.spec)
    assert "restored" in str(refused.value)
    assert (gvisor.paused_dir / handle / "manifest.json").exists()  # still paused
    for path, data in saved.items():
        Path(path).write_bytes(data)
    woken = await gvisor.wake(handle, sb.spec)  # the good image still wakes
    try:
        assert (await woken.execute("x + 1")).text == "2"
    finally:
        await woken.close()


async def test_a_deleted_paused_machine_is_gone(gvisor: GvisorBackend) -> None:
    sb = await gvisor.create(small_spec())
    handle = await sb.suspend()
    assert handle is not None and (gvisor.paused_dir / handle).is_dir()
    await gvisor.discard(handle)
    assert not (gvisor.paused_dir / handle).exists()
    with pytest.raises(ImageUnusable):
        await gvisor.wake(handle, sb.spec)


async def test_a_machine_holding_a_network_socket_is_not_saved_whole(
    gvisor: GvisorBackend,
) -> None:
    """This gVisor cannot save a TCP socket: the pause says so (None: the caller saves the
    kernels' state instead) and the machine runs on untouched, its server still serving."""
    sb = await gvisor.create(small_spec())
    try:
        server = await sb.start_process(
            ProcessRequest(
                argv=[
                    "/opt/kernel/bin/python",
                    "-u",
                    "-m",
                    "http.server",
                    "8123",
                    "--bind",
                    "127.0.0.1",
                ]
            )
        )
        probe = "import urllib.request\nurllib.request.urlopen('http://127.0.0.1:8123/').status"
        serving = sb.process(server.pid)
        await until(lambda: "Serving" in serving.result().stdout, "the server up")
        assert await sb.suspend() is None
        assert (await sb.execute(probe)).text == "200"
        assert sb.process(server.pid).running
    finally:
        await sb.close()


async def test_a_machine_that_hits_its_memory_limit_goes_on_in_a_new_one(
    gvisor: GvisorBackend,
) -> None:
    """gVisor ends whole at the host cgroup's limit: the execution is told the kernel ran out
    of memory, the next runs in a new machine, and the workspace is kept."""
    sb = await gvisor.create(small_spec(limits=ResourceLimits(memory_mb=300)))
    try:
        await sb.upload("kept.txt", b"kept")
        bomb = await sb.execute(
            "x = bytearray(900 << 20)\nx[::4096] = b'a' * len(x[::4096])", timeout_s=60
        )
        assert bomb.status == "kernel_died" and bomb.error is not None, bomb
        assert "ran out of memory" in bomb.error.value, bomb.error
        after = await sb.execute("open('kept.txt').read()", timeout_s=60)
        assert after.text == "'kept'", after
    finally:
        await sb.close()
    cgroup = Path(f"/sys/fs/cgroup/memory/code-interpreter-gvisor/{sb.id}")
    assert not cgroup.exists()
