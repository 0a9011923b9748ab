"""What only the Docker backend does: the container's settings, its death, its clean-up."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import docker
import pytest

from sandbox import Backend, BackendUnavailable, ExecutionStatus, create_backend
from sandbox.backends.docker import LABEL_ORCHESTRATOR, LABEL_SANDBOX, DockerSandbox
from sandbox.spec import ResourceLimits
from tests.conftest import TEST_ORCHESTRATOR_ID, backend_unavailable, small_spec

why = backend_unavailable("docker")
pytestmark = pytest.mark.skipif(why is not None, reason=f"docker unavailable: {why}")


@pytest.fixture(scope="module")
def engine() -> Iterator[docker.DockerClient]:
    client = docker.from_env()
    yield client
    client.close()


@pytest.fixture
async def docker_backend() -> AsyncIterator[Backend]:
    backend = create_backend("docker", orchestrator_id=TEST_ORCHESTRATOR_ID)
    yield backend
    await backend.close()


def inspect(engine: docker.DockerClient, sb: DockerSandbox) -> dict[str, Any]:
    assert sb.container_name is not None
    attrs: dict[str, Any] = engine.api.inspect_container(sb.container_name)
    return attrs


async def test_container_settings_read_back(
    docker_backend: Backend, engine: docker.DockerClient
) -> None:
    limits = ResourceLimits(
        memory_mb=768, cpus=0.5, pids=128, file_size_mb=32, open_files=512, tmp_size_mb=48
    )
    sb = await docker_backend.create(small_spec(limits=limits))
    assert isinstance(sb, DockerSandbox)
    try:
        attrs = inspect(engine, sb)
        host, config = attrs["HostConfig"], attrs["Config"]
        assert host["NetworkMode"] == "none"
        assert host["ReadonlyRootfs"] is True
        assert host["CapDrop"] == ["ALL"]
        assert host["SecurityOpt"] == ["no-new-privileges"]
        assert host["PidsLimit"] == 128
        assert host["Memory"] == 768 << 20
        assert host["MemorySwap"] == 768 << 20
        assert host["NanoCpus"] == 500_000_000
        assert host["Init"] is True
        assert host["Privileged"] is False
        assert host["PortBindings"] in (None, {})
        assert "size=48m" in host["Tmpfs"]["/tmp"]
        ulimits = {u["Name"]: (u["Soft"], u["Hard"]) for u in host["Ulimits"]}
        assert ulimits == {"nofile": (512, 512), "fsize": (32 << 20, 32 << 20), "core": (0, 0)}
        assert config["User"] == "1000:1000"
        assert config["Labels"][LABEL_SANDBOX] == sb.id
        assert config["Labels"][LABEL_ORCHESTRATOR] == TEST_ORCHESTRATOR_ID
        assert config.get("ExposedPorts") in (None, {})
        # The limits as the kernel sees them.
        ex = await sb.execute(
            "import resource as r, os\n"
            "(r.getrlimit(r.RLIMIT_NOFILE)[0], r.getrlimit(r.RLIMIT_FSIZE)[0], os.getuid(),"
            " open('/proc/mounts').read().split('\\n')[0].split()[3].startswith('ro'))"
        )
        assert ex.text == f"(512, {32 << 20}, 1000, True)", ex.error
    finally:
        await sb.close()


async def test_workspace_is_size_capped(docker_backend: Backend) -> None:
    limits = ResourceLimits(workspace_size_mb=16, file_size_mb=64)
    async with await docker_backend.create(small_spec(limits=limits)) as sb:
        ex = await sb.execute(
            "import errno\n"
            "try:\n"
            "    with open('fill', 'wb') as f:\n"
            "        for _ in range(40): f.write(b'x' * (1 << 20))\n"
            "    r = 'filled'\n"
            "except OSError as e:\n"
            "    r = errno.errorcode[e.errno]\n"
            "r"
        )
        assert ex.text == "'ENOSPC'", ex.error


async def test_killed_container_is_reported_and_recovers(
    docker_backend: Backend, engine: docker.DockerClient
) -> None:
    async with await docker_backend.create(small_spec()) as sb:
        assert isinstance(sb, DockerSandbox)
        await sb.upload("kept.txt", b"still here")
        await sb.execute("x = 1")
        first = sb.container_name
        task = asyncio.ensure_future(sb.execute("import time; time.sleep(60)"))
        await asyncio.sleep(1.0)
        await asyncio.to_thread(engine.api.kill, first)
        ex = await asyncio.wait_for(task, timeout=30)
        assert ex.status is ExecutionStatus.KERNEL_DIED
        assert ex.error is not None and "SIGKILL" in ex.error.value
        assert sb.container_name != first
        after = await sb.execute("'x' in globals(), open('kept.txt').read()")
        assert after.text == "(False, 'still here')"
        with pytest.raises(docker.errors.NotFound):
            engine.containers.get(first)  # the dead container was removed


async def test_close_removes_container_and_directories(
    docker_backend: Backend, engine: docker.DockerClient
) -> None:
    sb = await docker_backend.create(small_spec())
    assert isinstance(sb, DockerSandbox)
    name, root = sb.container_name, sb.dirs.root
    await sb.close()
    with pytest.raises(docker.errors.NotFound):
        engine.containers.get(name)
    assert not root.exists()


async def test_orphan_cleanup_removes_only_our_own(engine: docker.DockerClient) -> None:
    crashed = create_backend("docker", orchestrator_id=f"{TEST_ORCHESTRATOR_ID}-crashed")
    other_id = f"{TEST_ORCHESTRATOR_ID}-other"
    other = create_backend("docker", orchestrator_id=other_id)
    leftover = await crashed.create(small_spec())
    survivor = await other.create(small_spec())
    bystander = engine.containers.create(
        "code-interpreter-kernel:latest", ["sleep", "60"], network_mode="none"
    )
    try:
        assert isinstance(leftover, DockerSandbox)
        leftover_name = leftover.container_name
        # The "crash": the orchestrator is gone without closing anything.
        await crashed.close()
        restarted = create_backend("docker", orchestrator_id=f"{TEST_ORCHESTRATOR_ID}-crashed")
        assert await restarted.cleanup_orphans() >= 1
        await restarted.close()
        with pytest.raises(docker.errors.NotFound):
            engine.containers.get(leftover_name)
        assert (await survivor.execute("'alive'")).text == "'alive'"
        engine.containers.get(bystander.id)  # unlabelled: untouched
    finally:
        bystander.remove(force=True)
        await survivor.close()
        await other.close()
        await leftover.close()


async def test_missing_engine_says_how_to_start_one() -> None:
    backend = create_backend("docker", docker_host="unix:///nonexistent/docker.sock")
    with pytest.raises(BackendUnavailable, match="dockerd"):
        await backend.create()


async def test_missing_image_says_how_to_build_it(docker_backend: Backend) -> None:
    with pytest.raises(BackendUnavailable, match="make image"):
        await docker_backend.create(small_spec(image="code-interpreter-nope:missing"))


def test_no_container_of_this_run_is_left(engine: docker.DockerClient) -> None:
    """Runs last in this module: everything the tests above created is gone."""
    left = engine.containers.list(
        all=True, filters={"label": f"{LABEL_ORCHESTRATOR}={TEST_ORCHESTRATOR_ID}"}
    )
    assert [c.name for c in left] == []
