"""What only the local backend does: finding bwrap, the loud opt-out, orphan clean-up."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from code_interpreter_wire.errors import BackendUnavailable, SandboxStartError
from code_interpreter_wire.network_policy import policy_from_text
from code_interpreter_wire.spec import ResourceLimits, SandboxSpec
from sandbox import cgroups, create_backend
from sandbox.backends.local import LocalBackend, LocalBackendConfig
from sandbox.cgroups import SandboxCgroup


async def test_missing_bwrap_says_how_to_install_it(state_dir: Path) -> None:
    backend = create_backend("local", bwrap="/nonexistent/bwrap", state_dir=state_dir)
    with pytest.raises(BackendUnavailable, match="apt-get install bubblewrap"):
        await backend.create()


async def test_unsandboxed_runs_only_when_asked_by_name(state_dir: Path) -> None:
    backend = LocalBackend(
        LocalBackendConfig(bwrap="/nonexistent/bwrap", unsafe_no_sandbox=True, state_dir=state_dir)
    )
    async with await backend.create() as sb:
        ex = await sb.execute("import os; os.getcwd().endswith('/workspace'), 1 + 1")
        assert ex.text == "(True, 2)"
        await sb.upload("a.txt", b"x")
        assert (await sb.execute("open('a.txt').read()")).text == "'x'"


async def test_sandbox_directories_are_removed_on_close(state_dir: Path) -> None:
    backend = create_backend("local", state_dir=state_dir)
    sb = await backend.create()
    assert len(list((state_dir / "local").iterdir())) == 1
    groups = SandboxCgroup(sb.id).dirs
    assert all(d.is_dir() for d in groups) == cgroups.available()
    await sb.close()
    assert list((state_dir / "local").iterdir()) == []
    assert not any(d.exists() for d in groups)


async def test_a_kernel_that_cannot_start_leaves_nothing_behind(state_dir: Path) -> None:
    """The create recipe (kernel_recipe.py) undoes every step when the kernel fails to start:
    the kernel's driver closed, the directories (channels included) removed, the cgroup's OOM
    clock closed, the cgroup and then the uid given back; no process of it is left. (Other
    processes on the machine make cgroups of their own meanwhile: the uid, given back only
    after its cgroup went, says that it did.)"""
    backend = LocalBackend(LocalBackendConfig(state_dir=state_dir))
    children, descriptors = _children(), _descriptors()
    spec = SandboxSpec(
        env={"PYTHONHOME": "/nonexistent"},  # the kernel's Python dies at start-up
        host_tools=True,
        network=policy_from_text("pypi.org:443"),
    )
    with pytest.raises(SandboxStartError, match="No module named 'encodings'"):
        await backend.create(spec)
    assert list((state_dir / "local").iterdir()) == []
    assert backend.uids.in_use == frozenset()
    assert _children() <= children
    left = {fd: target for fd, target in _descriptors().items() if fd not in descriptors}
    assert not [t for t in left.values() if "eventfd" in t or t.startswith("/sys/fs/cgroup")]


def _children() -> set[int]:
    """The pids of this process's children now."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[1]) == os.getpid():
            found.add(int(stat.parent.name))
    return found


def _descriptors() -> dict[int, str]:
    """This process's open descriptors and what each is."""
    found = {}
    for fd in Path("/proc/self/fd").iterdir():
        try:
            found[int(fd.name)] = os.readlink(fd)
        except OSError:
            continue  # the directory's own, closed meanwhile
    return found


async def test_orphans_of_a_dead_orchestrator_are_removed_and_nothing_else(
    state_dir: Path,
) -> None:
    backend = create_backend("local", state_dir=state_dir)
    live = await backend.create()
    base = state_dir / "local"
    orphan = base / "deadbeefdeadbeef"
    orphan.mkdir()
    (orphan / "owner").write_text(json.dumps({"pid": 2**22 + 1, "start": "1"}))
    reused_pid = base / "0123456789abcdef"  # a live pid, but a different process start
    reused_pid.mkdir()
    (reused_pid / "owner").write_text(json.dumps({"pid": os.getpid(), "start": "0"}))
    assert await backend.cleanup_orphans() == 2
    assert [p.name for p in base.iterdir()] == [live.id]
    assert (await live.execute("1")).ok
    await live.close()


async def test_host_wide_proc_files_describe_the_sandbox_or_nothing(state_dir: Path) -> None:
    backend = create_backend("local", state_dir=state_dir)
    spec = SandboxSpec(limits=ResourceLimits(memory_mb=1536, cpus=1))
    async with await backend.create(spec) as sb:
        ex = await sb.execute(
            "import os\n"
            "def read(p):\n"
            "    try:\n"
            "        return open(p).read()\n"
            "    except OSError:\n"
            "        return ''\n"
            "masked = ['/proc/pressure/cpu', '/proc/pressure/memory', '/proc/vmstat',\n"
            "          '/proc/diskstats', '/proc/interrupts', '/proc/softirqs', '/proc/swaps',\n"
            "          '/proc/zoneinfo', '/proc/keys', '/proc/timer_list', '/proc/kcore']\n"
            "mem = dict(l.split(':') for l in read('/proc/meminfo').splitlines())\n"
            "cpus = [l for l in read('/proc/stat').splitlines()\n"
            "        if l.startswith('cpu') and l[3:4].isdigit()]\n"
            "([p for p in masked if read(p)], mem['MemTotal'].strip(), len(cpus),\n"
            " read('/proc/loadavg').split()[:3], os.cpu_count())"
        )
        assert ex.ok, ex.error
        assert ex.text == f"([], '{1536 << 10} kB', 1, ['0.00', '0.00', '0.00'], 1)"
