"""Closing a Docker sandbox while it replaces a kernel a command killed (`kill -9 -1`) leaves no
container behind, whatever step the replacement was at: removing the dead kernel's container,
creating the new one, starting it, or waiting for its kernel to answer.

Each step is held at a gate the test opens only once the close has cut the replacement short,
so the race is the same on every run. The engine is the real one; the gates wrap its calls.
Docker must run here: in CI these fail (not skip) without an engine (`require_backend`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import docker
import pytest
from docker.errors import APIError, NotFound

from code_interpreter_wire.processes import ProcessRequest
from sandbox import Backend, create_backend
from sandbox.backends.docker import DockerBackend, DockerSandbox
from sandbox.backends.docker_container import LABEL_SANDBOX
from tests.conftest import TEST_ORCHESTRATOR_ID, require_backend, small_spec


@pytest.fixture(scope="module")
async def docker_backend() -> AsyncIterator[Backend]:
    require_backend("docker")
    backend = create_backend("docker", orchestrator_id=TEST_ORCHESTRATOR_ID)
    yield backend
    await backend.close()


class Gate:
    """Where a step of the replacement waits: `entered` once it reaches the gate (from any
    thread), on again once the test opens it."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.entered = asyncio.Event()
        self.opened = threading.Event()

    def reach_from_thread(self) -> None:
        self.loop.call_soon_threadsafe(self.entered.set)
        self.opened.wait(120)

    async def reach(self) -> None:
        self.entered.set()
        await asyncio.to_thread(self.opened.wait, 120)


class GatedContainers:
    """The engine's `containers`, its creations (or the starts of what it creates) gated."""

    def __init__(self, containers: Any, gate: Gate, step: str) -> None:
        self._containers = containers
        self._gate = gate
        self._step = step

    def __getattr__(self, name: str) -> Any:
        return getattr(self._containers, name)

    def create(self, **options: Any) -> Any:
        container = self._containers.create(**options)
        if self._step == "create":  # made, and the launch still waiting for the engine's word
            self._gate.reach_from_thread()
        if self._step == "start":
            start = container.start

            def gated_start(*args: Any, **kwargs: Any) -> Any:
                started = start(*args, **kwargs)
                self._gate.reach_from_thread()
                return started

            container.start = gated_start
        return container


class GatedEngine:
    def __init__(self, client: Any, containers: GatedContainers) -> None:
        self._client = client
        self.containers = containers

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def gate_step(box: DockerSandbox, step: str, gate: Gate) -> None:
    launcher = box._launcher
    driver = box.driver
    if step == "remove the dead kernel":
        assert driver._kernel is not None
        process: Any = driver._kernel.process
        kill: Callable[[], Awaitable[None]] = process.kill

        async def gated_kill() -> None:
            await gate.reach()
            await kill()

        process.kill = gated_kill
    elif step in ("create", "start"):
        launcher.client = GatedEngine(
            launcher.client, GatedContainers(launcher.client.containers, gate, step)
        )
    else:  # the kernel's answer is awaited once its container is launched
        launch = launcher.launch

        async def launched_then_gate(connection_file: str) -> Any:
            process = await launch(connection_file)
            gate.entered.set()
            gate.opened.set()  # nothing held: the close comes while the kernel boots
            return process

        launcher.launch = launched_then_gate  # type: ignore[method-assign,assignment]


async def until_closing(box: DockerSandbox, closing: asyncio.Future[None]) -> None:
    """On once the close has told the driver and cut its background work short, or is over
    (the test's own timeout bounds it): these are flags, with no event to wait on."""
    driver = box.driver

    def told() -> bool:
        background = list(driver._background)
        return driver._closed and all(t.cancelling() or t.done() for t in background)

    while not (told() or closing.done()):  # noqa: ASYNC110
        await asyncio.sleep(0.01)


def containers_of(engine: docker.DockerClient, sandbox_id: str) -> list[str]:
    return [
        c["Names"][0]
        for c in engine.api.containers(all=True, filters={"label": f"{LABEL_SANDBOX}={sandbox_id}"})
    ]


STEPS = ["remove the dead kernel", "create", "start", "answer"]


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("replaced_by", ["its watcher, between calls", "the running call"])
async def test_a_close_during_a_kernel_replacement_leaves_no_container(
    docker_backend: Backend, step: str, replaced_by: str
) -> None:
    assert isinstance(docker_backend, DockerBackend)
    engine = docker.from_env()
    box = await docker_backend.create(small_spec())
    assert isinstance(box, DockerSandbox)
    gate = Gate()
    running: asyncio.Future[Any] | None = None
    closing: asyncio.Future[None] | None = None
    try:
        gate_step(box, step, gate)
        if replaced_by == "the running call":
            running = asyncio.ensure_future(box.execute("import time; time.sleep(600)"))
            while box.driver._run is None or box.driver._run.reply is None:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        await box.run_command(ProcessRequest(command="kill -9 -1"))
        await asyncio.wait_for(gate.entered.wait(), 60)
        closing = asyncio.ensure_future(box.close())
        await until_closing(box, closing)
        gate.opened.set()
        await closing
        assert containers_of(engine, box.id) == []
        assert box.uid not in docker_backend.uids.in_use  # given back: its containers are gone
        if running is not None:
            done = await running
            assert not done.ok
    finally:
        gate.opened.set()
        if closing is not None:
            with contextlib.suppress(Exception):
                await closing
        await box.close()
        if running is not None:
            with contextlib.suppress(Exception):
                await running
        for name in containers_of(engine, box.id):
            with contextlib.suppress(NotFound, APIError):
                engine.containers.get(name.lstrip("/")).remove(force=True)
        engine.close()
