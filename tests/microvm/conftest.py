"""Fixtures of the microvm tests: a backend whose sandboxes are QEMU machines (docs/microvm.md).

They need QEMU, a static busybox, mkfs.ext4, the fetched guest kernel and the kernel image on a
Docker engine; without them they skip on a developer's machine and fail in CI (CI=true).

Every module shares one state directory, at a fixed path, so that each module's
`cleanup_orphans` sweeps what an earlier, killed run left there (its sessions' QEMU processes,
cgroups and directories). Sharing is safe: each module has its own backend, and a backend's
`cleanup_orphans` removes only sessions whose owner process is gone (`SessionDirs.orphans` reads
the pid and start time each session's directory names), never a live module's sandboxes,
whichever xdist worker runs them. Whatever else a module keeps there (a paused machine, a
template) is named apart: a random handle, a template key of its own. The image's root
filesystem disk is not in it: the backend keeps that in the user's cache, made once per image.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from code_interpreter_wire.results import Execution
from code_interpreter_wire.spec import ResourceLimits, SandboxSpec
from sandbox import Sandbox, create_backend
from sandbox.backends.kernel_sandbox import KernelSandbox
from sandbox.backends.microvm.backend import MicrovmBackend
from sandbox.cgroups import PARENT, ROOT
from tests.conftest import require_backend, small_spec

STATE_DIR = Path("/tmp/cir-test-microvm-state")
QEMU = b"qemu-system-x86_64"


def shared_state_dir() -> Path:
    """The state directory every microvm test module shares (reachable by sandbox uids)."""
    STATE_DIR.mkdir(mode=0o711, exist_ok=True)
    if STATE_DIR.is_symlink() or STATE_DIR.stat().st_uid != os.geteuid():
        pytest.fail(f"{STATE_DIR} is not this user's own directory: remove it")
    return STATE_DIR


def vm_spec(**overrides: object) -> SandboxSpec:
    """`small_spec`, with a smaller machine: under TCG, memory the guest touches is slow, and a
    whole save writes it all."""
    fields: dict[str, object] = {
        "limits": ResourceLimits(memory_mb=512, tmp_size_mb=64, file_size_mb=64),
        "default_timeout_s": 120.0,
    }
    fields.update(overrides)
    return small_spec(**fields)


@pytest.fixture(scope="module")
async def microvm() -> AsyncIterator[MicrovmBackend]:
    """A microvm backend of the module's own, without templates (each machine boots)."""
    require_backend("microvm")
    backend = create_backend("microvm", state_dir=shared_state_dir(), templates=False)
    assert isinstance(backend, MicrovmBackend)
    await backend.cleanup_orphans()
    yield backend
    await backend.close()


def qemu_children() -> set[int]:
    """The QEMU processes this test process started (their parent is this process: QEMU is
    started directly, in a session of its own); exact even beside other workers' machines."""
    found = set()
    me = str(os.getpid())
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv0 = (entry / "cmdline").read_bytes().split(b"\0", 1)[0]
        except OSError:
            continue
        # The fields after the command's name, which is in parentheses and may hold spaces.
        fields = stat.rsplit(")", 1)[1].split()
        if fields[1] == me and fields[0] != "Z" and argv0.endswith(QEMU):
            found.add(int(entry.name))
    return found


def qemu_of(sb: KernelSandbox) -> int:
    """The pid of the QEMU that runs `sb` (its command line names the session's directory)."""
    marker = str(sb.dirs.root).encode() + b"/"
    pids = []
    for pid in qemu_children():
        try:
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(pid)
        except OSError:
            continue
    assert len(pids) == 1, f"QEMU processes of {sb.id}: {pids}"
    return pids[0]


def cgroup_dirs(sb: KernelSandbox) -> list[Path]:
    """The host cgroups a sandbox's QEMU runs in (sandbox/cgroups.py, machine.py)."""
    return [ROOT / c / PARENT / f"vm-{sb.id}" for c in ("memory", "pids", "cpu")]


async def run_ok(sb: Sandbox, code: str, timeout_s: float = 120.0) -> Execution:
    ex = await sb.execute(code, timeout_s=timeout_s)
    assert ex.ok, (ex.status, ex.error, ex.stdout, ex.stderr, ex.notice)
    return ex


async def until(condition: Callable[[], object], what: str, limit_s: float = 60.0) -> None:
    """Wait for `condition` to hold, looking again and again; fail after `limit_s`."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        await asyncio.sleep(0.05)
