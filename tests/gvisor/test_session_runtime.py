"""A session's own runtime: honoured by the Docker backend, refused where it cannot be."""

from __future__ import annotations

from pathlib import Path

import docker
import pytest
from docker.models.containers import Container

from code_interpreter_wire.errors import RuntimeUnavailable
from code_interpreter_wire.results import ExecutionStatus
from sandbox import Backend, Sandbox, create_backend
from sandbox.backends.docker import DockerSandbox
from tests.conftest import small_spec
from tests.gvisor.conftest import GVISOR, container_runtime

KERNEL_LOG = (
    "import subprocess\n"
    "subprocess.run(['dmesg'], capture_output=True, text=True).stdout.splitlines()[:1]"
)


async def run_ok(sb: Sandbox, code: str) -> str:
    ex = await sb.execute(code, timeout_s=60)
    assert ex.status is ExecutionStatus.OK, (ex.error, ex.stdout, ex.stderr)
    assert ex.text is not None
    return ex.text


async def test_a_session_asking_for_runsc_runs_under_gvisor(docker_backend: Backend) -> None:
    sb = await docker_backend.create(small_spec(runtime=GVISOR))
    try:
        assert isinstance(sb, DockerSandbox) and sb.container_name is not None
        assert sb.runtime == GVISOR
        assert container_runtime(sb.container_name) == GVISOR
        # gVisor's own kernel answers from inside: its boot log, not the host's.
        assert "Starting gVisor" in await run_ok(sb, KERNEL_LOG)
    finally:
        await sb.close()


async def test_a_session_asking_for_nothing_keeps_the_engine_default(
    docker_backend: Backend,
) -> None:
    sb = await docker_backend.create(small_spec())
    try:
        assert isinstance(sb, DockerSandbox) and sb.container_name is not None
        assert sb.runtime == "runc" == container_runtime(sb.container_name)
        assert "gVisor" not in await run_ok(sb, "open('/proc/version').read()")
    finally:
        await sb.close()


async def test_every_language_kernel_of_a_session_runs_under_its_runtime(
    docker_backend: Backend,
) -> None:
    """The full image's other kernels (JavaScript through the supervisor relay) get their own
    containers: under the session's runtime too."""
    sb = await docker_backend.create(
        small_spec(runtime=GVISOR, image="code-interpreter-kernel-full:latest")
    )
    try:
        ex = await sb.execute("console.log(40 + 2)", language="javascript", timeout_s=120)
        assert ex.status is ExecutionStatus.OK, (ex.error, ex.stdout, ex.stderr)
        assert ex.stdout.strip() == "42"
        assert isinstance(sb, DockerSandbox)
        names = [c.name for c in _containers_of(sb.id)]
        assert len(names) == 2, names
        assert {container_runtime(n) for n in names} == {GVISOR}
    finally:
        await sb.close()


async def test_a_runtime_the_engine_lacks_is_refused_by_name(docker_backend: Backend) -> None:
    with pytest.raises(RuntimeUnavailable, match=r"no runtime 'kata'.*runc.*runsc"):
        await docker_backend.create(small_spec(runtime="kata"))


async def test_the_local_backend_refuses_any_runtime(state_dir: Path) -> None:
    backend = create_backend("local", state_dir=state_dir)
    try:
        with pytest.raises(RuntimeUnavailable, match="docker backend only"):
            await backend.create(small_spec(runtime=GVISOR))
    finally:
        await backend.close()


def _containers_of(sandbox_id: str) -> list[Container]:
    client = docker.from_env()
    return list(
        client.containers.list(
            ignore_removed=True, filters={"label": f"code-interpreter.sandbox={sandbox_id}"}
        )
    )
