"""The microvm backend's smoke set (docs/microvm.md): each sandbox a QEMU machine with a Linux
kernel of its own. Run on every `make test`, so kept to a few machines: one shared by the tests
that leave it as they found it, one of its own for each test that abuses or stops its machine.
"""

from __future__ import annotations

import asyncio
import json
import platform
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from code_interpreter_wire.errors import FileMissing
from code_interpreter_wire.processes import ProcessRequest
from code_interpreter_wire.results import ExecutionStatus
from code_interpreter_wire.spec import ResourceLimits
from sandbox.backends.microvm import guest_kernel
from sandbox.backends.microvm.backend import MicrovmBackend, MicrovmSandbox
from sandbox.backends.microvm.machine import QEMU_THREADS
from tests.microvm.conftest import cgroup_dirs, qemu_of, run_ok, until, vm_spec

pytestmark = pytest.mark.timeout(600)

# The count goes to /tmp/ticks through a rename, so a reader never finds it half written.
TICKER = (
    "i=0; while true; do i=$((i+1)); echo tick $i;"
    " echo $i > /tmp/ticks.new; mv /tmp/ticks.new /tmp/ticks; sleep 0.1; done"
)
DRAW = (
    "import json, os, random, numpy\n"
    "print(json.dumps([random.random(), os.urandom(8).hex(), float(numpy.random.rand())]))"
)


@pytest.fixture(scope="module")
async def shared(microvm: MicrovmBackend) -> AsyncIterator[MicrovmSandbox]:
    """One machine for the tests that leave it as they found it."""
    sb = await microvm.create(vm_spec())
    try:
        yield sb
    finally:
        await sb.close()


async def test_python_with_pandas_runs_on_the_guests_own_kernel(shared: MicrovmSandbox) -> None:
    ex = await run_ok(
        shared,
        "import platform, pandas\n"
        "frame = pandas.DataFrame({'a': [1, 2, 3]})\n"
        "(platform.release(), int(frame.a.sum()))",
    )
    guest = guest_kernel.find().release
    assert ex.text == repr((guest, 6)), ex.text
    assert guest != platform.release()  # the host's kernel is another


async def test_commands_and_files_go_through_the_machine(shared: MicrovmSandbox) -> None:
    done = await shared.run_command(ProcessRequest(command="echo out; echo err >&2; exit 3"))
    assert (done.exit_code, done.stdout, done.stderr) == (3, "out\n", "err\n"), done
    who = await shared.run_command(ProcessRequest(command="id -u; uname -r; pwd"))
    uid, release, cwd = who.stdout.split()
    assert uid != "0" and release == guest_kernel.find().release and cwd == "/workspace", who

    # The API's file into the kernel, and the kernel's file out through the API.
    info = await shared.upload("smoke/in.txt", b"hello")
    assert (info.path, info.type, info.size) == ("smoke/in.txt", "file", 5)
    read = await run_ok(shared, "open('smoke/in.txt').read().upper()")
    assert read.text == "'HELLO'"
    await run_ok(shared, "open('smoke/out.txt', 'w').write('from the kernel')")
    assert await shared.download("smoke/out.txt") == b"from the kernel"
    listed = {(f.path, f.type, f.size) for f in await shared.list_files("smoke")}
    assert listed == {("smoke/in.txt", "file", 5), ("smoke/out.txt", "file", 15)}, listed
    # A command sees the same files, at the same paths.
    cat = await shared.run_command(ProcessRequest(command="cat smoke/out.txt smoke/in.txt"))
    assert cat.stdout == "from the kernelhello", cat

    await shared.remove_file("smoke/in.txt")
    with pytest.raises(FileMissing):
        await shared.download("smoke/in.txt")
    gone = await run_ok(shared, "import os; os.path.exists('smoke/in.txt')")
    assert gone.text == "False"
    await shared.remove_file("smoke")
    assert [f.path for f in await shared.list_files("") if f.path.startswith("smoke")] == []


async def test_a_memory_bomb_ends_inside_the_machine(microvm: MicrovmBackend) -> None:
    """The guest's own OOM killer ends the kernel: the execution says its kernel died, QEMU
    (well under its host cgroup's limit) runs on, and the next execution works."""
    sb = await microvm.create(vm_spec(limits=ResourceLimits(memory_mb=256, tmp_size_mb=64)))
    try:
        await run_ok(sb, "kept = 1")
        qemu = qemu_of(sb)
        bomb = await sb.execute(
            "chunks = []\nwhile True:\n    chunks.append(b'x' * (64 << 20))", timeout_s=180
        )
        assert bomb.status is ExecutionStatus.KERNEL_DIED and bomb.error is not None, bomb
        assert "kernel" in bomb.error.value, bomb.error
        assert qemu_of(sb) == qemu  # the same machine: only the kernel inside ended
        host_kills = (cgroup_dirs(sb)[0] / "memory.oom_control").read_text()
        assert "oom_kill 0" in host_kills.splitlines(), host_kills
        after = await run_ok(sb, "'kept' in globals(), 6 * 7")
        assert after.text == "(False, 42)", after  # a new kernel, in the same machine
        assert qemu_of(sb) == qemu
    finally:
        await sb.close()


async def test_a_fork_bomb_stays_inside_the_machine(microvm: MicrovmBackend) -> None:
    """The guest's RLIMIT_NPROC (`ulimit -u`, the spec's pids) holds the sandbox's user; on the
    host, QEMU's threads stay within its pids cgroup whatever the guest runs."""
    sb = await microvm.create(vm_spec())
    try:
        limit = await sb.run_command(ProcessRequest(command="ulimit -u"))
        assert limit.stdout.strip() == str(sb.spec.limits.pids), limit
        pids = cgroup_dirs(sb)[1]
        assert int((pids / "pids.max").read_text()) == QEMU_THREADS
        qemu = qemu_of(sb)
        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, int((pids / "pids.current").read_text()))
                await asyncio.sleep(0.05)

        watcher = asyncio.ensure_future(watch())
        try:
            bomb = ProcessRequest(command="bomb() { bomb | bomb & }; bomb", timeout_s=5)
            result = await asyncio.wait_for(sb.run_command(bomb), 120)
        finally:
            watcher.cancel()
        assert result.timed_out or result.exit_code is not None, result
        assert 0 < peak <= QEMU_THREADS, peak
        # The kernel answers (if the bomb's leftovers starved it of a thread, it was replaced
        # once at most), and the machine is the same one.
        deaths = 0
        for _ in range(3):
            probe = await sb.execute("6 * 7", timeout_s=120)
            if probe.ok:
                break
            assert probe.status is ExecutionStatus.KERNEL_DIED, probe
            deaths += 1
        assert probe.text == "42" and deaths <= 1, (probe, deaths)
        assert qemu_of(sb) == qemu
    finally:
        await sb.close()


async def test_pause_and_resume_keep_memory_and_a_background_process(
    microvm: MicrovmBackend,
) -> None:
    sb = await microvm.create(vm_spec())
    try:
        await run_ok(sb, "kept = {'n': 41}")
        ticker = await sb.start_process(ProcessRequest(command=TICKER))
        process = sb.process(ticker.pid)
        await until(lambda: "tick 3\n" in process.result().stdout, "the ticker ticked")
        handle = await sb.suspend()
        assert handle is not None
    except BaseException:
        await sb.close()
        raise
    try:
        woken = await microvm.wake(handle, sb.spec)
    except BaseException:
        await microvm.discard(handle)  # the shared state directory keeps no paused machine
        raise
    try:
        await microvm.woken(handle)
        assert (await run_ok(woken, "kept['n'] + 1")).text == "42"
        again = woken.process(ticker.pid)
        assert again.running
        assert [p.pid for p in woken.list_processes()] == [ticker.pid]
        # Its output from before the pause is there, and it goes on counting from its count.
        await until(lambda: "tick 1\n" in again.result().stdout, "its earlier output")
        now = await woken.run_command(ProcessRequest(command="cat /tmp/ticks"))
        count = int(now.stdout)
        await until(lambda: f"tick {count + 3}\n" in again.result().stdout, "it ticking on")
        await again.kill()
        ended = await asyncio.wait_for(again.wait(), 60)
        assert ended.exit_code != 0 and not again.running
    finally:
        await woken.close()


async def test_forks_of_a_saved_machine_draw_different_random_numbers(
    microvm: MicrovmBackend, shared: MicrovmSandbox, tmp_path: Path
) -> None:
    # The streams seeded before the save: forks that kept them would draw alike.
    await run_ok(shared, DRAW)
    saved = await shared.save_whole(tmp_path / "whole", max_bytes=8 << 30)
    assert saved is not None and saved.machine and saved.machine_bytes > 0
    forks = []
    try:
        for _ in range(2):
            forks.append(await microvm.fork(tmp_path / "whole", shared.spec))
        draws = [json.loads((await run_ok(sb, DRAW)).stdout) for sb in (*forks, shared)]
    finally:
        for sb in forks:
            await sb.close()
    for kind in range(3):  # random, os.urandom, numpy: each apart in every machine
        assert len({draw[kind] for draw in draws}) == 3, draws


async def test_the_hosts_loopback_is_out_of_reach(
    shared: MicrovmSandbox, host_listener: int
) -> None:
    """No network device at all: 127.0.0.1 inside is the guest's own loopback, where nothing
    listens on the host listener's port."""
    attempt = (
        "import socket\n"
        "s = socket.socket(); s.settimeout(10)\n"
        "try:\n"
        f"    s.connect(('127.0.0.1', {host_listener})); reached = 'connected'\n"
        "except OSError as e:\n"
        "    reached = type(e).__name__\n"
        "reached"
    )
    assert (await run_ok(shared, attempt)).text == "'ConnectionRefusedError'"
    devices = await run_ok(shared, "import os; sorted(os.listdir('/sys/class/net'))")
    assert devices.text == "['lo']"


def test_qemu_itself_runs_confined(shared: MicrovmSandbox) -> None:
    """Under TCG the emulator is the wall: were it taken over, it would be a process of its
    own uid, under its seccomp filter, with no network (its own namespace: a loopback of its
    own, no host socket by address), no host IPC, an empty root, no core dump and files no
    larger than its machine needs."""
    pid = qemu_of(shared)
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    uids = status["Uid"].split()
    assert uids[0] != "0" and len(set(uids)) == 1, uids
    assert status["Seccomp"].strip() == "2"
    for kind in ("net", "ipc", "uts"):
        assert Path(f"/proc/{pid}/ns/{kind}").readlink() != Path(f"/proc/self/ns/{kind}").readlink()
    assert Path(f"/proc/{pid}/root").readlink() == shared.dirs.root / "machine" / "empty"
    limits = Path(f"/proc/{pid}/limits").read_text()
    core = next(line for line in limits.splitlines() if line.startswith("Max core file size"))
    assert core.split()[4:6] == ["0", "0"]
    size = next(line for line in limits.splitlines() if line.startswith("Max file size"))
    assert size.split()[3] != "unlimited"
