"""Fixtures of the gVisor tests: a Docker backend whose sessions choose their runtime.

They need an engine with `runsc` registered (scripts/ensure-docker-engine.sh does it where
gVisor is installed); without one they skip on a developer's machine and fail in CI.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import AsyncIterator, Iterator

import docker
import pytest

from sandbox import Backend, create_backend
from sandbox.backends.gvisor.backend import GvisorBackend
from tests.conftest import TEST_ORCHESTRATOR_ID, require_backend
from tests.orchestrator.service.conftest import Server, make_server

GVISOR = "runsc"


def require_gvisor() -> None:
    """Skip where the engine has no runsc; in CI, fail instead."""
    require_backend("docker")
    runtimes = docker.from_env().info().get("Runtimes") or {}
    if GVISOR not in runtimes:
        why = f"the Docker engine has no {GVISOR} runtime (it has: {', '.join(runtimes)})"
        if os.environ.get("CI"):
            pytest.fail(f"gVisor must run in CI: {why}; run scripts/ensure-docker-engine.sh")
        pytest.skip(why)


@pytest.fixture(scope="module")
async def docker_backend() -> AsyncIterator[Backend]:
    """A Docker backend with the engine's default runtime: sessions ask for runsc themselves."""
    require_gvisor()
    backend = create_backend("docker", orchestrator_id=TEST_ORCHESTRATOR_ID)
    yield backend
    await backend.close()


def container_runtime(name: str) -> str:
    """The runtime the engine says a container runs under."""
    return str(docker.from_env().containers.get(name).attrs["HostConfig"]["Runtime"])


@pytest.fixture(scope="module")
async def gvisor(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[GvisorBackend]:
    """A gvisor backend of the module's own, without templates (each machine starts cold); a
    module that wants templates defines its own."""
    require_backend("gvisor")
    state = tmp_path_factory.mktemp("gv-machines", numbered=True)
    backend = create_backend("gvisor", state_dir=state, templates=False)
    assert isinstance(backend, GvisorBackend)
    yield backend
    await backend.close()


@contextlib.contextmanager
def machine_server(backends: str) -> Iterator[Server]:
    """A real server whose default backend is gvisor (`backends`: the ones it enables); it may
    be stopped and started again by its test."""
    require_backend("gvisor")
    running = make_server(backends=backends, default_backend="gvisor").start()
    try:
        yield running
    finally:
        if running.process is not None and running.process.poll() is None:
            running.stop()
        shutil.rmtree(running.state_dir.parent, ignore_errors=True)
