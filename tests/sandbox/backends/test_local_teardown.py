"""Closing a local sandbox (the second half of a pause) leaves nothing: no process, zombie,
cgroup, directory or uid of it is left when `close` returns, and nothing of it is left for the
host's init to reap, which it may do late (a second or more) or never (this service as a
container's pid 1).

The kernel's bwrap has a PID namespace whose init is bwrap's child; the init goes first
(`kill_namespace_init`), so bwrap reaps it itself. Killed first, bwrap would orphan the init.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from code_interpreter_wire.processes import ProcessRequest
from sandbox.backends.bwrap_kernel import kill_namespace_init
from sandbox.backends.local import LocalBackend, LocalBackendConfig
from sandbox.cgroups import SandboxCgroup
from sandbox.saved_state import restore_state, save_state

REPO = Path(__file__).resolve().parents[3]

# A daemon the kernel starts (its own session, its parent gone: the namespace's init adopts it).
DAEMON = (
    "import os, subprocess\n"
    "subprocess.Popen(['sh', '-c', 'sleep 1001 & exit'], start_new_session=True).wait()\n"
    "kept = 'kept'"
)


def _uid_of(pid: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def processes_of_uid(uid: int) -> list[int]:
    """Host pids (zombies included) whose real uid is `uid`."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and _uid_of(p) == uid]


@pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes get host uids of their own as root")
async def test_a_closed_sandbox_leaves_no_process_and_resumes_at_once(state_dir: Path) -> None:
    backend = LocalBackend(LocalBackendConfig(state_dir=state_dir))
    try:
        sb = await backend.create()
        (host_uid,) = backend.uids.in_use
        await sb.start_process(ProcessRequest(argv=["sleep", "1000"]))
        assert (await sb.execute(DAEMON)).ok
        assert len(processes_of_uid(host_uid)) >= 5  # bwrap, init, kernel, sleeps
        saved = await save_state(sb, state_dir.parent / "saved", max_bytes=1 << 30)
        assert saved.saved_count >= 1
        await sb.close()
        # Gone when close returns: not one process or zombie, nor its cgroup, dirs or uid.
        assert processes_of_uid(host_uid) == []
        assert not any(d.exists() for d in SandboxCgroup(sb.id).dirs)
        assert not (state_dir / "local" / sb.id).exists()
        assert backend.uids.in_use == frozenset()
        # A new sandbox takes the state back at once.
        async with await backend.create() as again:
            restored = await restore_state(again, state_dir.parent / "saved")
            assert restored.restored_count >= 1
            assert (await again.execute("kept")).text == "'kept'"
    finally:
        await backend.close()


# Run in a process of its own that is a child subreaper, as a service that is a container's
# pid 1 is the reaper of what its children orphan: whatever a close orphans becomes its child.
_AS_REAPER = """
import asyncio, ctypes, json, os, sys
from pathlib import Path
from code_interpreter_wire.processes import ProcessRequest
from sandbox.backends.local import LocalBackend, LocalBackendConfig
from sandbox.cgroups import SandboxCgroup

PR_SET_CHILD_SUBREAPER = 36
assert ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0

def children() -> list[str]:
    me = str(os.getpid())
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields.get("PPid", "").strip() == me:
            found.append(f"{pid} {fields['Name'].strip()} {fields['State'].strip()}")
    return found

async def main() -> None:
    backend = LocalBackend(LocalBackendConfig(state_dir=Path(sys.argv[1])))
    sb = await backend.create()
    await sb.start_process(ProcessRequest(argv=["sleep", "1000"]))
    assert (await sb.execute(sys.argv[2])).ok
    await sb.close()
    left = children()
    groups = [str(d) for d in SandboxCgroup(sb.id).dirs if d.exists()]
    await backend.close()
    print(json.dumps({"children": left, "groups": groups}))

asyncio.run(main())
"""


async def test_closing_a_sandbox_orphans_nothing_for_the_reaper(state_dir: Path) -> None:
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", _AS_REAPER, str(state_dir), DAEMON],
        cwd=REPO,
        capture_output=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    told = json.loads(done.stdout.decode().strip().splitlines()[-1])
    assert told == {"children": [], "groups": []}, told


def test_only_a_namespace_init_is_killed() -> None:
    """A child that is not the init of a PID namespace of its own is left alone: never a
    process that merely has the pid bwrap's child had."""
    shell = subprocess.Popen(["sh", "-c", "sleep 1000 & wait"], start_new_session=True)
    try:
        assert kill_namespace_init(shell.pid, None) is False
        assert shell.poll() is None
        assert kill_namespace_init(2**22 + 1, None) is False  # no such process
    finally:
        os.killpg(shell.pid, signal.SIGKILL)  # its own group: the shell and its sleep
        shell.wait()
