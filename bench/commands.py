"""`echo hi` as a command beside the kernel: through our Python API, our HTTP API and E2B's SDK
against our E2B front, each beside the floor it is measured against in the same run (a plain
subprocess on this machine; `docker exec` into a running container of our image)."""

from __future__ import annotations

import asyncio
import subprocess
from typing import Any

import docker
import httpx

from bench.ours import backend
from bench.served import API_KEY, served
from bench.stats import timed
from code_interpreter_wire.processes import ProcessRequest
from sandbox.backends.docker import DEFAULT_IMAGE

ECHO = ProcessRequest(argv=["echo", "hi"])


async def subprocess_floor(runs: int) -> list[float]:
    async def once() -> None:
        proc = await asyncio.create_subprocess_exec(
            "echo", "hi", stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        out, _ = await proc.communicate()
        assert out == b"hi\n"

    return await timed(runs, once)


async def docker_exec_floor(runs: int) -> list[float]:
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

        return await timed(runs, once)
    finally:
        container.kill()
        client.close()


async def through_the_sandbox(name: str, runs: int) -> list[float]:
    b = backend(name)
    try:
        async with await b.create() as sb:

            async def once() -> None:
                result = await sb.run_command(ECHO)
                assert (result.exit_code, result.stdout) == (0, "hi\n")

            return await timed(runs, once)
    finally:
        await b.close()


async def through_the_service(runs: int) -> dict[str, list[float]]:
    """`echo hi` over our HTTP API and through E2B's SDK (`commands.run`) against our front."""
    from e2b import AsyncSandbox

    async with served() as url:
        async with httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
        ) as api:
            sid = (await api.post("/v1/sessions", json={})).json()["id"]

            async def over_http() -> None:
                r = await api.post(f"/v1/sessions/{sid}/commands", json={"argv": ["echo", "hi"]})
                assert r.json()["stdout"] == "hi\n"

            http = await timed(runs, over_http)
        sdk: Any = await AsyncSandbox.create(api_key=API_KEY, api_url=url, sandbox_url=url)
        try:

            async def over_e2b() -> None:
                done = await sdk.commands.run("echo hi")
                assert done.stdout == "hi\n"

            e2b = await timed(runs, over_e2b)
        finally:
            await sdk.kill()
        return {"http": http, "e2b": e2b}
