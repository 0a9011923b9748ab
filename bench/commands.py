"""`echo hi` as a command beside the kernel: through our Python API, our HTTP API and E2B's SDK
against our E2B front, each beside the floor it is measured against (a plain subprocess on this
machine; `docker exec` into a running container of our image). bench/latency.py takes their
samples in turns."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import docker

from bench.served import API_KEY
from code_interpreter_wire.processes import ProcessRequest
from sandbox import Sandbox
from sandbox.backends.docker import DEFAULT_IMAGE

ECHO = ProcessRequest(argv=["echo", "hi"])
Once = Callable[[], Awaitable[None]]


async def subprocess_once() -> None:
    proc = await asyncio.create_subprocess_exec(
        "echo", "hi", stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, _ = await proc.communicate()
    assert out == b"hi\n"


async def sandbox_once(sb: Sandbox) -> None:
    result = await sb.run_command(ECHO)
    assert (result.exit_code, result.stdout) == (0, "hi\n")


@contextlib.asynccontextmanager
async def docker_exec_floor() -> AsyncIterator[Once]:
    """The engine's own exec into a container of our image, with the same options ours use."""
    client = docker.from_env()
    container = client.containers.run(
        DEFAULT_IMAGE, ["sleep", "infinity"], detach=True, network_mode="none", auto_remove=True
    )
    try:

        def once_blocking() -> None:
            exec_id = client.api.exec_create(container.id, ["echo", "hi"], user="1000")["Id"]
            assert client.api.exec_start(exec_id) == b"hi\n"
            assert client.api.exec_inspect(exec_id)["ExitCode"] == 0

        async def once() -> None:
            await asyncio.to_thread(once_blocking)

        yield once
    finally:
        container.kill()
        client.close()


@contextlib.asynccontextmanager
async def e2b_sandbox(url: object) -> AsyncIterator[Once]:
    """`commands.run("echo hi")` through E2B's SDK against our front at `url`."""
    from e2b import AsyncSandbox

    sdk: Any = await AsyncSandbox.create(api_key=API_KEY, api_url=str(url), sandbox_url=str(url))
    try:

        async def once() -> None:
            done = await sdk.commands.run("echo hi")
            assert done.stdout == "hi\n"

        yield once
    finally:
        await sdk.kill()
