"""Local kernels forked from the kernel zygote (`zygote_modules`): modules loaded before the
first call, confined exactly as a kernel started afresh, and sharing nothing with a sibling
forked from the same zygote (no variable, no file, no random stream).

As root with bwrap (the local backend's tests): in CI these fail, never skip, without them.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator

import pytest

from code_interpreter_wire.processes import ProcessRequest
from sandbox import Backend, create_backend
from sandbox.backends.local import LocalBackend
from sandbox.preload import ANALYST_PRELOAD, preload_code
from tests.conftest import host_processes_with, require_backend, small_spec
from tests.security.test_process_abuse import (
    DESCRIBE_SELF,
    check_a_command_is_confined_exactly_as_the_kernel,
)

# The inline backend too: imported in the zygote, where there is no shell to hook into.
MODULES = ["numpy", "pandas", "matplotlib.pyplot", "matplotlib_inline.backend_inline"]
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
        where = await sandbox.execute(
            "import os; os.getcwd(), os.getuid(), __import__('sys').path[0]"
        )
        assert where.text == "('/workspace', 1000, '')", where
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


async def test_sibling_kernels_share_no_state_file_or_random_stream(forked: Backend) -> None:
    one, two = await asyncio.gather(forked.create(small_spec()), forked.create(small_spec()))
    try:
        await one.execute("secret = 'one'; open('/tmp/mine', 'w').write('one')")
        seen = await two.execute("import os; ('secret' in globals(), os.path.exists('/tmp/mine'))")
        assert seen.text == "(False, False)", seen
        draws = [json.loads((await box.execute(DRAWS)).stdout) for box in (one, two)]
        for a, b in zip(*draws, strict=True):
            assert a != b, draws
    finally:
        await asyncio.gather(one.close(), two.close())


async def test_a_kernel_killed_from_inside_is_forked_again(forked: Backend) -> None:
    sandbox = await forked.create(small_spec())
    try:
        await sandbox.execute("x = 1")
        await sandbox.run_command(ProcessRequest(command="kill -9 -1"))
        after = await sandbox.execute("import sys; 'pandas' in sys.modules, 'x' in globals()")
        assert after.text == "(True, False)", after
        assert after.state_lost
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
    for box in (first, second):
        assert host_processes_with(box.id) == []
