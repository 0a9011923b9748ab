"""Docker kernels forked from the kernel zygote (`zygote_modules`): the zygote runs in a
container of the backend's image; each kernel, forked into its own container, has its modules
loaded before the first call, is confined exactly as a kernel the engine started, and shares
nothing with a sibling (no variable, no file, no random stream).

As root beside a Docker engine (cgroup v1, cgroupfs): in CI these fail, never skip, without it.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from typing import Any

import pytest

from code_interpreter_wire.spec import SandboxSpec
from sandbox import Backend, create_backend
from sandbox.backends.docker import DockerBackend, DockerSandbox
from sandbox.backends.docker_container import LABEL_ORCHESTRATOR
from sandbox.backends.docker_forked_kernel import ForkedContainerKernel
from sandbox.backends.docker_zygote import LABEL_ZYGOTE
from sandbox.preload import ANALYST_PRELOAD, preload_code
from tests.conftest import backend_config, require_backend, small_spec
from tests.sandbox.backends.test_local_forked_kernels import (
    MODULES,
    STARTED_AS,
    check_killed_from_inside_is_forked_again,
    check_siblings_share_nothing,
)
from tests.security.test_process_abuse import (
    DESCRIBE_SELF,
    check_a_command_is_confined_exactly_as_the_kernel,
)


@pytest.fixture(scope="module")
async def forked() -> AsyncIterator[Backend]:
    require_backend("docker")
    if os.geteuid() != 0:
        pytest.skip("kernels are forked into containers as root only")
    backend = create_backend("docker", zygote_modules=MODULES, **backend_config("docker"))
    yield backend
    await backend.close()


def _process_of(sandbox: Any) -> object:
    """The process of the sandbox's running kernel."""
    assert isinstance(sandbox, DockerSandbox)
    kernel = sandbox.driver._kernel
    assert kernel is not None
    return kernel.process


def _kernel_of(sandbox: Any) -> ForkedContainerKernel:
    """The sandbox's running kernel, which must have been forked."""
    process = _process_of(sandbox)
    assert isinstance(process, ForkedContainerKernel), process
    return process


def _ids_named(status: dict[str, list[str]]) -> dict[str, list[str]]:
    """/proc/self/status's fields, each sandbox's own uid (its gid, its group) as "uid"."""
    uid = status["Uid"][0]
    return {k: ["uid" if v == uid else v for v in values] for k, values in status.items()}


def _forked_where_it_must_be(backend: Backend, sandbox: Any) -> None:
    """The forking backend's kernels must have been forked (a fallback would compare a
    kernel the engine started with another)."""
    if isinstance(backend, DockerBackend) and backend.config.zygote_modules:
        _kernel_of(sandbox)


async def _said(backend: Backend, spec: SandboxSpec, code: str) -> dict[str, Any]:
    sandbox = await backend.create(spec)
    try:
        _forked_where_it_must_be(backend, sandbox)
        return dict(json.loads((await sandbox.execute(code)).stdout))
    finally:
        await sandbox.close()


async def test_a_forked_kernel_has_its_modules_and_a_fresh_namespace(forked: Backend) -> None:
    sandbox = await forked.create(small_spec())
    try:
        _kernel_of(sandbox)
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
        where = await sandbox.execute("import os, socket; os.getcwd(), socket.gethostname()")
        assert where.text == "('/workspace', 'sandbox')", where
        # A module the zygote did not import comes from the image, as in any kernel.
        late = await sandbox.execute("import sqlite3, json; json.__file__.startswith('/usr')")
        assert late.text == "True", late
    finally:
        await sandbox.close()


async def test_a_forked_kernel_is_confined_exactly_as_one_the_engine_started(
    forked: Backend,
) -> None:
    """A command beside it is confined as it is (as beside any kernel), and it is confined as
    a kernel the engine started: same ids, groups, capabilities (none, bounding set too),
    no_new_privs, seccomp, rlimits; its container's namespaces and memory cgroup."""
    inside = await check_a_command_is_confined_exactly_as_the_kernel(forked, _kernel_of)
    afresh = create_backend("docker", **backend_config("docker"))
    try:
        started = await _said(afresh, small_spec(env={"SESSION_VAR": "s"}), DESCRIBE_SELF)
    finally:
        await afresh.close()
    assert _ids_named(inside["status"]) == _ids_named(started["status"])
    # In every hierarchy, its container's group (as the engine puts a container's processes).
    for said in (inside, started):
        assert set(said["cgroups"].values()) == {said["memory_cgroup"]}, said["cgroups"]
    assert inside["limits"] == started["limits"]
    assert inside["status"]["CapBnd"] == ["0000000000000000"]
    assert inside["cwd"] == started["cwd"] == "/workspace"
    # Its environment is the kernel's: the engine's own additions aside.
    for name in ("HOSTNAME", "HOME", "PATH", "SESSION_VAR", "PYTHONUNBUFFERED"):
        assert inside["environment"].get(name) == started["environment"].get(name), name
    # None of its namespaces is the host's (the zygote's are: it shares the host's PID one).
    host = {n: os.readlink(f"/proc/self/ns/{n}") for n in inside["namespaces"]}
    assert all(inside["namespaces"][n] != host[n] for n in ("mnt", "pid", "net", "ipc", "uts"))


async def test_a_forked_kernel_refuses_what_the_seccomp_profile_refuses(forked: Backend) -> None:
    """The system-call policy is the one every sandbox has: a namespace, a mount, ptrace."""
    code = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "said = []\n"
        "for call in (lambda: libc.unshare(0x20000000), lambda: libc.ptrace(0, 0, 0, 0),\n"
        "             lambda: libc.mount(b'none', b'/tmp', b'tmpfs', 0, None)):\n"
        "    said.append((call(), ctypes.get_errno()))\n"
        "print(said)"
    )
    forked_said = (await _run(forked, code)).strip()
    afresh = create_backend("docker", **backend_config("docker"))
    try:
        started_said = (await _run(afresh, code)).strip()
    finally:
        await afresh.close()
    assert forked_said == started_said == "[(-1, 1), (-1, 1), (-1, 1)]"


async def _run(backend: Backend, code: str) -> str:
    sandbox = await backend.create(small_spec())
    try:
        _forked_where_it_must_be(backend, sandbox)
        return (await sandbox.execute(code)).stdout
    finally:
        await sandbox.close()


async def test_a_forked_kernel_starts_as_an_interpreter_does(forked: Backend) -> None:
    spec = small_spec(
        env={"PYTHONPATH": "/workspace/lib:/workspace/more"},
        limits={"memory_mb": 1024, "cpus": 2.0},
    )
    afresh = create_backend("docker", **backend_config("docker"))
    try:
        said = {"forked": await _said(forked, spec, STARTED_AS)}
        said["afresh"] = await _said(afresh, spec, STARTED_AS)
    finally:
        await afresh.close()
    assert said["forked"] == said["afresh"]
    assert said["forked"]["pipe"] == "BrokenPipeError"
    assert said["forked"]["path"] == ["/workspace/lib", "/workspace/more"]


async def test_sibling_kernels_share_no_state_file_or_random_stream(forked: Backend) -> None:
    await check_siblings_share_nothing(forked, _kernel_of)


async def test_a_kernel_killed_from_inside_is_forked_again(forked: Backend) -> None:
    await check_killed_from_inside_is_forked_again(forked, _kernel_of)


async def test_a_kernel_over_its_memory_is_told_so_and_forked_again(forked: Backend) -> None:
    sandbox = await forked.create(small_spec(limits={"memory_mb": 256}))
    try:
        _kernel_of(sandbox)
        died = await sandbox.execute("b = bytearray(600 << 20); b[::4096] = b'x' * len(b[::4096])")
        assert died.error is not None and "memory" in str(died.error.value), died
        again = await sandbox.execute("import sys; 'pandas' in sys.modules")
        assert again.text == "True", again
        _kernel_of(sandbox)
    finally:
        await sandbox.close()


async def test_a_template_image_is_never_forked(forked: Backend) -> None:
    """Only the backend's own image has a zygote: another image's kernels start afresh."""
    assert isinstance(forked, DockerBackend)
    other = "code-interpreter-kernel-full:latest"
    sandbox = await forked.create(small_spec(image=other))
    try:
        assert not isinstance(_process_of(sandbox), ForkedContainerKernel)
        assert (await sandbox.execute("1 + 1")).text == "2"
    finally:
        await sandbox.close()


async def test_a_dead_zygote_is_started_again_and_closing_leaves_nothing(
    forked: Backend,
) -> None:
    assert isinstance(forked, DockerBackend)
    first = await forked.create(small_spec())
    zygote = forked._zygote
    assert zygote is not None and zygote.container is not None
    await asyncio.to_thread(zygote.container.kill)
    second = await forked.create(small_spec())  # a new zygote forks it
    try:
        assert (await first.execute("1 + 1")).text == "2"  # kernels outlive their zygote
        assert (await second.execute("import sys; 'pandas' in sys.modules")).text == "True"
        _kernel_of(second)
    finally:
        await asyncio.gather(first.close(), second.close())
    client = zygote.client
    ours = {"label": [LABEL_ZYGOTE, f"{LABEL_ORCHESTRATOR}={forked.config.orchestrator_id}"]}
    left = await asyncio.to_thread(client.containers.list, all=True, filters=ours)
    assert len(left) == 1  # the zygote running now, the dead one removed
    await forked.close()  # the fixture's close after it finds nothing more to do
    left = await asyncio.to_thread(client.containers.list, all=True, filters=ours)
    assert left == []


async def test_a_kernel_of_another_build_of_the_image_starts_afresh_and_the_zygote_again(
    forked: Backend,
) -> None:
    """The image's tag rebuilt since the zygote started (its recorded build made another's
    here): the kernel, whose container runs the image as it is now, starts afresh, never
    forked from the old build's modules; the zygote is started again and forks the next."""
    assert isinstance(forked, DockerBackend)
    first = await forked.create(small_spec())
    await first.close()
    zygote = forked._zygote
    assert zygote is not None and zygote.container is not None
    old = zygote.container.id
    zygote.image_id = "sha256:" + "0" * 64
    second = await forked.create(small_spec())
    try:
        assert not isinstance(_process_of(second), ForkedContainerKernel)
        assert (await second.execute("1 + 1")).text == "2"
    finally:
        await second.close()
    third = await forked.create(small_spec())
    try:
        _kernel_of(third)
        assert zygote.container is not None and zygote.container.id != old
    finally:
        await third.close()
