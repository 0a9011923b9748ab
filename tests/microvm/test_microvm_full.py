"""The microvm backend's longer set (`make test-microvm`, not `make test`): templates, a guest
kernel's panic, a full workspace disk, corrupt saves, an output flood, and what closing a
sandbox leaves (docs/microvm.md)."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from code_interpreter_wire.errors import FileTooLarge
from code_interpreter_wire.processes import ProcessRequest
from code_interpreter_wire.results import ExecutionStatus
from code_interpreter_wire.spec import ResourceLimits
from sandbox import Sandbox, create_backend
from sandbox.backends.base import SavedSandboxUnusable
from sandbox.backends.gvisor.machine_images import MANIFEST
from sandbox.backends.gvisor.machine_sandbox import IMAGE_DIR
from sandbox.backends.kernel_sandbox import KernelSandbox
from sandbox.backends.microvm.backend import MicrovmBackend, MicrovmSandbox
from sandbox.backends.microvm.machine import STATE_FILE
from sandbox.preload import ANALYST_PRELOAD
from tests.conftest import require_backend
from tests.microvm.conftest import (
    cgroup_dirs,
    qemu_children,
    qemu_of,
    run_ok,
    shared_state_dir,
    until,
    vm_spec,
)

pytestmark = [pytest.mark.microvm_full, pytest.mark.timeout(900)]

LOOK = (
    "import json, random, sys\n"
    "from ipykernel.kernelapp import IPKernelApp\n"
    "with open(IPKernelApp.instance().connection_file) as f:\n"
    "    on_file = json.load(f)['key']\n"
    "print(json.dumps({'key': get_ipython().kernel.session.key.decode(), 'on_file': on_file,"
    " 'pandas': 'pandas' in sys.modules, 'draw': random.random(),"
    " 'numpy': float(sys.modules['numpy'].random.rand()) if 'numpy' in sys.modules else None}))"
)
PANIC = ProcessRequest(command="echo c > /proc/sysrq-trigger", user="root", timeout_s=60)
GROWTH_LIMIT = 150 << 20  # what the host process may grow by while a command floods output
OUTPUT_LIMIT = 100_000


def our_sessions(backend: MicrovmBackend) -> set[str]:
    """The session directories this test process owns in the shared state directory."""
    found = set()
    base = backend.vm_config.state_dir / backend.name
    for entry in base.iterdir() if base.is_dir() else []:
        try:
            owner = json.loads((entry / "owner").read_text())
        except (OSError, ValueError):
            continue
        if owner.get("pid") == os.getpid():
            found.add(entry.name)
    return found


def assert_all_gone(sb: KernelSandbox, qemu: int) -> None:
    """No QEMU, no cgroup and no session directory left of a closed sandbox."""
    assert qemu not in qemu_children() and not Path(f"/proc/{qemu}").exists()
    left = [str(d) for d in cgroup_dirs(sb) if d.exists()]
    assert left == [], left
    assert not sb.dirs.root.exists()


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")


@pytest.fixture(scope="module")
async def templated() -> AsyncIterator[MicrovmBackend]:
    """A backend with templates, its preload marked with this run's own token: its template is
    made here (never one kept from an earlier run), and removed after."""
    require_backend("microvm")
    preload = f"{ANALYST_PRELOAD}\n# test run {secrets.token_hex(8)}\n"
    backend = create_backend(
        "microvm", state_dir=shared_state_dir(), templates=True, preload=preload, max_templates=1
    )
    assert isinstance(backend, MicrovmBackend)
    yield backend
    await backend.close()


async def look(sb: Sandbox) -> dict[str, object]:
    done = await sb.execute(LOOK, timeout_s=120)
    assert done.ok and done.execution_count == 1, done  # the first execution of a clean kernel
    found: dict[str, object] = json.loads(done.stdout)
    return found


async def test_sandboxes_restored_from_a_template_are_warm_and_share_no_secret(
    templated: MicrovmBackend,
) -> None:
    spec = vm_spec()
    template = await templated.prepare_templates(spec)
    restored: list[Sandbox] = []
    try:
        started = time.monotonic()
        restored += [await templated.create(spec) for _ in range(2)]
        took = time.monotonic() - started
        seen = [await look(sb) for sb in restored]
        template_key = json.loads((template / MANIFEST).read_text())["kernels"]["python"]["key"]
    finally:
        for sb in restored:
            await sb.close()
        shutil.rmtree(template, ignore_errors=True)  # this run's own: no later run would use it
    assert all(s["pandas"] is True for s in seen), seen  # imported by the preload, not here
    keys = {str(s["key"]) for s in seen}
    assert len(keys) == 2 and template_key not in keys, (keys, template_key)  # each re-keyed
    assert all(s["key"] == s["on_file"] for s in seen)  # the connection file says its own
    assert seen[0]["draw"] != seen[1]["draw"] and seen[0]["numpy"] != seen[1]["numpy"], seen
    assert took < 120, took  # restored, not booted and preloaded (each ~1 s here, TCG)


async def test_the_analyst_stack_runs_without_the_host_ending_the_machine(
    microvm: MicrovmBackend,
) -> None:
    """The guest uses far less than its memory, yet QEMU as a whole must fit its host cgroup:
    the guest's RAM (all of it resident once booted), QEMU's own and, under TCG, the code it
    translated. Imports of the usual stack must not end the machine from outside."""
    sb = await microvm.create(vm_spec())
    try:
        qemu = qemu_of(sb)
        done = await sb.execute(
            f"{ANALYST_PRELOAD}\nimport scipy.stats, sklearn.linear_model\n'imported'",
            timeout_s=300,
        )
        memory = cgroup_dirs(sb)[0]
        host = {
            name: (memory / name).read_text().strip()
            for name in ("memory.limit_in_bytes", "memory.max_usage_in_bytes", "memory.oom_control")
        }
        assert done.ok and done.text == "'imported'", (done.status, done.error, host)
        assert qemu_of(sb) == qemu, host
        used = await run_ok(
            sb, "import resource; resource.getrusage(resource.RUSAGE_SELF).ru_maxrss"
        )
        assert int(used.text or 0) << 10 < sb.spec.limits.memory_mb << 20  # well within it
    finally:
        await sb.close()


async def test_a_guest_kernel_panic_goes_on_in_a_new_machine(microvm: MicrovmBackend) -> None:
    """Root inside crashes the guest's kernel: the command is told its sandbox ended, the next
    call goes on in a freshly booted machine with the workspace disk kept (an upload made just
    before, too), and another sandbox is not touched."""
    sb = await microvm.create(vm_spec())
    try:
        other = await microvm.create(vm_spec())
    except BaseException:
        await sb.close()
        raise
    try:
        await run_ok(other, "mine = 'other'")
        other_qemu = qemu_of(other)
        await run_ok(sb, "lost = 1")
        first = qemu_of(sb)
        # Just before the crash: an upload is on the disk once it is answered (fsynced inside),
        # not in the page cache that dies with the guest's kernel.
        await sb.upload("kept.txt", b"kept")

        crashed = await asyncio.wait_for(sb.run_command(PANIC), 120)
        assert crashed.exit_code is None and crashed.error is not None, crashed
        assert "sandbox ended" in crashed.error, crashed

        after = await sb.execute("open('kept.txt').read(), 'lost' in globals()", timeout_s=180)
        assert after.ok and after.text == "('kept', False)", after
        assert after.notice is not None and "restarted" in after.notice, after.notice
        second = qemu_of(sb)
        assert second != first and not Path(f"/proc/{first}").exists()
        who = await sb.run_command(ProcessRequest(command="id -u; cat kept.txt"))
        uid, kept = who.stdout.split()
        assert uid != "0" and kept == "kept", who  # commands run again, as the sandbox's user

        assert (await run_ok(other, "mine")).text == "'other'"  # its kernel never noticed
        assert qemu_of(other) == other_qemu
    finally:
        await other.close()
        await sb.close()
    assert_all_gone(sb, second)  # the restarted machine's QEMU and cgroups too


async def test_a_full_workspace_disk_is_enospc_inside_and_a_typed_error_outside(
    microvm: MicrovmBackend,
) -> None:
    limits = ResourceLimits(memory_mb=512, tmp_size_mb=64, file_size_mb=64, workspace_size_mb=16)
    sb = await microvm.create(vm_spec(limits=limits))
    try:
        full = await sb.execute(
            "import errno\n"
            "try:\n"
            "    with open('big', 'wb') as f:\n"
            "        f.write(b'x' * (32 << 20))\n"
            "    outcome = 'written'\n"
            "except OSError as e:\n"
            "    outcome = errno.errorcode[e.errno]\n"
            "outcome",
            timeout_s=120,
        )
        assert full.text == "'ENOSPC'", full
        with pytest.raises(FileTooLarge, match="full"):
            await sb.upload("upload.bin", b"y" * (32 << 20))
        # Neither the refused upload nor its temporary file is left; the big file's start is.
        assert [f.path for f in await sb.list_files("")] == ["big"]
        await sb.remove_file("big")
        again = await run_ok(sb, "open('small', 'wb').write(b'x' * (1 << 20))")
        assert again.text == str(1 << 20)
        await sb.upload("upload.bin", b"y" * (4 << 20))  # room again
        assert len(await sb.download("upload.bin")) == 4 << 20
    finally:
        await sb.close()


async def test_a_corrupt_save_is_a_typed_error_and_leaves_no_machine(
    microvm: MicrovmBackend, tmp_path: Path
) -> None:
    sb = await microvm.create(vm_spec())
    try:
        await run_ok(sb, "x = 41")
        saved = tmp_path / "whole"
        assert await sb.save_whole(saved, max_bytes=8 << 30) is not None
    finally:
        await sb.close()
    good = await microvm.fork(saved, sb.spec)  # the save as taken forks
    try:
        assert (await run_ok(good, "x + 1")).text == "42"
    finally:
        await good.close()

    state = saved / IMAGE_DIR / STATE_FILE
    whole = state.read_bytes()
    corruptions = {
        "truncated": whole[: len(whole) // 2],  # QEMU starts loading it, then exits
        "not a state": b"garbage!" * 64,  # refused before QEMU is given it
    }
    machines, sessions = qemu_children(), our_sessions(microvm)
    for what, data in corruptions.items():
        state.write_bytes(data)
        started = time.monotonic()
        with pytest.raises(SavedSandboxUnusable, match="could not be restored"):
            await microvm.fork(saved, sb.spec)
        assert time.monotonic() - started < 30, what  # told, not left to a timeout
        assert qemu_children() == machines, what
        assert our_sessions(microvm) == sessions, what


@pytest.fixture(scope="module")
async def plain(microvm: MicrovmBackend) -> AsyncIterator[MicrovmSandbox]:
    """One machine for the tests that leave it as they found it."""
    sb = await microvm.create(vm_spec(output_limit_chars=OUTPUT_LIMIT))
    try:
        yield sb
    finally:
        await sb.close()


async def test_a_command_flooding_output_does_not_grow_the_host(plain: MicrovmSandbox) -> None:
    """`yes` writes as fast as the machine's channel takes it, far past what the host would
    grow by if it kept it: the host keeps the output limit's worth and counts the rest."""
    before = peak = rss()
    flood = await plain.start_process(ProcessRequest(command="yes", timeout_s=300))
    process = plain.process(flood.pid)

    def flowed() -> bool:
        nonlocal peak
        peak = max(peak, rss())
        return process.result().stdout_dropped > 3 * GROWTH_LIMIT or not process.running

    await until(flowed, "three times the growth limit through the channel", 240)
    assert process.running, process.result()
    await process.kill()
    result = await asyncio.wait_for(process.wait(), 60)
    assert peak - before < GROWTH_LIMIT, f"the host grew by {(peak - before) >> 20} MiB"
    assert len(result.stdout) < OUTPUT_LIMIT + 1_000 and result.stdout.startswith("y\ny\n")
    assert (await plain.run_command(ProcessRequest(command="echo alive"))).stdout == "alive\n"


async def test_a_command_may_write_to_dev_stdout_and_dev_stderr(plain: MicrovmSandbox) -> None:
    done = await plain.run_command(
        ProcessRequest(command="echo out > /dev/stdout; echo err > /dev/stderr")
    )
    assert (done.exit_code, done.stdout, done.stderr) == (0, "out\n", "err\n"), done


async def test_closing_a_sandbox_leaves_no_qemu_cgroup_or_directory(
    microvm: MicrovmBackend,
) -> None:
    sb = await microvm.create(vm_spec())
    try:
        qemu = qemu_of(sb)
        assert all(d.is_dir() for d in cgroup_dirs(sb))
        assert qemu in {int(p) for p in (cgroup_dirs(sb)[1] / "cgroup.procs").read_text().split()}
        assert (sb.dirs.root / "machine").is_dir()
    finally:
        await sb.close()
    assert_all_gone(sb, qemu)
    assert sb.id not in our_sessions(microvm)


async def test_a_hung_machine_is_ended_and_the_session_goes_on_in_a_fresh_one() -> None:
    """A guest that stops answering (here its CPUs stopped through QEMU's monitor: as a hung
    kernel looks from the host) fails the call waiting on it, typed, within the backend's
    hang_timeout_s, and the next call runs in a fresh machine with the workspace kept."""
    require_backend("microvm")
    backend = create_backend(
        "microvm", state_dir=shared_state_dir(), templates=False, hang_timeout_s=6
    )
    try:
        async with await backend.create(vm_spec()) as sb:
            assert isinstance(sb, MicrovmSandbox)
            await sb.upload("kept.txt", b"kept")
            await run_ok(sb, "x = 1")
            before = qemu_of(sb)
            monitor = await sb._machine._monitor()  # type: ignore[attr-defined]
            await monitor.pause()
            hung = await sb.execute("x", timeout_s=120)
            assert hung.status is ExecutionStatus.KERNEL_DIED, hung
            after = await run_ok(sb, "open('kept.txt').read()")
            assert after.text == "'kept'"
            assert qemu_of(sb) != before
    finally:
        await backend.close()
