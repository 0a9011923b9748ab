"""Local kernels forked from the kernel zygote (`zygote_modules`): modules loaded before the
first call, confined exactly as a kernel started afresh, and sharing nothing with a sibling
forked from the same zygote (no variable, no file, no random stream).

As root with bwrap (the local backend's tests): in CI these fail, never skip, without them.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from code_interpreter_wire.processes import ProcessRequest
from code_interpreter_wire.results import ExecutionStatus
from sandbox import Backend, Sandbox, create_backend
from sandbox.backends.local import LocalBackend
from sandbox.preload import ANALYST_PRELOAD, preload_code
from sandbox.processes.served import exit_of
from tests.conftest import require_backend, small_spec
from tests.security.test_process_abuse import (
    DESCRIBE_SELF,
    check_a_command_is_confined_exactly_as_the_kernel,
)

# The inline backend too: imported in the zygote, where there is no shell to hook into.
MODULES = ["numpy", "pandas", "matplotlib.pyplot", "matplotlib_inline.backend_inline"]
# What an interpreter starts with, which a forked kernel must take back: Python's signal
# dispositions, dumpable, sys.path from PYTHONPATH, its maths libraries' threads; and what a
# broken pipe does (an error, never the kernel's death).
STARTED_AS = """
import ctypes, json, signal, subprocess, sys
import numpy  # its BLAS loaded in either kernel, to count its threads
from threadpoolctl import threadpool_info
status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines())
proc = subprocess.Popen(["true"], stdin=subprocess.PIPE)
proc.wait()
try:
    proc.stdin.write(b"x" * 65536)
    proc.stdin.flush()
    pipe = "no error"
except BrokenPipeError:
    pipe = "BrokenPipeError"
print(json.dumps({
    "SigIgn": status["SigIgn"].strip(),
    "SigBlk": status["SigBlk"].strip(),
    "handlers": [str(signal.getsignal(s)) for s in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT)],
    "dumpable": ctypes.CDLL(None).prctl(3, 0, 0, 0, 0),
    "path": [p for p in sys.path if p.startswith("/workspace")],
    "sys_path": sys.path,
    "oom_score_adj": open("/proc/self/oom_score_adj").read(),
    "threads": sorted({i["num_threads"] for i in threadpool_info()}),
    "pipe": pipe,
}))
"""
# What differs between two kernels' random streams, if any stream was shared.
DRAWS = (
    "import random, os, numpy, json; print(json.dumps([random.random(), "
    "float(numpy.random.rand()), os.urandom(8).hex()]))"
)


@pytest.fixture(scope="module")
async def forked() -> AsyncIterator[Backend]:
    require_backend("local")
    if os.geteuid() != 0:
        pytest.skip("kernels are forked into sandboxes as root only")
    backend = create_backend("local", zygote_modules=MODULES)
    yield backend
    await backend.close()


async def test_a_forked_kernel_has_its_modules_and_a_fresh_namespace(forked: Backend) -> None:
    sandbox = await forked.create(small_spec())
    try:
        first = await sandbox.execute(
            "import sys; [m in sys.modules for m in ('pandas', 'matplotlib.pyplot')], len(In)"
        )
        assert first.text == "([True, True], 2)", first
        assert first.execution_count == 1
        await sandbox.preload(preload_code(MODULES, ANALYST_PRELOAD))  # as a pool's sandbox
        chart = await sandbox.execute(
            "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()"
        )
        assert [a.extension for a in chart.artifacts] == ["png"], chart
        # Without show(): the inline backend shows it at the cell's end, and closes it, as in
        # any kernel (hooked into this kernel's shell, though imported before it existed).
        unshown = await sandbox.execute("plt.plot([2, 1])\nNone")
        assert [a.extension for a in unshown.artifacts] == ["png"], unshown
        assert (await sandbox.execute("plt.get_fignums()")).text == "[]"
        where = await sandbox.execute("import os; os.getcwd(), os.getuid()")
        assert where.text == "('/workspace', 1000)", where
    finally:
        await sandbox.close()


async def test_a_forked_kernel_is_confined_exactly_as_one_started_afresh(
    forked: Backend,
) -> None:
    """A command beside it is confined as it is (as beside any kernel), and it is confined as
    a kernel bwrap started: same ids, capabilities (none), no_new_privs, seccomp, rlimits."""
    inside = await check_a_command_is_confined_exactly_as_the_kernel(forked)
    afresh = create_backend("local")
    try:
        sandbox = await afresh.create(small_spec(env={"SESSION_VAR": "s"}))
        try:
            started = json.loads((await sandbox.execute(DESCRIBE_SELF)).stdout)
        finally:
            await sandbox.close()
    finally:
        await afresh.close()
    assert inside["status"] == started["status"]
    assert inside["limits"] == started["limits"]
    assert inside["status"]["CapBnd"] == ["0000000000000000"]
    # Its sandbox's namespaces (a command's, above), none of them the zygote's (the host's).
    host = {n: os.readlink(f"/proc/self/ns/{n}") for n in inside["namespaces"]}
    assert all(inside["namespaces"][n] != host[n] for n in host)


async def test_a_forked_kernel_starts_as_an_interpreter_does(forked: Backend) -> None:
    """What `python` sets as it starts (not inherited from the zygote, which was started
    otherwise): the same in a forked kernel as in one started afresh."""
    spec = small_spec(
        env={"PYTHONPATH": "/workspace/lib:/workspace/more"},
        limits={"memory_mb": 1024, "cpus": 2.0},
    )
    afresh = create_backend("local")
    said = {}
    try:
        for name, backend in (("forked", forked), ("afresh", afresh)):
            sandbox = await backend.create(spec)
            try:
                said[name] = json.loads((await sandbox.execute(STARTED_AS)).stdout)
            finally:
                await sandbox.close()
    finally:
        await afresh.close()
    assert said["forked"] == said["afresh"]
    assert said["forked"]["pipe"] == "BrokenPipeError"
    assert said["forked"]["path"] == ["/workspace/lib", "/workspace/more"]


async def test_sibling_kernels_share_no_state_file_or_random_stream(forked: Backend) -> None:
    await check_siblings_share_nothing(forked)


async def check_siblings_share_nothing(
    forked: Backend, is_forked: Callable[[Sandbox], object] = lambda _: None
) -> None:
    """Two kernels forked from one zygote: nothing of one is seen in the other, and every
    random stream draws differently; `is_forked` checks a sandbox's kernel was forked."""
    one = await forked.create(small_spec())
    try:
        two = await forked.create(small_spec())
    except BaseException:
        await one.close()
        raise
    try:
        is_forked(one), is_forked(two)
        await one.execute("secret = 'one'; open('/tmp/mine', 'w').write('one')")
        seen = await two.execute("import os; ('secret' in globals(), os.path.exists('/tmp/mine'))")
        assert seen.text == "(False, False)", seen
        draws = [json.loads((await box.execute(DRAWS)).stdout) for box in (one, two)]
        for a, b in zip(*draws, strict=True):
            assert a != b, draws
    finally:
        await asyncio.gather(one.close(), two.close())


async def test_a_kernel_killed_from_inside_is_forked_again(forked: Backend) -> None:
    await check_killed_from_inside_is_forked_again(forked)


async def check_killed_from_inside_is_forked_again(
    forked: Backend, is_forked: Callable[[Sandbox], object] = lambda _: None
) -> None:
    sandbox = await forked.create(small_spec())
    try:
        await sandbox.execute("x = 1")
        await sandbox.run_command(ProcessRequest(command="kill -9 -1"))
        after = await sandbox.execute("import sys; 'pandas' in sys.modules, 'x' in globals()")
        assert after.text == "(True, False)", after
        assert after.state_lost
        is_forked(sandbox)
    finally:
        await sandbox.close()


async def test_a_dead_zygote_is_started_again_and_closing_leaves_nothing(
    forked: Backend,
) -> None:
    assert isinstance(forked, LocalBackend)
    first = await forked.create(small_spec())
    zygote = forked._zygote
    assert zygote is not None and zygote._proc is not None
    zygote._proc.kill()
    await zygote._proc.wait()
    second = await forked.create(small_spec())  # a new zygote forks it
    try:
        assert (await first.execute("1 + 1")).text == "2"  # kernels outlive their zygote
        assert (await second.execute("import sys; 'pandas' in sys.modules")).text == "True"
    finally:
        await asyncio.gather(first.close(), second.close())
    # Keepers are the zygote's children (the first's, orphaned with its zygote, is gone too):
    # each ends once its kernel has (the sandbox's end, just now), so this waits for their end.
    assert zygote._proc is not None
    await asyncio.wait_for(_until_gone(_children(zygote._proc.pid)), 60)
    assert all(not _in_a_cgroup_of(box.id) for box in (first, second))


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


async def _until_gone(pids: list[int]) -> None:
    """On once every one of `pids` has ended (its pidfd readable)."""
    for pid in pids:
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            await exit_of(pidfd)
        finally:
            os.close(pidfd)


def _cgroup_members(sandbox_id: str) -> set[int]:
    groups = Path("/sys/fs/cgroup/memory/code-interpreter") / sandbox_id
    return {int(pid) for procs in groups.rglob("cgroup.procs") for pid in procs.read_text().split()}


def _in_a_cgroup_of(sandbox_id: str) -> bool:
    """Whether any process is left in the sandbox's cgroups (or they are still there)."""
    groups = Path("/sys/fs/cgroup/memory/code-interpreter") / sandbox_id
    return groups.exists() and any(
        procs.read_text().strip() for procs in groups.rglob("cgroup.procs")
    )


async def test_a_keeper_killed_ends_its_kernel_and_a_new_one_is_forked(forked: Backend) -> None:
    """Its kernel dies with it (the parent-death signal); the end of its control socket says
    so, rather than a call waiting on a sandbox that lives on."""
    assert isinstance(forked, LocalBackend)
    sandbox = await forked.create(small_spec())
    try:
        await sandbox.execute("x = 1")
        zygote = forked._zygote
        assert zygote is not None and zygote._proc is not None
        pid = zygote._proc.pid
        # This sandbox's keeper: the zygote's child in this sandbox's cgroup (others may not
        # have ended yet, their sandboxes closed just before).
        members = _cgroup_members(sandbox.id)
        [keeper] = [c for c in _children(pid) if c in members]
        os.kill(keeper, signal.SIGKILL)
        # The kernel's parent-death signal is delivered on its own time: the call below must
        # find it dead, not still answering.
        await asyncio.wait_for(_until_gone(sorted(members)), 60)
        after = await asyncio.wait_for(sandbox.execute("'x' in globals()"), 60)
        if after.status is ExecutionStatus.KERNEL_DIED:  # found dead by this call: told so
            assert after.error is not None and after.error.name == "KernelDied", after
            after = await asyncio.wait_for(sandbox.execute("'x' in globals()"), 60)
        else:  # found dead before it: the loss is told with its result
            assert after.state_lost, after
        assert after.text == "False", after
        again = await sandbox.execute("import sys; 'pandas' in sys.modules")
        assert again.text == "True", again  # forked again
    finally:
        await sandbox.close()


async def test_an_environment_larger_than_a_message_reaches_a_forked_kernel(
    forked: Backend,
) -> None:
    # Over a socket message's most in all (the kernel's request goes in a memfd); each under
    # the most one variable may hold through an exec (bwrap's own).
    big = {f"BIG_{i}": "x" * 100_000 for i in range(3)}
    sandbox = await forked.create(small_spec(env=big))
    try:
        got = await sandbox.execute(
            "import os, sys; sum(len(os.environ[f'BIG_{i}']) for i in range(3)), "
            "'pandas' in sys.modules"
        )
        assert got.text == "(300000, True)", got
    finally:
        await sandbox.close()
