"""What only the Docker backend does: the container's settings, its death, its clean-up."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import docker
import pytest

from code_interpreter_wire.errors import BackendUnavailable, SandboxStartError
from code_interpreter_wire.results import ExecutionStatus
from code_interpreter_wire.spec import ResourceLimits
from sandbox import Backend, create_backend
from sandbox.backends.docker import DockerBackend, DockerSandbox
from sandbox.backends.docker_container import LABEL_ORCHESTRATOR, LABEL_OWNER, LABEL_SANDBOX
from sandbox.backends.docker_launcher import KERNEL_LOG_FILE_BYTES, KERNEL_LOG_FILES
from sandbox.process_identity import ProcessIdentity
from tests.conftest import TEST_ORCHESTRATOR_ID, require_backend, small_spec


@pytest.fixture(scope="module")
def engine_required() -> None:
    """Every test that needs the engine and its images asks for this (through `engine` or
    `docker_backend`): skipped without them on a developer's machine, failed in CI (CI=true),
    as every backend test is. Tests that need no engine run everywhere."""
    require_backend("docker")


@pytest.fixture(scope="module")
def engine(engine_required: None) -> Iterator[docker.DockerClient]:
    client = docker.from_env()
    yield client
    client.close()


@pytest.fixture
async def docker_backend(engine_required: None) -> AsyncIterator[Backend]:
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
        assert host["SecurityOpt"][0] == "no-new-privileges"
        assert all(opt.startswith("seccomp=") for opt in host["SecurityOpt"][1:])
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
        assert config["User"] == f"{sb.uid}:{sb.uid}" and sb.uid >= 1_600_000
        assert host["LogConfig"] == {
            "Type": "json-file",
            "Config": {"max-size": str(KERNEL_LOG_FILE_BYTES), "max-file": str(KERNEL_LOG_FILES)},
        }
        assert config["Labels"][LABEL_SANDBOX] == sb.id
        assert config["Labels"][LABEL_ORCHESTRATOR] == TEST_ORCHESTRATOR_ID
        assert config.get("ExposedPorts") in (None, {})
        # The limits as the kernel sees them.
        ex = await sb.execute(
            "import resource as r, os\n"
            "(r.getrlimit(r.RLIMIT_NOFILE)[0], r.getrlimit(r.RLIMIT_FSIZE)[0], os.getuid(),"
            " open('/proc/mounts').read().split('\\n')[0].split()[3].startswith('ro'))"
        )
        assert ex.text == f"(512, {32 << 20}, {sb.uid}, True)", ex.error
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
        assert "from outside the sandbox" in ex.error.value  # the engine was asked: not memory
        assert sb.container_name != first
        after = await sb.execute("'x' in globals(), open('kept.txt').read()")
        assert after.text == "(False, 'still here')"
        with pytest.raises(docker.errors.NotFound):
            engine.containers.get(first)  # the dead container was removed


async def test_close_removes_container_and_directories(
    docker_backend: Backend, engine: docker.DockerClient
) -> None:
    sb = await docker_backend.create(small_spec())
    assert isinstance(sb, DockerSandbox) and isinstance(docker_backend, DockerBackend)
    name, root = sb.container_name, sb.dirs.root
    assert sb.uid in docker_backend.uids.in_use
    await sb.close()
    assert docker_backend.uids.in_use == frozenset()  # its uid is free for another sandbox
    with pytest.raises(docker.errors.NotFound):
        engine.containers.get(name)
    assert not root.exists()


CRASHING_ORCHESTRATOR = """
import asyncio, os, sys
from sandbox import create_backend
from tests.conftest import small_spec

async def main():
    backend = create_backend("docker", orchestrator_id=sys.argv[1])
    sandbox = await backend.create(small_spec())
    print(sandbox.container_name, flush=True)
    os.kill(os.getpid(), 9)  # the crash: nothing is closed

asyncio.run(main())
"""


async def test_orphan_cleanup_removes_a_crashed_orchestrators_containers_only(
    engine: docker.DockerClient,
) -> None:
    crashed_id = f"{TEST_ORCHESTRATOR_ID}-crashed"
    other = create_backend("docker", orchestrator_id=f"{TEST_ORCHESTRATOR_ID}-other")
    survivor = await other.create(small_spec())
    bystander = engine.containers.create(
        "code-interpreter-kernel:latest", ["sleep", "60"], network_mode="none"
    )
    try:
        crash = await asyncio.create_subprocess_exec(
            sys.executable, "-c", CRASHING_ORCHESTRATOR, crashed_id, stdout=subprocess.PIPE
        )
        out, _ = await asyncio.wait_for(crash.communicate(), timeout=120)
        assert crash.returncode == -signal.SIGKILL
        leftover_name = out.decode().strip()
        assert engine.containers.get(leftover_name).status == "running"
        restarted = create_backend("docker", orchestrator_id=crashed_id)
        try:
            assert await restarted.cleanup_orphans() >= 1
        finally:
            await restarted.close()
        with pytest.raises(docker.errors.NotFound):
            engine.containers.get(leftover_name)
        assert (await survivor.execute("'alive'")).text == "'alive'"
        engine.containers.get(bystander.id)  # unlabelled: untouched
    finally:
        bystander.remove(force=True)
        await survivor.close()
        await other.close()


def dead_process() -> ProcessIdentity:
    """A process that ran and is gone: its pid and start time name nothing alive."""
    proc = subprocess.Popen(["sleep", "0"])
    start = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    proc.wait()
    me = ProcessIdentity.of_this_process()
    return ProcessIdentity(proc.pid, start, me.boot_id, me.pid_namespace)


async def test_orphan_cleanup_removes_only_what_is_provably_dead(
    engine: docker.DockerClient,
) -> None:
    """Two services sharing an orchestrator id: the second's clean-up spares the first's."""
    shared_id = f"{TEST_ORCHESTRATOR_ID}-shared"
    me = ProcessIdentity.of_this_process()
    owners = {
        "dead": dead_process(),
        "alive": me,
        "other-boot": ProcessIdentity(me.pid, me.start, "another-boot-id", me.pid_namespace),
        "other-pid-namespace": ProcessIdentity(2, "1", me.boot_id, "pid:[1]"),
    }
    made = {}
    try:
        for name, owner in owners.items():
            labels = {LABEL_ORCHESTRATOR: shared_id, **owner.labels(LABEL_OWNER)}
            made[name] = engine.containers.create(
                "code-interpreter-kernel:latest",
                ["sleep", "60"],
                labels=labels,
                network_mode="none",
            )
        made["unlabelled-owner"] = engine.containers.create(
            "code-interpreter-kernel:latest",
            ["sleep", "60"],
            labels={LABEL_ORCHESTRATOR: shared_id},
            network_mode="none",
        )
        backend = create_backend("docker", orchestrator_id=shared_id)
        try:
            assert await backend.cleanup_orphans() == 1
        finally:
            await backend.close()
        left = {c.id for c in engine.containers.list(all=True, ignore_removed=True)}
        assert {name for name, c in made.items() if c.id in left} == {
            "alive",
            "other-boot",
            "other-pid-namespace",
            "unlabelled-owner",
        }
    finally:
        for container in made.values():
            with contextlib.suppress(docker.errors.NotFound):
                container.remove(force=True)


async def test_a_kernel_flooding_its_original_stdout_fills_a_capped_log(
    docker_backend: Backend, engine: docker.DockerClient
) -> None:
    async with await docker_backend.create(small_spec()) as sb:
        ex = await sb.execute(
            "import os, time\n"
            "chunk, written, t = b'x' * 65535 + b'\\n', 0, time.monotonic()\n"
            "while time.monotonic() - t < 3:\n"
            "    written += os.write(1, chunk)\n"
            "written",
            timeout_s=120,
        )
        assert ex.ok and int(ex.text or 0) > 16 * KERNEL_LOG_FILE_BYTES, ex.error
        assert isinstance(sb, DockerSandbox)
        log_path = Path(inspect(engine, sb)["LogPath"])
        files = list(log_path.parent.glob(log_path.name + "*"))
        assert files and len(files) <= KERNEL_LOG_FILES
        # Each file may pass its cap by one message (16 KiB of output, JSON-escaped).
        per_file = KERNEL_LOG_FILE_BYTES + (64 << 10)
        assert all(f.stat().st_size <= per_file for f in files), [f.stat() for f in files]


async def test_a_kernel_that_dies_at_start_up_shows_its_last_output(
    docker_backend: Backend,
) -> None:
    """The capped log still gives `diagnostics()` the kernel's last words."""
    with pytest.raises(SandboxStartError, match="No module named 'encodings'"):
        await docker_backend.create(small_spec(env={"PYTHONHOME": "/nonexistent"}))
    assert isinstance(docker_backend, DockerBackend)
    assert docker_backend.uids.in_use == frozenset()  # a failed start gives its uid back


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
        all=True,
        ignore_removed=True,
        filters={"label": f"{LABEL_ORCHESTRATOR}={TEST_ORCHESTRATOR_ID}"},
    )
    assert [c.name for c in left] == []
